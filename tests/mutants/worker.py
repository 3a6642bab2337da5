"""A mutant worker: imports what the checkers need once, then forks one checker per mutant.

``python -m tests.mutants`` starts one worker per ``--jobs``, as ``python -m
tests.mutants.worker``, in the checkers' environment (`worker_env` in __main__.py: impl's
Python sources, the Hypothesis profile, Triton's interpreter). The worker imports pytest and
its plugins, Hypothesis, numpy, torch, Triton and every kvspec module once (`preload`: most of
a checker's cost used to be these imports, some 2.5 s of CPU each), then reads one request
per line on stdin, ``{"name": mutant, "args": pytest arguments, "timeout": seconds}``. For each
it forks a child from its own clean state, so no checker sees what another one changed; the
child names the mutant in ``KVSPEC_MUTANT`` and runs ``pytest.main(args)``, whose conftest
plants the mutant in ``pytest_configure`` as in a fresh process (the test modules are not
preloaded: they import the planted names when pytest collects them). The worker answers each
request with one line, ``{"name", "returncode", "seconds", "cpu_seconds", "timed_out",
"output"}``: pytest's exit status (minus the signal's number where the child was killed),
what it printed on stdout and stderr, and whether it ran past its timeout (its process group,
checker and whatever it started, is then killed).

Preloading changes no mutant's reach: a module that binds a planted name at import
(``from kvspec.impl.hashing import f``) holds the original whether pytest's conftest or this
worker imported it first, as every mutant module imports impl/ before any mutant is planted;
for each mutant, the same objects hold what it replaces whether every kvspec module is
imported before or after planting (checked for the whole catalogue when this worker was
written; docs/audit.md).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import pkgutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from importlib.metadata import entry_points
from typing import IO, Any, NoReturn

# Third-party modules the checkers import; absent ones are skipped (Triton is optional).
LIBRARIES = ("numpy", "torch", "triton", "hypothesis", "hypothesis.strategies",
             "hypothesis.stateful", "hypothesis.extra.numpy")
# The subpackages of kvspec (pyproject's package-dir maps each to its own folder).
KVSPEC_PACKAGES = ("kvspec", "kvspec.spec", "kvspec.impl", "kvspec.conformance", "kvspec.models")
# pytest's exit status for an internal error: a child whose pytest.main raised exits with it,
# which no verdict counts as a kill.
INTERNAL_ERROR = 3
POLL_SECONDS = 0.01


def kvspec_modules() -> Iterator[str]:
    """Every module of the kvspec packages, ``__main__`` modules left out (they run a CLI)."""
    for package_name in KVSPEC_PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.iter_modules(package.__path__, f"{package_name}."):
            if not info.name.endswith(".__main__"):
                yield info.name


def preload() -> list[str]:
    """Import what every checker imports: pytest with its plugins, the libraries, every kvspec
    module and the mutant catalogue (which conftest.py reads to plant). Returns the modules
    that did not import (a child that needs one imports it again and reports the error)."""
    failed: list[str] = []

    def load(name: str) -> None:
        try:
            importlib.import_module(name)
        except Exception:  # a broken or optional module: the checker that needs it says why
            failed.append(name)

    load("pytest")
    from _pytest.config import default_plugins
    for plugin in default_plugins:
        load(f"_pytest.{plugin}")
    for entry in entry_points(group="pytest11"):
        try:
            entry.load()
        except Exception:
            failed.append(entry.value)
    for library in LIBRARIES:
        load(library)
    # What tests/conftest.py imports before it plants, then everything else of kvspec.
    load("kvspec.conformance.profiles")
    try:
        from tests.mutants import catalogue

        catalogue()
    except Exception:
        failed.append("the mutant catalogue")
    for name in kvspec_modules():
        load(name)
    return failed


def run_checker(name: str, args: Sequence[str], output: int) -> NoReturn:
    """In the forked child: run pytest on ``args`` with ``name`` planted, writing stdout and
    stderr to the file ``output``; exit with pytest's status."""
    status = INTERNAL_ERROR
    try:
        os.setpgid(0, 0)  # its own process group, so a timeout kills what it started too
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        os.environ["KVSPEC_MUTANT"] = name
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        import pytest

        status = int(pytest.main(list(args)))
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)  # no atexit handlers: they are the worker's


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def check(name: str, args: Sequence[str], timeout: float) -> dict[str, Any]:
    """Fork a child that runs ``args`` with mutant ``name`` planted, wait for it at most
    ``timeout`` seconds, and return the reply to send."""
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as output:
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            run_checker(name, args, os.dup(output.fileno()))
        # Also here, so the group exists before any kill (unless the child set it already, or
        # has already exited).
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        deadline = start + timeout
        timed_out = False
        try:
            # Wait for the child to end without reaping it (WNOWAIT), so that its process
            # group's number cannot be reused before what it left running is killed.
            while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                if time.perf_counter() > deadline:
                    timed_out = True
                    break
                time.sleep(POLL_SECONDS)
        finally:  # also when the worker is stopped: no checker outlives it
            kill_group(pid)
            _, status, usage = os.wait4(pid, 0)
        seconds = time.perf_counter() - start
        output.seek(0)
        text = output.read().decode("utf-8", errors="replace")
    return {"name": name, "returncode": os.waitstatus_to_exitcode(status),
            "seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "timed_out": timed_out, "output": text}


def serve(requests: IO[str], replies: IO[str]) -> None:
    """Answer each request line with one reply line until ``requests`` ends."""
    for line in requests:
        if not line.strip():
            continue
        request = json.loads(line)
        reply = check(str(request["name"]), [str(a) for a in request["args"]],
                      float(request["timeout"]))
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main() -> NoReturn:
    # Replies go out on a copy of stdout; fd 1 then points at stderr, so nothing the imports
    # print can be taken for a reply.
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    # Stopped by the runner (or Ctrl-C), the worker unwinds, and check() kills its checker.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    status = 1
    try:
        failed = preload()
        if failed:
            print(f"mutant worker: could not preload {', '.join(failed)}", file=sys.stderr)
        # Nothing imported so far is ever freed: the collector skips it in every child, and
        # the children's memory pages stay shared with the worker's.
        gc.collect()
        gc.freeze()
        replies.write(json.dumps({"ready": os.getpid()}) + "\n")
        replies.flush()
        serve(sys.stdin, replies)
        status = 0
    except SystemExit as stopped:
        status = stopped.code if isinstance(stopped.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        # No interpreter shutdown: the libraries' exit hooks (nanobind's leak report for
        # Triton's bindings) have nothing to say about a worker.
        sys.stderr.flush()
        os._exit(status)


if __name__ == "__main__":
    main()
