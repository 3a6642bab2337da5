"""The audit runner behind ``kvspec audit``: run conformance machines against a target.

For each layer (the block pool; the KV-cache manager and the block table where their
machines exist) the runner builds the layer's Hypothesis state machine for the target and
the profile, wraps every rule and invariant so it can count how many steps each one checked
and record the program each example runs, and runs the machine in batches until the time
budget is spent. A failure is shrunk by Hypothesis; its minimal program is kept (and can be
written out as a runnable pytest file). A failure in a named *situation* (a bad call, a call
outside vLLM's caller contract) is reported and the situation is excluded from the next
batches, so that one known discrepancy does not hide the others; a failure in an ordinary
rule ends that layer's audit.

`run_audit` returns an `AuditResult`; `render_report` and `result_to_json` present it.
`replay_machine` and `Draws` replay a recorded program outside Hypothesis (the written
counterexamples use them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from hypothesis import HealthCheck, Phase, Verbosity, seed, settings
from hypothesis.errors import HypothesisException
from hypothesis.stateful import (
    INITIALIZE_RULE_MARKER,
    INVARIANT_MARKER,
    RULE_MARKER,
    RuleBasedStateMachine,
    run_state_machine_as_test,
)
from hypothesis.strategies import DataObject, SearchStrategy

from kvspec.spec.conformance.deadline import StepBudget, call_with_deadline, configured_seconds
from kvspec.spec.conformance.vllm_targets import TargetError, pool_target
from kvspec.spec.pool import Profile

REPO_ROOT = Path(__file__).resolve().parents[2]
# Written by `python -m tests.mutants`: one entry per mutant, with its checker and verdict.
MUTATION_CACHE = REPO_ROOT / "build" / "mutants.json"
COUNTEREXAMPLE_DIR = Path("build") / "audit"
LAYER_NAMES = ("pool", "manager", "block-table")

# --- Layers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerMachine:
    """A layer's machine, ready to run against one target under one profile."""

    machine: type[RuleBasedStateMachine]
    target_class: str  # what is being driven, for the report
    api: str  # which adapter drives it
    out_of_contract: frozenset[str] = frozenset()
    notes: tuple[str, ...] = ()  # what the report should say about this machine


class LayerUnavailable(Exception):
    """A layer that cannot be audited for this target (no machine, no adapter): skipped."""


@dataclass(frozen=True)
class Layer:
    name: str
    description: str
    checker: str  # the test file whose machine the mutant catalogue scores
    build: Callable[[str, Profile], LayerMachine]


def _build_pool(target: str, profile: Profile) -> LayerMachine:
    from kvspec.spec.conformance import pool_machine

    info = pool_target(target)
    return LayerMachine(pool_machine.machine_for(info.make, profile), info.pool_path, info.api,
                        frozenset(getattr(pool_machine, "OUT_OF_CONTRACT", ())))


def _build_manager(target: str, profile: Profile) -> LayerMachine:
    try:
        from kvspec.spec.conformance import manager_machine
    except ImportError as error:
        raise LayerUnavailable(f"no manager machine in this checkout ({error})") from error
    if profile is not Profile.V0_13:
        raise LayerUnavailable(f"the manager spec has no {profile.value} profile yet")
    if target == "impl":
        return LayerMachine(manager_machine.machine_for(manager_machine.ImplManager),
                            "kvspec.impl.kv_cache_manager:KVCacheManager",
                            "vLLM 0.13 KVCacheManager API")
    if target != "vllm":
        raise LayerUnavailable(f"no KVCacheManager adapter for target {target!r} yet")
    from kvspec.spec.conformance import vllm_targets

    if vllm_targets.vllm_version() is None:
        raise TargetError(vllm_targets._no_vllm_message())
    manager_class = vllm_targets.load_class(vllm_targets.VLLM_MANAGER)
    if not vllm_targets.has_013_manager_api(manager_class):
        raise LayerUnavailable("no adapter for this vLLM's KVCacheManager API (0.13's only)")
    layouts, left_out = vllm_targets.vllm_013_layouts(manager_machine.ALL_LAYOUTS)
    return LayerMachine(
        manager_machine.machine_for(vllm_targets.vllm_manager_013_target, tuple(layouts)),
        vllm_targets.VLLM_MANAGER, "vLLM 0.13 KVCacheManager API",
        notes=tuple(f"layout left out: {reason}" for reason in left_out))


