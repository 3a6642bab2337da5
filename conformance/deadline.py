"""The step deadline: a conformance-machine step that does not return in time is a discrepancy.

A target that loops for ever (a free queue's stale-entry loop handed a negative count, say)
would otherwise hang the run, which then ends in a suite timeout with no counterexample. So
every rule of a machine, and every round of invariant checks after it, runs under a deadline
(``KVSPEC_STEP_DEADLINE`` seconds, default `DEFAULT_SECONDS`; ``0`` turns it off; ``kvspec
audit --step-deadline``):

* **SIGALRM.** A real-time timer is armed in the main thread around the call. Python runs
  signal handlers between bytecodes, so the handler interrupts pure-Python code wherever it
  loops (impl/ from its sources, vLLM, a fork, the spec) and the step fails with
  `TargetDidNotReturn`, an ``AssertionError`` that says where the step was stuck. Hypothesis
  takes it as any other failure: it shrinks the program and reports it; the audit reports it
  as a discrepancy with its program. Every replay that still hangs costs a deadline, so once
  a step of a machine has not returned its deadline is cut to a multiple of its slowest
  returning step (`StepBudget`), and shrinking takes seconds, not minutes.
* **The backstop.** Code compiled with mypyc (impl's hot modules in the compiled build) never
  checks for pending signals, so a loop there cannot be interrupted from inside the process:
  the SIGALRM handler would only run once the loop returned. A second timer (``ITIMER_PROF``,
  `BACKSTOP_SECONDS` of CPU time after the deadline) ends the process instead: faulthandler
  writes every thread's Python traceback to stderr, then SIGPROF's default action kills the
  process (exit status 155 in a shell, "Profiling timer expired"). The run still ends within
  the bound, but without a shrunk program: run the machine on the sources
  (``KVSPEC_PURE_PYTHON=1``, same code) to get one. Under pytest's output capture the
  traceback goes to the captured stderr and is lost with the process; ``pytest -s`` shows it.

Both timers are process-wide, so they are armed only in the main thread (elsewhere, and
where the platform has no ``setitimer``, steps run unbounded), and a call inside a bounded
call runs under the outer deadline. The SIGALRM handler is put in place on the first step
and stays (setting it twice a step would double the cost): an alarm that is not a step's
goes to the handler it replaced, and an outer user of the timer (pytest-timeout's signal
method) gets its remaining time back after each step. Arming and disarming cost about 4 us
a call, two a step (a rule, then the invariants): about 3% of a pool-machine step.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from time import monotonic
from types import FrameType
from typing import Any, TypeVar

from hypothesis import settings as Settings
from hypothesis.stateful import INITIALIZE_RULE_MARKER, RULE_MARKER, RuleBasedStateMachine

import kvspec.spec as spec_package

T = TypeVar("T")

DEFAULT_SECONDS = 5.0
SHRINK_MARGIN = 5.0  # after a hang: this many times the slowest step that returned ...
SHRINK_FLOOR = 0.25  # ... and at least this many seconds
BACKSTOP_SECONDS = 2.0  # CPU seconds past the deadline before the backstop ends the process
ENVIRONMENT_VARIABLE = "KVSPEC_STEP_DEADLINE"

_SPEC_DIR = Path(spec_package.__file__).resolve().parent  # the model: a hang there is the spec's
_MAIN_THREAD = threading.main_thread().ident
_CAN_ALARM = hasattr(signal, "setitimer") and hasattr(signal, "SIGALRM")
if _CAN_ALARM:  # looked up once: a step arms and disarms two timers
    from signal import setitimer
    _REAL, _PROF, _SIGPROF = signal.ITIMER_REAL, signal.ITIMER_PROF, int(signal.SIGPROF)
# The bounded call now running (its budget, its deadline): inner calls run under it.
_armed: tuple[StepBudget, float] | None = None
_replaced_handler: Any = signal.SIG_DFL  # what SIGALRM's handler was before ours


class TargetDidNotReturn(AssertionError):
    """A step of a conformance machine did not return within the step deadline."""


class _Alarm(BaseException):
    """Raised by the SIGALRM handler where the step is stuck; a BaseException, so that a
    target's ``except Exception`` cannot swallow it. `call_with_deadline` turns it into
    `TargetDidNotReturn` at the step's boundary."""

    def __init__(self, frame: FrameType | None) -> None:
        super().__init__()
        self.frame = frame


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    if _armed is not None:
        raise _Alarm(frame)
    # Not a step's alarm (none is running): it is for the handler ours replaced, if that
    # was a function. (Under the default action an alarm ends the process: no one sets a
    # timer for that, but a step's alarm can arrive just after its step returned.)
    if callable(_replaced_handler):
        _replaced_handler(signum, frame)


