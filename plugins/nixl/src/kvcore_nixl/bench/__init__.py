"""kvcore-nixl's bench code in one place; importing this package imports nothing heavy.

* :mod:`~kvcore_nixl.bench.baselines`: NIXL's own API as ``kvcore bench`` baselines (``nixl_initialize``,
  ``nixl_prepped``), registered by :mod:`kvcore_nixl.plugin`;
* :mod:`~kvcore_nixl.bench.bare_vs_agent`: the standalone two-process benchmark, bare NIXL vs ``NixlAgent`` vs
  memcpy (``python -m kvcore_nixl.bench``).
"""