def _build_block_table(target: str, profile: Profile) -> LayerMachine:
    raise LayerUnavailable("no block-table conformance machine in spec/conformance yet")


LAYERS: dict[str, Layer] = {
    "pool": Layer("pool", "BlockPool: allocation, ref counts, free order, prefix-cache keys, "
                  "events", "tests/test_pool_machine.py", _build_pool),
    "manager": Layer("manager", "KVCacheManager: hits, allocate_slots, free, per-group "
                     "tables", "tests/test_manager_machine.py", _build_manager),
    "block-table": Layer("block-table", "BlockTable: rows and slot mapping",
                         "tests/test_block_table_machine.py", _build_block_table),
}


def layers_for(layer: str, target: str) -> list[str]:
    """Which layers ``--layer`` names: ``auto`` picks by target (a class: by its name)."""
    if layer == "all" or (layer == "auto" and target in ("impl", "vllm")):
        return list(LAYER_NAMES)
    if layer == "auto":
        class_name = target.partition(":")[2]
        if "Manager" in class_name:
            return ["manager"]
        if "Table" in class_name:
            return ["block-table"]
        return ["pool"]
    if layer not in LAYERS:
        raise TargetError(f"unknown layer {layer!r}: use pool, manager, block-table or all")
    return [layer]


# --- Recording ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One call of a recorded program: a rule with its arguments and what it drew."""

    name: str
    arguments: tuple[tuple[str, str], ...]  # (name, repr)
    draws: tuple[str, ...]  # repr of each value drawn from a `data` argument

    def as_python(self, var: str = "state") -> str:
        parts = []
        for key, value in self.arguments:
            if value == "<data>":
                parts.append(f"{key}=Draws({', '.join(self.draws)})")
            else:
                parts.append(f"{key}={value}")
        return f"{var}.{self.name}({', '.join(parts)})"


class _RecordingData:
    """Stands in for a rule's `data` argument: draws through it and records the values."""

    def __init__(self, data: DataObject, draws: list[str]) -> None:
        self._data = data
        self._draws = draws

    def draw(self, strategy: SearchStrategy[Any], label: Any = None) -> Any:
        value = self._data.draw(strategy, label)
        elements = _sampled_elements(strategy)
        if not _is_literal(value) and elements is not None:
            # An object of the machine's (say, a running request): replay picks it by index.
            index = next((i for i, e in enumerate(elements) if e is value), None)
            if index is not None:
                self._draws.append(f"Pick({index})")
                return value
        self._draws.append(repr(value))
        return value


