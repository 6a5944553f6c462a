#!/usr/bin/env python3
"""Break kvcore on purpose, one guarantee at a time, and require the tests to notice (``make mutations``).

Each entry of ``tools/mutations.toml`` names a deliberate breakage: a file, an
exact snippet of today's code, its replacement, and the tests expected to catch
it. For each entry this script copies the repository (tracked and untracked,
non-ignored files) into a temporary directory, applies the one edit there and
runs pytest on the copy with ``PYTHONPATH`` pointing at it, so the copy's
``kvcore`` is the one imported (checked before every run, and by the
``_mutation_guard`` pytest plugin for every kvcore module the run imports), in
spawned child processes too.

The command fails when

* a snippet is not found exactly once (the list went stale: re-target it), or
* a breakage survives (its tests pass), or
* the tests could not run (collection or usage error), or
* the ``canary`` entry is not caught (the copy is not what the tests import), or
* a selected test already fails on the unmutated tree (baseline): a breakage "caught" by a test that fails
  anyway proves nothing. Such tests are deselected from the mutation runs and listed; ``--allow-baseline-failures``
  reports them without failing the command (useful while a feature the tests expect is being built).

It prints which test caught each breakage and the time each run took. Usage::

    python tools/mutations.py                 # every entry
    python tools/mutations.py --only NAME ... # some entries
    python tools/mutations.py --list          # names, files and tests; checks that every snippet applies
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "tools" / "mutations.toml"


@dataclass(frozen=True)
class Mutation:
    """One deliberate breakage and the tests that must catch it."""

    name: str
    guarantee: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    timeout_s: int = 180

    def apply(self, root: Path) -> None:
        """Edit ``root/file``; raises ``LookupError`` unless the snippet occurs exactly once."""
        path = root / self.file
        if not path.is_file():
            raise LookupError(f"{self.name}: file {self.file} does not exist (re-target this mutation)")
        text = path.read_text()
        n = text.count(self.original)
        if n != 1:
            where = "not found" if n == 0 else f"found {n} times"
            raise LookupError(f"{self.name}: snippet {where} in {self.file} (re-target this mutation)")
        path.write_text(text.replace(self.original, self.replacement))


def load(path: Path = LIST) -> list[Mutation]:
    """The mutation list; every field is checked so that a typo fails loudly."""
    data = tomllib.loads(path.read_text())
    out: list[Mutation] = []
    names: set[str] = set()
    for i, m in enumerate(data.get("mutation", [])):
        missing = {"name", "guarantee", "file", "original", "replacement", "tests"} - set(m)
        if missing:
            raise ValueError(f"mutation #{i} in {path.name} lacks {sorted(missing)}")
        if m["name"] in names:
            raise ValueError(f"mutation name {m['name']!r} appears twice in {path.name}")
        if m["original"] == m["replacement"]:
            raise ValueError(f"mutation {m['name']!r}: replacement equals the original")
        names.add(m["name"])
        out.append(
            Mutation(
                name=m["name"],
                guarantee=m["guarantee"],
                file=m["file"],
                original=m["original"],
                replacement=m["replacement"],
                tests=tuple(m["tests"]),
                timeout_s=int(m.get("timeout_s", 180)),
            )
        )
    return out


def _tree_files() -> list[str]:
    """Tracked and untracked, non-ignored files of the working tree (what the tests can see)."""
    res = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return [f for f in res.stdout.decode().split("\0") if f and (ROOT / f).is_file()]


def copy_tree(dest: Path) -> None:
    for rel in _tree_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)


def _env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), str(copy / "tools"), *filter(None, [env.get("PYTHONPATH")])])
    env["KVCORE_MUTATION_COPY"] = str(copy)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_import(copy: Path) -> None:
    """The copy's kvcore is the one Python imports there (not the installed one)."""
    res = subprocess.run(
        [sys.executable, "-c", "import kvcore; print(kvcore.__file__)"],
        cwd=copy,
        env=_env(copy),
        capture_output=True,
        text=True,
        check=True,
    )
    got = Path(res.stdout.strip()).resolve()
    if copy.resolve() not in got.parents:
        raise RuntimeError(f"the copy imports kvcore from {got}, not from {copy}")


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


@dataclass
class Result:
    name: str
    verdict: str  # caught | SURVIVED | STALE | ERROR
    detail: str
    seconds: float


