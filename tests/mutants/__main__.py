"""Run every mutant's checker against it: ``python -m tests.mutants [--jobs N] [NAME ...]``.

Each mutant's checker runs in its own pytest process (``-x``: the first failure kills it),
``--jobs`` of them at a time. Every checker runs under one fixed Hypothesis profile,
``mutants`` (derandomized, no example database, no shrinking), whoever runs it and whatever
``CI`` or ``KVSPEC_PROFILE`` say, so a verdict depends on the code alone; ``--profile`` picks
another one for experiments. Prints one line per mutant as it finishes (killed or survived,
seconds to kill), then the summary in catalogue order, writes build/mutants.json (which
``kvspec audit`` reads) and exits 1 if any survive.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from kvspec.conformance.mutation_scores import mutants_path
from kvspec.conformance.profiles import MUTANTS_PROFILE
from tests.mutants import Mutant, catalogue

# `kvspec audit` reads the mutation score from here: $KVSPEC_MUTANTS, else build/mutants.json
# under the current directory (the repository root, where `python -m tests.mutants` runs).
RESULTS = mutants_path()
DEFAULT_TIMEOUT = 600.0  # seconds a checker may run before its mutant counts as a survivor


@dataclass(frozen=True)
class Verdict:
    name: str
    killed: bool
    seconds: float
    detail: str  # the check that caught it, or why it survived

    def entry(self, checker: Sequence[str]) -> dict[str, object]:
        """The mutant's entry in build/mutants.json."""
        return {"name": self.name, "checker": list(checker), "killed": self.killed,
                "seconds": round(self.seconds, 2), "caught_by": self.detail}


def merge_results(previous: Iterable[Mapping[str, object]],
                  results: Mapping[str, dict[str, object]],
                  current: Iterable[str]) -> list[dict[str, object]]:
    """This run's entries over the previous ones, mutants no longer in the catalogue dropped,
    sorted by name."""
    known = {str(e["name"]): dict(e) for e in previous if isinstance(e, Mapping) and "name" in e}
    names = set(current)
    merged = {n: e for n, e in {**known, **results}.items() if n in names}
    return sorted(merged.values(), key=lambda e: str(e["name"]))


def read_results(path: Path = RESULTS) -> list[dict[str, object]]:
    """The entries of a previous run, or none."""
    try:
        entries = json.loads(path.read_text())["mutants"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [e for e in entries if isinstance(e, dict) and "name" in e] \
        if isinstance(entries, list) else []


def save_results(results: dict[str, dict[str, object]], profile: str = MUTANTS_PROFILE,
                 path: Path = RESULTS) -> None:
    """Merge this run's verdicts into build/mutants.json (mutants not run keep theirs)."""
    merged = merge_results(read_results(path), results, (m.name for m in catalogue()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "profile": profile,
        "finished": datetime.now().isoformat(timespec="seconds"),
        "mutants": merged,
    }, indent=2) + "\n")


def checker_env(base: Mapping[str, str], mutant: str, profile: str) -> dict[str, str]:
    """The environment of a mutant's checker: ``base`` with the mutant named, the Python
    sources (compiled classes cannot be monkeypatched) and ``profile``, whatever ``base``
    says about CI or KVSPEC_PROFILE."""
    env = dict(base)
    env.update(KVSPEC_MUTANT=mutant, KVSPEC_PURE_PYTHON="1", KVSPEC_PROFILE=profile)
    env.setdefault("TRITON_INTERPRET", "1")
    return env


def checker_command(mutant: Mutant) -> list[str]:
    # pyproject's addopts add -q and -p no:cacheprovider (no shared cache to race on).
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", *mutant.checker]


def judge(mutant: Mutant, returncode: int, output: str) -> tuple[bool, str]:
    """Whether a checker's exit status and output kill ``mutant``, and the detail to show.

    pytest exit 1 = a test failed: the mutant was caught. Anything else is a survivor (0 = all
    passed) or a broken checker (2-5), never a kill. A mutant that names the check expected to
    catch it is killed only when that check's name is in the failure.
    """
    if returncode != 1:
        return False, f"pytest exit {returncode}"
    if mutant.killed_by and mutant.killed_by not in failure_text(output):
        return False, f"failed, but not by {mutant.killed_by}"
    return True, mutant.killed_by


