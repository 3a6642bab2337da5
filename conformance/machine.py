"""The skeleton every layer's conformance machine shares (`LockstepMachine`).

A layer's machine is a Hypothesis state machine whose rules are what a caller does with the
component, one `spec` command at a time, run on the spec and a target in lock step
(`lockstep.Lockstep`); every step runs under the step deadline (`deadline.BoundedSteps`).
The base holds what the five machines (free queue, hash map, pool, manager, block table)
have in common: the adapter and the lockstep built per example, the spec's state, bad calls
(each refused by the spec, so the target must refuse it and change nothing; an audit may
exclude one it has reported), rare calls enabled one step in N, the target's view and state
read once a step, named invariants (one Hypothesis invariant per spec predicate, on the
target's state) and ``for_target``, which makes the machine for one target.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from hypothesis import event, note
from hypothesis.stateful import invariant, precondition, rule

from kvspec.conformance.deadline import BoundedSteps
from kvspec.conformance.lockstep import Discrepancy, Lockstep, Refused

S = TypeVar("S")
Rule = Callable[..., None]
BAD_CALL_MARKER = "kvspec_bad_call"


def bad_call(*preconditions: Callable[[Any], bool],
             **strategies: Any) -> Callable[[Rule], Rule]:
    """A bad-call rule: a Hypothesis rule drawing ``strategies``, enabled where every one of
    ``preconditions`` holds, and listed in its machine's ``bad_call_rules``. It names itself
    as the step's situation and does nothing where an audit has excluded it; each call it
    makes must be refused (`LockstepMachine.refuse`)."""
    def decorate(function: Rule) -> Rule:
        @functools.wraps(function)
        def bad_call_rule(self: LockstepMachine[Any], **arguments: Any) -> None:
            if self.allows(function.__name__):
                function(self, **arguments)

        decorated: Rule = rule(**strategies)(bad_call_rule)  # type: ignore[no-untyped-call]
        for condition in preconditions:
            decorated = precondition(condition)(decorated)
        setattr(decorated, BAD_CALL_MARKER, True)
        return decorated

    return decorate


class LockstepMachine(BoundedSteps, Generic[S]):
    """A layer's machine: subclasses set ``spec_step`` (the spec's ``step``), ``view_of``
    and ``state_from_view``; ``for_target`` sets ``make_adapter``."""

    spec_step: Any  # the spec's step (a staticmethod)
    view_of: Any  # the spec's state as a target shows it (a staticmethod)
    make_adapter: Callable[[], Any]
    excluded: frozenset[str] = frozenset()  # bad calls and situations an audit has reported
    bad_call_rules: frozenset[str] = frozenset()  # its `bad_call` rules: each must be refused
    situation = ""  # what the current step is doing, named for an audit's report
    # The target's exceptions that are no refusal reported as a `Discrepancy` naming the
    # command (the free queue and the hash map), rather than as they are.
    wrap_target_errors = False
    # False: the machine runs the target's representation check as its last invariant.
    check_representation_each_step = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # The class's own `bad_call` rules join those it inherits (before `BoundedSteps`
        # wraps its rules).
        cls.bad_call_rules = cls.bad_call_rules | {
            name for name, member in vars(cls).items() if getattr(member, BAD_CALL_MARKER, False)}
        super().__init_subclass__(**kwargs)

    def __init__(self) -> None:
        super().__init__()
        self.adapter = type(self).make_adapter()
        self.lockstep: Lockstep[S] = Lockstep(
            type(self).spec_step, self.adapter,
            check_representation=self.check_representation_each_step, judge=self.judge)
        self._views: tuple[int, object, object] | None = None

    judge: Callable[[Any, Any], None] | None = None  # named checks of a step's own output

    @property
    def built(self) -> bool:
        return self.lockstep.state is not None

    @property
    def spec(self) -> S:
        """The spec's state (the component is built first)."""
        assert self.lockstep.state is not None, "the component is built first"
        return self.lockstep.state

    def run(self, command: Any) -> Any:
        """One command on the spec and the target; the spec's output (`Refused` if refused)."""
        if not self.wrap_target_errors:
            return self.lockstep(command)
        try:
            return self.lockstep(command)
        except Discrepancy:
            raise
        except Exception as error:
            raise Discrepancy(f"{command}: the target raised {type(error).__name__}: "
                              f"{error}") from error

    def allows(self, situation: str) -> bool:
        """Name what the step is about to do; False when an audit has excluded it."""
        self.situation = situation
        return situation not in self.excluded

    def refuse(self, command: Any) -> None:
        """A bad call: the spec refuses it, so the target must, changing nothing."""
        output = self.run(command)
        if not isinstance(output, Refused):
            raise AssertionError(f"{self.situation}: the spec accepts {command}; not a bad "
                                 f"call")
        event(f"refused: {self.situation}")

    def every(self, period: int, phase: int = 0) -> bool:
        """True on one step in ``period`` (by the commands run so far): rare calls are
        enabled that often, so that they do not crowd out the common ones."""
        return self.built and len(self.lockstep.performed) % period == phase

    # -- the target's state, read once a step ------------------------------------------------

    def _read(self) -> tuple[int, object, object]:
        key = len(self.lockstep.performed)
        if self._views is None or self._views[0] != key:
            view = self.adapter.view()
            self._views = (key, view, self.state_from_view(view))
        return self._views

    def target_view(self) -> Any:
        """The target's view (``adapter.view()``), read once a step."""
        return self._read()[1]

    def target_state(self) -> Any:
        """The target's state in the spec's terms (None before the component is built)."""
        return self._read()[2] if self.built else None

    def state_from_view(self, view: Any) -> Any:
        """The spec's state with the target's view in it (the abstraction function)."""
        raise NotImplementedError

    # -- making the machine --------------------------------------------------------------

    @classmethod
    def add_invariants(cls, predicates: Sequence[Callable[[Any], bool]],
                       show_state: bool = True) -> None:
        """One Hypothesis invariant per named predicate of the spec, ``invariant_<name>``,
        checked on the target's state. Hypothesis runs invariants in name order, so these
        come before a machine's whole-state comparison and a broken one is reported by name."""
        for predicate in predicates:
            def check(self: LockstepMachine[Any], predicate: Callable[[Any], bool] = predicate,
                      ) -> None:
                state = self.target_state()
                if state is not None and not predicate(state):
                    shown = f" (state {state})" if show_state else ""
                    raise AssertionError(
                        f"invariant {predicate.__name__} violated by the target{shown}")
            check.__name__ = f"invariant_{predicate.__name__}"
            check.__doc__ = predicate.__doc__
            setattr(cls, check.__name__, invariant()(check))

    @classmethod
    def for_target(cls, make_adapter: Callable[[], Any], **attributes: Any) -> type[Any]:
        """The machine checking the targets make_adapter makes (``PoolMachine`` ->
        ``PoolConformance``)."""
        name = cls.__name__.removesuffix("Machine") + "Conformance"
        return type(name, (cls,), {"make_adapter": staticmethod(make_adapter), **attributes})


class ComponentMachine(LockstepMachine[S]):
    """A component driven on its own (the free queue, the hash map): a target's exception
    that is no refusal is a discrepancy naming the command, the representation check runs
    after every step, and the whole view is compared with the spec's (``shown``: what the
    view holds, for the message). Subclasses set ``from_view`` (the spec's)."""

    wrap_target_errors = True
    shown = "view"
    from_view: Callable[[int, Any], Any]

    def state_from_view(self, view: Any) -> Any:
        spec: Any = self.spec
        return type(self).from_view(spec.num_blocks, view)

    @invariant()
    def representation_check(self) -> None:
        """The target's own representation invariant (impl's ``check_representation()``)."""
        if self.built:
            self.adapter.check_representation()

    @invariant()
    def view_matches_spec(self) -> None:
        if not self.built:
            return
        actual, expected = self.target_view(), self.view_of(self.spec)
        if actual != expected:
            note(f"target: {actual}\nspec:   {expected}")
            raise AssertionError(f"view_matches_spec: target ({self.shown}) {actual}, spec "
                                 f"{expected}")
