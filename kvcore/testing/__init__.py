"""Test support for transport authors: the contract suite (``contract``) and its two-process harness (``harness``).

``hosts`` builds two namespaced "hosts" joined by a veth pair (root only) for cross-host tests.

Importing this package imports nothing heavy; pytest loads ``kvcore.testing.pytest_plugin`` on its own.
"""
