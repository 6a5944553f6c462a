"""The generation role (:class:`Receiver`), one module per concern over one settle module."""

from kvcore.transceiver.receive.receiver import Receiver

__all__ = ["Receiver"]