def _is_literal(value: object) -> bool:
    """Whether repr(value) reads back as an equal value."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return True
    if isinstance(value, (tuple, list, set, frozenset)):
        return all(_is_literal(item) for item in value)
    return False


def _sampled_elements(strategy: Any) -> Sequence[Any] | None:
    """The elements a sampled_from strategy picks from, or None for other strategies."""
    for _ in range(4):
        elements = getattr(strategy, "elements", None)
        if isinstance(elements, (list, tuple)):
            return elements
        strategy = getattr(strategy, "wrapped_strategy", None)
        if strategy is None:
            return None
    return None


@dataclass
class Failure:
    """One discrepancy: where it showed, what was raised, and the minimal program."""

    layer: str
    kind: str  # "rule", "invariant" or "run" (outside any rule)
    check: str  # the rule or invariant that raised
    situation: str  # what the step was doing (a rule name, or a named situation)
    error: str  # exception type
    message: str
    program: list[Step]
    excluded: frozenset[str] = frozenset()  # the exclusions in force when it was found
    counterexample: str | None = None  # path of the written pytest file
    known: bool = False  # listed in the --baseline result

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
        self.counting = True  # off while Hypothesis shrinks a failure
        self.program: list[Step] = []
        self.on_progress = on_progress

    def new_example(self) -> None:
        if self.counting:
            self.examples += 1
        self.program = []
        if self.on_progress is not None:
            self.on_progress(self)

    def failed(self, error: BaseException, kind: str, check: str, situation: str) -> None:
        """Tag the exception with where it happened, unless an inner wrapper already did."""
        if not isinstance(error, Exception) or isinstance(error, HypothesisException):
            return  # Hypothesis's own control flow (rejections, stops), not a failure
        self.counting = False
        if not hasattr(error, "_kvspec_where"):
            try:
                error._kvspec_where = (kind, check, situation)  # type: ignore[attr-defined]
                error._kvspec_program = list(self.program)  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                pass  # an exception type that takes no attributes: reported without a program


def _markers(function: Any) -> list[tuple[str, Any]]:
    found = []
    for marker in (RULE_MARKER, INITIALIZE_RULE_MARKER, INVARIANT_MARKER):
        value = getattr(function, marker, None)
        if value is not None:
            found.append((marker, value))
    return found


def _wrap_rule(name: str, function: Callable[..., Any], recorder: Recorder) -> Callable[..., Any]:
    def rule_wrapper(machine: Any, **arguments: Any) -> Any:
        draws: list[str] = []
        shown = []
        for key, value in sorted(arguments.items()):
            if isinstance(value, DataObject):
                arguments[key] = _RecordingData(value, draws)
                shown.append((key, "<data>"))
            else:
                shown.append((key, repr(value)))
        step = Step(name, tuple(shown), ())
        recorder.program.append(step)
        machine.situation = name
        try:
            result = function(machine, **arguments)
        except BaseException as error:
            recorder.program[-1] = dataclasses.replace(step, draws=tuple(draws))
            recorder.failed(error, "rule", name, getattr(machine, "situation", name) or name)
            raise
        recorder.program[-1] = dataclasses.replace(step, draws=tuple(draws))
        if recorder.counting:
            recorder.steps += 1
            recorder.rule_steps[name] += 1
            situation = getattr(machine, "situation", name)
            if situation and situation != name and situation not in machine.excluded:
                recorder.situation_steps[situation] += 1
        return result

    rule_wrapper.__name__ = name
    rule_wrapper.__doc__ = function.__doc__
    return rule_wrapper


def _wrap_invariant(name: str, function: Callable[..., Any],
                    recorder: Recorder) -> Callable[..., Any]:
    def invariant_wrapper(machine: Any) -> Any:
        try:
            result = function(machine)
        except BaseException as error:
            recorder.failed(error, "invariant", name, getattr(machine, "situation", "") or "")
            raise
        if recorder.counting:
            recorder.invariant_steps[name] += 1
        return result

    invariant_wrapper.__name__ = name
    invariant_wrapper.__doc__ = function.__doc__
    return invariant_wrapper


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
            wrap = _wrap_invariant if marker == INVARIANT_MARKER else _wrap_rule
            wrapper = wrap(name, value.function, recorder)
            setattr(wrapper, marker, dataclasses.replace(value, function=wrapper))
            namespace[name] = wrapper

    def __init__(self: Any) -> None:
        recorder.new_example()
        machine.__init__(self)

    namespace["__init__"] = __init__
    return type(machine.__name__, (machine,), namespace)


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def _failure_of(layer: str, error: BaseException, excluded: frozenset[str]) -> Failure:
    kind, check, situation = getattr(error, "_kvspec_where", ("run", "", ""))
    program: list[Step] = getattr(error, "_kvspec_program", [])
    message = str(error).strip() or type(error).__name__
    return Failure(layer, kind, check, situation, type(error).__name__, message, program,
                   excluded)


# --- Running -----------------------------------------------------------------------------------


@dataclass
class Row:
    kind: str  # "rule", "situation" or "invariant"
    name: str
    steps: int
    verdict: str  # "ok", "FAIL", "excluded" or "not reached"


@dataclass
class LayerResult:
    layer: str
    status: str  # "audited" or "skipped"
    reason: str = ""
    target_class: str = ""
    api: str = ""
    examples: int = 0
    steps: int = 0
    seconds: float = 0.0
    rows: list[Row] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    out_of_contract_skipped: list[str] = field(default_factory=list)
    interrupted: bool = False
    mutation_score: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def conforms(self) -> bool:
        return self.status == "audited" and not self.failures


@dataclass
class AuditResult:
    target: str
    profile: str
    scope: str
    budget: float
    seed: int
    python: str
    vllm_version: str | None
    layers: list[LayerResult]
    seconds: float = 0.0
    baseline: str | None = None  # a previous result whose failures count as known
    step_deadline: float | None = None  # seconds a step may run (0: none; None: the default)

    @property
    def audited(self) -> list[LayerResult]:
        return [layer for layer in self.layers if layer.status == "audited"]

    @property
    def failures(self) -> list[Failure]:
        return [f for layer in self.audited for f in layer.failures]

    @property
    def new_failures(self) -> list[Failure]:
        return [f for f in self.failures if not f.known]

    @property
    def passes(self) -> bool:
        """Conforms, or (with a baseline) has no discrepancy beyond the baseline's."""
        if self.baseline is None:
            return self.conforms
        return bool(self.audited) and not self.new_failures

    @property
    def conforms(self) -> bool:
        return bool(self.audited) and all(layer.conforms for layer in self.audited)

    @property
    def verdict(self) -> str:
        if not self.audited:
            return "not audited"
        return "conforms" if self.conforms else "does not conform"


