"""A mutant worker: imports what the checkers need once, then forks one checker per mutant.

``python -m tests.mutants`` starts one worker per ``--jobs``, as ``python -m
tests.mutants.worker``, in the checkers' environment (`worker_env` in __main__.py: impl's
Python sources, the Hypothesis profile, Triton's interpreter). The worker imports once what a
checker process imports before tests/conftest.py plants its mutant (`preload`: pytest and its
plugins, Hypothesis, numpy, torch, Triton, the profile, impl/ and the catalogue; most of a
checker's cost used to be these imports, some 2.5 s of CPU each). Then it reads one request a
line on stdin, ``{"name": mutant, "args": pytest arguments, "timeout": seconds}``, and for each
forks a child from its own unchanged state, so no checker sees what another one changed. The
child names the mutant in ``KVSPEC_MUTANT`` and runs ``pytest.main(args)``: conftest plants
the mutant in ``pytest_configure``, and the test modules import the rest after it, as in a
process of its own. The worker answers each request with one line, ``{"name", "returncode",
"seconds", "cpu_seconds", "timed_out", "output"}``: pytest's exit status (minus the signal's
number where the child was killed), what it wrote on stdout and stderr, and whether it ran
past its timeout (its process group, the checker and whatever it started, is then killed).

``python -m tests.mutants.worker --listen PATH MODULE...`` is the same worker as a server on a
Unix socket, for the checkers that run some of their tests again under vLLM 0.33's Python
(tests/vllm_033.py): started there by the runner, it imports vLLM's modules once (`listen`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from typing import IO, Any, NoReturn

# Third-party modules the checkers import; absent ones are skipped (Triton is optional).
LIBRARIES = ("numpy", "torch", "triton", "hypothesis", "hypothesis.strategies",
             "hypothesis.stateful")
# pytest's exit status for an internal error: a child whose pytest.main raised exits with it,
# which no verdict counts as a kill.
INTERNAL_ERROR = 3
MUTANT_VARIABLE = "KVSPEC_MUTANT"  # the mutant tests/conftest.py plants
# Where a checker's environment may differ from the one a server imported its modules in:
# variables no module reads when it is imported (what pytest sets while it runs; the example
# database tests/conftest.py turns off, read only when an audit or a campaign runs).
PER_CHECKER_VARIABLES = frozenset({MUTANT_VARIABLE, "PYTEST_CURRENT_TEST", "PYTEST_VERSION",
                                   "KVSPEC_DATABASE"})
SERVER_GRACE = 60.0  # seconds a server may take beyond a checker's timeout to answer
POLL_SECONDS = 0.01
# The plugins were imported before pytest could mark them for assertion rewriting (their own
# asserts, not the tests'): pytest's warning that it cannot is about the preloading, not about
# the checker.
QUIET_PRELOAD = ("-W", "ignore:Module already imported so cannot be rewritten"
                 ":pytest.PytestAssertRewriteWarning")


def preload(extra: Sequence[str] = ()) -> list[str]:
    """Import what every checker imports, up to where conftest.py plants its mutant: pytest
    with its plugins, the libraries, the Hypothesis profile, impl/ and the mutant catalogue,
    and the ``extra`` modules. Returns the modules that did not import (a child that needs
    one imports it again and reports the error).

    No other kvspec module: a checker's test modules import those, in the child, after the
    mutant is planted, as in a process of its own. Hypothesis draws some values from the
    constants of the project's modules loaded at the time (``/site-packages/`` and tests/
    excluded), so a module preloaded here that the checker would not have imported would
    change the examples it runs."""
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
    # What tests/conftest.py does when pytest imports it: load the Hypothesis profile (a
    # settings object made when a module is imported takes its defaults from the profile
    # loaded then); then what its pytest_configure imports to plant.
    try:
        from kvspec.conformance.profiles import load_profile

        load_profile()
        load("kvspec.impl")
        from tests.mutants import catalogue

        catalogue()
    except Exception:
        failed.append("the profile or the mutant catalogue")
    for name in extra:
        load(name)
    return failed


def run_checker(args: Sequence[str], env: Mapping[str, str], cwd: str | None, stdout: int,
                stderr: int) -> NoReturn:
    """In the forked child: run pytest on ``args`` in environment ``env`` (which names the
    mutant that conftest.py plants) and directory ``cwd``, writing to the files ``stdout``
    and ``stderr``; exit with pytest's status."""
    status = INTERNAL_ERROR
    try:
        os.setpgid(0, 0)  # its own process group, so a timeout kills what it started too
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        import pytest

        status = int(pytest.main([*QUIET_PRELOAD, *args]))
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


