"""Test support for transport authors: the contract suite (``contract``), its two-process harness (``harness``).

Also the one KV oracle (``oracle``), a demo run's spec and a rank's storage (``scenario``) and a harness peer
inside a namespaced host (``host_peer``). The processes under them run on :mod:`kvcore.runtime` (rank
processes on msgpack pipes, two namespaced hosts), which the tools use directly.

Importing this package imports nothing heavy; pytest loads ``kvcore.testing.pytest_plugin`` on its own.
"""