ProgressHook = Callable[[str, Recorder, float, int], None]


def run_layer(layer: Layer, target: str, profile: Profile, budget: float, seed_base: int,
              scope: str = "all", progress: ProgressHook | None = None,
              step_count: int | None = None,
              step_deadline: float | None = None) -> LayerResult:
    """Audit one layer of target for budget seconds (the target's log warnings silenced)."""
    logging.disable(logging.WARNING)
    try:
        return _run_layer(layer, target, profile, budget, seed_base, scope, progress,
                          step_count, step_deadline)
    finally:
        logging.disable(logging.NOTSET)


def _run_layer(layer: Layer, target: str, profile: Profile, budget: float, seed_base: int,
               scope: str, progress: ProgressHook | None, step_count: int | None,
               step_deadline: float | None) -> LayerResult:
    try:
        built = layer.build(target, profile)
    except LayerUnavailable as reason:
        return LayerResult(layer.name, "skipped", reason=str(reason))
    result = LayerResult(layer.name, "audited", target_class=built.target_class, api=built.api,
                         notes=list(built.notes))
    excluded = built.out_of_contract if scope == "contract" else frozenset()
    result.out_of_contract_skipped = sorted(excluded)
    start = time.perf_counter()
    deadline = start + budget
    failures_by_key: dict[tuple[str, str, str, str], Failure] = {}
    state = {"failures": 0}

    def report(recorder: Recorder) -> None:
        if progress is not None:
            progress(layer.name, recorder, time.perf_counter() - start, state["failures"])

    recorder = Recorder(report)
    examples_per_second = 0.0
    batch = 0
    stop = False
    while not stop and time.perf_counter() < deadline:
        remaining = deadline - time.perf_counter()
        if examples_per_second:
            max_examples = max(5, int(examples_per_second * min(remaining, 10.0)))
        else:
            max_examples = 10
        machine = instrument(built.machine, recorder, excluded, step_deadline)
        machine = seed(seed_base + batch)(machine)
        batch += 1
        recorder.counting = True
        examples_before, batch_start = recorder.examples, time.perf_counter()
        run_settings = settings(
            max_examples=max_examples, stateful_step_count=step_count or _step_count(),
            deadline=None, database=None, derandomize=False, print_blob=False,
            report_multiple_bugs=True, verbosity=Verbosity.quiet,
            phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck),
        )
        try:
            with _shrinking_bounded(max(5.0, deadline - time.perf_counter())):
                run_state_machine_as_test(machine, settings=run_settings)
        except KeyboardInterrupt:
            result.interrupted = True
            break
        except BaseException as error:
            new = []
            for leaf in _leaves(error):
                failure = _failure_of(layer.name, leaf, excluded)
                if failure.key not in failures_by_key:
                    failures_by_key[failure.key] = failure
                    new.append(failure)
            state["failures"] = len(failures_by_key)
            # Exclude the named situations that failed and look further; a failure in an
            # ordinary rule (or outside any rule) ends this layer's audit.
            to_exclude = {f.situation for f in new
                          if f.situation and f.kind != "run" and f.situation != f.check
                          and f.situation not in _rule_names(built.machine)}
            if not new or any(f.situation not in to_exclude for f in new):
                stop = True
            excluded = excluded | frozenset(to_exclude)
        else:
            elapsed = time.perf_counter() - batch_start
            done = recorder.examples - examples_before
            if done and elapsed > 0:
                examples_per_second = done / elapsed
    result.seconds = time.perf_counter() - start
    result.examples, result.steps = recorder.examples, recorder.steps
    result.failures = list(failures_by_key.values())
    result.excluded = sorted(excluded - frozenset(result.out_of_contract_skipped))
    result.rows = _rows(built.machine, recorder, result)
    result.mutation_score = mutation_score(layer.checker)
    return result


