"""``kvcore bench``: kvcore end to end vs the bare transport vs memcpy, on identical fragments, in one run.

For every selected backend the orchestrator (this process) starts one context
and one generation rank process (:class:`kvcore.runtime.RankProcess`;
orchestration commands travel on pipes as msgpack frames, never pickle). Each *case* is a
function ``case(run: BackendRun) -> dict``; :data:`CASES` maps names to them.

* ``llama8b``: one Llama-3-8B-shaped request (32 layers, 8 KV heads, head dim
  128, bf16, 32-token blocks, 4096 tokens = 128 blocks = 512 MiB, K and V, TP1,
  one head-major pool per rank, so one 4 MiB fragment per block), blocks
  scattered on both sides (independent random permutations), moved

  - ``kvcore``: through the whole stack: ``Transceiver.start_send`` on the
    context rank, ``start_receive`` on the generation rank, control plane
    (ZeroMQ), ``plan_transfer``, the agent, completion report, ``poll()``;
    timed on the generation rank from ``start_receive`` to the DONE outcome;
  - ``agent``: the same backend's ``TransferAgent.submit`` of the identical
    fragment plan (built once with :func:`kvcore.layout.mapping.plan_transfer` from the
    same page tables), polled without back-off: the transport without kvcore's
    control plane;
  - the baselines the backend's plugin registers (``kvcore.transport.baselines``; NIXL's
    ``nixl_initialize`` / ``nixl_prepped``): the transport's own API on the
    identical descriptor list, no kvcore code in the loop;
  - ``memcpy``: numpy ``copyto`` of the same number of bytes between two
    pre-faulted buffers, and ``memcpy_scattered``: one ``memmove`` per fragment
    of the same plan into a local buffer (the physical references).

* ``frag16k``: the same modes on 4096 x 16 KiB fragments (64 MiB).
* ``small``: one-block requests of the ``frag16k`` pool (16 KiB): latency of
  requests sent one at a time (p50/p99) against the agent's own one-fragment
  time (the difference is kvcore's per-request overhead), and requests per
  second with many requests in flight.
* ``small_auth`` (``--auth``): the same case with CurveZMQ on both
  transceivers' control planes (a fresh key pair per instance, as
  ``kvcore demo --auth``), run by the same rank processes right after ``small``.

Every timed transfer lands in zeroed destination memory and is verified
afterwards, byte for byte, against an expectation the generation rank computes
from the seed and the block ids alone (no kvcore arithmetic). Destination
memory is touched before anything is timed; the first transfer of each mode
(and the first contact between the instances) is reported separately.

The package, one job a module (imports run downwards in this list):

* ``spec``: :class:`BenchSpec`, :class:`Shape`, the errors;
* ``blocks``: where each request's blocks lie and what bytes they hold (from the seed alone);
* ``bare``: the bare modes (agent, plugin baselines, memcpy) a rank runs on kvcore's plan;
* ``rank``: the rank processes and the commands they serve;
* ``run``: the orchestrator (:class:`BackendRun`), the case registry (:func:`register_case`), :func:`run_bench`;
* ``cases``: the cases, registered on import (``transfer``, ``latency``, ``soak``, ``matrix``; shared result
  assembly in ``cases.common``);
* ``report``, ``plot``: the tables and the PNG; ``repeat``: ``--invocations``, the medians of several runs;
  ``command``: ``kvcore bench``'s options and exit status.
"""

from __future__ import annotations

from kvcore.tools.bench import cases as _cases  # noqa: F401  (registers every case)
from kvcore.tools.bench.cases.matrix import matrix_cells
from kvcore.tools.bench.command import add_parser, cmd_bench
from kvcore.tools.bench.plot import plot_result
from kvcore.tools.bench.report import print_result
from kvcore.tools.bench.run import (
    CASE_UNITS,
    CASES,
    BackendRun,
    BenchProgress,
    CaseFn,
    installed_backends,
    register_case,
    run_bench,
)
from kvcore.tools.bench.spec import BenchError, BenchSpec, BenchTimeoutError, Shape

__all__ = [
    "BenchError",
    "BenchTimeoutError",
    "BenchSpec",
    "Shape",
    "BackendRun",
    "BenchProgress",
    "CASES",
    "CASE_UNITS",
    "CaseFn",
    "register_case",
    "installed_backends",
    "matrix_cells",
    "run_bench",
    "add_parser",
    "cmd_bench",
    "print_result",
    "plot_result",
]
