"""Test support for transport authors: the contract suite (``contract``) and its two-process harness (``harness``).

``ranks`` is the one rank-process harness under ``harness``, the demo, the bench, the tests and the plugins: a
child process runs ``main(channel, **kwargs)``, driven over msgpack frames with a deadline on every read.
``hosts`` builds two namespaced "hosts" joined by a veth pair (root only) for cross-host tests.

Importing this package imports nothing heavy; pytest loads ``kvcore.testing.pytest_plugin`` on its own.
"""
