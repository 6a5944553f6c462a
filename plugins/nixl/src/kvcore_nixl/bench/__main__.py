"""``python -m kvcore_nixl.bench``: bare NIXL vs kvcore's NixlAgent vs host memcpy (see ``--help``)."""

from __future__ import annotations

import sys

from kvcore_nixl.bench.bare_vs_agent import main

if __name__ == "__main__":
    sys.exit(main())
