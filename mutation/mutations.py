#!/usr/bin/env python3
"""Break kvcore on purpose, one guarantee at a time, and require the tests to notice (``make mutations``).

Each entry of ``mutation/mutations.toml`` names a deliberate breakage: a file, an
exact snippet of today's code, its replacement, the tests to run and (optional
``caught_by``, default: those tests) the tests one of which must fail. For each
entry this script copies the repository (tracked and untracked, non-ignored
files) into a temporary directory, applies the one edit there and runs pytest
on the copy with ``PYTHONPATH`` pointing at it, so the copy's ``kvcore`` is the
one imported (checked before every run, and by the ``_mutation_guard`` pytest
plugin for every kvcore module the run imports), in spawned child processes too.

A run's verdict is read from pytest's own final summary line ("1 failed, 3
passed in 2.1s"), never from its exit status alone (``python -m pytest`` exits
1 when pytest is not even installed):

* ``caught``: pytest exited 1, its summary counts at least one *failed* test,
  and a failed test is one of the entry's ``caught_by`` (the canary's: the one
  test it names);
* ``SURVIVED``: the tests ran and passed (or every one was deselected because
  it fails on the unmutated tree);
* ``WRONG-TEST``: tests failed, but none of those named in ``caught_by``;
* ``STALE``: the snippet is not found exactly once (re-target the entry);
* ``ERROR``: pytest did not run the tests: no summary line (pytest missing or
  crashed), errors but no failed test (an import, collection or fixture error),
  or any other exit status (a usage error: an option whose plugin is missing, a
  test id that does not exist, a kvcore module imported from outside the copy).

The command fails on any verdict but ``caught``; when the baseline (every
selected test once on an unmutated copy) does not end with passed tests and no
errors; when the ``canary`` entry is not caught by its own test (the copy is not
what the tests import: the remaining runs are skipped); and when a selected
test already fails on the unmutated tree: a breakage "caught" by a test that
fails anyway proves nothing. Such tests are deselected from the mutation runs
and listed; ``--allow-baseline-failures`` reports them without failing.

``--check`` is the cheap half, run by ``make lint`` (so by CI) on every change:
every snippet still applies exactly once, the mutated file still compiles, and
every named test file and test function exists. It prints only the problems
and one summary line. ``--sample N`` runs the canary and the next N entries of
a rotation driven by the commit count of ``HEAD`` (``make mutations-sample``, in CI).
Usage::

    python mutation/mutations.py                 # every entry (make mutations; ~10 min here)
    python mutation/mutations.py --only NAME ... # some entries
    python mutation/mutations.py --sample 3      # the canary and 3 entries in turn (make mutations-sample, CI)
    python mutation/mutations.py --check         # every entry still applies; quiet (make lint)
    python mutation/mutations.py --list          # names, files, guarantees and tests, with the same check

``--file``, ``--root`` and ``--python`` point the tool at another list, tree or
interpreter (``tests/test_mutations_tool.py`` runs it on a tiny tree with a
fake pytest).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST = Path("mutation") / "mutations.toml"  # relative to the tree's root

_FIELDS = {"name", "guarantee", "file", "original", "replacement", "tests"}
_OPTIONAL = {"caught_by", "timeout_s", "canary"}


@dataclass(frozen=True)
class Mutation:
    """One deliberate breakage, the tests to run and the tests one of which must fail."""

    name: str
    guarantee: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    caught_by: tuple[str, ...] = ()  # empty: any of ``tests``
    timeout_s: int = 180
    canary: bool = False

    @property
    def catchers(self) -> tuple[str, ...]:
        return self.caught_by or self.tests

    def count(self, root: Path) -> int:
        """How often the snippet occurs in ``root/file`` (-1: no such file)."""
        path = root / self.file
        return path.read_text().count(self.original) if path.is_file() else -1

    def apply(self, root: Path) -> None:
        """Edit ``root/file``; raises ``LookupError`` unless the snippet occurs exactly once."""
        n = self.count(root)
        if n != 1:
            raise LookupError(f"{self.name}: {_count_problem(self, n)} (re-target this mutation)")
        path = root / self.file
        path.write_text(path.read_text().replace(self.original, self.replacement))


def _count_problem(m: Mutation, n: int) -> str:
    if n < 0:
        return f"file {m.file} does not exist"
    return f"snippet {'not found' if n == 0 else f'found {n} times'} in {m.file}"


def load(path: Path) -> list[Mutation]:
    """The mutation list; every field is checked so that a typo fails loudly (``ValueError``)."""
    data = tomllib.loads(path.read_text())
    out: list[Mutation] = []
    names: set[str] = set()
    for i, m in enumerate(data.get("mutation", [])):
        missing = _FIELDS - set(m)
        if missing:
            raise ValueError(f"mutation #{i} in {path.name} lacks {sorted(missing)}")
        unknown = set(m) - _FIELDS - _OPTIONAL
        if unknown:
            raise ValueError(f"mutation {m['name']!r} in {path.name}: unknown field(s) {sorted(unknown)}")
        if m["name"] in names:
            raise ValueError(f"mutation name {m['name']!r} appears twice in {path.name}")
        if m["original"] == m["replacement"]:
            raise ValueError(f"mutation {m['name']!r}: replacement equals the original")
        if not m["tests"]:
            raise ValueError(f"mutation {m['name']!r}: no tests")
        names.add(m["name"])
        mut = Mutation(
            name=m["name"],
            guarantee=m["guarantee"],
            file=m["file"],
            original=m["original"],
            replacement=m["replacement"],
            tests=tuple(m["tests"]),
            caught_by=tuple(m.get("caught_by", ())),
            timeout_s=int(m.get("timeout_s", 180)),
            canary=bool(m.get("canary", False)),
        )
        if mut.canary and (len(mut.tests) != 1 or "::" not in mut.tests[0] or mut.caught_by):
            raise ValueError(f"canary {mut.name!r}: expected exactly one test id (file::test) and no caught_by")
        out.append(mut)
    canaries = [m.name for m in out if m.canary]
    if len(canaries) != 1:
        raise ValueError(f"{path.name}: expected exactly one entry with canary = true, got {canaries}")
    return out


# --- pytest's output -------------------------------------------------------------------------------------------

# The final summary line: "1 failed, 3 passed, 2 warnings in 2.10s", "no tests ran in 0.01s", framed by "=" when
# not quiet, with "(0:10:45)" after long runs.
_SUMMARY = re.compile(
    r"^=*\s*(?P<body>\d+ [a-z]+(?:, \d+ [a-z]+)*|no tests ran) in \d+(?:\.\d+)?s(?: \([0-9:]+\))?\s*=*\s*$"
)
_PLURAL = {"error": "errors", "warning": "warnings"}
_FAILED = re.compile(r"^FAILED (.+?)(?: - (.*))?$", re.MULTILINE)


def parse_summary(stdout: str) -> dict[str, int] | None:
    """The counts of pytest's final summary line (``{"failed": 1, "passed": 3}``); None when it printed none."""
    for line in reversed(stdout.splitlines()):
        m = _SUMMARY.match(line.strip())
        if m:
            body = m.group("body")
            if body == "no tests ran":
                return {}
            counts: dict[str, int] = {}
            for part in body.split(", "):
                n, word = part.split(" ")
                counts[_PLURAL.get(word, word)] = int(n)
            return counts
    return None


