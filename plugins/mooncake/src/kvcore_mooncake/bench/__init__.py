"""kvcore-mooncake's bench code in one place; importing this package imports nothing heavy.

* :mod:`~kvcore_mooncake.bench.baselines`: Mooncake's own batch write (``mooncake_batch``) as the ``kvcore bench``
  baseline of ``mooncake``, registered by :mod:`kvcore_mooncake.plugin`.
"""
