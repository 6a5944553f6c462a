"""The kvcore exception hierarchy: every error the library raises derives from ``KvcoreError``.

Messages name the field, the expected value and the actual value, so that a
person reading a log line knows what to change without opening the source.
"""

from __future__ import annotations

__all__ = [
    "KvcoreError",
    "PluginError",
    "PluginLoadError",
    "PluginAPIVersionError",
    "DuplicateBackendError",
    "UnknownBackendError",
    "ConfigError",
    "TransferError",
    "RegistrationError",
    "RemoteAgentError",
    "RemoteRangeError",
    "UnsupportedOperationError",
    "TransferFailedError",
    "TransferTimeoutError",
    "PeerLostError",
    "ProtocolError",
    "MessageDecodeError",
    "MessageTooLargeError",
    "ProtocolVersionError",
    "NotRegisteredError",
    "IncompatiblePeerError",
    "LayoutError",
    "MappingError",
    "PoolMismatchError",
    "TopologyError",
    "CollectiveError",
    "SessionError",
    "RequestCancelledError",
    "ResourceExhaustedError",
    "TicketError",
    "LeaseExpiredError",
    "PayloadTooLargeError",
]


class KvcoreError(Exception):
    """Base class of every error kvcore raises."""


# --- plugins and configuration -------------------------------------------------------------


class PluginError(KvcoreError):
    """A plugin could not be discovered, loaded or used."""


class PluginLoadError(PluginError):
    """A plugin's entry point failed to import or to register (raised in strict mode)."""


class PluginAPIVersionError(PluginError):
    """A plugin was built for a different ``KVCORE_PLUGIN_API`` than this core provides."""


class DuplicateBackendError(PluginError):
    """Two plugins registered the same name in the same registry."""


class UnknownBackendError(PluginError, LookupError):
    """A backend was asked for by name but is not registered, or its plugin is broken."""


class ConfigError(KvcoreError, ValueError):
    """A configuration value is missing, malformed or inconsistent."""


# --- data plane -----------------------------------------------------------------------------


class TransferError(KvcoreError):
    """A transfer agent could not register memory, reach a peer or move bytes."""


class RegistrationError(TransferError):
    """Memory could not be registered or deregistered with a transfer agent."""


class RemoteAgentError(TransferError):
    """A remote agent's descriptor is malformed, unknown, or was not loaded."""


class RemoteRangeError(TransferError):
    """A fragment's remote range lies outside memory the peer registered; nothing was moved."""


class UnsupportedOperationError(TransferError):
    """The agent does not support the requested operation or memory kind."""


class TransferFailedError(TransferError):
    """The transport reported a failed transfer."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer or wait did not finish within its deadline."""


class PeerLostError(TransferError):
    """The peer process died or became unreachable."""


# --- control plane --------------------------------------------------------------------------


class ProtocolError(KvcoreError):
    """A control-plane message broke the protocol."""


class MessageDecodeError(ProtocolError):
    """A control-plane frame could not be decoded into a known message."""


class MessageTooLargeError(ProtocolError):
    """A control-plane frame exceeds the configured size bound."""


class ProtocolVersionError(ProtocolError):
    """The peer speaks a protocol version this process cannot talk to."""


class NotRegisteredError(ProtocolError):
    """A context rank does not know the asking generation rank (incarnation): it took nothing; register and ask again."""


class IncompatiblePeerError(KvcoreError):
    """The peer's geometry or configuration cannot be reconciled with ours; refused before any byte moved."""


# --- layout and mapping ---------------------------------------------------------------------


class LayoutError(KvcoreError, ValueError):
    """A KV cache or page table does not have a layout kvcore understands."""


class MappingError(KvcoreError):
    """A fragment plan cannot be built for this pair of pools."""


class PoolMismatchError(MappingError):
    """The two sides disagree on pool role or mapper kind."""


class TopologyError(KvcoreError, ValueError):
    """A parallel topology is malformed or not supported."""


class CollectiveError(KvcoreError):
    """The agreement among an instance's ranks failed: another rank closed its transceiver, exited, or stopped
    calling the collective ``poll()`` in step (the process group's own error is chained)."""


# --- sessions -------------------------------------------------------------------------------


class SessionError(KvcoreError):
    """A request's transfer session ended in an error state or was misused."""


class RequestCancelledError(SessionError):
    """The request was cancelled."""


class ResourceExhaustedError(SessionError):
    """A configured limit (sessions, buffers, memory) was reached."""


class TicketError(SessionError):
    """A receiver did not present the request's ticket (from the context's transfer parameters); nothing was sent."""


class LeaseExpiredError(TransferTimeoutError):
    """The context side let go of a request's pages: its lease ran out before every receiver had the KV."""


class PayloadTooLargeError(SessionError, ValueError):
    """An aux payload is larger than ``max_aux_bytes`` allows (on the side that refused it)."""
