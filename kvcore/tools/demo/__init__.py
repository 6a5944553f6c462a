"""``kvcore demo``: a context instance and a generation instance as separate processes, every byte verified.

The orchestrator (this process) spawns ``ctx_tp*ctx_pp`` context ranks and
``gen_tp*gen_pp`` generation ranks. Ranks of one instance agree through a gloo
process group. Context ranks fill their KV pools (and Mamba state slots) with
values derived from (request, layer, kv, head, token, dim); generation ranks
receive N requests concurrently, then compare every received byte with the
same formula computed independently on their own shard, and check that every
byte nothing may write (a cached prefix, another DP group's request) is still
zero. Each rank is a :class:`kvcore.runtime.RankProcess`; orchestration
messages are msgpack frames, never pickle.

What a run can cover: any TP/PP on each side (uneven PP splits too), GQA with
fewer KV heads than TP (replicated heads), MLA (one latent "head", replicated
on every TP rank), attention DP on either side (request ``r`` belongs to DP
group ``r % dp_size`` of each instance), a Mamba-hybrid model (conv state
sectioned ``x|B|C`` and SSM state head-sharded, one slot per request),
head-major or token-major block order, a cached prefix, and the bounce-buffer
setting of the transceiver.

``--auth`` turns CurveZMQ on for every rank of both instances, with a fresh
key pair per instance (:func:`instance_keys`). ``--two-hosts`` runs the
context instance and the generation instance in two namespaced hosts
(:mod:`kvcore.tools.demo.two_hosts`, built on :mod:`kvcore.runtime.hosts`).

The oracles (:func:`heads_of_rank`, :func:`layers_of_rank`,
:func:`conv_channels_of_rank`, :func:`ssm_heads_of_rank`, :func:`expected_values`,
:func:`expected_conv`, :func:`expected_ssm`) are written from the model
definition and never call kvcore's sharding or mapping code; they live in
:mod:`kvcore.testing.oracle`, the one oracle the tests and plugins use too.

By concern: :mod:`~kvcore.tools.demo.rank` (a rank process's body: build the transceiver, fill or receive,
verify), :mod:`~kvcore.tools.demo.run` (the orchestrator: start the ranks, collect their reports, the summary),
:mod:`~kvcore.tools.demo.command` (``kvcore demo``'s options and its summary table) and
:mod:`~kvcore.tools.demo.two_hosts` (``--two-hosts``). The scenario itself (spec, rank storage, oracle view)
lives in :mod:`kvcore.testing.scenario`.
"""

from __future__ import annotations

from kvcore.testing.oracle import (
    conv_channels_of_rank,
    expected_conv,
    expected_ssm,
    expected_values,
    heads_of_rank,
    layers_of_rank,
    ssm_heads_of_rank,
)
from kvcore.testing.scenario import BOUNCE_MODES, MAX_PROCESSES, DemoSpec
from kvcore.tools.demo.command import add_parser, cmd_demo
from kvcore.tools.demo.run import instance_keys, run_demo

__all__ = [
    "BOUNCE_MODES",
    "MAX_PROCESSES",
    "DemoSpec",
    "add_parser",
    "cmd_demo",
    "conv_channels_of_rank",
    "expected_conv",
    "expected_ssm",
    "expected_values",
    "heads_of_rank",
    "instance_keys",
    "layers_of_rank",
    "run_demo",
    "ssm_heads_of_rank",
]
