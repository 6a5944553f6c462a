"""The NIXL transfer agent: kvcore's ``TransferAgent`` contract over NVIDIA NIXL (UCX backend by default).

Lanes. NIXL takes UCX's error-handling mode as a *backend init parameter*:
one ``nixl_agent`` has one UCX context in one mode, and one agent cannot hold
two UCX backends. Same-host peers want ``ucx_error_handling_mode=none``
(shared memory + CMA, truly one-sided writes, 0.3 ms first connection); peers
on another host want ``peer`` (TCP/IB with failure detection: in ``none`` mode
a dead remote over TCP is never reported). So a kvcore agent holds one
``nixl_agent`` per distinct parameter set, a *lane*: by default a same-host
lane (``none``) and a cross-host lane (``peer``), each created with no
backends and no NIXL progress thread (NIXL 1.5 hard-codes a zero progress
delay, which spins a full core), then ``create_backend(<backend>, <params>)``.
Memory is registered with every lane. The descriptor carries every lane's
metadata and ``kvcore.hostinfo.host_identity()``; a peer with the same host
identity is loaded into the same-host lane, any other into the cross-host
lane, so both sides pick the same mode without talking. Options override the
parameters per scope; scopes with equal parameters share one lane, and
``peers`` limits which lanes exist (``"cross_host"`` for a deployment where
every peer is remote: one registration per region).

Progress. Without a progress thread, NIXL moves only when this agent is
called: ``poll``/``wait`` progress the initiator, ``get_notifications()`` and
``progress()`` progress the target. The *target* must progress before the
first connection from a new peer arrives, and in ``peer`` error mode for writes
of 256 KiB and more, so an engine must call ``agent.progress()`` or
``agent.get_notifications()`` regularly (its loop does anyway). Alternatively
pass ``progress_thread=True``: NIXL's own thread then runs with a
``progress_delay_us`` sleep (100 µs by default) instead of spinning.

Descriptors. The peer's NIXL metadata travels inside kvcore's msgpack
descriptor as bytes (never NIXL's pickle-based descriptor serialization). For
the common case, many equal-size fragments at offsets that are multiples of
the fragment size inside registered regions, the agent prepares (once per
peer and fragment size, cached) a strided descriptor list that splits every
registered region into units of that size, and builds each transfer with
``make_prepped_xfer`` and numpy index arrays computed in bulk. Anything else
goes through ``initialize_xfer`` with contiguous runs merged first. No Python
loop runs per fragment.

Failures. NIXL exceptions map to kvcore errors: a disconnected peer is
``PeerLostError``, a range NIXL does not know is ``RemoteRangeError``, a
registration failure is ``RegistrationError``, anything else
``TransferFailedError``. A transfer to a peer that is alive but hung stays
pending forever; ``wait(timeout)`` bounds it, and such a transfer cannot be
aborted (``can_abort`` is False): NIXL's release of an in-flight UCX request
gives no guarantee that no more bytes land.
"""

from __future__ import annotations

import bisect
import importlib
import itertools
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np

from kvcore.errors import (
    ConfigError,
    PeerLostError,
    RegistrationError,
    RemoteAgentError,
    RemoteRangeError,
    TransferError,
    TransferFailedError,
    UnknownBackendError,
    UnsupportedOperationError,
)
from kvcore.extension.convert import convert_options
from kvcore.hostinfo import host_identity
from kvcore.transport.agent import (
    AgentCapabilities,
    AgentDescriptor,
    CheckedPlan,
    MemoryRegion,
    Notification,
    Registration,
    RemoteAgent,
    TransferAgent,
    TransferHandle,
    TransferStatus,
    process_incarnation,
)
from kvcore.transport.fragments import merge_runs
from kvcore_nixl.plugin import CAPABILITIES, INSTALL_HINT

__all__ = [
    "NixlAgent",
    "NixlOptions",
    "NixlPayload",
    "NixlLane",
    "DEFAULT_CROSS_HOST_PARAMS",
    "SAME_HOST",
    "CROSS_HOST",
    "decode_payload",
    "load_nixl",
    "NIXL_MODULES",
    "DEFAULT_BACKEND_PARAMS",
    "map_nixl_error",
]

#: Import candidates in order: the meta package, then the CUDA-flavoured wheels.
NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")

#: Backend init params for same-host peers unless options override them (string values, as NIXL wants).
DEFAULT_BACKEND_PARAMS: dict[str, dict[str, str]] = {
    # 'none' selects shm/CMA on one host: one-sided writes, 0.3 ms first connection.
    "UCX": {"ucx_error_handling_mode": "none"},
}
#: What differs for peers on another host: UCX must detect a dead peer (in 'none' mode a lost TCP peer is never
#: reported and a write to it can hang); 'peer' mode also excludes shared-memory transports.
DEFAULT_CROSS_HOST_PARAMS: dict[str, dict[str, str]] = {
    "UCX": {"ucx_error_handling_mode": "peer"},
}

#: The two kinds of peer a lane can serve, decided per peer from the host identities in the descriptors.
SAME_HOST = "same_host"
CROSS_HOST = "cross_host"
_SCOPES = (SAME_HOST, CROSS_HOST)
_PEERS_OPTION = {"any": _SCOPES, SAME_HOST: (SAME_HOST,), CROSS_HOST: (CROSS_HOST,)}


_PAYLOAD_VERSION = 2
_NAME_SEP = "#"  # NIXL agent name = <kvcore name>#<incarnation>.<n>; notifications map back by the prefix

