"""mutation/mutations.py counts a breakage as caught only when pytest's own summary shows a named test failed.

The tool runs here on a tiny git tree of its own (a two-line ``kvcore``, one test file, a two-entry list) with a
fake ``pytest`` package in front of the real one, so no run touches this repository or runs its suite: a pytest
that cannot start and one whose tests all pass must both fail the command; an honest one must pass it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvcore_mutations_tool", ROOT / "mutation" / "mutations.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


tool = _load_tool()

CORE = "def answer():\n    return 42\n"

TESTS = """\
from kvcore.core import answer


def test_answer():
    assert answer() == 42


def test_other():
    assert True
"""

LIST = """\
[[mutation]]
name = "canary"
canary = true
guarantee = "the copy is what the tests import"
file = "kvcore/core.py"
original = '''
    return 42
'''
replacement = '''
    raise RuntimeError("canary")
'''
tests = ["tests/test_fake.py::test_answer"]

[[mutation]]
name = "answer-off-by-one"
guarantee = "the answer is 42"
file = "kvcore/core.py"
original = "return 42"
replacement = "return 41"
tests = ["tests/test_fake.py"]
"""

# The fake pytest: FAKE_PYTEST picks what it does. "honest" fails FAKE_FAILS (default: test_answer) when the copy's
# kvcore/core.py no longer returns 42, and passes otherwise.
FAKE_PYTEST = """\
import os, sys
from pathlib import Path

mode = os.environ["FAKE_PYTEST"]
if mode == "cannot-start":  # what python prints when there is no pytest to run
    print(sys.executable + ": No module named pytest", file=sys.stderr)
    sys.exit(1)
if mode == "conftest-import-error":
    print("ImportError while loading conftest '/tree/tests/conftest.py'.", file=sys.stderr)
    print("ModuleNotFoundError: No module named 'torch'", file=sys.stderr)
    sys.exit(1)
if mode == "one-error":
    print("E")
    print("ERROR tests/test_fake.py::test_answer - fixture 'ctx' not found")
    print("1 error in 0.12s")
    sys.exit(1)
if mode == "missing-plugin":
    print("ERROR: usage: __main__.py [options] [file_or_dir] [file_or_dir] [...]", file=sys.stderr)
    print("__main__.py: error: unrecognized arguments: --timeout=180", file=sys.stderr)
    sys.exit(4)
if mode == "all-pass":
    print("..")
    print("2 passed in 0.01s")
    sys.exit(0)
assert mode == "honest", mode
if "return 42" in Path("kvcore/core.py").read_text():
    print("..")
    print("2 passed in 0.01s")
    sys.exit(0)
