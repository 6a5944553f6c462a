"""Test support for transport authors: the contract suite (``contract``) and its two-process harness (``harness``).

Importing this package imports nothing heavy; pytest loads ``kvcore.testing.pytest_plugin`` on its own.
"""