#: A NIXL backend init parameter as configuration may give it; NIXL receives every value as a string.
ParamValue = str | int | float | bool


class NixlOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The nixl agent's options: ``TransceiverConfig.agent_options`` with ``backend = "nixl"``."""

    nixl_backend: str = "UCX"
    """NIXL backend plugin (``"LIBFABRIC"``, ...); it must be installed (listed by NIXL)."""
    backend_params: dict[str, ParamValue] = {}
    """Init params for that backend, merged over kvcore's defaults for every lane (UCX:
    ``ucx_error_handling_mode=none`` for same-host peers, ``peer`` for peers on another host)."""
    same_host_params: dict[str, ParamValue] = {}
    """Params for same-host peers only, merged over ``backend_params``."""
    cross_host_params: dict[str, ParamValue] = {}
    """Params for peers on another host only, merged over ``backend_params`` (``{"ucx_devices": "mlx5_0:1"}``)."""
    peers: Literal["any", "same_host", "cross_host"] = "any"
    """``"any"``: a lane for each kind of peer; ``"same_host"``/``"cross_host"``: only that lane (a peer
    of the other kind is refused at load)."""
    progress_thread: bool = False
    """Run NIXL's progress thread (otherwise the engine calls ``progress()``/``get_notifications()``)."""
    progress_delay_us: Annotated[int, msgspec.Meta(ge=0)] = 100
    """That thread's sleep between rounds (NIXL's own default, 0, spins a core)."""
    unit_dlist_max_entries: Annotated[int, msgspec.Meta(ge=1)] = 1 << 22
    """Largest prepared unit list; above it a transfer falls back to per-submit descriptors."""
    unit_dlist_cache: Annotated[int, msgspec.Meta(ge=1)] = 4
    """Unit (fragment) sizes kept prepared per side."""
    unit_dlists: bool | Literal["auto"] = "auto"
    """``"auto"``: prepared unit lists when a submit still has more than ``direct_max_descriptors``
    descriptors after merging, else one-step lists; ``True``/``False`` force one path."""
    direct_max_descriptors: Annotated[int, msgspec.Meta(ge=0)] = 12288
    """The descriptor count above which ``unit_dlists="auto"`` uses prepared unit lists."""


_nixl_cache: ModuleType | None = None
_nixl_lock = threading.Lock()
_agent_seq = itertools.count(1)


def load_nixl() -> ModuleType:
    """NIXL's Python API module (``nixl._api``, else ``nixl_cu12._api``, else ``nixl_cu13._api``).

    Raises ``UnknownBackendError`` with the install hint when none imports; the
    last import failure is chained.
    """
    global _nixl_cache
    if _nixl_cache is not None:
        return _nixl_cache
    failures: list[str] = []
    last: BaseException | None = None
    for name in NIXL_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # the nixl meta package raises ImportError for a missing CUDA flavour
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            last = exc
            continue
        _nixl_cache = mod
        if not os.environ.get("NIXL_LOG_LEVEL"):
            # NIXL's Python logger prints an INFO line to stdout for every agent and backend it creates;
            # a library should stay quiet unless asked (NIXL_LOG_LEVEL=INFO brings the lines back).
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return mod
    raise UnknownBackendError(
        "transfer agent 'nixl' needs NIXL's Python API, which could not be imported:\n  "
        + "\n  ".join(failures)
        + f"\n  hint: {INSTALL_HINT}"
    ) from last


def map_nixl_error(
    exc: BaseException, context: str, *, not_found: type[TransferError] = RemoteRangeError
) -> TransferError:
    """Translate a NIXL exception into the kvcore error a caller can act on; ``context`` starts the message."""
    kind = type(exc).__name__
    detail = f"{context}: {kind}: {exc}"
    if isinstance(exc, TransferError):
        return exc
    if kind == "nixlRemoteDisconnectError":
        err: TransferError = PeerLostError(f"{detail} (the peer process died or its connection was lost)")
    elif kind == "nixlNotFoundError":
        err = not_found(f"{detail} (NIXL does not know these addresses as registered memory)")
    elif kind in ("nixlInvalidParamError", "nixlMismatchError"):
        err = TransferFailedError(f"{detail} (NIXL rejected the request's parameters)")
    elif kind == "nixlBackendError":
        err = TransferFailedError(f"{detail} (the NIXL backend failed; see NIXL/UCX log lines above)")
    else:
        err = TransferFailedError(detail)
    err.__cause__ = exc
    return err


class NixlLane(msgspec.Struct, array_like=True, frozen=True):
    """One NIXL agent of a kvcore agent as peers see it: the peers it serves, its name, metadata and error mode."""

    scopes: list[str]  # SAME_HOST and/or CROSS_HOST
    nixl_name: str
    metadata: bytes
    error_mode: str  # ucx_error_handling_mode ("" for non-UCX backends); both ends of a pair must agree


class NixlPayload(msgspec.Struct, array_like=True, frozen=True):
    """The transport part of a kvcore descriptor: host identity, backend, and every lane's NIXL name and metadata.

    ``nixl_name``/``metadata`` repeat the first lane (same-host when it exists) for tools that drive bare NIXL.
    """

    version: int
    nixl_name: str
    nixl_backend: str
    metadata: bytes
    host_identity: str
    lanes: list[NixlLane]


_payload_decoder = msgspec.msgpack.Decoder(NixlPayload)
_payload_encoder = msgspec.msgpack.Encoder()


