"""The transfer-agent contract: what every transport (shm, NIXL, UCX, third-party) implements.

A transfer agent moves bytes between memory it registered locally and memory a
peer agent registered, with one-sided WRITE (and READ where declared) of many
``(local address, remote address, size)`` fragments at once. The base class
does everything that is the same for every transport: argument validation,
the check that every fragment lies inside registered memory on both sides
(before any byte moves), descriptor encoding (msgpack, never pickle), handle
book-keeping and leak accounting. A transport implements the ``_``-prefixed
primitives.

A caller that moves one large plan in pieces checks it once with ``check_plan`` and submits slices of the
returned :class:`CheckedPlan` with ``submit_checked``: the pieces are not checked again while neither side's
registrations changed since the check (then they are), and a transport may do its per-plan work once
(``_submit_piece``).

Example (two processes, the receiver exported its descriptor ``d``)::

    agent = registry.get("shm")(name="ctx0")
    reg = agent.register_memory(src_tensor)
    peer = agent.load_remote_agent(d)
    h = agent.submit(TransferOp.WRITE, peer, src_addrs, dst_addrs, sizes, notification=b"req-7")
    agent.wait(h, timeout=5.0)
    agent.release(h)

:class:`TransferAgent` is assembled from one module per concern, each a base class below it: ``agent_base`` (the
name, options and tables), ``agent_memory`` (registrations), ``agent_peers`` (descriptors, loading peers, the
one-identity-per-name rule), ``agent_completions`` (notifications, the completion listener); this module adds the
transfers (submit, poll, wait, release) and the agent's life (resources, close). The values it passes around live in
``agent_types``, the range arithmetic in ``ranges``; every name stays importable from here.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import Any

import numpy as np

from kvcore.errors import (
    RegistrationError,
    RemoteRangeError,
    TransferError,
    TransferFailedError,
    TransferTimeoutError,
    UnsupportedOperationError,
)
from kvcore.transport.agent_completions import AgentCompletions
from kvcore.transport.agent_peers import AgentPeers
from kvcore.transport.agent_types import (
    DESCRIPTOR_VERSION,
    AgentCapabilities,
    AgentDescriptor,
    CheckedPlan,
    MemoryKind,
    MemoryRegion,
    Notification,
    RegionInfo,
    Registration,
    RemoteAgent,
    TransferHandle,
    TransferOp,
    TransferStatus,
    process_incarnation,
)
from kvcore.transport.ranges import _as_u64, ranges_inside
from kvcore.transport.ranges import merge_intervals as merge_intervals

__all__ = [
    "MemoryKind",
    "TransferOp",
    "TransferStatus",
    "AgentCapabilities",
    "MemoryRegion",
    "Registration",
    "RemoteAgent",
    "TransferHandle",
    "CheckedPlan",
    "Notification",
    "AgentDescriptor",
    "RegionInfo",
    "TransferAgent",
    "DESCRIPTOR_VERSION",
    "process_incarnation",
]


def _frozen(values: np.ndarray) -> np.ndarray:
    """A read-only copy: what a checked plan holds, so that no fragment changes after its check."""
    out = values.copy()
    out.flags.writeable = False
    return out


class TransferAgent(AgentPeers, AgentCompletions):
    """Abstract transfer agent. Subclasses set ``backend`` and ``capabilities`` and implement the primitives.

    Threading: an agent is driven from one thread at a time (the engine's
    loop); implementations may run their own progress threads internally.

    Names: one identity per peer name. ``load_remote_agent`` refuses a
    descriptor under a loaded name unless it is a refresh by the same agent
    (same incarnation and ``_same_agent``) or ``_peer_gone`` proves the loaded
    one gone; a transport tells these hooks what identifies its endpoint and
    when a peer is provably gone (``_describe_agent`` words the refusal).

    Class attributes a transport sets (declared in ``AgentBase``): ``backend`` (its registered name),
    ``capabilities`` (:class:`AgentCapabilities`) and ``options_type`` (its options struct, or None). The constructor
    is ``TransferAgent(name, options=None)`` (``AgentBase.__init__``).
    """

    # --- transfers ------------------------------------------------------------------------

    def submit(
        self,
        op: TransferOp,
        remote: str,
        local_addrs: Any,
        remote_addrs: Any,
        sizes: Any,
        notification: bytes | None = None,
    ) -> TransferHandle:
        """Submit one batch of fragments; returns at once with a handle to poll.

        Every local range must lie in memory this agent registered and every
        remote range in memory the peer registered (per its latest descriptor);
        otherwise nothing moves and ``RemoteRangeError`` / ``RegistrationError``
        names the first offending fragment.

        Args:
            op: ``TransferOp.WRITE`` (local -> remote) or ``READ`` (remote -> local), as ``capabilities`` allow.
            remote: a loaded peer's name (what ``load_remote_agent`` returned).
            local_addrs: local start addresses, a 1-D array of non-negative integers.
            remote_addrs: the peer's start addresses, the same length.
            sizes: fragment lengths in bytes, the same length, none zero.
            notification: bytes the peer receives once from ``get_notifications`` after the transfer, or None.

        Returns:
            A :class:`TransferHandle` (``PENDING``) to ``poll`` or ``wait`` on, then ``release``.

        Raises:
            TransferError: the agent is closed, ``notification`` is not bytes, an array is not 1-D integers or
                holds a negative value, the arrays differ in length, or a fragment has size 0.
            UnsupportedOperationError: ``op`` or a notification is not in ``capabilities``.
            ValueError: ``op`` is not a ``TransferOp`` value.
            RemoteAgentError: ``remote`` is not loaded.
            RegistrationError: a local range is not inside memory this agent registered.
            RemoteRangeError: a remote range is not inside memory the peer registered.
            TransferFailedError: the transport failed to start the transfer (its error chained); a
                ``TransferError`` the transport raised propagates as it is.
        """
        self._check_open()
        op = self._allowed_op(op)
        self._check_notification(notification)
        peer = self.remote(remote)
        local, rem, size = self._checked_fragments(peer, local_addrs, remote_addrs, sizes)
        return self._post(op, peer, local, rem, size, notification, None, 0, 0)

    def check_plan(
        self,
        op: TransferOp,
        remote: str,
        local_addrs: Any,
        remote_addrs: Any,
        sizes: Any,
    ) -> CheckedPlan:
        """Check a batch of fragments once, to submit it whole or in pieces with ``submit_checked``; moves nothing.

        The same checks as ``submit`` (every local range inside memory this agent registered, every remote range
        inside memory the peer registered), done once for the whole plan: a caller that moves a large plan in
        pieces pays them once, not per piece.

        Args:
            op: ``TransferOp.WRITE`` or ``READ``, as ``capabilities`` allow.
            remote: a loaded peer's name.
            local_addrs: local start addresses, a 1-D array of non-negative integers.
            remote_addrs: the peer's start addresses, the same length.
            sizes: fragment lengths in bytes, the same length, none zero.

        Returns:
            A :class:`CheckedPlan` holding read-only copies of the arrays (uint64), for this agent only.

        Raises:
            The errors of ``submit`` for the same arguments, but the transport's (nothing is submitted).
        """
        self._check_open()
        op = self._allowed_op(op)
        peer = self.remote(remote)
        local, rem, size = (_frozen(a) for a in self._checked_fragments(peer, local_addrs, remote_addrs, sizes))
        before = np.zeros(size.size + 1, dtype=np.uint64)
        np.cumsum(size, out=before[1:])
        return CheckedPlan(op, remote, local, rem, size, before, self, peer, self._generation)

    def submit_checked(
        self, plan: CheckedPlan, start: int = 0, stop: int | None = None, notification: bytes | None = None
    ) -> TransferHandle:
        """Submit fragments ``start:stop`` of a plan this agent checked; returns at once with a handle to poll.

        The fragments are not checked again while neither side's registrations changed since ``check_plan`` (a
        registration made or withdrawn here, the peer reloaded or unloaded); after such a change they are checked
        again, as ``submit`` would, before any byte moves.

        Args:
            plan: what this agent's ``check_plan`` returned.
            start: the first fragment of the piece.
            stop: the fragment after its last (default: the end of the plan).
            notification: as for ``submit``.

        Returns:
            A :class:`TransferHandle` (``PENDING``) to ``poll`` or ``wait`` on, then ``release``.

        Raises:
            TransferError: the agent is closed, ``plan`` was checked by another agent, ``start:stop`` is not a range
                inside the plan, or ``notification`` is not bytes.
            UnsupportedOperationError: a notification is not in ``capabilities``.
            RemoteAgentError: the plan's peer is no longer loaded.
            RegistrationError, RemoteRangeError: registrations changed since the check and a fragment of the piece
                is no longer inside registered memory (nothing moved).
            TransferFailedError: as for ``submit``.
        """
        self._check_open()
        if plan.agent is not self:
            raise TransferError(f"this plan was checked by another agent, not by agent {self.name!r}")
        self._check_notification(notification)
        count = plan.count
        stop = count if stop is None else stop
        if not (0 <= start <= stop <= count):
            raise TransferError(f"fragments [{start}, {stop}) are not a range of the plan's {count} fragments")
        peer = self.remote(plan.remote)
        local, rem, size = plan.local[start:stop], plan.remote_addrs[start:stop], plan.sizes[start:stop]
        if peer is plan.peer and self._generation == plan.generation:
            return self._post(plan.op, peer, local, rem, size, notification, plan, start, stop)
        # A registration changed on either side since the check: this piece is checked against what is registered now.
        self._check_ranges(peer, local, rem, size)
        return self._post(plan.op, peer, local, rem, size, notification, None, 0, 0)

    def _allowed_op(self, op: TransferOp) -> TransferOp:
        if op.__class__ is not TransferOp:
            op = TransferOp(op)
        if op is TransferOp.WRITE and not self.capabilities.write:
            raise UnsupportedOperationError(f"{self.backend} agent does not support WRITE")
        if op is TransferOp.READ and not self.capabilities.read:
            raise UnsupportedOperationError(f"{self.backend} agent does not support READ")
        return op

    def _check_notification(self, notification: bytes | None) -> None:
        if notification is not None and not self.capabilities.notifications:
            raise UnsupportedOperationError(f"{self.backend} agent does not support notifications")
        if notification is not None and not isinstance(notification, bytes):
            raise TransferError(f"notification must be bytes, got {type(notification).__name__}")

    def _checked_fragments(
        self, peer: RemoteAgent, local_addrs: Any, remote_addrs: Any, sizes: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The fragment arrays as uint64, each fragment checked: non-empty, inside registered memory on both sides."""
        local = _as_u64("local_addrs", local_addrs)
        rem = _as_u64("remote_addrs", remote_addrs)
        size = _as_u64("sizes", sizes)
        if not (local.size == rem.size == size.size):
            raise TransferError(
                f"fragment arrays differ in length: local_addrs={local.size}, remote_addrs={rem.size}, sizes={size.size}"
            )
        if size.size and (0 in size.tolist() if size.size <= 8 else int(size.min()) == 0):
            raise TransferError(f"fragment {int(np.argmin(size))} has size 0")
        self._check_ranges(peer, local, rem, size)
        return local, rem, size

    def _check_ranges(self, peer: RemoteAgent, local: np.ndarray, rem: np.ndarray, size: np.ndarray) -> None:
        """Raise unless every local range lies in memory this agent registered and every remote one in the peer's."""
        bad_local = ~ranges_inside(local, size, self._local_starts, self._local_ends)
        if bad_local.any():
            i = int(np.flatnonzero(bad_local)[0])
            raise RegistrationError(
                f"fragment {i}: local range [{int(local[i]):#x}, +{int(size[i])}) is not inside memory "
                f"registered with agent {self.name!r} ({int(bad_local.sum())} of {size.size} fragments affected)"
            )
        bad_remote = ~ranges_inside(rem, size, peer.starts, peer.ends)
        if bad_remote.any():
            i = int(np.flatnonzero(bad_remote)[0])
            raise RemoteRangeError(
                f"fragment {i}: remote range [{int(rem[i]):#x}, +{int(size[i])}) is not inside memory "
                f"peer {peer.name!r} registered ({int(bad_remote.sum())} of {size.size} fragments affected); "
                "nothing was moved"
            )

    def _post(
        self,
        op: TransferOp,
        peer: RemoteAgent,
        local: np.ndarray,
        rem: np.ndarray,
        size: np.ndarray,
        notification: bytes | None,
        plan: CheckedPlan | None,
        start: int,
        stop: int,
    ) -> TransferHandle:
        """Hand checked fragments to the transport (``_submit_piece`` for a piece of a plan still valid)."""
        handle = TransferHandle(
            id=next(self._ids),
            op=op,
            remote=peer.name,
            count=int(size.size),
            nbytes=plan.nbytes(start, stop) if plan is not None else (int(size.sum()) if size.size else 0),
            notification=notification,
            submitted_at=time.monotonic(),
        )
        try:
            if plan is not None:
                handle.native = self._submit_piece(handle, peer, plan, start, stop)
            else:
                handle.native = self._submit(handle, peer, local, rem, size)
        except TransferError:
            raise
        except Exception as exc:
            raise TransferFailedError(f"{self.backend} agent failed to submit to {peer.name!r}: {exc}") from exc
        self._handles[handle.id] = handle
        return handle

    def poll(self, handle: TransferHandle) -> TransferStatus:
        """Advance and report a transfer's state; a failure is kept in ``handle.error``.

        Args:
            handle: what ``submit`` returned, not yet released.

        Returns:
            ``PENDING``, ``DONE`` (every byte is visible in the destination) or ``FAILED`` (``handle.error`` is a
            ``TransferError``: the transport's own, or a ``TransferFailedError`` wrapping another exception).

        Raises:
            TransferError: the handle was already released.
        """
        if handle.released:
            raise TransferError(f"transfer {handle.id} was already released")
        if handle.status is TransferStatus.PENDING:
            try:
                handle.status = self._poll(handle)
            except TransferError as exc:
                handle.status, handle.error = TransferStatus.FAILED, exc
            except Exception as exc:
                handle.status = TransferStatus.FAILED
                handle.error = TransferFailedError(
                    f"{self.backend} transfer {handle.id} to {handle.remote!r} failed: {exc}"
                )
                handle.error.__cause__ = exc
        return handle.status

    def wait(self, handle: TransferHandle, timeout: float, *, interval: float = 0.0002) -> TransferStatus:
        """Poll until terminal; raises ``TransferTimeoutError`` after ``timeout`` seconds, or the transfer's error.

        Args:
            handle: what ``submit`` returned, not yet released.
            timeout: seconds to wait at most.
            interval: the first pause between polls, doubled up to 5 ms.

        Returns:
            ``TransferStatus.DONE``.

        Raises:
            TransferTimeoutError: still pending after ``timeout`` seconds (the transfer is not stopped).
            TransferError: the handle was already released; or the failed transfer's ``handle.error``.
        """
        deadline = time.monotonic() + timeout
        sleep = interval
        while self.poll(handle) is TransferStatus.PENDING:
            if time.monotonic() >= deadline:
                raise TransferTimeoutError(
                    f"{self.backend} transfer {handle.id} to {handle.remote!r} still pending after {timeout:.3f}s"
                )
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.005)
        if handle.status is TransferStatus.FAILED and handle.error is not None:
            raise handle.error
        return handle.status

    def release(self, handle: TransferHandle) -> None:
        """Free a terminal transfer's resources. A pending transfer is aborted if the transport can, else refused.

        Idempotent: releasing a released handle does nothing. An aborted transfer ends ``FAILED``.

        Args:
            handle: what ``submit`` returned.

        Raises:
            TransferError: the transfer is still pending and ``capabilities.can_abort`` is False.
        """
        if handle.released:
            return
        if self.poll(handle) is TransferStatus.PENDING:
            if not self.capabilities.can_abort:
                raise TransferError(
                    f"transfer {handle.id} to {handle.remote!r} is still in flight and the {self.backend} agent "
                    "cannot abort it; poll until it is terminal before releasing"
                )
            self._abort(handle)
            handle.status = TransferStatus.FAILED
        self._release(handle)
        handle.released = True
        handle.native = None
        self._handles.pop(handle.id, None)

    def progress(self) -> None:
        """Drive the transport once (transports with their own progress threads do nothing).

        The engine's loop calls it between polls; a transport that progresses only when called overrides it.
        """

    def resources(self) -> dict[str, int]:
        """Live resource counts, for leak checks: all zero after ``close()`` or a full cleanup.

        Returns:
            ``registrations``, ``remote_agents`` and ``transfers`` (unreleased handles), plus the transport's own
            counts (``_native_resources``).
        """
        return {
            "registrations": len(self._registrations),
            "remote_agents": len(self._remotes),
            "transfers": len(self._handles),
            **self._native_resources(),
        }

    def close(self) -> None:
        """Release every transfer, peer and registration. Idempotent.

        A pending transfer the transport cannot abort is forgotten, not waited for. After ``close``,
        ``register_memory``, ``descriptor``, ``load_remote_agent``, ``submit`` and ``get_notifications`` raise
        ``TransferError``.

        Raises:
            Exception: nothing of kvcore's own; what a transport primitive (``_release``, ``_unload_remote``,
                ``_deregister``, ``_close``) raises propagates, and the agent stays open for another ``close``.
        """
        if self._closed:
            return
        for h in list(self._handles.values()):
            try:
                self.release(h)
            except TransferError:
                self._handles.pop(h.id, None)
        for name in list(self._remotes):
            self.unload_remote_agent(name)
        for reg in list(self._registrations.values()):
            self.deregister_memory(reg)
        self._close()
        self._closed = True

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- primitives a transport implements --------------------------------------------------

    @abstractmethod
    def _submit(
        self,
        handle: TransferHandle,
        remote: RemoteAgent,
        local: np.ndarray,
        remote_addrs: np.ndarray,
        sizes: np.ndarray,
    ) -> Any:
        """Start the transfer (arrays are validated uint64); return its native handle."""

    def _submit_piece(
        self, handle: TransferHandle, remote: RemoteAgent, plan: CheckedPlan, start: int, stop: int
    ) -> Any:
        """Start fragments ``start:stop`` of a checked plan; return the native handle (default: ``_submit``).

        Called only while the plan's check still holds. A transport overrides it to do its per-plan work (region
        lookups, descriptor arrays) once, in ``plan.native``, instead of once per piece.
        """
        return self._submit(
            handle, remote, plan.local[start:stop], plan.remote_addrs[start:stop], plan.sizes[start:stop]
        )

    @abstractmethod
    def _poll(self, handle: TransferHandle) -> TransferStatus:
        """Report the transfer's state; raise a ``TransferError`` subclass on failure.

        ``DONE`` is a promise: every byte of every fragment is visible in the
        destination memory (for WRITE, in the peer's memory), so the receiver may
        read it as soon as the initiator reports completion on the control plane.
        """

    @abstractmethod
    def _release(self, handle: TransferHandle) -> None:
        """Free a terminal transfer's native resources."""

    def _abort(self, handle: TransferHandle) -> None:
        """Stop an in-flight transfer (only for agents with ``can_abort``)."""
        raise UnsupportedOperationError(f"{self.backend} agent cannot abort transfers")

    def _close(self) -> None:
        """Release transport-wide resources (workers, threads, segments)."""

    def _native_resources(self) -> dict[str, int]:
        """Transport-specific live counts for ``resources()``."""
        return {}
