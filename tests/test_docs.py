"""Docs stay in sync with the code: every hook spec has a ``##`` heading in docs/hooks.md that mentions all its arguments."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from kvcore.extension import hookspecs

DOCS = Path(__file__).resolve().parent.parent / "docs"


def hook_specs() -> dict[str, list[str]]:
    """Every function in kvcore.extension.hookspecs marked with ``@hookspec`` -> its argument names."""
    return {
        name: list(inspect.signature(fn).parameters)
        for name, fn in vars(hookspecs).items()
        if callable(fn) and hasattr(fn, f"{hookspecs.PROJECT}_spec")
    }


def sections(text: str) -> dict[str, str]:
    """``## heading`` -> the text up to the next ``##`` heading."""
    parts = re.split(r"^## +(.+?)\s*$", text, flags=re.MULTILINE)
    return {parts[i].strip("` "): parts[i + 1] for i in range(1, len(parts), 2)}


def test_there_are_hook_specs() -> None:
    specs = hook_specs()
    assert len(specs) >= 3 and all(name.startswith("kvcore_") for name in specs)


@pytest.mark.parametrize("hook", sorted(hook_specs()))
def test_hook_is_documented(hook: str) -> None:
    docs = sections((DOCS / "hooks.md").read_text())
    assert hook in docs, f"docs/hooks.md has no '## {hook}' heading"
    for arg in hook_specs()[hook]:
        assert re.search(rf"`{arg}`", docs[hook]), f"docs/hooks.md section {hook!r} does not mention argument `{arg}`"


def test_no_heading_for_a_hook_that_does_not_exist() -> None:
    documented = {h for h in sections((DOCS / "hooks.md").read_text()) if h.startswith("kvcore_")}
    assert documented <= set(hook_specs()), f"documented but not specified: {documented - set(hook_specs())}"


def test_writing_a_transport_points_at_a_real_example() -> None:
    guide = (DOCS / "writing-a-transport.md").read_text()
    example = DOCS / "examples" / "kvcore-cma"
    for path in ("pyproject.toml", "src/kvcore_cma/plugin.py", "src/kvcore_cma/agent.py", "tests/test_cma_contract.py"):
        assert (example / path).is_file(), f"docs/examples/kvcore-cma/{path} is missing"
    assert "class TestCmaContract(TransferAgentContract):" in guide
    assert "class TestCmaContract(TransferAgentContract):" in (example / "tests/test_cma_contract.py").read_text()
    assert 'cma = "kvcore_cma.plugin"' in (example / "pyproject.toml").read_text()
    assert "KVCORE_PLUGIN_API = 1" in (example / "src/kvcore_cma/plugin.py").read_text()


def test_the_guides_config_table_is_the_one_the_code_generates() -> None:
    """docs/engine-guide.md's TransceiverConfig table: every field, its environment variable and its real default."""
    from kvcore.config import TransceiverConfig, config_table

    text = (DOCS / "engine-guide.md").read_text()
    m = re.search(r"<!-- config-table:start -->\n(.*?)<!-- config-table:end -->", text, flags=re.DOTALL)
    assert m, "docs/engine-guide.md has no generated TransceiverConfig table"
    assert m.group(1) == config_table(), (
        "the table is stale: regenerate it with kvcore.config.config_table() "
        "(python -c 'from kvcore.config import config_table; print(config_table())')"
    )
    import dataclasses

    for f in dataclasses.fields(TransceiverConfig):
        assert f"| `{f.name}` | `KVCORE_{f.name.upper()}` |" in m.group(1)
    assert "—" not in m.group(1), "a field without a comment in kvcore/config.py documents nothing"


@pytest.mark.parametrize("stale", ["once wired", "being added", "once merged", "Wiring status"])
def test_no_doc_promises_work_that_already_landed(stale: str) -> None:
    hits = [
        f"{p.relative_to(DOCS.parent)}:{i}"
        for p in [*DOCS.glob("*.md"), DOCS.parent / "README.md"]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if stale in line
    ]
    assert not hits, f"{stale!r} in {hits}"
