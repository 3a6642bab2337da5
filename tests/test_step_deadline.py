"""The step deadline (conformance/deadline.py): a step that does not return is a failure
with its program, in the machine and in the audit, and never a hung run.

The hanging target is tests.planted_bug_pool.NegativeCountSpinsPool: a negative count let
through to the free queue's stale-entry loop, which spins.
"""

from __future__ import annotations

import contextlib
import re
import resource
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvspec.conformance import deadline
from kvspec.conformance.deadline import (
    StepBudget,
    TargetDidNotReturn,
    call_with_deadline,
    configured_seconds,
)
from kvspec.conformance.pool_machine import machine_for
from kvspec.conformance.targets import VllmApiPool

SPINNING_POOL = "tests.planted_bug_pool:NegativeCountSpinsPool"


def spin() -> None:
    while True:
        pass


@pytest.fixture
def no_outer_alarm() -> Iterator[None]:
    """Each test leaves no timer running."""
    yield
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)


def test_a_python_loop_is_interrupted_and_says_where(no_outer_alarm: None) -> None:
    budget = StepBudget(configured=0.2)
    with pytest.raises(TargetDidNotReturn, match=r"target did not return within 0\.2 s") as error:
        call_with_deadline(budget, spin)
    # Where it was stuck, up to the step's boundary: the frames of the call only.
    [where] = str(error.value).splitlines()[1:]
    assert re.fullmatch(r"  interrupted in spin \(tests/test_step_deadline.py:\d+\)", where)
    assert error.value.__context__ is None  # one origin for Hypothesis, wherever it stuck
    assert budget.cut


def test_a_returning_call_returns_and_is_timed(no_outer_alarm: None) -> None:
    budget = StepBudget(configured=5.0)
    assert call_with_deadline(budget, sum, [1, 2, 3]) == 6
    assert 0 < budget.slowest < 5 and not budget.cut


def test_a_target_catching_exception_cannot_swallow_the_deadline(no_outer_alarm: None) -> None:
    def stubborn() -> None:
        with contextlib.suppress(Exception):  # what a target's own clean-up may do
            spin()

    with pytest.raises(TargetDidNotReturn):
        call_with_deadline(StepBudget(configured=0.2), stubborn)


def test_after_a_hang_the_deadline_is_cut_to_shrink_fast(no_outer_alarm: None) -> None:
    budget = StepBudget(configured=5.0, slowest=0.01)
    budget.cut = True
    assert budget.seconds == deadline.SHRINK_FLOOR
    budget.slowest = 0.2
    assert budget.seconds == pytest.approx(deadline.SHRINK_MARGIN * 0.2)
    budget.slowest = 10.0
    assert budget.seconds == 5.0  # never more than configured
    # Timed against a configured deadline of 60 s: it ends at the cut one (0.25 s), and the
    # test allows 10 s, 40 times that, so a loaded machine passes; without the cut, 60 s.
    start = time.monotonic()
    with pytest.raises(TargetDidNotReturn, match=r"within 0\.25 s \(the step deadline, 60 s,"):
        call_with_deadline(StepBudget(configured=60.0, slowest=0.01, cut=True), spin)
    assert time.monotonic() - start < 10.0


def test_nested_calls_run_under_the_outer_deadline_and_the_inner_one_reports(
        no_outer_alarm: None) -> None:
    outer, inner = StepBudget(configured=0.2), StepBudget(configured=60.0)
    seen: list[BaseException] = []

    def wrapper() -> None:  # as the audit's recording wrapper around a bounded rule
        try:
            call_with_deadline(inner, spin)
        except BaseException as error:
            seen.append(error)
            raise

    with pytest.raises(TargetDidNotReturn, match=r"within 0\.2 s"):
        call_with_deadline(outer, wrapper)
    assert [type(e) for e in seen] == [TargetDidNotReturn]  # wrappers see the failure itself
    assert outer.cut and not inner.cut


def test_an_outer_timer_gets_its_alarm_and_remaining_time_back() -> None:
    """The outer timer (2 s) is 40 times the step (a 0.05 s sleep), so a loaded machine does
    not let it run out before the step returns; what the step took (at least its 0.05 s) is
    taken off the time it gets back, and its alarm arrives after that, awaited under a cap."""
    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    try:
        call_with_deadline(StepBudget(configured=60.0), time.sleep, 0.05)
        assert signal.getsignal(signal.SIGALRM) is deadline._on_alarm  # it stays, passing on
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining < 1.96  # 2 s less the step's 0.05 s at least (and rounding)
        cap = time.monotonic() + remaining + 60
        while not fired and time.monotonic() < cap:
            time.sleep(0.05)
        assert fired == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_zero_turns_it_off_and_the_environment_configures_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert call_with_deadline(StepBudget(configured=0.0), time.sleep, 0.01) is None
    monkeypatch.delenv(deadline.ENVIRONMENT_VARIABLE, raising=False)
    assert configured_seconds() == deadline.DEFAULT_SECONDS
    assert configured_seconds(1.5) == 1.5
    monkeypatch.setenv(deadline.ENVIRONMENT_VARIABLE, "0")
    assert configured_seconds() == 0.0
    monkeypatch.setenv(deadline.ENVIRONMENT_VARIABLE, "soon")
    with pytest.raises(ValueError, match="KVSPEC_STEP_DEADLINE must be a number"):
        configured_seconds()
    with pytest.raises(ValueError, match="finite number of seconds >= 0"):
        configured_seconds(-1.0)


def test_a_c_loop_that_never_checks_signals_ends_the_process_with_a_traceback() -> None:
    """What a spin in mypyc-compiled code does: the backstop ends the process."""
    script = textwrap.dedent("""
        import collections, itertools
        from kvspec.conformance.deadline import StepBudget, call_with_deadline

        def stuck_in_c():  # C code that never checks for signals, as mypyc's loops
            collections.deque(itertools.repeat(None), maxlen=0)

        call_with_deadline(StepBudget(configured=0.5), stuck_in_c)
    """)
    # The backstop fires after 2.5 s of the process's CPU time (the deadline plus
    # BACKSTOP_SECONDS), which a loaded machine stretches in wall time but not in CPU time:
    # the test allows the child 25 s of CPU, 10 times that, where the loop alone would run
    # for ever (the subprocess timeout, 300 s of wall time, only stops a hang).
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    process = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=300, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert process.returncode == -signal.SIGPROF
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 10 * (0.5 + deadline.BACKSTOP_SECONDS)
    assert "in stuck_in_c" in process.stderr and "in call_with_deadline" in process.stderr


def test_the_pool_machine_reports_a_hang_with_its_shrunk_program(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(deadline.ENVIRONMENT_VARIABLE, "1")
    machine = machine_for(lambda: VllmApiPool(SPINNING_POOL))
    with pytest.raises(TargetDidNotReturn, match="target did not return") as error:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=200, stateful_step_count=20, database=None, derandomize=True,
            deadline=None, phases=[Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck)))
    assert "interrupted in take_until_none_missing" in str(error.value)
    program = "\n".join(getattr(error.value, "__notes__", []))
    assert "state.build(" in program and "state.bad_alloc_negative()" in program
