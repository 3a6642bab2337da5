"""Recording what an audited machine does: steps per rule, situation and invariant, and the
program of a failure.

`instrument` makes a subclass of a layer's machine whose every rule and invariant reports to a
`Recorder` (and whose excluded rules never run); a failure is tagged with where it happened
and the commands the machine had run (`Failure`, from `failure_of`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hypothesis.errors import HypothesisException
from hypothesis.stateful import (
    INITIALIZE_RULE_MARKER,
    INVARIANT_MARKER,
    RULE_MARKER,
    RuleBasedStateMachine,
)

# A program is the list of commands (conformance/lockstep.py) a machine ran on the target
# and the spec: read from the failing machine's ``lockstep.performed``, never re-derived from
# Hypothesis's draws.


@dataclass
class Failure:
    """One discrepancy: where it showed, what was raised, and the minimal program."""

    layer: str
    kind: str  # "rule", "invariant" or "run" (outside any rule)
    check: str  # the rule or invariant that raised
    situation: str  # what the step was doing (a rule name, or a named situation)
    error: str  # exception type
    message: str
    program: list[Any]  # the commands run, the build command first
    excluded: frozenset[str] = frozenset()  # the exclusions in force when it was found
    rule: str = ""  # the rule that was running (for an invariant: the last rule run)
    machine: Any = None  # the failing machine (its lockstep's step and adapter write the file)
    counterexample: str | None = None  # path of the written pytest file
    known: bool = False  # listed in the --baseline result
    replayed: bool = False  # found replaying the example database (found by an earlier run)

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.kind, self.check, self.situation, self.error)


class Recorder:
    """Counts steps per rule, situation and invariant, and records each example's program."""

    def __init__(self, on_progress: Callable[[Recorder], None] | None = None) -> None:
        self.rule_steps: Counter[str] = Counter()
        self.situation_steps: Counter[str] = Counter()
        self.invariant_steps: Counter[str] = Counter()
        self.examples = 0
        self.steps = 0
        # Examples that reached each `hypothesis.event` label the machine emitted.
        self.event_examples: Counter[str] = Counter()
        self.counting = True  # off while Hypothesis shrinks a failure
        self.on_progress = on_progress

    def new_example(self) -> None:
        if self.counting:
            self.examples += 1
        if self.on_progress is not None:
            self.on_progress(self)

    def failed(self, error: BaseException, kind: str, check: str, machine: Any) -> None:
        """Tag the exception with where it happened and the program that got there."""
        if not isinstance(error, Exception) or isinstance(error, HypothesisException):
            return  # Hypothesis's own control flow (rejections, stops), not a failure
        self.counting = False
        if not hasattr(error, "_kvspec_where"):
            situation = getattr(machine, "situation", "") or ""
            rule = getattr(machine, "_kvspec_rule", "") or ""
            lockstep = getattr(machine, "lockstep", None)
            program = list(getattr(lockstep, "performed", []))
            try:
                error._kvspec_where = (kind, check, situation, rule)  # type: ignore[attr-defined]
                error._kvspec_program = (program, machine)  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                pass  # an exception type that takes no attributes: reported without a program


def _markers(function: Any) -> list[tuple[str, Any]]:
    """The Hypothesis rules and invariants a machine's member is, by marker."""
    return [(marker, getattr(function, marker))
            for marker in (RULE_MARKER, INITIALIZE_RULE_MARKER, INVARIANT_MARKER)
            if getattr(function, marker, None) is not None]


def _wrap(kind: str, name: str, function: Callable[..., Any],
          recorder: Recorder) -> Callable[..., Any]:
    """A rule (or an invariant, ``kind``) that reports its steps and failures to recorder; a
    rule also names itself as the machine's situation, and counts a situation it names."""
    def wrapper(machine: Any, **arguments: Any) -> Any:
        if kind == "rule":
            machine.situation = name
            machine._kvspec_rule = name
        try:
            result = function(machine, **arguments)
        except BaseException as error:
            recorder.failed(error, kind, name, machine)
            raise
        if recorder.counting and kind == "invariant":
            recorder.invariant_steps[name] += 1
        elif recorder.counting:
            recorder.steps += 1
            recorder.rule_steps[name] += 1
            situation = getattr(machine, "situation", name)
            if situation and situation != name and situation not in machine.excluded:
                recorder.situation_steps[situation] += 1
        return result

    wrapper.__name__ = name
    wrapper.__doc__ = function.__doc__
    return wrapper


def rule_and_invariant_names(machine: type[RuleBasedStateMachine]) -> tuple[list[str], list[str]]:
    """The machine's rules (initialize rules first) and invariants, in Hypothesis's order."""
    initializers, rules, invariants = [], [], []
    for name, member in inspect.getmembers(machine):
        for marker, _ in _markers(member):
            if marker == INITIALIZE_RULE_MARKER:
                initializers.append(name)
            elif marker == RULE_MARKER:
                rules.append(name)
            else:
                invariants.append(name)
    return initializers + rules, invariants


def instrument(machine: type[RuleBasedStateMachine], recorder: Recorder,
               excluded: frozenset[str] = frozenset(),
               step_deadline: float | None = None) -> type[RuleBasedStateMachine]:
    """A subclass of machine whose rules and invariants report to recorder (and whose steps
    run under ``step_deadline`` seconds, where given: `deadline.BoundedSteps`)."""
    namespace: dict[str, Any] = {"excluded": frozenset(getattr(machine, "excluded", ()))
                                 | excluded}
    if step_deadline is not None:
        namespace["step_deadline"] = step_deadline
    for name, member in inspect.getmembers(machine):
        for marker, value in _markers(member):
            kind = "invariant" if marker == INVARIANT_MARKER else "rule"
            wrapper = _wrap(kind, name, value.function, recorder)
            changes: dict[str, Any] = {"function": wrapper}
            if marker == RULE_MARKER and name in namespace["excluded"]:
                # An excluded rule (a bad call already reported, or out of scope) never runs.
                changes["preconditions"] = (*value.preconditions, lambda machine: False)
            setattr(wrapper, marker, dataclasses.replace(value, **changes))
            namespace[name] = wrapper

    def __init__(self: Any) -> None:
        recorder.new_example()
        machine.__init__(self)

    def teardown(self: Any) -> None:
        try:
            machine.teardown(self)
        finally:
            if recorder.counting:
                recorder.event_examples.update(example_events())

    namespace["__init__"] = __init__
    namespace["teardown"] = teardown
    return type(machine.__name__, (machine,), namespace)


# Events Hypothesis itself records about its draws, not the machine's coverage labels.
_HYPOTHESIS_EVENTS = ("Retried draw from ", "Aborted test because ")


def example_events() -> list[str]:
    """The `hypothesis.event` labels the running example has emitted (read at its end: a
    cheap alternative to Hypothesis's observability, which slows a machine about 3x)."""
    from hypothesis.control import current_build_context

    try:
        events = current_build_context().data.events
    except Exception:  # outside a test: nothing to read
        return []
    return [str(label) for label in events if not str(label).startswith(_HYPOTHESIS_EVENTS)]


def leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from leaves(inner)
    else:
        yield error


def failure_of(layer: str, error: BaseException, excluded: frozenset[str]) -> Failure:
    kind, check, situation, rule = getattr(error, "_kvspec_where", ("run", "", "", ""))
    program, machine = getattr(error, "_kvspec_program", ([], None))
    message = str(error).strip() or type(error).__name__
    return Failure(layer, kind, check, situation, type(error).__name__, message, program,
                   excluded, rule, machine)