def decode_payload(descriptor: bytes) -> NixlPayload:
    """The NIXL part of a ``nixl`` agent's kvcore descriptor (validated); ``RemoteAgentError`` if malformed."""
    desc = TransferAgent.decode_descriptor(descriptor)
    return TransferAgent.decode_payload(desc, _payload_decoder, version=_PAYLOAD_VERSION)


class _Dlist:
    """A prepared NIXL descriptor list plus a use count (released only when unused and stale)."""

    __slots__ = ("handle", "stale", "users")

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.users = 0
        self.stale = False


@dataclass
class _Side:
    """The registered regions of one side (local or a peer), sorted by start, for index arithmetic."""

    starts: np.ndarray  # uint64, sorted
    lengths: np.ndarray  # uint64
    devices: np.ndarray  # uint64
    kinds: list[str]  # NIXL memory type per region
    target: str  # prep_xfer_dlist agent name: "NIXL_INIT_AGENT" or the peer's NIXL name
    api: Any  # the nixl_agent (lane) that prepares this side's lists
    units: dict[int, tuple[_Dlist, np.ndarray]] = field(default_factory=dict)  # unit -> (dlist, first index)
    _start_list: list[int] | None = None  # ``starts`` as Python ints, made on the first small lookup

    @classmethod
    def build(cls, regions: list[tuple[int, int, str, int]], target: str, api: Any) -> _Side:
        regions = sorted(regions)
        return cls(
            api=api,
            starts=np.array([r[0] for r in regions], dtype=np.uint64),
            lengths=np.array([r[1] for r in regions], dtype=np.uint64),
            devices=np.array([r[3] for r in regions], dtype=np.uint64),
            kinds=[r[2] for r in regions],
            target=target,
        )

    def locate(self, addrs: np.ndarray) -> np.ndarray:
        """Index of the region holding each address (addresses were range-checked by the base class)."""
        if addrs.size <= 4:  # a one-block request: bisect on the region starts beats three numpy calls
            if self._start_list is None:
                self._start_list = self.starts.tolist()
            lo = self._start_list
            return np.array([max(0, bisect.bisect_right(lo, a) - 1) for a in addrs.tolist()], dtype=np.int64)
        idx = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        return np.maximum(idx, 0)


@dataclass(eq=False)
class _Lane:
    """One ``nixl_agent`` of this kvcore agent, with the parameters it was created with and its local lists."""

    scopes: tuple[str, ...]
    params: dict[str, str]
    nixl_name: str
    nixl: Any = None
    mem_types: set[str] = field(default_factory=set)
    local: _Side | None = None

    @property
    def error_mode(self) -> str:
        return self.params.get("ucx_error_handling_mode", "")


@dataclass
class _Peer:
    """A loaded NIXL peer: the lane that reaches it, its NIXL name, metadata and prepared descriptor lists."""

    nixl_name: str
    metadata: bytes
    side: _Side
    lane: _Lane
    scope: str


#: Present where the NVIDIA driver is loaded (a GPU machine), with or without CUDA in this process.
NVIDIA_DRIVER_PROC = "/proc/driver/nvidia"


def ucx_tls_hint(backend: str, ucx_tls: str | None, nvidia_present: bool) -> str:
    """What to add to a failed UCX backend creation where ``UCX_TLS`` is its likely cause, else ``""``.

    NIXL's UCX backend refuses a ``UCX_TLS`` that names no CUDA transport on a machine with NVIDIA GPUs, even
    for host memory; its own reason goes to its log only, and the exception says ``NIXL_ERR_BACKEND``.
    """
    if backend != "UCX" or not ucx_tls or not nvidia_present or ucx_tls.startswith("^"):  # "^x": all but x
        return ""
    if any(t.strip() == "all" or t.strip().startswith("cuda") for t in ucx_tls.split(",")):
        return ""
    return (
        f". UCX_TLS={ucx_tls!r} is set in the environment and names no CUDA transport: on a machine with "
        "NVIDIA GPUs NIXL refuses it; add cuda_copy to it (or unset it)"
    )


def _params(values: Mapping[str, ParamValue]) -> dict[str, str]:
    """Backend params as NIXL takes them: every value a string."""
    return {k: str(v) for k, v in values.items()}


@dataclass
class _Xfer:
    """One posted NIXL transfer and the descriptor lists it holds."""

    handle: Any
    dlists: tuple[_Dlist, ...]
    api: Any = None  # the lane's nixl_agent that owns the handle
    done: bool = False


