"""``python -m kvcore`` is the ``kvcore`` command."""

import sys

from kvcore.tools.cli import main

sys.exit(main())
