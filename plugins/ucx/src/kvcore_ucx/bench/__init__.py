"""kvcore-ucx's bench code in one place; importing this package imports nothing heavy.

* :mod:`~kvcore_ucx.bench.baselines`: bare UCX (``ucx_put``) as the ``kvcore bench`` baseline of ``ucx``,
  registered by :mod:`kvcore_ucx.plugin`;
* :mod:`~kvcore_ucx.bench.designs`: the standalone two-process benchmark of the UCX designs
  (``python -m kvcore_ucx.bench --designs B,A``);
* :mod:`~kvcore_ucx.bench.ucxx_proto`: design A, the ucxx prototype (never registered as a backend; needs ucxx).
"""