def _install_handler() -> None:
    """Put `_on_alarm` in place, once: setting a handler costs more than the rest of a step's
    deadline together, so it stays, passing on the alarms that are not a step's."""
    global _replaced_handler
    current = signal.getsignal(signal.SIGALRM)
    if current is not _on_alarm:
        _replaced_handler = current
        signal.signal(signal.SIGALRM, _on_alarm)


def configured_seconds(value: float | None = None) -> float:
    """The deadline in seconds (0: none): ``value`` if given, else ``KVSPEC_STEP_DEADLINE``,
    else `DEFAULT_SECONDS`."""
    if value is not None:
        seconds = value
    else:
        text = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
        if not text:
            return DEFAULT_SECONDS
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(f"{ENVIRONMENT_VARIABLE} must be a number of seconds (0 for no "
                             f"deadline), got {text!r}") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"the step deadline must be a finite number of seconds >= 0, "
                         f"got {seconds!r}")
    return seconds


@dataclass
class StepBudget:
    """How long a step of one machine class may run.

    ``configured`` seconds (0: no deadline) until a step has not returned. Hypothesis then
    shrinks the failing program, replaying it and its variants, and every replay that still
    hangs costs a whole deadline (50 to 100 of them for one planted hang). So from then on the
    deadline is cut to `SHRINK_MARGIN` times the slowest step that did return, at least
    `SHRINK_FLOOR` seconds: a step that slow has stopped making progress, and shrinking a hang
    takes seconds instead of minutes.
    """

    configured: float = DEFAULT_SECONDS
    slowest: float = 0.0  # the longest a step of this class took and returned, in seconds
    cut: bool = False  # a step has not returned

    @property
    def seconds(self) -> float:
        if not self.cut:
            return self.configured
        return min(self.configured, max(SHRINK_FLOOR, SHRINK_MARGIN * self.slowest))


def call_with_deadline(budget: StepBudget, call: Callable[..., T], *args: Any,
                       **kwargs: Any) -> T:
    """``call(*args, **kwargs)``, failing with `TargetDidNotReturn` if it has not returned
    within the budget's deadline. Inside a bounded call (the audit wraps a machine's bounded
    rules in its own recording wrappers) the outer deadline holds, and the innermost bounded
    call reports the failure, so that every wrapper between it and Hypothesis sees it."""
    global _armed
    if _armed is not None:
        try:
            return call(*args, **kwargs)
        except _Alarm as alarm:
            stuck = alarm.frame
        raise _did_not_return(stuck)
    seconds = budget.seconds
    if not seconds or not _CAN_ALARM or threading.get_ident() != _MAIN_THREAD:
        return call(*args, **kwargs)
    _install_handler()
    _register_backstop()
    outer_prof = setitimer(_PROF, seconds + BACKSTOP_SECONDS)
    _armed = (budget, seconds)
    started = monotonic()
    outer_real = setitimer(_REAL, seconds)
    failure: TargetDidNotReturn | None = None
    try:
        try:
            result = call(*args, **kwargs)
        finally:
            setitimer(_REAL, 0)
    except _Alarm as alarm:  # also one that fired as the call returned: it took the deadline
        failure = _did_not_return(alarm.frame)
    finally:
        _armed = None
        setitimer(_PROF, 0)
        faulthandler.unregister(_SIGPROF)
        elapsed = monotonic() - started
        if outer_real[0] or outer_prof[0]:
            _restore_timer(_REAL, outer_real, elapsed)
            _restore_timer(_PROF, outer_prof, elapsed)
    if failure is None:
        budget.slowest = max(budget.slowest, elapsed)
        return result
    # Raised here, outside the except clause, so that the failure has no context and always
    # the same origin: Hypothesis tells failures apart by type and location.
    raise failure


