"""Run every mutant's checker against it: ``python -m tests.mutants [NAME ...]``.

Prints one line per mutant (killed or survived, seconds to kill) and exits 1 if any survive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from kvspec.spec.conformance.profiles import profile_name
from tests.mutants import Mutant, catalogue

# `kvspec audit` reads the mutation score from here.
RESULTS = Path(__file__).resolve().parents[2] / "build" / "mutants.json"


def save_results(results: dict[str, dict[str, object]]) -> None:
    """Merge this run's verdicts into build/mutants.json (mutants not run keep theirs)."""
    try:
        previous = {m["name"]: m for m in json.loads(RESULTS.read_text())["mutants"]}
    except (OSError, ValueError, KeyError, TypeError):
        previous = {}
    current = {m.name for m in catalogue()}
    merged = {n: e for n, e in {**previous, **results}.items() if n in current}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "profile": profile_name(),
        "finished": datetime.now().isoformat(timespec="seconds"),
        "mutants": sorted(merged.values(), key=lambda m: str(m["name"])),
    }, indent=2) + "\n")


def run_one(mutant: Mutant) -> tuple[bool, float, str]:
    # Compiled classes cannot be monkeypatched: mutants are planted in the Python sources.
    env = dict(os.environ, KVSPEC_MUTANT=mutant.name, KVSPEC_PURE_PYTHON="1")
    if env.get("CI", "").lower() == "true" and not env.get("KVSPEC_PROFILE"):
        env["KVSPEC_PROFILE"] = "ci-mutants"
    env.setdefault("TRITON_INTERPRET", "1")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", *mutant.checker],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False,
    )
    seconds = time.perf_counter() - start
    # pytest exit 1 = a test failed: the mutant was caught. Anything else is a survivor
    # (0 = all passed) or a broken checker (2-5), never a kill. A mutant that names the check
    # expected to catch it is killed only when that check's name is in the failure.
    caught = proc.returncode == 1
    if caught and mutant.killed_by and mutant.killed_by not in proc.stdout:
        return False, seconds, f"failed, but not by {mutant.killed_by}"
    return caught, seconds, mutant.killed_by if caught else f"pytest exit {proc.returncode}"


def main(argv: list[str]) -> int:
    mutants = catalogue()
    if argv:
        mutants = [m for m in mutants if m.name in set(argv)]
    width = max((len(m.name) for m in mutants), default=10)
    survivors = []
    results: dict[str, dict[str, object]] = {}
    print(f"{'mutant':<{width}}  verdict   seconds  caught by / description")
    for mutant in mutants:
        killed, seconds, detail = run_one(mutant)
        verdict = "killed" if killed else "SURVIVED"
        print(f"{mutant.name:<{width}}  {verdict:<8} {seconds:7.1f}  "
              f"[{detail or 'a failing test'}] {mutant.description}", flush=True)
        if not killed:
            survivors.append(mutant.name)
        results[mutant.name] = {"name": mutant.name, "checker": list(mutant.checker),
                                "killed": killed, "seconds": round(seconds, 2),
                                "caught_by": detail}
    save_results(results)
    print(f"{len(mutants) - len(survivors)}/{len(mutants)} mutants killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
