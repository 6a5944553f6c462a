"""Peers of a transfer agent: this agent's descriptor, loading peers from theirs, and the one-identity-per-name rule.

:class:`AgentPeers` encodes what a peer needs to reach this agent (an :class:`AgentDescriptor`, msgpack) and loads
peers from theirs, checking everything a peer sent (bounds before decoding, version, regions) and the name rule: a
descriptor under a loaded peer's name refreshes it only when it comes from the same agent, and another agent under
that name is refused while the loaded one may be alive. The transport's part: ``_descriptor_payload`` (and
``_identity_payload``), ``_load_remote`` / ``_unload_remote``, and the identity hooks ``_same_agent``,
``_peer_gone``, ``_describe_agent``.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, TypeVar

import msgspec
import numpy as np

from kvcore.errors import RemoteAgentError, TransferError
from kvcore.msgbounds import check_msgpack_bounds
from kvcore.transport.agent_memory import AgentMemory
from kvcore.transport.agent_types import (
    DESCRIPTOR_VERSION,
    AgentDescriptor,
    MemoryKind,
    RegionInfo,
    RemoteAgent,
    process_incarnation,
)
from kvcore.transport.ranges import merge_intervals

P = TypeVar("P")

_decoder = msgspec.msgpack.Decoder(AgentDescriptor)
_encoder = msgspec.msgpack.Encoder()
_MAX_DESCRIPTOR_BYTES = 16 * 1024 * 1024


class AgentPeers(AgentMemory):
    """The peer part of the agent contract: descriptors out and in, loading, exposing and unloading peers."""

    def descriptor(self, *, exposed: bool = True) -> bytes:
        """This agent's descriptor (msgpack bytes) for a peer's ``load_remote_agent``.

        ``exposed=False``: an identity-only descriptor, with no region and no key to any of this agent's memory,
        for a peer that must know this agent but may not access its memory; ``b""`` when the transport needs no
        such thing (``_identity_payload`` returns None: a peer reaches memory only through the keys a full
        descriptor carries, so it need not load this agent at all).

        Args:
            exposed: True for the full descriptor (every region ``offers`` lists, the transport payload); False
                for the identity-only one.

        Returns:
            The encoded :class:`AgentDescriptor` (msgpack), or ``b""`` as above.

        Raises:
            TransferError: the agent is closed.
        """
        self._check_open()
        if not exposed:
            identity = self._identity_payload()
            if identity is None:
                return b""
            return _encoder.encode(
                AgentDescriptor(
                    version=DESCRIPTOR_VERSION,
                    backend=self.backend,
                    name=self.name,
                    incarnation=process_incarnation(),
                    generation=0,  # any full descriptor (generation >= 1 once memory is registered) refreshes it
                    regions=[],
                    payload=identity,
                )
            )
        desc = AgentDescriptor(
            version=DESCRIPTOR_VERSION,
            backend=self.backend,
            name=self.name,
            incarnation=process_incarnation(),
            generation=self._generation,
            regions=[
                RegionInfo(r.region.address, r.region.length, r.region.kind.value, r.region.device_id)
                for r in self._registrations.values()
                if self._exported(r)
            ],
            payload=self._descriptor_payload(),
        )
        return _encoder.encode(desc)

    @staticmethod
    def decode_descriptor(data: bytes) -> AgentDescriptor:
        """Decode and validate a descriptor; raises ``RemoteAgentError`` naming what is wrong.

        Args:
            data: the bytes a peer's ``descriptor()`` returned (untrusted).

        Returns:
            The :class:`AgentDescriptor`, its version and regions checked.

        Raises:
            RemoteAgentError: ``data`` is not bytes, is over 16 MiB, is malformed msgpack (bounds are checked
                before decoding), has another ``DESCRIPTOR_VERSION``, or lists a region with an unknown memory
                kind or a non-positive address or length.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise RemoteAgentError(f"agent descriptor must be bytes, got {type(data).__name__}")
        if len(data) > _MAX_DESCRIPTOR_BYTES:
            raise RemoteAgentError(f"agent descriptor is {len(data)} bytes, over the {_MAX_DESCRIPTOR_BYTES} limit")
        check_msgpack_bounds(
            data, error=RemoteAgentError, what="malformed agent descriptor"
        )  # before msgspec: no RecursionError, bounded memory
        try:
            desc = _decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise RemoteAgentError(f"malformed agent descriptor: {exc}") from exc
        except Exception as exc:  # nothing a peer sends may escape as an untyped error
            raise RemoteAgentError(f"agent descriptor could not be decoded: {type(exc).__name__}: {exc}") from exc
        if desc.version != DESCRIPTOR_VERSION:
            raise RemoteAgentError(
                f"agent descriptor version: expected {DESCRIPTOR_VERSION}, got {desc.version} (peer {desc.name!r})"
            )
        for r in desc.regions:
            if r.kind not in MemoryKind.__members__ or r.address <= 0 or r.length <= 0:
                raise RemoteAgentError(f"agent descriptor of {desc.name!r} holds an invalid region {r!r}")
        return desc

    @staticmethod
    def decode_payload(
        descriptor: AgentDescriptor, decoder: msgspec.msgpack.Decoder[P], *, version: int | None = None
    ) -> P:
        """A peer's transport payload, bound-checked and decoded with ``decoder``; its ``version`` field must equal
        ``version`` (unless that is ``None``: a payload without a version of its own).

        The one way agents read what a peer put in ``AgentDescriptor.payload``: nested junk cannot raise
        ``RecursionError`` (bounds first), and every problem is a ``RemoteAgentError`` naming the peer, the
        backend and what was wrong, e.g. ``peer 'x': ucx payload version: expected 2, got 1``.

        Args:
            descriptor: a decoded peer descriptor (``decode_descriptor``).
            decoder: a ``msgspec.msgpack.Decoder`` of the transport's payload struct.
            version: the payload version this transport speaks (compared with the payload's ``version`` field),
                or ``None``.

        Returns:
            The decoded payload.

        Raises:
            RemoteAgentError: the payload is malformed (bounds, type) or its version differs.
        """
        who, backend = f"peer {descriptor.name!r}", descriptor.backend
        what = f"{who}: {backend} payload is malformed"
        check_msgpack_bounds(descriptor.payload, error=RemoteAgentError, what=what)
        try:
            payload = decoder.decode(descriptor.payload)
        except msgspec.DecodeError as exc:
            raise RemoteAgentError(f"{what}: {exc}") from exc
        except Exception as exc:  # nothing a peer sends may escape as an untyped error
            raise RemoteAgentError(f"{what}: {type(exc).__name__}: {exc}") from exc
        got = getattr(payload, "version", None)
        if version is not None and got != version:
            raise RemoteAgentError(f"{who}: {backend} payload version: expected {version}, got {got!r}")
        return payload

    def load_remote_agent(self, descriptor: bytes, *, expose: bool = True) -> str:
        """Load (or refresh) a peer from its descriptor; returns the peer's name for ``submit``.

        One identity per name: a descriptor under the name of a loaded peer refreshes it only when it comes from
        the same agent (the same incarnation, and ``_same_agent`` says the same transport endpoint), with a
        newer ``generation`` (an older one is ignored). Any other agent under that name is refused with
        ``RemoteAgentError`` while the loaded one may be alive: a peer cannot take over a loaded name. Once
        ``_peer_gone`` proves the loaded one gone, or after ``unload_remote_agent``, the name is free again.

        Args:
            descriptor: the bytes of the peer's ``descriptor()`` (untrusted).
            expose: whether the peer may access this agent's memory (``expose_to``).

        Returns:
            The peer's name, to pass to ``submit``, ``remote`` and ``unload_remote_agent``.

        Raises:
            TransferError: the agent is closed; or a ``TransferError`` the transport's ``_load_remote`` raised.
            RemoteAgentError: the descriptor does not decode (see ``decode_descriptor``), names another backend,
                comes from another agent under the name of a loaded peer that may be alive, or the transport
                failed to load it (its error chained).
        """
        self._check_open()
        desc = self.decode_descriptor(descriptor)
        if desc.backend != self.backend:
            raise RemoteAgentError(
                f"peer {desc.name!r} runs backend {desc.backend!r}; this agent runs {self.backend!r}"
            )
        old = self._remotes.get(desc.name)
        if old is not None and not (old.incarnation == desc.incarnation and self._same_agent(old, desc)):
            # One identity per name: another agent under a loaded name is a takeover unless the loaded one is gone.
            if not self._peer_gone(old):
                raise RemoteAgentError(
                    f"peer {desc.name!r}: an agent of that name is already loaded (incarnation "
                    f"{self._describe_agent(old.descriptor)}) and, as far as this agent knows, alive; a descriptor of "
                    f"incarnation {self._describe_agent(desc)} does not replace it. Unload the old peer first if it really "
                    "restarted"
                )
            self.unload_remote_agent(desc.name)
            old = None
        if old is not None and old.descriptor.generation > desc.generation:
            return desc.name  # a stale (reordered) descriptor never replaces a newer one
        starts = np.array([r.address for r in desc.regions], dtype=np.uint64)
        ends = np.array([r.address + r.length for r in desc.regions], dtype=np.uint64)
        starts, ends = merge_intervals(starts, ends)
        try:
            native = self._load_remote(desc, old)
        except TransferError:
            raise
        except Exception as exc:
            raise RemoteAgentError(f"{self.backend} agent could not load peer {desc.name!r}: {exc}") from exc
        self._remotes[desc.name] = RemoteAgent(desc.name, desc, starts, ends, native)
        self.expose_to(desc.name, expose)
        return desc.name

    def expose_to(self, name: str, exposed: bool = True) -> None:
        """Whether the loaded peer ``name`` may access this agent's memory, where this side decides it.

        Loading a peer exposes this agent's memory to it unless ``load_remote_agent(..., expose=False)``. Where
        the owner hands out access on request (the shm agent serves its memfds only to an exposed, loaded peer)
        this is the gate. Where a peer accesses memory with keys from a full descriptor (NIXL, UCX), the gate is
        who is given that descriptor; this flag then only records the decision. Access already handed out (fds
        passed, keys unpacked) cannot be taken back by ``exposed=False``: only deregistering the memory does.

        Args:
            name: a loaded peer's name; a name that is not loaded is never exposed.
            exposed: True to expose this agent's memory to it, False to withdraw that.
        """
        if exposed and name in self._remotes:
            self._exposed.add(name)
        else:
            self._exposed.discard(name)

    def exposed_to(self, name: str) -> bool:
        """Whether ``expose_to`` lets the loaded peer ``name`` access this agent's memory.

        Args:
            name: a peer's name.

        Returns:
            True when ``name`` is loaded and exposed; False otherwise (an unknown name included).
        """
        return name in self._exposed

    def unload_remote_agent(self, name: str) -> None:
        """Forget a peer and drop its connection state; its name is free for another agent from then on.

        Args:
            name: a loaded peer's name.

        Raises:
            RemoteAgentError: ``name`` is not loaded.
        """
        remote = self._remotes.pop(name, None)
        self._exposed.discard(name)
        if remote is None:
            raise RemoteAgentError(f"peer {name!r} is not loaded in agent {self.name!r}")
        self._unload_remote(remote)

    @property
    def remote_agents(self) -> tuple[str, ...]:
        """The names of the loaded peers."""
        return tuple(self._remotes)

    def remote(self, name: str) -> RemoteAgent:
        """The loaded peer ``name``: its descriptor and the merged address ranges ``submit`` checks against.

        Args:
            name: a loaded peer's name.

        Returns:
            Its :class:`RemoteAgent`.

        Raises:
            RemoteAgentError: ``name`` is not loaded (the message lists the loaded names).
        """
        try:
            return self._remotes[name]
        except KeyError:
            known = ", ".join(sorted(self._remotes)) or "none"
            raise RemoteAgentError(f"peer {name!r} is not loaded in agent {self.name!r} (loaded: {known})") from None

    # --- primitives a transport implements --------------------------------------------------

    @abstractmethod
    def _descriptor_payload(self) -> bytes:
        """Transport data a peer needs to reach this agent (never pickle)."""

    def _identity_payload(self) -> bytes | None:
        """The payload of ``descriptor(exposed=False)``: what identifies this agent to a peer, with no key to its
        memory; None (the default) when a peer never needs to load this agent without access to its memory."""
        return None

    @abstractmethod
    def _load_remote(self, descriptor: AgentDescriptor, previous: RemoteAgent | None) -> Any:
        """Connect to a peer; ``previous`` is the earlier state when the same agent is refreshing its descriptor.

        ``previous`` is only ever the agent ``descriptor`` comes from (``_same_agent``): another agent under a
        loaded name was refused, or its gone predecessor unloaded, before this is called.
        """

    def _same_agent(self, loaded: RemoteAgent, descriptor: AgentDescriptor) -> bool:
        """Whether ``descriptor`` comes from the agent object ``loaded`` was loaded from (its refresh).

        Called only when the incarnations (processes) match. Compare what stays fixed for the agent's life and
        what a peer reaches it by (a worker address, a NIXL agent name, socket names), never what changes when
        it registers memory (regions, rkeys, metadata). Default: True, the incarnation alone identifies it;
        a transport whose process can hold two agents of one name (an engine rebuilt in place) overrides it.
        """
        return True

    def _peer_gone(self, loaded: RemoteAgent) -> bool:
        """Whether the loaded peer provably serves no more (its process died, its endpoint failed).

        True lets another agent's descriptor replace it under its name; be sure: a wrong True lets a live
        peer's name be taken over. Default: False, only ``unload_remote_agent`` frees a name.
        """
        return False

    def _describe_agent(self, descriptor: AgentDescriptor) -> str:
        """A short description of the agent a descriptor names, for errors: its incarnation, then transport details."""
        return descriptor.incarnation[:8]

    @abstractmethod
    def _unload_remote(self, remote: RemoteAgent) -> None:
        """Drop a peer's connection state."""
