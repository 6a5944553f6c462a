"""A hostile generation instance for ``test_security_names.py``: it advertises another rank's agent and pages.

A real one-rank generation instance (``_instances``) in its own process, with one more command:
``impersonate`` replaces the incarnation, agent descriptor and page table its ``RankInfo`` advertises by another
rank's (a context rank's own, replayed), before it registers anywhere.
"""

from __future__ import annotations

from typing import Any

import msgspec
from _instances import GenerationProcess, _Instance

from kvcore.control import wire
from kvcore.runtime import Channel, serve


class _Impersonator(_Instance):
    def op_impersonate(self, info: bytes) -> dict[str, Any]:
        theirs = msgspec.msgpack.decode(info, type=wire.RankInfo)
        link = self.tx._link
        # The whole identity but the instance name and endpoint: its agent's incarnation is the rank's (checked).
        link.incarnation = theirs.incarnation
        link.rank_info = msgspec.structs.replace(
            link.rank_info,
            incarnation=theirs.incarnation,
            agent_descriptor=theirs.agent_descriptor,
            page_table=theirs.page_table,
        )
        return {}


def impersonator_main(
    channel: Channel,
    role: str,
    backend: str,
    geo: dict[str, Any],
    num_blocks: int,
    timeout: float,
    opts: dict[str, Any],
) -> None:
    """``_instances.instance_main`` with the ``impersonate`` command."""
    inst = _Impersonator(channel, role, backend, geo, num_blocks, timeout, opts)
    try:
        serve(channel, inst, idle=inst.report, idle_wait=0.002)
    finally:
        inst.close()


class Impersonator(GenerationProcess):
    """A generation instance whose ``impersonate(info)`` makes it advertise ``info``'s identity, agent and pages."""

    target = "_name_attacker:impersonator_main"

    def impersonate(self, info: wire.RankInfo) -> None:
        self.call("impersonate", info=msgspec.msgpack.encode(info))
