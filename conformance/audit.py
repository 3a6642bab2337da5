"""The audit runner behind ``kvspec audit``: run conformance machines against a target.

For each layer (`layers.LAYERS`) the runner builds the layer's Hypothesis state machine for
the target and the profile, instruments every rule and invariant (`recording.instrument`) so
it can count how many steps each one checked and record the program each example runs, and
runs the machine in batches until the time budget is spent, or, with an examples bound, until
that many examples have run (batches of a fixed size, so that the same seed explores the same
programs on a fast machine and on a loaded one; the budget is then only a hard cap). A
failure is shrunk by
Hypothesis; its minimal program is kept (and can be written out as a pytest file of calls on
the target's own API, `counterexamples`). A failure in a bad-call rule (``bad_*``) or a named
*situation* (a call outside vLLM's caller contract) is reported and excluded from the next
batches, so that one known discrepancy does not hide the others; a failure in an ordinary
rule ends that layer's audit.

`run_audit` returns an `AuditResult`; `report` presents it, `baseline` compares it with a
previous one, `mutation_scores` adds each machine's measured mutation score.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, seed, settings
from hypothesis.database import ExampleDatabase
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from kvspec.conformance.deadline import configured_seconds
from kvspec.conformance.example_db import CountingDatabase, audit_key
from kvspec.conformance.layers import (
    LAYER_NAMES,
    LAYERS,
    Layer,
    LayerUnavailable,
    layers_for,
    policy_layer,
)
from kvspec.conformance.mutation_scores import mutation_score
from kvspec.conformance.recording import (
    Failure,
    Recorder,
    failure_of,
    instrument,
    leaves,
    rule_and_invariant_names,
)
from kvspec.conformance.vllm_targets import TargetError
from kvspec.spec.pool import Profile


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
    replayed: int = 0  # saved examples replayed first from the example database
    events: dict[str, int] = field(default_factory=dict)  # examples per hypothesis.event label

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
    examples: int | None = None  # examples per layer, where the audit was bounded by them

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


# With an examples bound, each batch asks Hypothesis for this many examples (the last for
# what is left): sizes that never depend on the machine's speed.
EXAMPLES_PER_BATCH = 50


class AuditBoundError(ValueError):
    """An examples bound that is not a whole number >= 1."""


def checked_examples(examples: int | None) -> int | None:
    """``examples`` if it is None or an int >= 1, else `AuditBoundError` naming it."""
    if examples is not None and (type(examples) is not int or examples < 1):
        raise AuditBoundError(f"the examples bound must be a whole number >= 1, "
                              f"got {examples!r}")
    return examples


ProgressHook = Callable[[str, Recorder, float, int], None]
FailureHook = Callable[[Failure], None]


@dataclass(frozen=True)
class Replay:
    """An example database for an audit: its failures are replayed before anything is
    generated, and what the audit finds is saved to it (`example_db`). ``key`` names what is
    audited beyond the layer (target, profile, policy), `example_db.audit_key`."""

    database: ExampleDatabase
    target: str
    profile: str
    policy: str | None = None


def run_layer(layer: Layer, target: str, profile: Profile, budget: float, seed_base: int,
              scope: str = "all", progress: ProgressHook | None = None,
              step_count: int | None = None, step_deadline: float | None = None,
              mutants: Path | None = None, replay: Replay | None = None,
              on_failure: FailureHook | None = None,
              examples: int | None = None) -> LayerResult:
    """Audit one layer of target for budget seconds (the target's log warnings silenced);
    its machine's mutation score is read from ``mutants`` (`mutation_scores.mutants_path`).
    With ``replay``, the database's failures for this machine run first and new ones are
    saved there; ``on_failure`` hears each distinct failure as soon as it is shrunk. With
    ``examples``, the layer asks Hypothesis for that many examples in all, in batches of
    `EXAMPLES_PER_BATCH`, and stops there (or at a failure that ends it); the budget is only
    a hard cap then, and a note says so where it cut the layer short."""
    checked_examples(examples)
    logging.disable(logging.WARNING)
    try:
        return _run_layer(layer, target, profile, budget, seed_base, scope, progress,
                          step_count, step_deadline, mutants, replay, on_failure, examples)
    finally:
        logging.disable(logging.NOTSET)


def _run_layer(layer: Layer, target: str, profile: Profile, budget: float, seed_base: int,
               scope: str, progress: ProgressHook | None, step_count: int | None,
               step_deadline: float | None, mutants: Path | None, replay: Replay | None,
               on_failure: FailureHook | None, examples: int | None) -> LayerResult:
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
    asked = 0  # examples asked of Hypothesis so far
    batch = 0
    stop = False
    while not stop and time.perf_counter() < deadline:
        remaining = deadline - time.perf_counter()
        if examples is not None:
            if asked >= examples:
                break
            max_examples = min(EXAMPLES_PER_BATCH, examples - asked)
        elif examples_per_second:
            # Batches of about 10 s at the speed measured, so that the budget is spent.
            max_examples = max(5, int(examples_per_second * min(remaining, 10.0)))
        else:
            max_examples = 10
        asked += max_examples
        machine = instrument(built.machine, recorder, excluded, step_deadline)
        database: CountingDatabase | None = None
        if replay is not None:
            database = CountingDatabase(replay.database)
            # Hypothesis keys a machine's examples by a digest of its class, with this added.
            machine._hypothesis_internal_add_digest = audit_key(
                layer.name, replay.target, replay.profile, replay.policy, scope, excluded)
        machine = seed(seed_base + batch)(machine)
        batch += 1
        recorder.counting = True
        examples_before, batch_start = recorder.examples, time.perf_counter()
        run_settings = settings(
            max_examples=max_examples,
            stateful_step_count=step_count or settings().stateful_step_count,
            deadline=None, database=database, derandomize=False, print_blob=False,
            report_multiple_bugs=True, verbosity=Verbosity.quiet,
            phases=((Phase.reuse,) if database is not None else ()) + (Phase.generate,
                                                                        Phase.shrink),
            suppress_health_check=list(HealthCheck),
        )
        try:
            with _shrinking_bounded(max(5.0, deadline - time.perf_counter())):
                run_state_machine_as_test(machine, settings=run_settings)
        except KeyboardInterrupt:
            result.interrupted = True
            break
        except BaseException as error:
            new = []
            for leaf in leaves(error):
                failure = failure_of(layer.name, leaf, excluded)
                # Hypothesis generates nothing once a saved example fails again, so a
                # failure in a batch that replayed examples is one found before.
                failure.replayed = database is not None and database.replayed > 0
                if failure.key not in failures_by_key:
                    failures_by_key[failure.key] = failure
                    new.append(failure)
                    if on_failure is not None:
                        on_failure(failure)
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
        finally:
            if database is not None:
                result.replayed += database.replayed
    result.seconds = time.perf_counter() - start
    if examples is not None and asked < examples and not stop and not result.interrupted:
        result.notes.append(f"the budget ran out after {asked} of the {examples} examples "
                            f"asked for")
    result.examples, result.steps = recorder.examples, recorder.steps
    result.events = dict(recorder.event_examples)
    result.failures = list(failures_by_key.values())
    result.excluded = sorted(excluded - frozenset(result.out_of_contract_skipped))
    result.rows = _rows(built.machine, recorder, result)
    result.mutation_score = mutation_score(layer.checker, mutants)
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


def _excludable(failure: Failure, machine: type[RuleBasedStateMachine]) -> bool:
    """Whether the audit may exclude what failed and look further: a bad-call rule (named
    ``bad_*``, or listed in the machine's ``bad_call_rules``), or a named situation inside a
    rule; never an ordinary rule or invariant."""
    situation = failure.situation
    if not situation or failure.kind == "run":
        return False
    if situation.startswith("bad_") or situation in getattr(machine, "bad_call_rules", ()):
        return True
    rules, invariants = rule_and_invariant_names(machine)
    return situation != failure.check and situation not in {*rules, *invariants}


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
    return "FAIL" if failing else "excluded" if excluded else "ok" if steps else "not reached"


def warm_up(layers: Iterable[str] = LAYER_NAMES) -> None:
    """Do the slow first-time work before any step runs: importing vLLM's modules where vLLM
    is installed (impl binds its event classes to vLLM's, `impl.host_types`) and, for the
    block table, torch's first tensor. Under a step deadline on a loaded machine that work,
    mostly C code the deadline's signal cannot interrupt, would read as a target that does not
    return (`deadline`)."""
    from kvspec.impl import host_types

    host_types.bound_to()
    if "block-table" in layers:
        with contextlib.suppress(ImportError):
            import torch

            torch.zeros(1).sum()


def run_audit(target: str, profile: Profile, budget: float, layer: str = "auto",
              scope: str = "all", seed_base: int | None = None,
              progress: ProgressHook | None = None,
              step_deadline: float | None = None, policy: str | None = None,
              mutants: Path | None = None, database: ExampleDatabase | None = None,
              on_failure: FailureHook | None = None,
              examples: int | None = None) -> AuditResult:
    """Audit every layer ``layer`` selects; the budget is shared equally among them. A step
    that has not returned after ``step_deadline`` seconds (default: ``KVSPEC_STEP_DEADLINE``
    or `deadline.DEFAULT_SECONDS`; 0: none) is a discrepancy. With ``policy`` (an eviction
    policy's name, `spec.eviction`), the pool and manager layers run under that policy
    (`layers.policy_layer`) and the other layers are left out. With ``database`` (an example
    database object: the CLI opens it, `kvspec.campaign.redis_db.open_database`), each layer
    replays the failures saved there first and saves what it finds. With ``examples``, each
    layer runs that many examples (`run_layer`) and ``budget`` is only a hard cap: what the
    audit covers for a seed does not depend on the machine's speed (`AuditBoundError` for a
    bound that is not a whole number >= 1)."""
    import random

    from kvspec.conformance.vllm_targets import vllm_version

    checked_examples(examples)

    names = layers_for(layer, target)
    layers = {name: LAYERS[name] for name in names}
    if policy is not None:
        if layer == "auto":
            names = ["pool", "manager"]
        names = [name for name in names if name in ("pool", "manager")]
        if not names:
            raise TargetError(f"--policy audits the pool and manager layers, not {layer!r}")
        layers = {name: replace(LAYERS[name], build=functools.partial(policy_layer, name,
                                                                      policy))
                  for name in names}
    if seed_base is None:
        seed_base = random.randrange(2**31)
    version = vllm_version() if target == "vllm" or target.startswith("vllm.") else None
    warm_up(names)
    start = time.perf_counter()
    replay = None if database is None else Replay(database, target, profile.value, policy)
    results: list[LayerResult] = []
    for index, name in enumerate(names):
        share = (budget - (time.perf_counter() - start)) / (len(names) - index)
        results.append(run_layer(layers[name], target, profile, max(share, 1.0), seed_base,
                                 scope, progress, step_deadline=step_deadline,
                                 mutants=mutants, replay=replay, on_failure=on_failure,
                                 examples=examples))
    audit = AuditResult(target, profile.value, scope, budget, seed_base, sys.executable,
                        version, results, step_deadline=configured_seconds(step_deadline),
                        examples=examples)
    audit.seconds = time.perf_counter() - start
    return audit