class NixlAgent(TransferAgent):
    """kvcore transfer agent over NIXL: one-sided WRITE/READ, DRAM and VRAM, notifications, remote peers.

    Options (``TransceiverConfig.agent_options``): :class:`NixlOptions`, converted by
    :func:`kvcore.extension.convert.convert_options` (an unknown key or a wrong type is a ``ConfigError``).
    """

    backend: ClassVar[str] = "nixl"
    capabilities: ClassVar[AgentCapabilities] = CAPABILITIES  # stated once, where the plugin registers it
    options_type: ClassVar[type[msgspec.Struct] | None] = NixlOptions

    def __init__(self, name: str, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(name, options)
        opts = self.opts = convert_options(NixlOptions, options, owner="nixl agent")
        self._nixl_backend = opts.nixl_backend
        user = {
            "backend_params": _params(opts.backend_params),
            "same_host_params": _params(opts.same_host_params),
            "cross_host_params": _params(opts.cross_host_params),
        }
        scope_params = {
            SAME_HOST: {
                **DEFAULT_BACKEND_PARAMS.get(self._nixl_backend, {}),
                **user["backend_params"],
                **user["same_host_params"],
            },
            CROSS_HOST: {
                **DEFAULT_BACKEND_PARAMS.get(self._nixl_backend, {}),
                **DEFAULT_CROSS_HOST_PARAMS.get(self._nixl_backend, {}),
                **user["backend_params"],
                **user["cross_host_params"],
            },
        }
        self._progress_thread = opts.progress_thread
        self._progress_delay_us = opts.progress_delay_us
        self._unit_max = opts.unit_dlist_max_entries
        self._unit_cache = opts.unit_dlist_cache
        self._use_units: bool | str = opts.unit_dlists
        self._direct_max = opts.direct_max_descriptors

        api = load_nixl()
        self._api = api
        self._host_identity = host_identity()
        base_name = f"{name}{_NAME_SEP}{process_incarnation()[:12]}.{next(_agent_seq)}"
        self._lanes: list[_Lane] = []
        for scope in _PEERS_OPTION[opts.peers]:  # scopes with equal params share one lane (one nixl_agent)
            same = next((lane for lane in self._lanes if lane.params == scope_params[scope]), None)
            if same is not None:
                same.scopes += (scope,)
                continue
            suffix = "" if not self._lanes else f".{len(self._lanes)}"
            self._lanes.append(_Lane((scope,), scope_params[scope], base_name + suffix))
        for lane in self._lanes:
            self._create_lane(lane)
        primary = self._lanes[0]
        self._nixl, self._nixl_name, self._backend_params = primary.nixl, primary.nixl_name, primary.params
        self._pending_notifs: list[Notification] = []
        self._leaked: list[Any] = []  # NIXL handles whose release failed; kept alive with the agent

    def _create_lane(self, lane: _Lane) -> None:
        lane.nixl = self._create_nixl_agent(self._api, lane.nixl_name)
        plugins = list(lane.nixl.get_plugin_list())
        if self._nixl_backend not in plugins:
            raise ConfigError(
                f"nixl agent option nixl_backend: {self._nixl_backend!r} is not an installed NIXL plugin; "
                f"available: {', '.join(plugins)}"
            )
        try:
            lane.nixl.create_backend(self._nixl_backend, lane.params)
        except Exception as exc:
            raise TransferFailedError(
                f"nixl agent {self.name!r} could not create NIXL backend {self._nixl_backend!r} for "
                f"{' and '.join(lane.scopes)} peers with params {lane.params}: {type(exc).__name__}: {exc}"
                + ucx_tls_hint(self._nixl_backend, os.environ.get("UCX_TLS"), os.path.exists(NVIDIA_DRIVER_PROC))
            ) from exc
        lane.mem_types = set(lane.nixl.get_backend_mem_types(self._nixl_backend))

    def _create_nixl_agent(self, api: ModuleType, nixl_name: str) -> Any:
        config = api.nixl_agent_config(enable_prog_thread=self._progress_thread, backends=[])
        if not self._progress_thread:
            return api.nixl_agent(nixl_name, config)
        # nixl_agent() hard-codes pthrDelay=0 (a spinning thread); swap in a config class that keeps ours.
        bind = api.nixlBind
        original = bind.nixlAgentConfig
        delay = self._progress_delay_us

        class _DelayedConfig(original):  # type: ignore[misc, valid-type]
            def __setattr__(self, key: str, value: Any) -> None:
                super().__setattr__(key, delay if key == "pthrDelay" else value)

        with _nixl_lock:
            bind.nixlAgentConfig = _DelayedConfig
            try:
                return api.nixl_agent(nixl_name, config)
            finally:
                bind.nixlAgentConfig = original

    @property
    def nixl_name(self) -> str:
        """The first lane's NIXL agent name (unique per process incarnation)."""
        return self._nixl_name

    @property
    def lanes(self) -> dict[str, dict[str, str]]:
        """``{scope: init params}`` of the NIXL backend serving each kind of peer this agent can reach."""
        return {scope: dict(lane.params) for lane in self._lanes for scope in lane.scopes}

    def peer_scope(self, remote: str) -> str:
        """``"same_host"`` or ``"cross_host"``: how a loaded peer is reached (which lane and UCX mode)."""
        peer: _Peer = self.remote(remote).native
        return peer.scope

    @property
    def nixl_backend(self) -> str:
        return self._nixl_backend

    @property
    def backend_params(self) -> dict[str, str]:
        """The init params NIXL reports for the first lane's backend."""
        return dict(self._nixl.get_backend_params(self._nixl_backend))

    # --- memory -----------------------------------------------------------------------------

    def _register(self, region: MemoryRegion, keepalive: Any) -> Any:
        seg = f"{region.kind.value}_SEG"
        for lane in self._lanes:
            if seg not in lane.mem_types:
                raise UnsupportedOperationError(
                    f"NIXL backend {self._nixl_backend!r} cannot register {region.kind.value} memory "
                    f"(it supports {', '.join(sorted(lane.mem_types))})"
                )
        descs = np.array([[region.address, region.length, region.device_id]], dtype=np.uint64)
        done: list[tuple[_Lane, Any]] = []
        try:
            for lane in self._lanes:
                done.append((lane, lane.nixl.register_memory(descs, region.kind.value)))
        except Exception as exc:
            for lane, handle in done:
                lane.nixl.deregister_memory(handle)
            raise RegistrationError(
                f"NIXL backend {self._nixl_backend!r} could not register {region.length} bytes of "
                f"{region.kind.value} (device {region.device_id}) at {region.address:#x}: {type(exc).__name__}: {exc}"
            ) from exc
        return [handle for _, handle in done]  # one per lane, in lane order

    def _deregister(self, registration: Registration) -> None:
        pending = [h for h in self._handles.values() if self.poll(h) is TransferStatus.PENDING]
        if pending:
            raise RegistrationError(
                f"cannot deregister {registration.region.length} bytes at {registration.region.address:#x}: "
                f"{len(pending)} transfer(s) of agent {self.name!r} are still in flight; wait for them first"
            )
        # NIXL segfaults on transfers or prepared lists that outlive the memory they describe.
        for h in self._handles.values():
            self._free_xfer(h)
        self._drop_local_sides()
        try:
            for lane, handle in zip(self._lanes, registration.native, strict=True):
                lane.nixl.deregister_memory(handle)
        except Exception as exc:
            raise map_nixl_error(exc, "NIXL could not deregister memory", not_found=RegistrationError) from exc

    def _local_side(self, lane: _Lane) -> _Side:
        if lane.local is None:
            regs = [
                (r.region.address, r.region.length, r.region.kind.value, r.region.device_id)
                for r in self._registrations.values()
            ]
            lane.local = _Side.build(regs, "NIXL_INIT_AGENT", lane.nixl)
        return lane.local

    def _drop_local_sides(self) -> None:
        for lane in getattr(self, "_lanes", ()):
            self._drop_side(lane.local)
            lane.local = None

    def _registrations_changed(self) -> None:
        super()._registrations_changed()
        self._drop_local_sides()

    # --- descriptors and peers --------------------------------------------------------------

    def _descriptor_payload(self) -> bytes:
        lanes = [
            NixlLane(list(lane.scopes), lane.nixl_name, lane.nixl.get_agent_metadata(), lane.error_mode)
            for lane in self._lanes
        ]
        payload = NixlPayload(
            _PAYLOAD_VERSION,
            lanes[0].nixl_name,
            self._nixl_backend,
            lanes[0].metadata,
            self._host_identity,
            lanes,
        )
        return _payload_encoder.encode(payload)

    def _choose_lanes(self, descriptor: AgentDescriptor, payload: NixlPayload) -> tuple[str, _Lane, NixlLane]:
        """The scope of a peer (same host identity or not) and the lane on each side that serves it."""
        same = bool(self._host_identity) and payload.host_identity == self._host_identity
        scope = SAME_HOST if same else CROSS_HOST
        where = (
            f"on this host ({self._host_identity})"
            if same
            else f"on another host (its identity {payload.host_identity or 'unknown'!r}, ours {self._host_identity!r})"
        )
        mine = next((lane for lane in self._lanes if scope in lane.scopes), None)
        if mine is None:
            raise RemoteAgentError(
                f"peer {descriptor.name!r} is {where}, but agent {self.name!r} was created with "
                f"peers={'/'.join(s for lane in self._lanes for s in lane.scopes)!r} and has no {scope} lane"
            )
        theirs = next((lane for lane in payload.lanes if scope in lane.scopes), None)
        if theirs is None:
            offered = ", ".join(s for lane in payload.lanes for s in lane.scopes) or "none"
            raise RemoteAgentError(
                f"peer {descriptor.name!r} is {where}, but it offers no {scope} lane (it offers: {offered})"
            )
        if theirs.error_mode != mine.error_mode:
            raise RemoteAgentError(
                f"peer {descriptor.name!r} ({scope}): ucx_error_handling_mode: this agent uses "
                f"{mine.error_mode!r}, the peer uses {theirs.error_mode!r}; UCX refuses mixed endpoints, "
                "set the same backend params on both sides"
            )
        return scope, mine, theirs

    def _load_remote(self, descriptor: AgentDescriptor, previous: RemoteAgent | None) -> Any:
        payload = self.decode_payload(descriptor, _payload_decoder, version=_PAYLOAD_VERSION)
        if payload.nixl_backend != self._nixl_backend:
            raise RemoteAgentError(
                f"peer {descriptor.name!r} uses NIXL backend {payload.nixl_backend!r}; "
                f"agent {self.name!r} uses {self._nixl_backend!r}"
            )
        if any(lane.nixl_name == mine.nixl_name for lane in payload.lanes for mine in self._lanes):
            raise RemoteAgentError(f"peer {descriptor.name!r} is this agent itself; loopback is not supported")
        scope, lane, theirs = self._choose_lanes(descriptor, payload)
        regions = [(r.address, r.length, r.kind, r.device_id) for r in descriptor.regions]
        old: _Peer | None = previous.native if previous is not None else None
        if (
            old is not None
            and old.lane is lane
            and old.nixl_name == theirs.nixl_name
            and old.metadata == theirs.metadata
        ):
            old.side = self._rebuild_side(old.side, regions) if _side_regions(old.side) != sorted(regions) else old.side
            return old
        if old is not None:
            busy = [
                h
                for h in self._handles.values()
                if h.remote == descriptor.name and self.poll(h) is TransferStatus.PENDING
            ]
            if busy:
                raise RemoteAgentError(
                    f"peer {descriptor.name!r} changed its NIXL metadata while {len(busy)} transfer(s) to it are "
                    "in flight; wait for them before loading the new descriptor"
                )
            self._forget_peer(descriptor.name, old)
        try:
            loaded = lane.nixl.add_remote_agent(theirs.metadata)
        except Exception as exc:
            raise map_nixl_error(
                exc, f"NIXL could not load the metadata of peer {descriptor.name!r}", not_found=RemoteAgentError
            ) from exc
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != theirs.nixl_name:
            lane.nixl.remove_remote_agent(loaded)
            raise RemoteAgentError(
                f"peer {descriptor.name!r} claims NIXL name {theirs.nixl_name!r} but its metadata names {loaded!r}"
            )
        return _Peer(theirs.nixl_name, theirs.metadata, _Side.build(regions, theirs.nixl_name, lane.nixl), lane, scope)

    def _same_agent(self, loaded: RemoteAgent, descriptor: AgentDescriptor) -> bool:
        """The same NIXL agent (its name is unique per kvcore agent object); its metadata changes as it registers."""
        payload = self.decode_payload(descriptor, _payload_decoder, version=_PAYLOAD_VERSION)
        old: _Peer = loaded.native
        return self._choose_lanes(descriptor, payload)[2].nixl_name == old.nixl_name  # the lane it is loaded by

    def _describe_agent(self, descriptor: AgentDescriptor) -> str:
        payload = self.decode_payload(descriptor, _payload_decoder, version=_PAYLOAD_VERSION)
        return f"{descriptor.incarnation[:8]}, NIXL agent {payload.nixl_name!r}"

    def _rebuild_side(self, side: _Side, regions: list[tuple[int, int, str, int]]) -> _Side:
        self._drop_side(side)
        return _Side.build(regions, side.target, side.api)

    def _unload_remote(self, remote: RemoteAgent) -> None:
        self._forget_peer(remote.name, remote.native)

    def _forget_peer(self, name: str, peer: _Peer) -> None:
        for h in self._handles.values():
            if h.remote == name:
                self._free_xfer(h)
        self._drop_side(peer.side)
        try:
            peer.lane.nixl.remove_remote_agent(peer.nixl_name)
        except Exception as exc:
            raise map_nixl_error(exc, f"NIXL could not remove peer {name!r}", not_found=RemoteAgentError) from exc

    # --- descriptor lists -------------------------------------------------------------------

    def _drop_side(self, side: _Side | None) -> None:
        if side is None:
            return
        for dl, _ in side.units.values():
            dl.stale = True
            self._maybe_release_dlist(dl)
        side.units.clear()

    def _maybe_release_dlist(self, dl: _Dlist) -> None:
        if dl.stale and dl.users == 0 and dl.handle is not None:
            handle, dl.handle = dl.handle, None
            try:
                handle.release()
            except Exception:
                self._leaked.append(handle)

    def _unit_list(self, side: _Side, unit: int) -> tuple[_Dlist, np.ndarray] | None:
        """The cached list splitting every region of ``side`` into ``unit``-byte descriptors, prepared on a miss."""
        hit = side.units.get(unit)
        if hit is not None:
            side.units[unit] = side.units.pop(unit)  # most recently used last
            return hit
        counts = side.lengths // np.uint64(unit)
        if int(counts.sum()) > self._unit_max or len(set(side.kinds)) != 1:
            return None
        first = np.zeros(counts.size, dtype=np.int64)
        np.cumsum(counts[:-1], out=first[1:])
        keep = counts > 0
        # Nx5 strided rows (address, length, device, stride, count): one row per region, expanded by NIXL.
        rows = np.stack(
            [side.starts, np.full_like(side.starts, unit), side.devices, np.full_like(side.starts, unit), counts],
            axis=1,
        )[keep]
        handle = side.api.prep_xfer_dlist(side.target, np.ascontiguousarray(rows), side.kinds[0])
        while len(side.units) >= self._unit_cache:
            victim = next(iter(side.units))
            dl, _ = side.units.pop(victim)
            dl.stale = True
            self._maybe_release_dlist(dl)
        entry = (_Dlist(handle), first)
        side.units[unit] = entry
        return entry

    @staticmethod
    def _unit_indices(side: _Side, first: np.ndarray, addrs: np.ndarray, unit: int) -> np.ndarray | None:
        region = side.locate(addrs)
        offset = addrs - side.starts[region]
        u = np.uint64(unit)
        # Overlapping registrations could place a fragment in another region than located: refuse then.
        if np.any(offset % u) or np.any(offset + u > side.lengths[region]):
            return None
        idx = first[region] + (offset // np.uint64(unit)).astype(np.int64)
        return idx.astype(np.int32) if idx.size == 0 or int(idx.max()) < 2**31 else None

    # --- transfers --------------------------------------------------------------------------

    def _submit(
        self,
        handle: TransferHandle,
        remote: RemoteAgent,
        local: np.ndarray,
        remote_addrs: np.ndarray,
        sizes: np.ndarray,
    ) -> Any:
        peer, lside, rside = self._sides(handle, remote)
        if sizes.size == 0:
            raise TransferError("a transfer needs at least one fragment")
        runs = _merge_runs(lside, rside, local, remote_addrs, sizes)
        return self._post_xfer(handle, remote, lside, rside, peer, (local, remote_addrs, sizes), runs, None)

    def _submit_piece(
        self, handle: TransferHandle, remote: RemoteAgent, plan: CheckedPlan, start: int, stop: int
    ) -> Any:
        """A piece of a checked plan: the plan's region lookups and descriptor rows are made once, at its first piece,
        and each piece takes its slice of them (merged again only where the piece has neighbours to merge)."""
        peer, lside, rside = self._sides(handle, remote)
        if stop <= start:
            raise TransferError("a transfer needs at least one fragment")
        pd: _PlanDescs | None = plan.native
        if pd is None or pd.lside is not lside or pd.rside is not rside:
            pd = plan.native = _PlanDescs.build(lside, rside, plan)
        frags = (plan.local[start:stop], plan.remote_addrs[start:stop], plan.sizes[start:stop])
        lreg, rreg = pd.lreg[start:stop], pd.rreg[start:stop]
        if pd.joins is not None and pd.joins[start : stop - 1].any():
            local, rem, sizes, (lreg, rreg) = merge_runs(*frags, lreg, rreg)
            return self._post_xfer(handle, remote, lside, rside, peer, frags, (local, rem, sizes, lreg, rreg), None)
        rows = (pd.ld[start:stop], pd.rd[start:stop], pd.lkind, pd.rkind)
        return self._post_xfer(handle, remote, lside, rside, peer, frags, (*frags, lreg, rreg), rows)

    def _sides(self, handle: TransferHandle, remote: RemoteAgent) -> tuple[_Peer, _Side, _Side]:
        if handle.notification == b"":
            raise UnsupportedOperationError(
                "the nixl agent cannot deliver an empty notification; send at least one byte"
            )
        peer: _Peer = remote.native
        return peer, self._local_side(peer.lane), peer.side

    def _post_xfer(
        self,
        handle: TransferHandle,
        remote: RemoteAgent,
        lside: _Side,
        rside: _Side,
        peer: _Peer,
        frags: tuple[np.ndarray, np.ndarray, np.ndarray],
        runs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        rows: tuple[np.ndarray, np.ndarray, str | None, str | None] | None,
    ) -> _Xfer:
        """Build the NIXL transfer of ``frags`` (merged: ``runs``; ``rows``: their descriptor rows, when made
        already) and post it."""
        api = peer.lane.nixl
        op = handle.op.value
        notif = handle.notification or b""
        local, remote_addrs, sizes = frags
        try:
            xfer = None
            # Measured (8192 x 64 KiB scattered: initialize_xfer 0.29 ms vs prepped 0.39 ms; 32768 x 16 KiB:
            # 4.6 ms vs 2.7 ms): one-step lists win up to ~12k descriptors, prepared unit lists above.
            if self._use_units is True or (self._use_units == "auto" and runs[0].size > self._direct_max):
                xfer = self._prepped_xfer(op, lside, rside, local, remote_addrs, sizes, notif)
            if xfer is None:
                xfer = self._direct_xfer(op, lside, rside, peer, runs, notif, rows)
        except TransferError:
            raise
        except Exception as exc:
            raise map_nixl_error(exc, f"NIXL refused the {op} of {sizes.size} fragments to {remote.name!r}") from exc
        try:
            state = api.transfer(xfer.handle, notif)
        except Exception as exc:
            self._free_native(xfer)
            raise map_nixl_error(exc, f"NIXL could not post the {op} to {remote.name!r}") from exc
        if state == "ERR":
            self._free_native(xfer)
            raise TransferFailedError(
                f"NIXL reported an error posting the {op} of {sizes.size} fragments to {remote.name!r}"
            )
        xfer.done = state == "DONE"
        return xfer

    def _prepped_xfer(
        self, op: str, lside: _Side, rside: _Side, local: np.ndarray, rem: np.ndarray, sizes: np.ndarray, notif: bytes
    ) -> _Xfer | None:
        """Equal-size, unit-aligned fragments: indices into cached unit lists (None when not applicable)."""
        unit = int(sizes[0])
        if not np.all(sizes == sizes[0]):
            return None
        lunit = self._unit_list(lside, unit)
        runit = self._unit_list(rside, unit) if lunit is not None else None
        if lunit is None or runit is None:
            return None
        lidx = self._unit_indices(lside, lunit[1], local, unit)
        ridx = self._unit_indices(rside, runit[1], rem, unit) if lidx is not None else None
        if lidx is None or ridx is None:
            return None
        h = lside.api.make_prepped_xfer(op, lunit[0].handle, lidx, runit[0].handle, ridx, notif)
        lunit[0].users += 1
        runit[0].users += 1
        return _Xfer(h, (lunit[0], runit[0]), lside.api)

    def _direct_xfer(
        self,
        op: str,
        lside: _Side,
        rside: _Side,
        peer: _Peer,
        runs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
        notif: bytes,
        rows: tuple[np.ndarray, np.ndarray, str | None, str | None] | None = None,
    ) -> _Xfer:
        """Any fragments, as merged runs: one-step ``initialize_xfer`` on Nx3 arrays (``rows``: made already)."""
        local, rem, sizes, lreg, rreg = runs
        if rows is None:
            ld, rd = _rows(local, sizes, lside.devices[lreg]), _rows(rem, sizes, rside.devices[rreg])
            lkind, rkind = _one_kind(lside, lreg, "local"), _one_kind(rside, rreg, "remote")
        else:
            ld, rd, lk, rk = rows
            lkind = lk if lk is not None else _one_kind(lside, lreg, "local")
            rkind = rk if rk is not None else _one_kind(rside, rreg, "remote")
        api = peer.lane.nixl
        h = api.initialize_xfer(op, api.get_xfer_descs(ld, lkind), api.get_xfer_descs(rd, rkind), peer.nixl_name, notif)
        return _Xfer(h, (), api)

    def _poll(self, handle: TransferHandle) -> TransferStatus:
        xfer: _Xfer | None = handle.native
        if xfer is None:
            raise TransferFailedError(f"transfer {handle.id} lost its NIXL handle (its peer or memory went away)")
        if xfer.done:
            return TransferStatus.DONE
        try:
            state = xfer.api.check_xfer_state(xfer.handle)
        except Exception as exc:
            raise map_nixl_error(exc, f"nixl transfer {handle.id} to {handle.remote!r} failed") from exc
        if state == "DONE":
            xfer.done = True
            return TransferStatus.DONE
        if state == "PROC":
            return TransferStatus.PENDING
        raise TransferFailedError(f"nixl transfer {handle.id} to {handle.remote!r} failed (NIXL state {state!r})")

    def _release(self, handle: TransferHandle) -> None:
        self._free_xfer(handle)

    def _free_xfer(self, handle: TransferHandle) -> None:
        xfer: _Xfer | None = handle.native
        if xfer is not None:
            handle.native = None
            if handle.status is TransferStatus.PENDING:
                handle.status = TransferStatus.FAILED
                handle.error = TransferFailedError(f"transfer {handle.id} was dropped while pending")
            self._free_native(xfer)

    def _free_native(self, xfer: _Xfer) -> None:
        try:
            xfer.handle.release()
        except Exception:
            self._leaked.append(xfer.handle)  # NIXL refused (still active): keep it alive rather than free it
        for dl in xfer.dlists:
            dl.users -= 1
            self._maybe_release_dlist(dl)
        xfer.dlists = ()

    # --- notifications and progress ---------------------------------------------------------

    def _drain(self) -> None:
        notifs: dict[Any, list[bytes]] = {}
        for lane in self._lanes:
            try:
                got = lane.nixl.get_new_notifs()
            except Exception as exc:
                raise map_nixl_error(exc, f"nixl agent {self.name!r} could not read notifications") from exc
            for key, messages in got.items():
                notifs.setdefault(key, []).extend(messages)
        for nixl_name, messages in notifs.items():
            peer = nixl_name.decode() if isinstance(nixl_name, bytes) else str(nixl_name)
            peer = peer.rpartition(_NAME_SEP)[0] or peer
            self._pending_notifs.extend(Notification(peer, bytes(m)) for m in messages)

    def progress(self) -> None:
        """Progress NIXL once (accept connections, complete target-side work), buffering notifications."""
        self._check_open()
        self._drain()

    def _get_notifications(self) -> list[Notification]:
        self._drain()
        out, self._pending_notifs = self._pending_notifs, []
        return out

    # --- lifecycle --------------------------------------------------------------------------

    def _close(self) -> None:
        self._drop_local_sides()
        self._pending_notifs.clear()

    def _native_resources(self) -> dict[str, int]:
        dlists = 0
        sides = [lane.local for lane in self._lanes] + [r.native.side for r in self._remotes.values()]
        for side in sides:
            if side is not None:
                dlists += len(side.units)
        return {"nixl_dlists": dlists, "nixl_leaked_handles": len(self._leaked)}


def _merge_runs(
    lside: _Side, rside: _Side, local: np.ndarray, rem: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Merge neighbours contiguous on both sides and inside the same registrations: (local, remote, sizes, lreg, rreg)."""
    local, rem, sizes, (lreg, rreg) = merge_runs(local, rem, sizes, lside.locate(local), rside.locate(rem))
    return local, rem, sizes, lreg, rreg


def _rows(addrs: np.ndarray, sizes: np.ndarray, devices: np.ndarray) -> np.ndarray:
    """NIXL's Nx3 descriptor rows (address, length, device)."""
    rows = np.empty((sizes.size, 3), dtype=np.uint64)
    rows[:, 0], rows[:, 1], rows[:, 2] = addrs, sizes, devices
    return rows


@dataclass(eq=False)
class _PlanDescs:
    """What every piece of one checked plan shares, made once: each fragment's region on both sides, where
    neighbours merge, the descriptor rows and the memory kinds (None: the side mixes kinds, found per piece)."""

    lside: _Side
    rside: _Side
    lreg: np.ndarray
    rreg: np.ndarray
    joins: np.ndarray | None  # fragment i+1 continues fragment i on both sides (None: nothing in the plan merges)
    ld: np.ndarray
    rd: np.ndarray
    lkind: str | None
    rkind: str | None

    @classmethod
    def build(cls, lside: _Side, rside: _Side, plan: CheckedPlan) -> _PlanDescs:
        local, rem, sizes = plan.local, plan.remote_addrs, plan.sizes
        lreg, rreg = lside.locate(local), rside.locate(rem)
        joins = (local[1:] == local[:-1] + sizes[:-1]) & (rem[1:] == rem[:-1] + sizes[:-1])
        joins &= (lreg[1:] == lreg[:-1]) & (rreg[1:] == rreg[:-1])
        return cls(
            lside,
            rside,
            lreg,
            rreg,
            joins if joins.any() else None,
            _rows(local, sizes, lside.devices[lreg]),
            _rows(rem, sizes, rside.devices[rreg]),
            lside.kinds[0] if len(set(lside.kinds)) == 1 else None,
            rside.kinds[0] if len(set(rside.kinds)) == 1 else None,
        )


def _side_regions(side: _Side) -> list[tuple[int, int, str, int]]:
    return sorted(zip(side.starts.tolist(), side.lengths.tolist(), side.kinds, side.devices.tolist(), strict=True))


def _one_kind(side: _Side, regions: np.ndarray, label: str) -> str:
    kinds = set(side.kinds)
    if len(kinds) == 1:
        return side.kinds[0]
    used = {side.kinds[i] for i in np.unique(regions).tolist()}
    if len(used) != 1:
        raise UnsupportedOperationError(
            f"one nixl transfer cannot mix memory kinds on its {label} side ({', '.join(sorted(used))}); "
            "submit DRAM and VRAM fragments separately"
        )
    return str(used.pop())
