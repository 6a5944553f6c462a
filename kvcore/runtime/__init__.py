"""The runtime for kvcore's own processes: rank processes on msgpack pipes, and two namespaced hosts.

A rank process is a child running ``main(channel, **kwargs)``, driven by its parent over length-prefixed
msgpack frames with a deadline on every read; ``kvcore demo``, ``kvcore bench``, the plugins' bench targets
and the test harnesses (:mod:`kvcore.testing`) run their processes on it. By concern:

* :mod:`~kvcore.runtime.frames`: the frame structs and their codec;
* :mod:`~kvcore.runtime.channel`: one end of a pipe (:class:`Channel`) and the typed :class:`RankError` family;
* :mod:`~kvcore.runtime.child`: the child's side (:func:`serve` answers ``op_<name>`` commands);
* :mod:`~kvcore.runtime.process`: the parent's handle (:class:`RankProcess`, :func:`ready`);
* :mod:`~kvcore.runtime.hosts`: two namespaced "hosts" joined by a veth pair (root only), whose pid 1 is
  :mod:`~kvcore.runtime.hostinit`.

It builds on nothing of kvcore but the base modules (errors, hostinfo): the tools and :mod:`kvcore.testing`
sit above it. Importing this package imports msgspec and the standard library, nothing heavy.
"""

from __future__ import annotations

from kvcore.runtime.channel import (
    Channel,
    RankError,
    RankExitedError,
    RankFailedError,
    RankProtocolError,
    RankTimeoutError,
)
from kvcore.runtime.child import serve
from kvcore.runtime.process import RankProcess, StartMethod, ready

__all__ = [
    "Channel",
    "RankError",
    "RankExitedError",
    "RankFailedError",
    "RankProcess",
    "RankProtocolError",
    "RankTimeoutError",
    "StartMethod",
    "ready",
    "serve",
]
