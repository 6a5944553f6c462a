"""``python -m kvcore_ucx.bench``: the UCX designs' two-process benchmark, printed as JSON (see ``--help``)."""

from __future__ import annotations

import sys

from kvcore_ucx.bench.designs import main

if __name__ == "__main__":
    sys.exit(main())