def failures(stdout: str) -> list[tuple[str, str]]:
    """``(node id, message)`` of each of pytest's ``FAILED`` short-summary lines (``-rf``)."""
    return [(m.group(1), m.group(2) or "") for m in _FAILED.finditer(stdout)]


def failed_tests(stdout: str) -> list[str]:
    """The node ids of pytest's ``FAILED`` short-summary lines (``-rf``)."""
    return [node for node, _ in failures(stdout)]


def matches(node: str, spec: str) -> bool:
    """``node`` (a pytest node id) is ``spec`` or lies within it (a file, a class, a parametrized test)."""
    if node == spec or node.startswith((spec + "::", spec + "[")):
        return True
    return "::" not in spec and node.startswith(spec.rstrip("/") + "/")


def judge(rc: int, stdout: str, stderr: str, catchers: Sequence[str]) -> tuple[str, str]:
    """The verdict and its detail for a run of a breakage's tests (see the module docstring)."""
    counts = parse_summary(stdout)
    tail = "\n".join((stdout + stderr).strip().splitlines()[-15:])
    if counts is None:
        return "ERROR", f"pytest exited {rc} without its summary line (did it start?):\n{tail}"
    shown = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no tests ran"
    if rc == 0:
        return "SURVIVED", f"every selected test passed ({shown})"
    if rc == 5:
        return "SURVIVED", "no runnable test (every one fails on the baseline, or none was collected)"
    if rc != 1 or not counts.get("failed"):
        return "ERROR", f"pytest exited {rc} with no failed test ({shown}):\n{tail}"
    failed = failures(stdout)
    if not failed:
        return "ERROR", f"pytest counts {counts['failed']} failed but its short summary names none:\n{tail}"
    hits = [(node, why) for node, why in failed if any(matches(node, c) for c in catchers)]
    if not hits:
        names = ", ".join(node for node, _ in failed)
        return "WRONG-TEST", f"{names} failed, none of the expected {', '.join(catchers)}"
    node, why = hits[0]
    return "caught", f"{node}\n    {why}" if why else node


