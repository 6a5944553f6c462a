"""kvcore-nixl: the NIXL transfer agent for kvcore (backend name ``nixl``).

Importing this package imports neither nixl nor torch; the agent lives in
``kvcore_nixl.agent`` and is loaded only when the ``nixl`` backend is selected.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