@contextlib.contextmanager
def _shrinking_bounded(seconds: float) -> Iterator[None]:
    """Cap the time Hypothesis spends shrinking a failure (its own cap is 300 s), so that a
    slow target still reports within about its budget. Hypothesis has no setting for this:
    the cap is a module constant, patched only where it exists."""
    from hypothesis.internal.conjecture import engine

    saved = getattr(engine, "MAX_SHRINKING_SECONDS", None)
    if saved is None:
        yield
        return
    engine.MAX_SHRINKING_SECONDS = min(saved, max(1, int(seconds)))
    try:
        yield
    finally:
        engine.MAX_SHRINKING_SECONDS = saved


def _step_count() -> int:
    return int(settings().stateful_step_count)


def _rule_names(machine: type[RuleBasedStateMachine]) -> set[str]:
    rules, invariants = rule_and_invariant_names(machine)
    return set(rules) | set(invariants)


def _rows(machine: type[RuleBasedStateMachine], recorder: Recorder,
          result: LayerResult) -> list[Row]:
    failed = {(f.kind, f.check) for f in result.failures}
    failed_situations = {f.situation for f in result.failures}
    excluded = set(result.excluded) | set(result.out_of_contract_skipped)
    rules, invariants = rule_and_invariant_names(machine)
    rows: list[Row] = []
    for name in rules:
        steps = recorder.rule_steps[name]
        failing = ("rule", name) in failed
        rows.append(Row("rule", name, steps, _verdict(steps, failing, False)))
    situations = sorted(set(recorder.situation_steps) | excluded | (
        failed_situations - set(rules) - set(invariants) - {""}))
    for name in situations:
        steps = recorder.situation_steps[name]
        rows.append(Row("situation", name, steps,
                        _verdict(steps, name in failed_situations, name in excluded)))
    for name in invariants:
        steps = recorder.invariant_steps[name]
        rows.append(Row("invariant", name, steps, _verdict(steps, ("invariant", name) in failed,
                                                           False)))
    return rows


def _verdict(steps: int, failing: bool, excluded: bool) -> str:
    if failing:
        return "FAIL"
    if excluded:
        return "excluded"
    return "ok" if steps else "not reached"


def run_audit(target: str, profile: Profile, budget: float, layer: str = "auto",
              scope: str = "all", seed_base: int | None = None,
              progress: ProgressHook | None = None,
              step_deadline: float | None = None) -> AuditResult:
    """Audit every layer ``layer`` selects; the budget is shared equally among them. A step
    that has not returned after ``step_deadline`` seconds (default: ``KVSPEC_STEP_DEADLINE``
    or `deadline.DEFAULT_SECONDS`; 0: none) is a discrepancy."""
    import random

    from kvspec.spec.conformance.vllm_targets import vllm_version

    names = layers_for(layer, target)
    if seed_base is None:
        seed_base = random.randrange(2**31)
    version = vllm_version() if target == "vllm" or target.startswith("vllm.") else None
    start = time.perf_counter()
    results: list[LayerResult] = []
    for index, name in enumerate(names):
        share = (budget - (time.perf_counter() - start)) / (len(names) - index)
        results.append(run_layer(LAYERS[name], target, profile, max(share, 1.0), seed_base,
                                 scope, progress, step_deadline=step_deadline))
    audit = AuditResult(target, profile.value, scope, budget, seed_base, sys.executable,
                        version, results, step_deadline=configured_seconds(step_deadline))
    audit.seconds = time.perf_counter() - start
    return audit


