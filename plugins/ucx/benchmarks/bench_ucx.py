"""Two-process UCX benchmark (designs A and B plus a memcpy baseline); the core is ``kvcore_ucx.bench.run``.

python plugins/ucx/benchmarks/bench_ucx.py --designs B,A --iterations 5
"""

from __future__ import annotations

from kvcore_ucx.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