def check(args: Sequence[str], env: Mapping[str, str], timeout: float, *,
          cwd: str | None = None, merge_stderr: bool = True,
          abandoned: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """Fork a child that runs pytest on ``args`` in ``env`` (and ``cwd``), wait for it at most
    ``timeout`` seconds, or until ``abandoned()`` says nobody waits for it any more, and
    return what it did: ``returncode`` (minus the signal's number where it was killed),
    ``seconds``, ``cpu_seconds`` (its own and what it waited for), ``timed_out``, and
    ``output`` (stdout and stderr as written), or ``stdout`` and ``stderr`` apart."""
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            run_checker(args, env, cwd, out.fileno(), (out if merge_stderr else err).fileno())
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
                if abandoned():
                    break
                time.sleep(POLL_SECONDS)
        finally:  # also when the worker is stopped: no checker outlives it
            kill_group(pid)
            _, status, usage = os.wait4(pid, 0)
        seconds = time.perf_counter() - start
        said = {}
        for key, file in (("output", out),) if merge_stderr else (("stdout", out),
                                                                  ("stderr", err)):
            file.seek(0)
            said[key] = file.read().decode("utf-8", errors="replace")
    return {"returncode": os.waitstatus_to_exitcode(status), "seconds": seconds,
            "cpu_seconds": usage.ru_utime + usage.ru_stime, "timed_out": timed_out, **said}


def serve(requests: IO[str], replies: IO[str]) -> None:
    """Answer each request line, ``{"name": mutant, "args": pytest arguments, "timeout":
    seconds}``, with one reply line (`check`'s, with the name), until ``requests`` ends."""
    for line in requests:
        if not line.strip():
            continue
        request = json.loads(line)
        name = str(request["name"])
        reply = check([str(a) for a in request["args"]], {**os.environ, MUTANT_VARIABLE: name},
                      float(request["timeout"]))
        replies.write(json.dumps({"name": name, **reply}) + "\n")
        replies.flush()


def listen(path: str, modules: Sequence[str]) -> None:
    """Serve checkers on a Unix socket at ``path`` (tests/vllm_033.py's reruns under vLLM
    0.33's Python), ``modules`` preloaded besides the usual: one request per connection,
    ``{"args", "env", "cwd", "timeout"}``, answered by `check`'s reply with stdout and stderr
    apart, from a handler forked per connection (so checkers run at once), or by
    ``{"refused": why}`` where the request's environment is not the one this server imported
    in (a module may have read it then)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)  # requests wait here while the modules are imported
    before = dict(os.environ)  # what the modules see when they are imported
    failed = preload(modules)
    if failed:
        print(f"mutant worker: could not preload {', '.join(failed)}", file=sys.stderr)
    gc.collect()
    gc.freeze()
    parent = os.getppid()
    server.settimeout(1.0)
    while os.getppid() == parent:  # the runner that started it is gone: so are its clients
        try:
            connection, _ = server.accept()
        except TimeoutError:
            _reap()
            continue
        connection.settimeout(None)
        _reap()
        if os.fork() == 0:
            server.close()
            status = 1
            try:
                _handle(connection, before)
                status = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(status)
        connection.close()


def _reap() -> None:
    """Reap the handlers that have finished."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _handle(connection: socket.socket, before: Mapping[str, str]) -> None:
    with connection, connection.makefile("rb") as lines:
        request = json.loads(lines.readline())
        env = {str(k): str(v) for k, v in request["env"].items()}
        differing = sorted(key for key in set(env) | set(before)
                           if key not in PER_CHECKER_VARIABLES and env.get(key) != before.get(key))
        if differing:
            reply = {"refused": f"its environment differs in {', '.join(differing)}"}
        else:
            # The environment as a fresh process would have it after the same imports (some
            # set variables, as vLLM does), with the checker's own variables.
            after = {k: v for k, v in os.environ.items() if k not in PER_CHECKER_VARIABLES}
            after.update((k, v) for k, v in env.items() if k in PER_CHECKER_VARIABLES)
            reply = check([str(a) for a in request["args"]], after, float(request["timeout"]),
                          cwd=str(request["cwd"]), merge_stderr=False,
                          abandoned=lambda: _hung_up(connection))
        connection.sendall(json.dumps(reply).encode() + b"\n")


def _hung_up(connection: socket.socket) -> bool:
    """Whether the client has gone (its checker killed): nobody waits for this one."""
    readable, _, _ = select.select([connection], [], [], 0)
    if not readable:
        return False
    try:
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except OSError:
        return True


def ask(path: str, args: Sequence[str], env: Mapping[str, str], cwd: str,
        timeout: float) -> dict[str, Any] | None:
    """Run pytest on ``args`` in ``env`` and ``cwd`` on the server listening at ``path``:
    its reply (`check`'s, stdout and stderr apart), or None where no server answers there or
    it refused the request (the caller runs the checker itself)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(path)
            connection.sendall(json.dumps({"args": list(args), "env": dict(env), "cwd": cwd,
                                           "timeout": timeout}).encode() + b"\n")
            connection.settimeout(timeout + SERVER_GRACE)
            with connection.makefile("rb") as lines:
                line = lines.readline()
    except OSError:
        return None
    reply: dict[str, Any] = json.loads(line) if line else {"refused": "no reply"}
    if "refused" in reply:
        print(f"mutant worker at {path} refused a checker: {reply['refused']}", file=sys.stderr)
        return None
    return reply


def main(argv: Sequence[str]) -> NoReturn:
    # Replies go out on a copy of stdout; fd 1 then points at stderr, so nothing the imports
    # print can be taken for a reply.
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    # Stopped by the runner (or Ctrl-C), the worker unwinds, and check() kills its checker.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    status = 1
    try:
        if argv[:1] == ["--listen"]:
            listen(argv[1], argv[2:])
        else:
            failed = preload()
            if failed:
                print(f"mutant worker: could not preload {', '.join(failed)}", file=sys.stderr)
            # Nothing imported so far is ever freed: the collector skips it in every child,
            # and the children's memory pages stay shared with the worker's.
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
    main(sys.argv[1:])