# --- running ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """Where the tree is and which interpreter runs pytest."""

    root: Path = ROOT
    python: str = sys.executable

    def tree_files(self) -> list[str]:
        """Tracked and untracked, non-ignored files of the working tree (what the tests can see)."""
        res = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=self.root,
            check=True,
            capture_output=True,
        )
        return [f for f in res.stdout.decode().split("\0") if f and (self.root / f).is_file()]

    def copy_tree(self, dest: Path) -> None:
        for rel in self.tree_files():
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self.root / rel, target)

    @staticmethod
    def env(copy: Path) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(copy), str(copy / "mutation"), *filter(None, [env.get("PYTHONPATH")])])
        env["KVCORE_MUTATION_COPY"] = str(copy)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["COLUMNS"] = "400"  # pytest cuts its FAILED lines to the terminal width: keep the reason readable
        return env

    def check_import(self, copy: Path) -> None:
        """The copy's kvcore is the one Python imports there (not the installed one)."""
        res = subprocess.run(
            [self.python, "-c", "import kvcore; print(kvcore.__file__)"],
            cwd=copy,
            env=self.env(copy),
            capture_output=True,
            text=True,
        )
        if res.returncode:
            raise RuntimeError(f"the copy cannot import kvcore ({self.python} exited {res.returncode}):\n{res.stderr}")
        got = Path(res.stdout.strip()).resolve()
        if copy.resolve() not in got.parents:
            raise RuntimeError(f"the copy imports kvcore from {got}, not from {copy}")

    def pytest(
        self, copy: Path, tests: Sequence[str], timeout_s: int, *, stop_first: bool, deselect: set[str]
    ) -> tuple[int, str, str]:
        cmd = [self.python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "_mutation_guard"]
        cmd.append(f"--timeout={timeout_s}")
        if stop_first:
            cmd.append("-x")
        for node in sorted(deselect):
            cmd += ["--deselect", node]
        res = subprocess.run([*cmd, *tests], cwd=copy, env=self.env(copy), capture_output=True, text=True)
        return res.returncode, res.stdout, res.stderr


@dataclass
class Result:
    name: str
    verdict: str  # caught | SURVIVED | WRONG-TEST | STALE | ERROR
    detail: str
    seconds: float


class BaselineError(RuntimeError):
    """The unmutated run did not show its tests passing: no mutation run could mean anything."""


