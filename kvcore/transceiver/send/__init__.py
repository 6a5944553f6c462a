"""The context role (:class:`Sender`), one module per concern over one settle module."""

from kvcore.transceiver.send.sender import Sender

__all__ = ["Sender"]
