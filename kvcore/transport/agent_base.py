"""The state every transfer agent holds: its name, options, class-level declarations and book-keeping tables.

:class:`AgentBase` is the root of :class:`~kvcore.transport.agent.TransferAgent`; the concerns built on it (memory
registrations, peers and their names, completions) each add methods in their own module and share this state.
A transport author subclasses ``TransferAgent``, never this class.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import msgspec
import numpy as np

from kvcore.errors import TransferError
from kvcore.transport.agent_types import AgentCapabilities, Registration, RemoteAgent, TransferHandle


class AgentBase:
    """What every part of the agent contract reads: class declarations, the name, the options, the tables."""

    backend: ClassVar[str] = ""
    capabilities: ClassVar[AgentCapabilities] = AgentCapabilities()
    #: The agent's options as a frozen msgspec struct (defaults and a docstring per field), which the agent
    #: builds with :func:`kvcore.extension.convert.convert_options`; ``None`` for an agent that reads the
    #: raw ``options`` mapping itself. Read by tools and docs tests: an agent states its options once.
    options_type: ClassVar[type[msgspec.Struct] | None] = None

    def __init__(self, name: str, options: Mapping[str, Any] | msgspec.Struct | None = None) -> None:
        """Create an agent named ``name``; a subclass calls this first, then sets up its transport.

        Args:
            name: this agent's name, as peers address it (``submit(..., remote=name)`` on their side).
            options: the transport's options (``TransceiverConfig.agent_options``), a mapping or the agent's
                ``options_type`` struct; kept as a dict in ``self.options``.

        Raises:
            TransferError: ``name`` is empty or not a string.
        """
        if not name or not isinstance(name, str):
            raise TransferError(f"agent name must be a non-empty string, got {name!r}")
        self.name = name
        if isinstance(options, msgspec.Struct):  # already typed: keep the mapping view for agents that read it
            options = msgspec.structs.asdict(options)
        #: The options as given (``TransceiverConfig.agent_options``); typed agents read their struct instead.
        self.options: dict[str, Any] = dict(options or {})
        self._registrations: dict[int, Registration] = {}
        self._remotes: dict[str, RemoteAgent] = {}
        self._exposed: set[str] = set()  # loaded peers that may access this agent's memory (``expose_to``)
        self._handles: dict[int, TransferHandle] = {}
        self._ids = itertools.count(1)
        self._generation = 0
        self._local_starts = np.zeros(0, dtype=np.uint64)
        self._local_ends = np.zeros(0, dtype=np.uint64)
        self._closed = False
        self._completion_listener: Callable[[int], None] | None = None

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"agent {self.name!r} is closed")