def baseline(setup: Setup, muts: list[Mutation]) -> tuple[set[str], float]:
    """Run every selected test once on an unmutated copy; the node ids that fail there."""
    t0 = time.monotonic()
    tests = sorted({t for m in muts for t in m.tests})
    tmp = Path(tempfile.mkdtemp(prefix="kvcore-mut-baseline-"))
    try:
        setup.copy_tree(tmp)
        setup.check_import(tmp)
        rc, out, err = setup.pytest(tmp, tests, max(m.timeout_s for m in muts), stop_first=False, deselect=set())
        counts = parse_summary(out)
        failed = failed_tests(out)
        tail = "\n".join((out + err).strip().splitlines()[-15:])
        if counts is None:
            raise BaselineError(f"baseline: pytest exited {rc} without its summary line (did it start?):\n{tail}")
        shown = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no tests ran"
        if rc not in (0, 1) or counts.get("errors") or not counts.get("passed"):
            raise BaselineError(f"baseline: pytest exited {rc} ({shown}); expected passed tests and no errors:\n{tail}")
        if rc == 1 and (not failed or len(failed) != counts.get("failed", 0)):
            raise BaselineError(f"baseline: pytest exited 1 ({shown}) and named {len(failed)} failed test(s):\n{tail}")
        return set(failed), time.monotonic() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_one(setup: Setup, m: Mutation, keep: bool = False, deselect: frozenset[str] = frozenset()) -> Result:
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f"kvcore-mut-{m.name}-"))
    try:
        setup.copy_tree(tmp)
        try:
            m.apply(tmp)
        except LookupError as exc:
            return Result(m.name, "STALE", str(exc), time.monotonic() - t0)
        try:
            setup.check_import(tmp)
        except RuntimeError as exc:
            return Result(m.name, "ERROR", str(exc), time.monotonic() - t0)
        rc, out, err = setup.pytest(tmp, list(m.tests), m.timeout_s, stop_first=True, deselect=set(deselect))
        verdict, detail = judge(rc, out, err, m.catchers)
        return Result(m.name, verdict, detail, time.monotonic() - t0)
    finally:
        if keep:
            print(f"  kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


# --- the cheap half: does every entry still apply? -------------------------------------------------------------


def _names_in(spec: str) -> tuple[str, list[str]]:
    path, *parts = spec.split("::")
    return path, [p.split("[", 1)[0] for p in parts]


def test_problems(root: Path, spec: str) -> list[str]:
    """Why the test id ``spec`` names nothing in ``root`` (its file, class and function exist): [] when it does."""
    path, names = _names_in(spec)
    target = root / path
    if not target.exists():
        return [f"test path {path} does not exist"]
    if not names:
        return []
    if not target.is_file():
        return [f"test path {path} is not a file"]
    text = target.read_text()
    return [
        f"{spec}: no {name!r} in {path}"
        for name in names
        if not re.search(rf"^\s*(?:async\s+def|def|class)\s+{re.escape(name)}\b", text, re.MULTILINE)
    ]


def problems(root: Path, m: Mutation) -> list[str]:
    """Why ``m`` cannot run as written against the tree at ``root``: [] when its snippet applies once."""
    out: list[str] = []
    n = m.count(root)
    if n != 1:
        out.append(f"STALE: {_count_problem(m, n)}")
    elif m.file.endswith(".py"):
        mutated = (root / m.file).read_text().replace(m.original, m.replacement)
        try:
            compile(mutated, m.file, "exec")
        except SyntaxError as exc:
            out.append(f"the mutated {m.file} does not compile: {exc.msg} (line {exc.lineno})")
    for spec in m.tests + m.caught_by:
        out += test_problems(root, spec)
    for c in m.caught_by:
        if not any(matches(c, t) for t in m.tests):
            out.append(f"caught_by {c} is not among the tests run ({', '.join(m.tests)})")
    return out


def check(root: Path, muts: list[Mutation], *, verbose: bool) -> int:
    """``--check`` (quiet: only problems) and ``--list`` (every entry); 1 when an entry cannot run."""
    bad = 0
    for m in muts:
        found = problems(root, m)
        bad += bool(found)
        if verbose:
            status = "applies" if not found else found[0]
            print(f"{m.name:42} {m.file:30} {status}\n    {m.guarantee}\n    tests: {' '.join(m.tests)}")
            if m.caught_by:
                print(f"    caught by: {' '.join(m.caught_by)}")
            for p in found[1:]:
                print(f"    {p}")
        else:
            for p in found:
                print(f"{m.name}: {p}")
    if bad:
        print(f"mutations: {bad} of {len(muts)} breakages cannot run as written (re-target them in {LIST})")
        return 1
    print(f"mutations: all {len(muts)} breakages apply exactly once and name existing tests")
    return 0


# --- selection -------------------------------------------------------------------------------------------------


def _git(root: Path, *args: str) -> str | None:
    res = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else None


def rotation_seed(root: Path) -> int:
    """The commit count of ``HEAD``: each commit moves the sample on by one entry, so consecutive commits cover
    the whole list. A shallow clone cannot count, so there HEAD's hash picks; without git, the date."""
    if _git(root, "rev-parse", "--is-shallow-repository") == "false":
        count = _git(root, "rev-list", "--count", "HEAD")
        if count and count.isdigit():
            return int(count)
    head = _git(root, "rev-parse", "HEAD")
    if head:
        return int(head[:8], 16)
    return int(hashlib.sha256(time.strftime("%Y-%m-%d").encode()).hexdigest()[:8], 16)


def sample(muts: list[Mutation], n: int, seed: int) -> list[Mutation]:
    """The canary, then the ``seed``-th group of ``n`` other entries in list order (wrapping around).

    Consecutive seeds take consecutive groups: ``ceil(len / n)`` commits in a row run every entry once.
    """
    canary = [m for m in muts if m.canary]
    pool = [m for m in muts if not m.canary]
    n = min(n, len(pool))
    return canary + [pool[(seed * n + i) % len(pool)] for i in range(n)]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    pick = ap.add_mutually_exclusive_group()
    pick.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    pick.add_argument("--sample", type=int, metavar="N", help="run the canary and N entries chosen by rotation")
    ap.add_argument("--seed", type=int, help="the rotation's position for --sample (default: HEAD's commit count)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="list the mutations and check that each still applies")
    mode.add_argument("--check", action="store_true", help="check that each still applies; print only problems")
    ap.add_argument("--keep", action="store_true", help="keep the mutated copies (for debugging)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run (faster; less trustworthy)")
    ap.add_argument(
        "--allow-baseline-failures",
        action="store_true",
        help="report tests that fail on the unmutated tree without failing the command",
    )
    ap.add_argument("--file", type=Path, help=f"the mutation list (default: ROOT/{LIST})")
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree to copy and mutate (default: this repository)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest (default: this one)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    root = args.root.resolve()
    setup = Setup(root=root, python=args.python)
    list_path = args.file or root / LIST
    try:
        muts = load(list_path)
    except (OSError, ValueError) as exc:
        print(f"mutations: cannot load {list_path}: {exc}", file=sys.stderr)
        return 1
    if args.only:
        unknown = set(args.only) - {m.name for m in muts}
        if unknown:
            print(f"unknown mutation(s): {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        muts = [m for m in muts if m.name in args.only]
    elif args.sample is not None:
        seed = rotation_seed(root) if args.seed is None else args.seed
        muts = sample(muts, args.sample, seed)
        print(f"- sample (rotation position {seed}): {', '.join(m.name for m in muts)}", flush=True)
    if args.list or args.check:
        return check(root, muts, verbose=args.list)
    results: list[Result] = []
    t_all = time.monotonic()
    broken: set[str] = set()
    if not args.no_baseline:
        print("- baseline: every selected test on the unmutated tree ...", flush=True)
        try:
            broken, secs = baseline(setup, muts)
        except (BaselineError, RuntimeError) as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
        print(f"  {len(broken)} failing in {secs:.0f}s" + "".join(f"\n    {b}" for b in sorted(broken)), flush=True)
    for m in sorted(muts, key=lambda m: not m.canary):  # the canary first: without it nothing else means anything
        print(f"- {m.name} ({m.file}) ...", flush=True)
        r = run_one(setup, m, keep=args.keep, deselect=frozenset(broken))
        results.append(r)
        print(f"  {r.verdict} in {r.seconds:.0f}s: {r.detail}", flush=True)
        if m.canary and r.verdict != "caught":
            print(
                f"FAILED: the canary {m.name} was not caught by {m.tests[0]}: the tests may not import the "
                "mutated copy, or pytest does not run; the other breakages were not run",
                file=sys.stderr,
            )
            return 1
    print(f"\n{'mutation':42} {'verdict':10} caught by")
    for r in results:
        print(f"{r.name:42} {r.verdict:10} {r.detail.splitlines()[0] if r.detail else ''}")
    bad = [r for r in results if r.verdict != "caught"]
    print(f"\n{len(results) - len(bad)} of {len(results)} breakages caught in {time.monotonic() - t_all:.0f}s")
    if broken:
        print(
            f"{len(broken)} selected test(s) fail without any mutation (deselected above): {', '.join(sorted(broken))}"
        )
    if bad:
        print(f"FAILED: {', '.join(f'{r.name} ({r.verdict})' for r in bad)}", file=sys.stderr)
        return 1
    if broken and not args.allow_baseline_failures:
        print("FAILED: the unmutated tree fails selected tests", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