def _did_not_return(stuck: FrameType | None) -> TargetDidNotReturn:
    """The failure for the bounded call now running, whose step was stuck in ``stuck``; its
    budget's deadline is cut from now on."""
    assert _armed is not None
    budget, seconds = _armed
    failure = TargetDidNotReturn(_stuck_message(seconds, stuck, budget))
    budget.cut = True
    return failure


def _register_backstop() -> None:
    """On SIGPROF: every thread's traceback to stderr, then SIGPROF's default action."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # replaced by an object without a file
        fd = 2
    faulthandler.register(_SIGPROF, file=fd, all_threads=True, chain=True)


def _restore_timer(which: int, outer: tuple[float, float], elapsed: float) -> None:
    delay, interval = outer
    if delay:  # an outer timer was running: give it back what it had left
        setitimer(which, max(delay - elapsed, 1e-6), interval)


def _stuck_message(seconds: float, frame: FrameType | None, budget: StepBudget) -> str:
    """Who did not return, and where it was interrupted (the innermost frames first)."""
    frames: list[FrameType] = []
    # The innermost frames, up to the step's boundary (this module's call_with_deadline).
    while frame is not None and len(frames) < 4 and frame.f_code.co_filename != __file__:
        frames.append(frame)
        frame = frame.f_back
    who = "target"
    if frames:
        path = Path(frames[0].f_code.co_filename).resolve()
        if path.is_relative_to(_SPEC_DIR):
            who = "spec"
    lines = [f"{who} did not return within {seconds:g} s"]
    if seconds < budget.configured:
        lines[0] += (f" (the step deadline, {budget.configured:g} s, is cut once a step has "
                     f"not returned, so that shrinking stays fast)")
    for number, stuck in enumerate(frames):
        code = stuck.f_code
        lines.append(f"  {'interrupted in' if number == 0 else 'called from'} "
                     f"{getattr(code, 'co_qualname', code.co_name)} "
                     f"({_shown_path(code.co_filename)}:{stuck.f_lineno})")
    return "\n".join(lines)


def _shown_path(filename: str) -> str:
    """A file's path from the current directory where it is under it (the project's own
    files), else as Python names it (an installed package's)."""
    path, here = Path(filename).resolve(), Path.cwd().resolve()
    return str(path.relative_to(here)) if path.is_relative_to(here) else filename


# --- Machines ------------------------------------------------------------------------------------


class BoundedSteps(RuleBasedStateMachine):
    """A state machine whose every rule, and every round of invariant checks, runs under the
    step deadline. Subclasses (and subclasses of those, such as the audit's instrumented
    machines) get their rules wrapped when the class is made.

    ``step_deadline`` (seconds, 0 for none) overrides ``KVSPEC_STEP_DEADLINE`` for a class.
    """

    step_deadline: float | None = None
    # One budget per class, shared by the instances Hypothesis makes to replay and shrink.
    _step_budget: StepBudget

    def __init__(self) -> None:
        super().__init__()
        self._step_budget.configured = configured_seconds(type(self).step_deadline)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._step_budget = StepBudget()
        for name, member in list(vars(cls).items()):
            for marker in (RULE_MARKER, INITIALIZE_RULE_MARKER):
                rule = getattr(member, marker, None)
                if rule is not None:
                    bounded = _bounded_rule(rule.function)
                    setattr(bounded, marker, dataclasses.replace(rule, function=bounded))
                    setattr(cls, name, bounded)

    def check_invariants(self, settings: Settings, output: Callable[[str], object],
                         runtimes: dict[str, float]) -> None:
        call_with_deadline(self._step_budget, super().check_invariants, settings, output,
                           runtimes)


def _bounded_rule(function: Callable[..., Any]) -> Callable[..., Any]:
    def bounded_rule(machine: BoundedSteps, *args: Any, **kwargs: Any) -> Any:
        return call_with_deadline(machine._step_budget, function, machine, *args, **kwargs)

    bounded_rule.__name__ = function.__name__  # Hypothesis prints steps by rule name
    bounded_rule.__qualname__ = function.__qualname__
    bounded_rule.__doc__ = function.__doc__
    return bounded_rule