node = os.environ.get("FAKE_FAILS", "tests/test_fake.py::test_answer")
print("F")
print(f"FAILED {node} - assert 41 == 42")
print("!!!!!!!!!!!!!!!!!!!!!!!!!! stopping after 1 failures !!!!!!!!!!!!!!!!!!!!!!!!!!")
print("1 failed in 0.02s")
sys.exit(1)
"""


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A git tree with a tiny kvcore, its test file and a mutation list; a fake pytest first on PYTHONPATH."""
    root = tmp_path / "tree"
    for rel, text in {
        "kvcore/__init__.py": "",
        "kvcore/core.py": CORE,
        "tests/test_fake.py": TESTS,
        "mutation/mutations.toml": LIST,
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    fake = tmp_path / "fake" / "pytest"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(FAKE_PYTEST)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_PYTEST", "honest")
    return root


def run_tool(tree: Path, *args: str) -> int:
    return int(tool.main(["--root", str(tree), *args]))


def test_an_honest_pytest_catches_both_breakages_and_the_command_passes(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_tool(tree) == 0
    out = capsys.readouterr().out
    assert "2 of 2 breakages caught" in out
    assert "canary" in out and "caught" in out and "tests/test_fake.py::test_answer" in out
    assert (tree / "kvcore" / "core.py").read_text() == CORE, "the tool edited the tree itself"


@pytest.mark.parametrize("mode", ["cannot-start", "conftest-import-error", "one-error", "missing-plugin"])
def test_a_pytest_that_cannot_run_the_tests_fails_the_baseline(
    tree: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    monkeypatch.setenv("FAKE_PYTEST", mode)
    assert run_tool(tree) != 0
    err = capsys.readouterr().err
    assert "FAILED: baseline" in err, err


@pytest.mark.parametrize("mode", ["cannot-start", "conftest-import-error", "one-error", "missing-plugin"])
def test_a_pytest_that_cannot_run_the_tests_is_an_error_not_a_catch(
    tree: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    monkeypatch.setenv("FAKE_PYTEST", mode)
    assert run_tool(tree, "--no-baseline", "--only", "answer-off-by-one") != 0
    out = capsys.readouterr().out
    assert "ERROR" in out and "0 of 1 breakages caught" in out, out


def test_an_interpreter_without_pytest_fails_the_command(tree: Path, tmp_path: Path) -> None:
    """``--python`` names the interpreter; this one runs everything but ``-m pytest`` (exit 1, as python does)."""
    exe = tmp_path / "python-without-pytest"
    exe.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then echo "$0: No module named pytest" >&2; exit 1; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    exe.chmod(0o755)
    assert run_tool(tree, "--python", str(exe)) != 0
    assert run_tool(tree, "--python", str(exe), "--no-baseline", "--only", "answer-off-by-one") != 0


def test_a_pytest_whose_tests_all_pass_fails_the_command(
    tree: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_PYTEST", "all-pass")
    assert run_tool(tree) != 0
    captured = capsys.readouterr()
    assert "SURVIVED" in captured.out
    assert "the canary canary was not caught" in captured.err  # and nothing after it ran
    assert "answer-off-by-one (kvcore/core.py)" not in captured.out
    assert run_tool(tree, "--only", "answer-off-by-one") != 0
    assert "answer-off-by-one                          SURVIVED" in capsys.readouterr().out


def test_the_canary_counts_only_when_its_own_test_fails(
    tree: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_FAILS", "tests/test_fake.py::test_other")
    assert run_tool(tree) != 0
    out = capsys.readouterr().out
    assert "WRONG-TEST" in out and "none of the expected tests/test_fake.py::test_answer" in out, out


def test_caught_by_names_the_test_that_must_fail(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listing = tree / "mutation" / "mutations.toml"
    listing.write_text(LIST + 'caught_by = ["tests/test_fake.py::test_other"]\n')
    assert run_tool(tree, "--only", "answer-off-by-one") != 0  # test_answer failed, test_other was expected
    monkeypatch.setenv("FAKE_FAILS", "tests/test_fake.py::test_other")
    assert run_tool(tree, "--only", "answer-off-by-one") == 0


def test_check_is_quiet_when_every_snippet_applies(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_tool(tree, "--check") == 0
    assert capsys.readouterr().out.strip().splitlines() == [
        "mutations: all 2 breakages apply exactly once and name existing tests"
    ]


def test_check_reports_a_stale_snippet_and_fails(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tree / "kvcore" / "core.py").write_text("def answer():\n    return 6 * 7\n")  # a refactor orphans both
    assert run_tool(tree, "--check") != 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "answer-off-by-one: STALE: snippet not found in kvcore/core.py" in lines
    assert lines[-1].startswith("mutations: 2 of 2 breakages cannot run as written")
    assert run_tool(tree, "--no-baseline", "--only", "answer-off-by-one") != 0  # a full run calls it STALE too
    assert "STALE" in capsys.readouterr().out


def test_check_reports_a_renamed_test_and_a_replacement_that_does_not_compile(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    listing = tree / "mutation" / "mutations.toml"
    listing.write_text(
        LIST.replace('tests = ["tests/test_fake.py"]', 'tests = ["tests/test_fake.py::test_renamed"]').replace(
            'replacement = "return 41"', 'replacement = "return (41"'
        )
    )
    assert run_tool(tree, "--check") != 0
    out = capsys.readouterr().out
    assert "answer-off-by-one: tests/test_fake.py::test_renamed: no 'test_renamed' in tests/test_fake.py" in out
    assert "answer-off-by-one: the mutated kvcore/core.py does not compile" in out


def test_the_real_list_applies_to_this_tree(capsys: pytest.CaptureFixture[str]) -> None:
    """What ``make lint`` runs: a refactor that orphans a breakage fails here and in CI."""
    assert tool.main(["--check"]) == 0, capsys.readouterr().out


def test_sample_is_the_canary_and_a_rotation_over_the_rest(tree: Path) -> None:
    muts = tool.load(tree / "mutation" / "mutations.toml")
    muts += [tool.Mutation(f"m{i}", "g", "f", "a", "b", ("t",)) for i in range(3)]
    pool = [m.name for m in muts if not m.canary]  # 4 entries
    picks = [[m.name for m in tool.sample(muts, 1, seed)] for seed in range(4)]
    assert all(p[0] == "canary" for p in picks)
    assert sorted(p[1] for p in picks) == sorted(pool)  # consecutive commits cover every entry in turn
    pairs = [[m.name for m in tool.sample(muts, 2, seed)][1:] for seed in (10, 11)]
    assert sorted(pairs[0] + pairs[1]) == sorted(pool)  # two commits, two entries each: all four
    assert tool.sample(muts, 2, 7) == tool.sample(muts, 2, 7)
    assert [m.name for m in tool.sample(muts, 9, 3)] == ["canary", *pool]  # never more than the list


@pytest.mark.parametrize(
    ("line", "counts"),
    [
        ("1 failed, 3 passed in 2.10s", {"failed": 1, "passed": 3}),
        ("========== 2 passed, 1 warning in 0.50s ==========", {"passed": 2, "warnings": 1}),
        ("1 error in 0.12s", {"errors": 1}),
        ("3 errors in 1.00s", {"errors": 3}),
        ("no tests ran in 0.01s", {}),
        (
            "1 failed, 1053 passed, 3 skipped, 2 deselected, 1 xfailed in 645.12s (0:10:45)",
            {"failed": 1, "passed": 1053, "skipped": 3, "deselected": 2, "xfailed": 1},
        ),
        ("/usr/bin/python3: No module named pytest", None),
        ("ImportError while loading conftest '/tree/tests/conftest.py'.", None),
        ("", None),
    ],
)
def test_summary_line_counts(line: str, counts: dict[str, int] | None) -> None:
    assert tool.parse_summary(f"some output\n{line}\n") == counts


def test_summary_and_failures_read_from_a_real_pytest_run(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.fixture
            def broken():
                raise RuntimeError("cannot set up")

            def test_passes():
                pass

            def test_fails():
                assert 1 == 2

            def test_errors(broken):
                pass

            @pytest.mark.parametrize("x", ["a b"])
            def test_param(x):
                assert x == "c"
            """
        )
    )
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "test_sample.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert tool.parse_summary(res.stdout) == {"failed": 2, "passed": 1, "errors": 1}, res.stdout
    assert tool.failed_tests(res.stdout) == ["test_sample.py::test_fails", "test_sample.py::test_param[a b]"]
    verdict, detail = tool.judge(res.returncode, res.stdout, res.stderr, ["test_sample.py::test_param"])
    assert verdict == "caught" and detail.startswith("test_sample.py::test_param[a b]"), detail


@pytest.mark.parametrize(
    ("rc", "stdout", "stderr", "verdict"),
    [
        (1, "", "/usr/bin/python3: No module named pytest", "ERROR"),
        (1, "E\n1 error in 0.10s\n", "", "ERROR"),
        (2, "!!! Interrupted: 1 error during collection !!!\n1 error in 0.30s\n", "", "ERROR"),
        (4, "", "error: unrecognized arguments: --timeout=180", "ERROR"),
        (4, "FAILED t.py::test_a - x\n1 failed in 0.1s\n", "kvcore modules imported from outside the copy", "ERROR"),
        (0, "..\n2 passed in 0.10s\n", "", "SURVIVED"),
        (1, "F\nFAILED t.py::test_b - x\n1 failed in 0.10s\n", "", "WRONG-TEST"),
        (1, "F\nFAILED t.py::test_a[shm] - x\n1 failed, 1 error in 0.10s\n", "", "caught"),
    ],
)
def test_verdicts(rc: int, stdout: str, stderr: str, verdict: str) -> None:
    assert tool.judge(rc, stdout, stderr, ["t.py::test_a"])[0] == verdict
