"""``kvcore bench`` baseline of kvcore-mooncake: Mooncake's own batch write on kvcore's fragment plan, no kvcore code
timed.

Registered by ``kvcore_mooncake.plugin`` beside the ``mooncake`` agent:

* ``mooncake_batch``: a second, bare ``TransferEngine`` in the context rank process (P2P handshake, the run's
  agent options turned into the same ``MC_*`` settings by :func:`kvcore_mooncake.agent.engine_settings`), the
  local pool registered with ``register_memory``, the generation rank's segment name taken from the descriptor
  its kvcore agent published; per transfer one ``batch_transfer_sync_write`` of the plan as given (no merging;
  batches of ``batch_entries`` fragments where the plan is longer, as the agent splits them) in this thread. It
  returns once the engine reports every fragment written. No notification: the bare speed of the data path.
"""

from __future__ import annotations

import os
import time

from kvcore.errors import TransferFailedError
from kvcore.extension.convert import convert_options
from kvcore.hostinfo import host_identity
from kvcore.transport.agent import TransferAgent
from kvcore.transport.baselines import BaselinePlan, BenchBaseline
from kvcore_mooncake.agent import (
    MooncakeOptions,
    decode_peer,
    dial_target,
    engine_settings,
    options_from_env,
    resolve_addresses,
)

__all__ = ["MooncakeBatchWrite"]


class MooncakeBatchWrite(BenchBaseline):
    """Bare Mooncake: ``batch_transfer_sync_write`` of the whole plan per transfer, in the calling thread."""

    def __init__(self, plan: BaselinePlan) -> None:
        super().__init__(plan)
        from mooncake.engine import TransferEngine

        opts = convert_options(MooncakeOptions, options_from_env(plan.agent_options), owner="mooncake agent")
        for key, value in engine_settings(opts).items():
            os.environ[key] = value
        addresses = resolve_addresses(opts.bind_address)
        hostname = next((a for a in addresses if not a.startswith("127.")), addresses[0])
        self._engine: object | None = None
        engine = TransferEngine()
        if engine.initialize(hostname, opts.metadata, opts.protocol, ",".join(opts.device_names)) != 0:
            raise TransferFailedError("bare Mooncake baseline: TransferEngine.initialize failed (see its log)")
        self._engine = engine
        self._base = plan.pool_base
        if engine.register_memory(plan.pool_base, plan.pool_bytes, "*") != 0:
            raise TransferFailedError("bare Mooncake baseline: register_memory of the local pool failed")
        desc = TransferAgent.decode_descriptor(plan.peer_descriptor)
        payload = decode_peer(desc)
        mine = host_identity()
        self._target = dial_target(desc.name, payload, bool(mine) and payload.host_identity == mine)
        step = opts.batch_entries
        # The plan as Python lists, made once outside the timed call (what a native caller would hold).
        self._batches = [
            (plan.src[i : i + step].tolist(), plan.dst[i : i + step].tolist(), plan.sizes[i : i + step].tolist())
            for i in range(0, int(plan.sizes.size), step)
        ]

    def once(self) -> tuple[float, float]:
        engine = self._engine
        assert engine is not None
        t0 = time.perf_counter()
        for src, dst, sizes in self._batches:
            rc = engine.batch_transfer_sync_write(self._target, src, dst, sizes)  # type: ignore[attr-defined]
            if rc != 0:
                raise TransferFailedError(
                    f"bare Mooncake baseline: batch_transfer_sync_write to {self._target} returned {rc}"
                )
        t1 = time.perf_counter()
        return t1 - t0, t1 - t0  # one synchronous call: submit and done are the same moment

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.unregister_memory(self._base)  # type: ignore[attr-defined]
            del engine  # the engine stops its threads and listeners when the last reference goes