class BaselineError(ValueError):
    """A --baseline file that cannot be read as a kvspec audit result."""


BaselineKey = tuple[str, str, str, str, str]  # layer, kind, check, situation, error


def read_baseline(path: Path) -> frozenset[BaselineKey]:
    """The discrepancies a previous result (written by --json) lists."""
    try:
        data = json.loads(path.read_text())
        return frozenset((layer["layer"], f["kind"], f["check"], f["situation"], f["error"])
                         for layer in data["layers"] for f in layer["failures"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise BaselineError(f"cannot read baseline {str(path)!r} as a kvspec audit result: "
                            f"{error}") from error


def apply_baseline(audit: AuditResult, known: frozenset[BaselineKey], name: str) -> None:
    """Mark the failures listed in known (the baseline called name) as known."""
    audit.baseline = name
    for layer in audit.audited:
        for failure in layer.failures:
            failure.known = (layer.layer, *failure.key) in known


# --- Mutation score ----------------------------------------------------------------------------


def mutation_score(checker: str, cache: Path | None = None) -> dict[str, Any] | None:
    """How many catalogue mutants the machine in ``checker`` kills, from the cached results.

    ``python -m tests.mutants`` writes the cache; None when it has not been run.
    """
    path = cache or MUTATION_CACHE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    entries = [m for m in data.get("mutants", []) if checker in m.get("checker", [])]
    if not entries:
        return None
    killed = sum(1 for m in entries if m.get("killed"))
    return {
        "killed": killed, "total": len(entries),
        "survivors": [m.get("name", "?") for m in entries if not m.get("killed")],
        "measured": data.get("finished", "unknown"), "profile": data.get("profile", "unknown"),
        "source": str(path),
    }


# --- Presenting --------------------------------------------------------------------------------


def result_to_json(audit: AuditResult) -> dict[str, Any]:
    """The audit as plain JSON data (format version 1)."""
    return {
        "kvspec_audit": 1,
        "target": audit.target, "profile": audit.profile, "scope": audit.scope,
        "vllm_version": audit.vllm_version, "python": audit.python,
        "budget_seconds": audit.budget, "seconds": round(audit.seconds, 3), "seed": audit.seed,
        "step_deadline_seconds": audit.step_deadline,
        "verdict": audit.verdict, "conforms": audit.conforms,
        "baseline": audit.baseline, "new_failures": len(audit.new_failures),
        "layers": [_layer_json(layer) for layer in audit.layers],
    }


def _layer_json(layer: LayerResult) -> dict[str, Any]:
    return {
        "layer": layer.layer, "status": layer.status, "reason": layer.reason,
        "target_class": layer.target_class, "api": layer.api,
        "examples": layer.examples, "steps": layer.steps, "seconds": round(layer.seconds, 3),
        "interrupted": layer.interrupted, "conforms": layer.conforms, "notes": layer.notes,
        "rules": [_row_json(r) for r in layer.rows if r.kind == "rule"],
        "situations": [_row_json(r) for r in layer.rows if r.kind == "situation"],
        "invariants": [_row_json(r) for r in layer.rows if r.kind == "invariant"],
        "excluded_after_failure": layer.excluded,
        "out_of_contract_skipped": layer.out_of_contract_skipped,
        "failures": [{
            "kind": f.kind, "check": f.check, "situation": f.situation, "error": f.error,
            "message": f.message, "program": [s.as_python() for s in f.program],
            "counterexample": f.counterexample, "known": f.known,
        } for f in layer.failures],
        "mutation_score": layer.mutation_score,
    }


def _row_json(row: Row) -> dict[str, Any]:
    return {"name": row.name, "steps": row.steps, "verdict": row.verdict}


def _first_lines(text: str, lines: int = 3, width: int = 160) -> str:
    kept = [line[:width] for line in text.splitlines()[:lines]]
    return "\n".join(kept)


def render_report(audit: AuditResult) -> str:
    """The conformance report as text: a table per layer, then the failures."""
    out: list[str] = []
    version = f" (vLLM {audit.vllm_version})" if audit.vllm_version else ""
    out.append(f"kvspec audit: target {audit.target}{version}, profile {audit.profile}, "
               f"scope {audit.scope}")
    out.append(f"python {audit.python}; budget {audit.budget:g} s, ran {audit.seconds:.1f} s, "
               f"seed {audit.seed}, " + (f"step deadline {audit.step_deadline:g} s"
                                         if audit.step_deadline else "no step deadline"))
    for layer in audit.layers:
        out.append("")
        if layer.status != "audited":
            out.append(f"== layer {layer.layer}: skipped ({layer.reason})")
            continue
        out.append(f"== layer {layer.layer}: {layer.target_class} driven through the "
                   f"{layer.api}")
        out.append(f"   {layer.examples} examples, {layer.steps} steps in {layer.seconds:.1f} s"
                   + (" (interrupted)" if layer.interrupted else ""))
        out.extend(f"   note: {note}" for note in layer.notes)
        width = max([len(r.name) for r in layer.rows] + [30])
        out.append(f"   {'check':<{width + 12}} {'steps':>8}  verdict")
        for row in layer.rows:
            label = {"rule": "rule", "situation": "  situation", "invariant": "invariant"}[
                row.kind]
            out.append(f"   {label:<11} {row.name:<{width}} {row.steps:>8}  {row.verdict}")
        score = layer.mutation_score
        if score is None:
            out.append("   mutation score of this machine: not measured "
                       "(run `make mutants` to measure it)")
        else:
            survivors = (f"; survivors: {', '.join(score['survivors'])}"
                         if score["survivors"] else "")
            out.append(f"   mutation score of this machine: {score['killed']}/{score['total']} "
                       f"mutants killed (measured {score['measured']}, {score['profile']} "
                       f"profile){survivors}")
        if layer.out_of_contract_skipped:
            skipped = ", ".join(layer.out_of_contract_skipped)
            out.append(f"   left out (--scope contract): {skipped}")
        for number, failure in enumerate(layer.failures, 1):
            out.append("")
            where = failure.check + (f" [{failure.situation}]"
                                     if failure.situation not in ("", failure.check) else "")
            known = " (known: in the baseline)" if failure.known else ""
            out.append(f"   FAILURE {number}{known}: {failure.kind} {where}: {failure.error}")
            for line in _first_lines(failure.message).splitlines():
                out.append(f"     {line}")
            if failure.program:
                out.append("     minimal program:")
                for step in failure.program:
                    out.append(f"       {step.as_python()}")
            if failure.counterexample:
                out.append(f"     runnable: python -m pytest {failure.counterexample}")
    out.append("")
    summary = ""
    if audit.failures:
        summary = f" ({len(audit.failures)} discrepancies"
        if audit.baseline is not None:
            summary += (f", {len(audit.failures) - len(audit.new_failures)} known from "
                        f"{audit.baseline}, {len(audit.new_failures)} new")
        summary += ")"
    out.append(f"verdict: {audit.target} {audit.verdict} to {audit.profile}{summary}")
    return "\n".join(out) + "\n"


# --- Counterexamples ---------------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()[:40] or "x"


def write_counterexample(audit: AuditResult, failure: Failure, directory: Path,
                         number: int) -> Path:
    """Write failure's minimal program as a runnable pytest file; return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    name = (f"test_audit_{_slug(audit.target)}_{_slug(audit.profile)}_{failure.layer}_"
            f"{number}_{_slug(failure.situation or failure.check)}.py")
    path = directory / name
    message = "\n".join("    " + line for line in _first_lines(failure.message, 6).splitlines())
    body = "\n".join("    " + step.as_python() for step in failure.program)
    excluded = sorted(failure.excluded)
    command = f"kvspec audit --target {audit.target} --profile {audit.profile}"
    text = f'''"""Counterexample found by `{command}`.

Layer {failure.layer}; {failure.kind} {failure.check!r} failed in situation {failure.situation!r}
with {failure.error}:

{message}

Run it with the interpreter that ran the audit, from the repository root:
    {audit.python} -m pytest {path}
Each call runs one rule of the conformance machine on the target and on the spec, then
checks every invariant, exactly as the audit did.
"""

from kvspec.spec.conformance.audit import Draws, Pick, replay_machine


def test_counterexample() -> None:
    state = replay_machine({failure.layer!r}, target={audit.target!r}, profile={audit.profile!r},
                           excluded={excluded!r}, step_deadline={audit.step_deadline!r})
{body}
    state.teardown()
'''
    path.write_text(text)
    failure.counterexample = str(path)
    return path


def write_counterexamples(audit: AuditResult, directory: Path) -> list[Path]:
    paths = []
    for layer in audit.audited:
        for number, failure in enumerate(layer.failures, 1):
            if failure.program:
                paths.append(write_counterexample(audit, failure, directory, number))
    return paths


# --- Replaying ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pick:
    """A recorded draw of the index-th element of a sampled_from strategy."""

    index: int


class Draws:
    """Replays the values a rule drew from its `data` argument, in order."""

    def __init__(self, *values: Any) -> None:
        self.values = list(values)

    def draw(self, strategy: Any = None, label: Any = None) -> Any:
        if not self.values:
            raise LookupError("the recorded program has no more draws for this rule: the "
                              "machine changed since the counterexample was written")
        value = self.values.pop(0)
        if isinstance(value, Pick):
            elements = _sampled_elements(strategy)
            if elements is None or not 0 <= value.index < len(elements):
                raise LookupError(f"cannot replay {value}: the rule drew from {strategy!r}")
            return elements[value.index]
        return value


class Replay:
    """A machine instance whose rule calls check every invariant afterwards."""

    def __init__(self, machine: RuleBasedStateMachine) -> None:
        self.machine = machine
        self.rules, self.invariants = rule_and_invariant_names(type(machine))

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name not in self.rules:
            raise AttributeError(f"the machine has no rule {name!r}")
        method = getattr(self.machine, name)

        def call(**arguments: Any) -> None:
            with _outside_hypothesis(type(self.machine)):
                method(**arguments)  # a rule of a BoundedSteps machine: under the deadline
                call_with_deadline(self._step_budget, self._check_invariants)

        return call

    @property
    def _step_budget(self) -> StepBudget:
        return getattr(self.machine, "_step_budget", None) or StepBudget(configured=0.0)

    def _check_invariants(self) -> None:
        for invariant_name in self.invariants:
            getattr(self.machine, invariant_name)()

    def teardown(self) -> None:
        self.machine.teardown()


def replay_machine(layer: str, target: str, profile: str,
                   excluded: list[str] | tuple[str, ...] = (),
                   step_deadline: float | None = None) -> Replay:
    """A fresh machine of layer for target and profile, for replaying a recorded program
    (each step under ``step_deadline`` seconds; None: the default)."""
    built = LAYERS[layer].build(target, Profile(profile))
    machine_class = type(built.machine.__name__, (built.machine,),
                         {"excluded": frozenset(excluded), "step_deadline": step_deadline})
    with _outside_hypothesis(machine_class):
        return Replay(machine_class())


@contextlib.contextmanager
def _outside_hypothesis(machine: type[RuleBasedStateMachine]) -> Iterator[None]:
    """Machines call hypothesis.event and note, which need a running test: print instead."""
    modules = {sys.modules[cls.__module__] for cls in machine.__mro__
               if cls.__module__ in sys.modules and cls.__module__ != "builtins"}
    saved = [(module, hook, getattr(module, hook)) for module in modules
             for hook in ("event", "note") if hasattr(module, hook)]
    for module, hook, _ in saved:
        setattr(module, hook, _print_note)
    try:
        yield
    finally:
        for module, hook, original in saved:
            setattr(module, hook, original)


def _print_note(value: object, payload: object = "") -> None:
    print(value, payload if payload else "")


def write_json(audit: AuditResult, stream: TextIO) -> None:
    json.dump(result_to_json(audit), stream, indent=2)
    stream.write("\n")
