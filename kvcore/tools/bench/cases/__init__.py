"""The benchmark cases; importing this package registers every one of them with ``register_case``.

A new case goes in the module of its kind (or a new one imported here): a function ``case(run: BackendRun) -> dict``
decorated with ``@register_case("name")``.
"""

from __future__ import annotations

# The import order is the registration order: `kvcore bench --help` lists the cases in it.
# isort: off
from kvcore.tools.bench.cases import transfer
from kvcore.tools.bench.cases import latency
from kvcore.tools.bench.cases import soak
from kvcore.tools.bench.cases import matrix
# isort: on

__all__ = ["transfer", "latency", "soak", "matrix"]
