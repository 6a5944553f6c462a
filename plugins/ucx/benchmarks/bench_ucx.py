"""Two-process UCX benchmark: design B (the shipped agent), prototype A (ucxx, this folder) and a memcpy baseline.

python plugins/ucx/benchmarks/bench_ucx.py --designs B,A --iterations 5

The core is ``kvcore_ucx.bench.run``; this script adds design A from ``ucxx_proto.py`` beside it, which the
kvcore-ucx wheel does not ship. A needs ucxx (see plugins/ucx/README.md, "Installing prototype A").
"""

from __future__ import annotations

import os
import sys

from kvcore_ucx import bench

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    sys.path.insert(0, HERE)
    bench.DESIGNS["A"] = "ucxx_proto:UcxxProtoAgent"
    raise SystemExit(bench.main(path=[HERE]))
