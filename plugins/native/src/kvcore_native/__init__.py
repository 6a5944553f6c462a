"""kvcore-native: kvcore's compiled helpers.

For now one: the threaded floor of a one-block request in C (:mod:`kvcore_native.floor`), which ``kvcore bench``
reports beside the Python floors. It is the first step of the native per-request path (docs/benchmarks.md, run 14
and Open problems): it builds a C extension from this repository with ``make install``, loads pyzmq's own libzmq
at run time and runs ZeroMQ on threads of its own with the GIL released.
"""

from kvcore_native.floor import NativeFloorError, echo_start, echo_stop, libzmq_path, ping_threaded

__all__ = ["NativeFloorError", "echo_start", "echo_stop", "libzmq_path", "ping_threaded"]
