"""The audit runner behind ``kvspec audit``: run conformance machines against a target.

For each layer (the block pool; the KV-cache manager and the block table where their
machines exist) the runner builds the layer's Hypothesis state machine for the target and
the profile, wraps every rule and invariant so it can count how many steps each one checked
and record the program each example runs, and runs the machine in batches until the time
budget is spent. A failure is shrunk by Hypothesis; its minimal program is kept (and can be
written out as a pytest file of calls on the target's own API). A failure in a bad-call rule
(``bad_*``) or a named *situation* (a call outside vLLM's caller contract) is reported and
excluded from the next batches, so that one known discrepancy does not hide the others; a
failure in an ordinary rule ends that layer's audit.

`run_audit` returns an `AuditResult`; `render_report` and `result_to_json` present it.
A program is the list of commands the failing machine ran (`lockstep.Lockstep.performed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
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

from kvspec.conformance.deadline import configured_seconds
from kvspec.conformance.lockstep import counterexample_source
from kvspec.conformance.vllm_targets import TargetError, pool_target
from kvspec.spec.pool import NewPool, Profile

REPO_ROOT = Path(__file__).resolve().parents[1]
# Written by `python -m tests.mutants`: one entry per mutant, with its checker and verdict.
MUTATION_CACHE = REPO_ROOT / "build" / "mutants.json"
COUNTEREXAMPLE_DIR = Path("build") / "audit"
LAYER_NAMES = ("free-queue", "hash-map", "pool", "manager", "block-table")

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
    from kvspec.conformance import pool_machine

    info = pool_target(target)
    try:  # a target that cannot be built is a usage error, not a discrepancy
        info.make().perform(NewPool(2, True, True))
    except Exception as error:
        raise TargetError(f"cannot build target {info.pool_path!r} as a BlockPool: "
                          f"{type(error).__name__}: {error}") from error
    return LayerMachine(pool_machine.machine_for(info.make, profile), info.pool_path, info.api,
                        frozenset(getattr(pool_machine, "OUT_OF_CONTRACT", ())))


def _build_manager(target: str, profile: Profile) -> LayerMachine:
    try:
        from kvspec.conformance import manager_machine
    except ImportError as error:
        raise LayerUnavailable(f"no manager machine in this checkout ({error})") from error
    if profile is not Profile.V0_13:
        raise LayerUnavailable(f"the manager spec has no {profile.value} profile yet")
    out_of_contract = frozenset(manager_machine.OUT_OF_CONTRACT)
    if target == "impl":
        return LayerMachine(manager_machine.machine_for(manager_machine.ImplManager),
                            "kvspec.impl.kv_cache_manager:KVCacheManager",
                            "vLLM 0.13 KVCacheManager API", out_of_contract)
    if target != "vllm":
        raise LayerUnavailable(f"no KVCacheManager adapter for target {target!r} yet")
    from kvspec.conformance import vllm_targets

    if vllm_targets.vllm_version() is None:
        raise TargetError(vllm_targets._no_vllm_message())
    manager_class = vllm_targets.load_class(vllm_targets.VLLM_MANAGER)
    if not vllm_targets.has_013_manager_api(manager_class):
        raise LayerUnavailable("no adapter for this vLLM's KVCacheManager API (0.13's only)")
    layouts, left_out = vllm_targets.vllm_013_layouts(manager_machine.ALL_LAYOUTS)
    return LayerMachine(
        manager_machine.machine_for(vllm_targets.vllm_manager_013_target, tuple(layouts)),
        vllm_targets.VLLM_MANAGER, "vLLM 0.13 KVCacheManager API", out_of_contract,
        notes=tuple(f"layout left out: {reason}" for reason in left_out))


def _policy_layer(layer: str, policy_name: str, target: str, profile: Profile) -> LayerMachine:
    """The pool or manager machine under an eviction policy (``--policy``): for ``impl``,
    impl's plug-in of that policy; for a ``module:Class`` that is an impl `EvictionPolicy`
    plug-in, impl's pool (and manager) built with it; for any other class, a pool with vLLM
    0.13's API and kvspec's policy calls that claims the policy itself (pool layer only)."""
    from kvspec.conformance import manager_machine, pool_machine
    from kvspec.conformance.targets import IMPL_POLICIES, VllmApiPool, load
    from kvspec.impl.eviction import EvictionPolicy
    from kvspec.spec.eviction import policy_named

    try:
        policy = policy_named(policy_name)
    except ValueError as error:
        raise TargetError(str(error)) from None
    plug_in: str | None
    pool_path = "kvspec.impl.block_pool:BlockPool"
    if target == "impl":
        plug_in = IMPL_POLICIES.get(policy_name)
    elif ":" in target:
        try:
            found = load(target)
        except (ImportError, AttributeError) as error:
            raise TargetError(f"cannot load target {target!r}: {error}") from error
        if isinstance(found, type) and issubclass(found, EvictionPolicy):
            plug_in = target
        else:
            plug_in, pool_path = None, target
    else:
        raise LayerUnavailable(f"--policy audits impl or a module:Class target, not {target!r}")
    shown = plug_in or pool_path
    if layer == "manager":
        if pool_path != "kvspec.impl.block_pool:BlockPool":
            raise LayerUnavailable("a pool class is audited on the pool layer only")
        return LayerMachine(
            manager_machine.machine_for(lambda: manager_machine.ImplManager(plug_in),
                                        policy=policy),
            shown, f"impl's KVCacheManager with eviction policy {policy_name}",
            frozenset(manager_machine.OUT_OF_CONTRACT))

    def make() -> VllmApiPool:
        return VllmApiPool(pool_path, policy_path=plug_in)
    try:
        make().perform(NewPool(2, True, True, policy=policy))
    except Exception as error:
        raise TargetError(f"cannot build target {shown!r} as a BlockPool with policy "
                          f"{policy_name}: {type(error).__name__}: {error}") from error
    return LayerMachine(pool_machine.machine_for(make, profile, policy), shown,
                        f"vLLM 0.13 BlockPool API + eviction policy {policy_name}",
                        frozenset(pool_machine.OUT_OF_CONTRACT))


def _component_layer(module_name: str, target: str, api: str) -> LayerMachine:
    """A layer whose machine module offers ``adapter_for(target)`` and ``machine_for``: the
    free queue, the hash map and the block tables (the same machine under every profile:
    what they do does not differ between the releases kvspec follows)."""
    import importlib

    try:
        module = importlib.import_module(f"kvspec.conformance.{module_name}")
    except ModuleNotFoundError as error:
        raise LayerUnavailable(f"no {module_name} in this checkout ({error})") from error
    make_adapter = module.adapter_for(target)
    adapter = make_adapter()
    target_class = getattr(adapter, "target_path", None) or getattr(
        adapter, "target_class", None) or target
    return LayerMachine(module.machine_for(make_adapter), str(target_class), api,
                        frozenset(getattr(module, "OUT_OF_CONTRACT", ())))


def _build_free_queue(target: str, profile: Profile) -> LayerMachine:
    return _component_layer("free_queue_machine", target, "vLLM FreeKVCacheBlockQueue API")


def _build_hash_map(target: str, profile: Profile) -> LayerMachine:
    return _component_layer("hash_map_machine", target, "vLLM BlockHashToBlockMap API")


def _build_block_table(target: str, profile: Profile) -> LayerMachine:
    return _component_layer("block_table_machine", target,
                            "vLLM BlockTable / MultiGroupBlockTable API")


LAYERS: dict[str, Layer] = {
    "free-queue": Layer("free-queue", "FreeKVCacheBlockQueue: the free order on its own",
                        "tests/test_free_queue_machine.py", _build_free_queue),
    "hash-map": Layer("hash-map", "BlockHashToBlockMap: the prefix-cache map on its own",
                      "tests/test_hash_map_machine.py", _build_hash_map),
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
        if "Queue" in class_name:
            return ["free-queue"]
        if "Map" in class_name:
            return ["hash-map"]
        return ["pool"]
    if layer not in LAYERS:
        raise TargetError(f"unknown layer {layer!r}: use {', '.join(LAYER_NAMES)} or all")
    return [layer]


# --- Recording ---------------------------------------------------------------------------------
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
    found = []
    for marker in (RULE_MARKER, INITIALIZE_RULE_MARKER, INVARIANT_MARKER):
        value = getattr(function, marker, None)
        if value is not None:
            found.append((marker, value))
    return found


def _wrap_rule(name: str, function: Callable[..., Any], recorder: Recorder) -> Callable[..., Any]:
    def rule_wrapper(machine: Any, **arguments: Any) -> Any:
        machine.situation = name
        machine._kvspec_rule = name
        try:
            result = function(machine, **arguments)
        except BaseException as error:
            recorder.failed(error, "rule", name, machine)
            raise
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
            recorder.failed(error, "invariant", name, machine)
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
            changes: dict[str, Any] = {"function": wrapper}
            if marker == RULE_MARKER and name in namespace["excluded"]:
                # An excluded rule (a bad call already reported, or out of scope) never runs.
                changes["preconditions"] = (*value.preconditions, _never)
            setattr(wrapper, marker, dataclasses.replace(value, **changes))
            namespace[name] = wrapper

    def __init__(self: Any) -> None:
        recorder.new_example()
        machine.__init__(self)

    namespace["__init__"] = __init__
    return type(machine.__name__, (machine,), namespace)


def _never(machine: Any) -> bool:
    return False


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def _failure_of(layer: str, error: BaseException, excluded: frozenset[str]) -> Failure:
    kind, check, situation, rule = getattr(error, "_kvspec_where", ("run", "", "", ""))
    program, machine = getattr(error, "_kvspec_program", ([], None))
    message = str(error).strip() or type(error).__name__
    return Failure(layer, kind, check, situation, type(error).__name__, message, program,
                   excluded, rule, machine)


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
            to_exclude = {f.situation for f in new if _excludable(f, built.machine)}
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


def _excludable(failure: Failure, machine: type[RuleBasedStateMachine]) -> bool:
    """Whether the audit may exclude what failed and look further: a bad-call rule (named
    ``bad_*``, or listed in the machine's ``bad_call_rules``), or a named situation inside a
    rule; never an ordinary rule or invariant."""
    situation = failure.situation
    if not situation or failure.kind == "run":
        return False
    if situation.startswith("bad_") or situation in getattr(machine, "bad_call_rules", ()):
        return True
    return situation != failure.check and situation not in _rule_names(machine)


def _rows(machine: type[RuleBasedStateMachine], recorder: Recorder,
          result: LayerResult) -> list[Row]:
    failed = {(f.kind, f.check) for f in result.failures}
    # A rule is marked where a failure happened in it, or in the invariants checked after it.
    failed |= {("rule", f.rule) for f in result.failures if f.rule}
    failed_situations = {f.situation for f in result.failures}
    excluded = set(result.excluded) | set(result.out_of_contract_skipped)
    rules, invariants = rule_and_invariant_names(machine)
    rows: list[Row] = []
    for name in rules:
        steps = recorder.rule_steps[name]
        failing = ("rule", name) in failed
        rows.append(Row("rule", name, steps, _verdict(steps, failing, name in excluded)))
    situations = sorted(set(recorder.situation_steps) | (excluded - set(rules)) | (
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
              step_deadline: float | None = None, policy: str | None = None) -> AuditResult:
    """Audit every layer ``layer`` selects; the budget is shared equally among them. A step
    that has not returned after ``step_deadline`` seconds (default: ``KVSPEC_STEP_DEADLINE``
    or `deadline.DEFAULT_SECONDS`; 0: none) is a discrepancy. With ``policy`` (an eviction
    policy's name, `spec.eviction`), the pool and manager layers run under that policy
    (`_policy_layer`) and the other layers are left out."""
    import random

    from kvspec.conformance.vllm_targets import vllm_version

    names = layers_for(layer, target)
    layers = {name: LAYERS[name] for name in names}
    if policy is not None:
        if layer == "auto":
            names = ["pool", "manager"]
        names = [name for name in names if name in ("pool", "manager")]
        if not names:
            raise TargetError(f"--policy audits the pool and manager layers, not {layer!r}")
        layers = {name: replace(LAYERS[name], build=functools.partial(_policy_layer, name,
                                                                      policy))
                  for name in names}
    if seed_base is None:
        seed_base = random.randrange(2**31)
    version = vllm_version() if target == "vllm" or target.startswith("vllm.") else None
    start = time.perf_counter()
    results: list[LayerResult] = []
    for index, name in enumerate(names):
        share = (budget - (time.perf_counter() - start)) / (len(names) - index)
        results.append(run_layer(layers[name], target, profile, max(share, 1.0), seed_base,
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
            "message": f.message, "rule": f.rule, "program": program_calls(f),
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
                out.append("     minimal program (calls on the target's API):")
                for call in program_calls(failure):
                    out.append(f"       {call}")
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
    message = "\n".join("    " + line for line in _first_lines(failure.message, 6).splitlines())
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


def write_json(audit: AuditResult, stream: TextIO) -> None:
    json.dump(result_to_json(audit), stream, indent=2)
    stream.write("\n")