def _pytest(copy: Path, tests: list[str], timeout_s: int, *, stop_first: bool, deselect: set[str]) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "_mutation_guard"]
    cmd.append(f"--timeout={timeout_s}")
    if stop_first:
        cmd.append("-x")
    for node in sorted(deselect):
        cmd += ["--deselect", node]
    res = subprocess.run([*cmd, *tests], cwd=copy, env=_env(copy), capture_output=True, text=True)
    return res.returncode, res.stdout + res.stderr


def baseline(muts: list[Mutation]) -> tuple[set[str], float]:
    """Run every selected test once on an unmutated copy; the node ids that fail there."""
    t0 = time.monotonic()
    tests = sorted({t for m in muts for t in m.tests})
    tmp = Path(tempfile.mkdtemp(prefix="kvcore-mut-baseline-"))
    try:
        copy_tree(tmp)
        check_import(tmp)
        rc, out = _pytest(tmp, tests, max(m.timeout_s for m in muts), stop_first=False, deselect=set())
        if rc not in (0, 1):
            tail = "\n".join(out.strip().splitlines()[-15:])
            raise RuntimeError(f"baseline pytest exited {rc}:\n{tail}")
        return set(_FAILED.findall(out)), time.monotonic() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_one(m: Mutation, keep: bool = False, deselect: frozenset[str] = frozenset()) -> Result:
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f"kvcore-mut-{m.name}-"))
    try:
        copy_tree(tmp)
        try:
            m.apply(tmp)
        except LookupError as exc:
            return Result(m.name, "STALE", str(exc), time.monotonic() - t0)
        check_import(tmp)
        rc, out = _pytest(tmp, list(m.tests), m.timeout_s, stop_first=True, deselect=set(deselect))
        if rc == 5:  # every selected test was deselected: nothing could catch the breakage
            return Result(m.name, "SURVIVED", "no runnable test (all fail on the baseline)", time.monotonic() - t0)
        if rc == 0:
            return Result(m.name, "SURVIVED", "every selected test passed", time.monotonic() - t0)
        if rc == 1:
            caught = _FAILED.findall(out)
            return Result(m.name, "caught", caught[0] if caught else "(a test failed)", time.monotonic() - t0)
        tail = "\n".join(out.strip().splitlines()[-15:])
        return Result(m.name, "ERROR", f"pytest exited {rc}:\n{tail}", time.monotonic() - t0)
    finally:
        if keep:
            print(f"  kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    ap.add_argument("--list", action="store_true", help="list the mutations and check that each still applies")
    ap.add_argument("--keep", action="store_true", help="keep the mutated copies (for debugging)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run (faster; less trustworthy)")
    ap.add_argument(
        "--allow-baseline-failures",
        action="store_true",
        help="report tests that fail on the unmutated tree without failing the command",
    )
    args = ap.parse_args(argv)
    muts = load()
    if args.only:
        unknown = set(args.only) - {m.name for m in muts}
        if unknown:
            print(f"unknown mutation(s): {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        muts = [m for m in muts if m.name in args.only]
    if args.list:
        bad = 0
        for m in muts:
            text = (ROOT / m.file).read_text() if (ROOT / m.file).is_file() else ""
            n = text.count(m.original)
            ok = "applies" if n == 1 else ("STALE: not found" if n == 0 else f"STALE: found {n} times")
            bad += n != 1
            print(f"{m.name:42} {m.file:28} {ok}\n    {m.guarantee}\n    tests: {' '.join(m.tests)}")
        return 1 if bad else 0
    results = []
    t_all = time.monotonic()
    broken: set[str] = set()
    if not args.no_baseline:
        print("- baseline: every selected test on the unmutated tree ...", flush=True)
        broken, secs = baseline(muts)
        print(f"  {len(broken)} failing in {secs:.0f}s" + "".join(f"\n    {b}" for b in sorted(broken)), flush=True)
    for m in muts:
        print(f"- {m.name} ({m.file}) ...", flush=True)
        r = run_one(m, keep=args.keep, deselect=frozenset(broken))
        results.append(r)
        print(f"  {r.verdict} in {r.seconds:.0f}s: {r.detail}", flush=True)
    print(f"\n{'mutation':42} {'verdict':9} caught by")
    for r in results:
        print(f"{r.name:42} {r.verdict:9} {r.detail.splitlines()[0] if r.detail else ''}")
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
