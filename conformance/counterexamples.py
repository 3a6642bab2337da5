"""Counterexamples: a failure's minimal program as calls on the target's own API, and as a
pytest file (`lockstep.counterexample_source`) with the spec's expected values written in."""

from __future__ import annotations

import math
import re
from pathlib import Path

from kvspec.conformance.audit import AuditResult
from kvspec.conformance.lockstep import counterexample_source
from kvspec.conformance.recording import Failure


def first_lines(text: str, lines: int = 3, width: int = 160) -> str:
    kept = [line[:width] for line in text.splitlines()[:lines]]
    return "\n".join(kept)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()[:40] or "x"


def program_calls(failure: Failure) -> list[str]:
    """The failure's program as calls on the target's own API (the commands' repr where the
    failing machine is not at hand)."""
    adapter = getattr(getattr(failure.machine, "lockstep", None), "adapter", None)
    if adapter is None:
        return [repr(command) for command in failure.program]
    variable = adapter.variable
    calls = []
    for number, command in enumerate(failure.program):
        call = adapter.call_source(command)
        calls.append(f"{variable} = {call}" if number == 0 else call)
    return calls


def write_counterexample(audit: AuditResult, failure: Failure, directory: Path,
                         number: int) -> Path:
    """Write failure's minimal program as a pytest file of calls on the target's own API, with
    the spec's expected outputs and states written in; return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    name = (f"test_audit_{_slug(audit.target)}_{_slug(audit.profile)}_{failure.layer}_"
            f"{number}_{_slug(failure.situation or failure.check)}.py")
    path = directory / name
    message = "\n".join("    " + line for line in first_lines(failure.message, 6).splitlines())
    command = f"kvspec audit --target {audit.target} --profile {audit.profile}"
    docstring = f"""Counterexample found by `{command}`.

Layer {failure.layer}; {failure.kind} {failure.check!r} failed (rule {failure.rule!r}, situation
{failure.situation!r}) with {failure.error}:

{message}

Each step calls the target's own API, then asserts what the spec ({audit.profile}) says: the
output, or a refusal, and the state read back through the checker's abstraction function.
Run it from any directory, with the interpreter that ran the audit:
    {audit.python} -m pytest {path.resolve()}
"""
    preamble = []
    if ":" in audit.target:  # a class found from the directory the audit ran in
        preamble = ["import sys", "", f"sys.path.insert(0, {str(Path.cwd())!r})"]
    fixtures: list[str] = []
    if failure.error == "TargetDidNotReturn":  # fail where the audit did, rather than hang
        seconds = max(1, math.ceil(audit.step_deadline or 5))
        fixtures = [
            "@pytest.fixture(autouse=True)",
            "def step_deadline() -> Iterator[None]:",
            f'    """The audit found a call that does not return: fail after {seconds} s."""',
            "    def fail(signum: int, frame: object) -> None:",
            f'        raise TimeoutError("the target did not return within {seconds} s")',
            "    previous = signal.signal(signal.SIGALRM, fail)",
            f"    signal.alarm({seconds})",
            "    yield",
            "    signal.alarm(0)",
            "    signal.signal(signal.SIGALRM, previous)",
        ]
        preamble = ["import signal", "from collections.abc import Iterator", *preamble]
    lockstep = failure.machine.lockstep
    text = counterexample_source(lockstep.step, failure.program, lockstep.adapter,
                                 type(failure.machine).view_of, docstring, preamble=preamble,
                                 fixtures=fixtures)
    path.write_text(text)
    failure.counterexample = str(path)
    return path


def write_counterexamples(audit: AuditResult, directory: Path) -> list[Path]:
    paths = []
    for layer in audit.audited:
        for number, failure in enumerate(layer.failures, 1):
            if failure.program and failure.machine is not None:
                paths.append(write_counterexample(audit, failure, directory, number))
    return paths