# A line of the failing program Hypothesis prints ("state.invariant_free_iff_unreferenced()"):
# it names every rule and invariant, so it must not count as the check that caught a mutant.
_PROGRAM_LINE = re.compile(r"^(E\s+)?\s*(state\.\w+\(|\w+ = state\.\w+\()")


def failure_text(output: str) -> str:
    """The checker's output without the printed failing program: what a check said."""
    return "\n".join(line for line in output.splitlines() if not _PROGRAM_LINE.match(line))


def run_one(mutant: Mutant, profile: str = MUTANTS_PROFILE,
            timeout: float = DEFAULT_TIMEOUT) -> Verdict:
    env = checker_env(os.environ, mutant.name, profile)
    start = time.perf_counter()
    try:
        proc = subprocess.run(checker_command(mutant), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, check=False,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return Verdict(mutant.name, False, time.perf_counter() - start,
                       f"checker ran past {timeout:g} s")
    killed, detail = judge(mutant, proc.returncode, proc.stdout)
    return Verdict(mutant.name, killed, time.perf_counter() - start, detail)


def schedule(mutants: Sequence[Mutant], seconds: Mapping[str, float]) -> list[Mutant]:
    """Slowest first (by the last run's seconds; unknown ones first of all), so that the
    last checkers to start are short ones and no core idles at the end."""
    return sorted(mutants, key=lambda m: -seconds.get(m.name, float("inf")))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help="mutants to run (default: the whole catalogue)")
    parser.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1,
                        help="checkers run at once (default: the number of CPUs)")
    parser.add_argument("--profile", default=MUTANTS_PROFILE,
                        help=f"Hypothesis profile of every checker (default {MUTANTS_PROFILE}; "
                        "CI and KVSPEC_PROFILE are ignored)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help="a checker still running after SECONDS leaves its mutant alive "
                        f"(default {DEFAULT_TIMEOUT:g})")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    mutants = catalogue()
    if args.names:
        unknown = sorted(set(args.names) - {m.name for m in mutants})
        if unknown:
            print(f"no mutant named {', '.join(unknown)}", file=sys.stderr)
            return 2
        mutants = [m for m in mutants if m.name in set(args.names)]
    width = max((len(m.name) for m in mutants), default=10)
    by_name = {m.name: m for m in mutants}
    last = {str(e["name"]): float(str(e.get("seconds", 0))) for e in read_results()}

    def line(v: Verdict) -> str:
        verdict = "killed" if v.killed else "SURVIVED"
        return (f"{v.name:<{width}}  {verdict:<8} {v.seconds:7.1f}  "
                f"[{v.detail or 'a failing test'}] {by_name[v.name].description}")

    header = f"{'mutant':<{width}}  verdict   seconds  caught by / description"
    print(f"{len(mutants)} mutants, {args.jobs} at a time, profile {args.profile}")
    print(header, flush=True)
    start = time.perf_counter()
    verdicts: dict[str, Verdict] = {}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_one, m, args.profile, args.timeout)
                   for m in schedule(mutants, last)]
        for future in as_completed(futures):
            verdict = future.result()
            verdicts[verdict.name] = verdict
            print(line(verdict), flush=True)
    wall = time.perf_counter() - start
    ordered = [verdicts[m.name] for m in mutants]
    survivors = [v.name for v in ordered if not v.killed]
    save_results({v.name: v.entry(by_name[v.name].checker) for v in ordered}, args.profile)
    print(f"\nsummary (catalogue order)\n{header}")
    for verdict in ordered:
        print(line(verdict))
    print(f"{len(mutants) - len(survivors)}/{len(mutants)} mutants killed in {wall:.1f} s "
          f"({sum(v.seconds for v in ordered):.1f} s of checkers, {args.jobs} at a time)")
    if survivors:
        print(f"survivors: {' '.join(survivors)}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
