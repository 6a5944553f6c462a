"""What a transfer agent delivers without being asked: peers' notifications and the completion listener.

:class:`AgentCompletions` hands out notifications (each exactly once) and lets an engine be told, from a
transport's own thread, that a transfer may have ended, so it need not poll in a loop. The transport's part:
``_get_notifications``, and ``_announce(handle_id)`` from its copy or progress threads when it declares
``capabilities.async_submit``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

from kvcore.transport.agent_base import AgentBase
from kvcore.transport.agent_types import Notification

log = logging.getLogger("kvcore.transport.agent")


class AgentCompletions(AgentBase, ABC):
    """The notification and completion part of the agent contract."""

    def get_notifications(self) -> list[Notification]:
        """Notifications received since the last call, each delivered exactly once.

        Returns:
            The :class:`Notification` objects (sender's name, message) that arrived since the last call; empty
            when none did.

        Raises:
            TransferError: the agent is closed.
        """
        self._check_open()
        return self._get_notifications()

    def set_completion_listener(self, listener: Callable[[int], None] | None) -> None:
        """Be told, from any thread, the id of a transfer that may have ended; ``poll`` it to learn how.

        Only transports with ``capabilities.async_submit`` announce (from their copy or progress threads);
        with any other transport, keep polling. The listener must return quickly and must not call into the
        agent (it may run on a transport thread while another thread drives the agent). ``None`` removes it.

        Args:
            listener: called with a ``TransferHandle.id``; an exception it raises is logged, never propagated.
        """
        self._completion_listener = listener

    def _announce(self, handle_id: int) -> None:
        """Tell the completion listener that transfer ``handle_id`` may have ended (for transports)."""
        listener = self._completion_listener
        if listener is None:
            return
        try:
            listener(handle_id)
        except Exception:  # a listener's bug must not stop a transport thread
            log.exception("completion listener of agent %r failed", self.name)

    # --- primitives a transport implements --------------------------------------------------

    @abstractmethod
    def _get_notifications(self) -> list[Notification]:
        """Drain received notifications."""
