"""``python -m kvcore`` is the ``kvcore`` command."""

import sys

from kvcore.cli import main

sys.exit(main())
