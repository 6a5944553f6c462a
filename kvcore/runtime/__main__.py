"""``python -m kvcore.runtime <name>``: a rank process's child (frames on stdin and on a copy of stdout)."""

from __future__ import annotations

import sys

from kvcore.runtime.child import main

if __name__ == "__main__":
    sys.exit(main())
