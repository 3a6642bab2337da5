"""Count the hostile-input suite's verdicts: ``python -m tests.hostile [--optimize]``.

Runs tests/hostile derandomized (the ci profile) on each build of impl/ there is here (the
compiled one, when ``make compile`` has built it, and the Python sources), each recording
every judged call, and prints per build how many bad calls got each verdict: refused (typed,
named, nothing changed), the caller's own exception passed through, accepted as documented,
and the failures (untyped, unnamed, changed, silent), which the promise wants at 0.
``--optimize`` runs them under ``python -O``.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvspec import impl
from tests.hostile import Verdict

ROOT = Path(__file__).resolve().parent.parent.parent


def count(pure: bool, optimize: bool) -> collections.Counter[str]:
    with tempfile.TemporaryDirectory() as folder:
        record = Path(folder) / "calls.jsonl"
        env = dict(os.environ, KVSPEC_PURE_PYTHON="1" if pure else "0",
                   KVSPEC_HOSTILE_RECORD=str(record), KVSPEC_PROFILE="ci")
        command = [sys.executable, *(["-O"] if optimize else []), "-m", "pytest", "-q",
                   "-p", "no:cacheprovider", "tests/hostile"]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            print(done.stdout[-3000:], file=sys.stderr)
        lines = record.read_text(encoding="utf-8").splitlines() if record.exists() else []
        return collections.Counter(json.loads(line)["verdict"] for line in lines)


def main(argv: list[str]) -> int:
    optimize = "--optimize" in argv
    builds = [("compiled", False)] if impl.COMPILED else []
    builds.append(("pure Python", True))
    print(f"{'build':<12} {'calls':>7} " + " ".join(f"{v.name.lower():>11}" for v in Verdict))
    failures = 0
    for name, pure in builds:
        counts = count(pure, optimize)
        total = sum(counts.values())
        print(f"{name:<12} {total:>7} " + " ".join(f"{counts[v.name]:>11}" for v in Verdict))
        failures += sum(counts[v.name] for v in Verdict if v not in
                        (Verdict.REFUSED, Verdict.PROPAGATED, Verdict.ACCEPTED))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
