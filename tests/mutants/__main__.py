"""Run every mutant's checker against it: ``python -m tests.mutants [--jobs N] [NAME ...]``.

Each mutant's checker is its own pytest run (``-x``: the first failure kills it), in a process
forked by a worker (tests/mutants/worker.py) that has imported what the checkers need once;
``--jobs`` workers run checkers at once, and one more serves the checkers' reruns under vLLM
0.33's Python where its environment is built. Every checker runs under one fixed Hypothesis
profile, ``mutants`` (derandomized, no example database, no shrinking), whoever runs it and
whatever ``CI`` or ``KVSPEC_PROFILE`` say, so a verdict depends on the code alone;
``--profile`` picks another one for experiments. Prints one line per mutant as it finishes
(killed or survived, seconds to kill), then the summary in catalogue order, writes
build/mutants.json (which ``kvspec audit`` reads) and exits 1 if any survive.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from kvspec.conformance.mutation_scores import mutants_path
from kvspec.conformance.profiles import MUTANTS_PROFILE
from tests import vllm_033
from tests.mutants import Mutant, catalogue

# `kvspec audit` reads the mutation score from here: $KVSPEC_MUTANTS, else build/mutants.json
# under the current directory (the repository root, where `python -m tests.mutants` runs).
RESULTS = mutants_path()
DEFAULT_TIMEOUT = 600.0  # seconds a checker may run before its mutant counts as a survivor
WORKER_GRACE = 60.0  # seconds a worker may take beyond a checker's timeout to answer or stop
WORKER_START = 600.0  # seconds a worker may take to import what the checkers need


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


def worker_env(base: Mapping[str, str], profile: str) -> dict[str, str]:
    """The environment of a mutant worker and so of every checker it forks: ``base`` with the
    Python sources (compiled classes cannot be monkeypatched) and ``profile``, whatever
    ``base`` says about CI or KVSPEC_PROFILE, and no mutant named (each checker names its
    own)."""
    env = dict(base)
    env.pop("KVSPEC_MUTANT", None)
    env.update(KVSPEC_PURE_PYTHON="1", KVSPEC_PROFILE=profile)
    env.setdefault("TRITON_INTERPRET", "1")
    return env


def checker_env(base: Mapping[str, str], mutant: str, profile: str) -> dict[str, str]:
    """The environment a mutant's checker runs in: its worker's, with the mutant named."""
    return {**worker_env(base, profile), "KVSPEC_MUTANT": mutant}


def checker_args(mutant: Mutant) -> list[str]:
    """The pytest arguments of a mutant's checker (``-x``: the first failure kills it); by
    hand: ``KVSPEC_MUTANT=<name> KVSPEC_PURE_PYTHON=1 python -m pytest <these>``."""
    # pyproject's addopts add -q and -p no:cacheprovider (no shared cache to race on).
    return ["-x", "-q", "-p", "no:randomly", *mutant.checker]


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


class WorkerError(Exception):
    """A mutant worker died or stopped answering."""


class Worker:
    """One mutant worker (tests/mutants/worker.py, started on first use, again after a
    failure): it has imported what the checkers need and forks each checker from there."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)  # `worker_env`'s
        self.process: subprocess.Popen[str] | None = None

    def run(self, mutant: Mutant, timeout: float) -> Verdict:
        """Run ``mutant``'s checker; a checker past ``timeout`` seconds, or a worker that
        fails, leaves the mutant alive."""
        start = time.perf_counter()
        try:
            if self.process is None:
                self._start()
                start = time.perf_counter()  # the worker's imports are no checker's cost
            requests, _ = self._pipes()
            requests.write(json.dumps({
                "name": mutant.name, "args": checker_args(mutant), "timeout": timeout}) + "\n")
            requests.flush()
            reply = self._reply(timeout + WORKER_GRACE)
        except Exception as error:  # any failure of the worker: no verdict of the checker
            self.stop()
            return Verdict(mutant.name, False, time.perf_counter() - start,
                           f"mutant worker failed: {error}")
        if reply["timed_out"]:
            return Verdict(mutant.name, False, reply["seconds"], f"checker ran past {timeout:g} s")
        killed, detail = judge(mutant, int(reply["returncode"]), str(reply["output"]))
        return Verdict(mutant.name, killed, float(reply["seconds"]), detail)

    def _start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.mutants.worker"],
            env=self.env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, encoding="utf-8")
        self._reply(WORKER_START)  # ready: its imports are done

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        process = self.process
        if process is None or process.stdin is None or process.stdout is None:
            raise WorkerError("it is not running")
        return process.stdin, process.stdout

    def _reply(self, timeout: float) -> dict[str, Any]:
        _, replies = self._pipes()
        ready, _, _ = select.select([replies], [], [], timeout)
        line = replies.readline() if ready else None
        if line is None:
            raise WorkerError(f"no answer in {timeout:g} s")
        if not line:
            status = self.process.wait() if self.process is not None else None
            raise WorkerError(f"it exited with status {status}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def stop(self) -> None:
        """Stop the worker (it kills the checker it runs) and wait for it."""
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(WORKER_GRACE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


class RerunServer:
    """A mutant worker in .venv-vllm-0.33.0's Python that forks the checkers' reruns there
    (tests/vllm_033.py), vLLM imported once instead of once a rerun, on a Unix socket that
    `env` names to the checkers; started where that environment has been built."""

    def __init__(self, worker_env: Mapping[str, str]) -> None:
        self.directory = tempfile.mkdtemp(prefix="kvspec-mutants-")
        path = os.path.join(self.directory, "vllm-0.33.sock")
        self.env = {**worker_env, vllm_033.WORKER_VARIABLE: path}
        self.process = subprocess.Popen(
            [str(vllm_033.VENV_PYTHON), "-m", "tests.mutants.worker", "--listen", path,
             *vllm_033.VLLM_MODULES],
            env=vllm_033.rerun_env(self.env), cwd=vllm_033.ROOT, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL)

    @staticmethod
    def available() -> bool:
        return vllm_033.VENV_PYTHON.exists()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(WORKER_GRACE)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def run_all(mutants: Sequence[Mutant], workers: Sequence[Worker], timeout: float,
            report: Callable[[Verdict], None]) -> dict[str, Verdict]:
    """Run every mutant's checker, in the order given, on the ``workers`` at once; ``report``
    each verdict as it comes (from this thread). Interrupted, it stops the workers."""
    pending = deque(mutants)
    lock = threading.Lock()
    verdicts: queue.Queue[Verdict] = queue.Queue()

    def drive(worker: Worker) -> None:
        while True:
            with lock:
                if not pending:
                    return
                mutant = pending.popleft()
            verdicts.put(worker.run(mutant, timeout))

    threads = [threading.Thread(target=drive, args=(w,), daemon=True) for w in workers]
    found: dict[str, Verdict] = {}
    try:
        for thread in threads:
            thread.start()
        while len(found) < len(mutants):
            verdict = verdicts.get()
            found[verdict.name] = verdict
            report(verdict)
    except BaseException:
        with lock:
            pending.clear()
        for worker in workers:
            worker.stop()
        raise
    finally:
        for thread in threads:
            thread.join()
    return found


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
    # Stopped (a CI limit), stop the workers and their checkers too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
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
    env = worker_env(os.environ, args.profile)
    server = RerunServer(env) if RerunServer.available() else None
    workers = [Worker(server.env if server else env)
               for _ in range(min(args.jobs, len(mutants)))]
    try:
        verdicts = run_all(schedule(mutants, last), workers, args.timeout,
                           lambda verdict: print(line(verdict), flush=True))
    finally:
        for worker in workers:
            worker.stop()
        if server is not None:
            server.stop()
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
