"""vLLM 0.13's real ``Scheduler`` driven step by step, with simulated model outputs.

The driver behind tests/test_vllm_scheduler_loop.py (vLLM's KV-cache manager against
kvspec's, step by step). The scheduler and the workloads are benchmarks/scheduler_loop.py's
(shared with benchmarks/bench_scheduler.py, the time of one step). It needs vLLM, and imports
it only inside its functions, so that this module imports without it.

How the scheduler is built on a CPU with nothing downloaded, and what a workload is, is said
there. One step is what vLLM's engine core does: ``schedule()`` then ``update_from_output()``
(skipped, as the engine skips it, while the scheduler has nothing).

``run_trace`` records, per step, what the KV-cache manager decides and the scheduler passes
on (``StepRecord``: block ids, computed and scheduled tokens, preempted and finished ids,
common-prefix blocks, KV events, usage, prefix-cache stats, eviction samples, outputs, and
the whole block table of every running request after the step) as
plain JSON-able values, plus two views of the manager: ``empty_table_entries`` (used to
explain M2, docs/findings.md) and, with a sliding-window group, ``RefusalWatcher``'s refused
allocations that freed blocks (D7: both vLLM and kvspec free a request's out-of-window
blocks before refusing it, so these are compared like the rest); ``first_difference``
compares two traces and ``comparison_counts`` counts what was compared.

``python -m tests.vllm_loop --side vllm|kvspec --out FILE`` writes the traces of every
workload to FILE. ``--side kvspec`` first installs kvspec's plugin
(``kvspec.vllm_plugin.install``), after vLLM's scheduler module is imported, so the rebinding
of names vLLM already took is what is exercised; with ``KVSPEC_MUTANT`` set it then plants
that mutant (tests/mutants), so ``python -m tests.mutants`` can use the loop as a checker.
Run it with PYTHONHASHSEED set (the test sets it): vLLM's ``init_none_hash`` seeds block
hashes from it, and both sides must agree.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import json
import os
import random
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from benchmarks.scheduler_loop import (
    ALL_WORKLOADS,
    BLOCK_SIZE,
    HYBRID_WORKLOADS,
    WORKLOADS,
    RequestStream,
    SimulatedModel,
    Workload,
    build_scheduler,
    request_block_hasher,
)

__all__ = ["ALL_WORKLOADS", "BLOCK_SIZE", "HYBRID_WORKLOADS", "WORKLOADS", "Workload",
           "build_scheduler"]

StepRecord = dict[str, Any]


class RefusalWatcher:
    """Forwards everything to a KV-cache manager, noting each refused ``allocate_slots`` that
    changed the number of free blocks. vLLM 0.13 frees a sliding-window request's
    out-of-window blocks (``remove_skipped_blocks``) before its capacity check, even when it
    then refuses, and so does kvspec (``Profile.refusal_frees_skipped_blocks``, D7): the
    watcher only observes, on both sides, and its notes are compared like the rest."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.refusals: list[list[Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)

    def allocate_slots(self, request: Any, num_new_tokens: int, *args: Any,
                       **kwargs: Any) -> Any:
        pool = self.manager.block_pool
        free_before = pool.get_num_free_blocks()
        blocks = self.manager.allocate_slots(request, num_new_tokens, *args, **kwargs)
        if blocks is None and pool.get_num_free_blocks() != free_before:
            self.refusals.append([request.request_id,
                                  pool.get_num_free_blocks() - free_before])
        return blocks


class RecordingPublisher:
    """Stands in for the scheduler's KV-event publisher: keeps what is published."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


# -- the workload -----------------------------------------------------------------------------


class EngineActions:
    """What happens before each engine step, the same in every release's loop: arrivals (none
    in a quiet spell), at most one abort, at most one reset, drawn from the workload's rates.
    A subclass sets ``workload``, ``scheduler``, ``stream``, ``rng`` and ``step_index``."""

    workload: Any
    scheduler: Any
    stream: Any
    rng: random.Random
    step_index: int

    def _quiet(self) -> bool:
        w = self.workload
        return bool(w.quiet_every) and self.step_index % w.quiet_every >= (
            w.quiet_every - w.quiet_steps)

    def act(self) -> list[str]:
        """Before the step: arrivals, at most one abort, at most one reset."""
        from vllm.v1.request import RequestStatus

        w, rng, scheduler = self.workload, self.rng, self.scheduler
        actions: list[str] = []
        arrivals = int(w.arrivals_per_step) + (rng.random() < w.arrivals_per_step % 1)
        for _ in range(arrivals):
            request = self.stream.next_request(float(self.step_index))
            if not self._quiet():
                scheduler.add_request(request)
                actions.append(f"add {request.request_id} ({request.num_prompt_tokens} tokens)")
        if scheduler.requests and rng.random() < w.abort_rate:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            actions.append(f"abort {victim}")
        roll = rng.random()
        if roll < w.reset_running_rate:
            actions.append(f"reset_prefix_cache(reset_running_requests=True) -> "
                           f"{scheduler.reset_prefix_cache(reset_running_requests=True)}")
        elif roll < w.reset_running_rate + w.reset_rate:
            actions.append(f"reset_prefix_cache() -> {scheduler.reset_prefix_cache()}")
        return actions


class Engine(EngineActions):
    """A scheduler, the workload's request stream and model: ``step()`` is one engine step."""

    def __init__(self, workload: Workload, scheduler: Any,
                 block_hasher: Callable[[Any], list[Any]]) -> None:
        self.workload = workload
        self.scheduler = scheduler
        self.publisher = RecordingPublisher()
        scheduler.kv_event_publisher = self.publisher
        self.manager = scheduler.kv_cache_manager
        self.watcher: RefusalWatcher | None = None
        if workload.sliding_window is not None:
            self.watcher = RefusalWatcher(self.manager)
            scheduler.kv_cache_manager = self.watcher
        self.stream = RequestStream(workload, block_hasher)
        self.model = SimulatedModel(workload.seed, workload.eos_rate)
        self.rng = random.Random(f"{workload.seed}:actions")
        self.step_index = 0

    def step(self) -> StepRecord:
        """One engine step, recorded."""
        actions = self.act()
        record: StepRecord = {"step": self.step_index, "actions": actions}
        self.step_index += 1
        scheduler = self.scheduler
        if not scheduler.has_requests():  # vLLM's engine core skips the step, too
            return record
        scheduler_output = scheduler.schedule()
        record.update(scheduled_record(scheduler_output))
        record["empty_table_entries"] = empty_table_entries(self.manager)
        if self.watcher is not None:
            record["refusals_that_freed"] = self.watcher.refusals[:]
            self.watcher.refusals.clear()
        engine_outputs = scheduler.update_from_output(
            scheduler_output, self.model.output(scheduler, scheduler_output))
        record.update(outputs_record(engine_outputs))
        # The whole block table of every running request (the output has only new blocks).
        record["tables"] = {request.request_id: plain(
            self.manager.get_block_ids(request.request_id)) for request in scheduler.running}
        record["kv_events"] = [plain_event(event) for event in self.publisher.events]
        self.publisher.events.clear()
        return record


# -- what is recorded -------------------------------------------------------------------------


def plain(value: Any) -> Any:
    """JSON-able: bytes as hex, sequences and sets as lists, enums by name."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(plain(v) for v in value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot record a {type(value).__name__}: {value!r}")


def plain_event(event: Any) -> list[Any]:
    """A KV event as ``[class name, {field: value}]`` (msgspec structs or dataclasses)."""
    names = getattr(event, "__struct_fields__", None)
    if names is None:
        names = tuple(f.name for f in fields(event))
    return [type(event).__name__, {name: plain(getattr(event, name)) for name in names}]


def scheduled_record(out: Any) -> StepRecord:
    cached = out.scheduled_cached_reqs
    return {
        "new": [[r.req_id, plain(r.block_ids), r.num_computed_tokens]
                for r in out.scheduled_new_reqs],
        "cached": [[req_id, req_id in cached.resumed_req_ids, plain(new_blocks), computed]
                   for req_id, new_blocks, computed in zip(
                       cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                       strict=True)],
        "num_scheduled_tokens": dict(out.num_scheduled_tokens),
        "num_common_prefix_blocks": plain(out.num_common_prefix_blocks),
        "preempted": plain(out.preempted_req_ids or set()),
        "finished": plain(out.finished_req_ids),
    }


def outputs_record(engine_outputs: dict[int, Any]) -> StepRecord:
    outputs: list[list[Any]] = []
    stats = None
    for client in sorted(engine_outputs):
        batch = engine_outputs[client]
        outputs.extend([o.request_id, list(o.new_token_ids), plain(o.finish_reason),
                        o.num_cached_tokens] for o in batch.outputs)
        stats = stats or batch.scheduler_stats
    record: StepRecord = {"outputs": outputs}
    if stats is not None:
        prefix = stats.prefix_cache_stats
        record["kv_cache_usage"] = stats.kv_cache_usage
        record["prefix_cache_stats"] = {
            name: getattr(prefix, name)
            for name in ("reset", "requests", "queries", "hits", "preempted_requests",
                         "preempted_queries", "preempted_hits")}
        # Eviction samples carry wall-clock ages: only how many there are is comparable.
        record["kv_cache_eviction_events"] = len(stats.kv_cache_eviction_events)
    return record


def empty_table_entries(manager: Any) -> int:
    """How many (group, request) entries of the manager's block tables hold no block.

    vLLM 0.13 leaves one behind when ``allocate_slots`` refuses a waiting request (its
    ``req_to_blocks`` is a defaultdict), and ``get_num_common_prefix_blocks`` then counts it as
    a request (docs/findings.md, M2); kvspec leaves none."""
    return sum(not blocks for single in manager.coordinator.single_type_managers
               for blocks in single.req_to_blocks.values())


def run_trace(workload: Workload) -> dict[str, Any]:
    """Every step of ``workload`` on a scheduler built now: ``{"manager": module of the
    KV-cache manager class, "steps": [StepRecord, ...]}``."""
    with tempfile.TemporaryDirectory(prefix="kvspec-loop-") as tmp:
        scheduler = build_scheduler(workload, Path(tmp) / "model")
        engine = Engine(workload, scheduler, request_block_hasher())
        steps = [engine.step() for _ in range(workload.steps)]
    return {"manager": type(engine.manager).__module__, "steps": steps}


# -- comparing --------------------------------------------------------------------------------


Explained = Callable[[StepRecord, StepRecord], set[str]]


def first_difference(ours: Sequence[StepRecord], theirs: Sequence[StepRecord],
                     explained: Explained | None = None,
                     names: tuple[str, str] = ("vLLM", "kvspec")) -> tuple[int, str] | None:
    """None when the traces are equal, else the first differing step's index and a report
    with both sides. ``explained(a, b)`` names the keys whose difference at a step is a
    known one, left out of the comparison."""
    for index, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a == b:
            continue
        keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
        if explained is not None:
            known = explained(a, b)
            keys = [k for k in keys if k not in known]
            if not keys:
                continue
        lines = [f"step {index} differs in {', '.join(keys)}",
                 f"  actions before it: {a.get('actions')}"]
        for key in keys:
            lines.append(f"  {key}:")
            lines.append(f"    {names[0]:>7}: {json.dumps(a.get(key))}")
            lines.append(f"    {names[1]:>7}: {json.dumps(b.get(key))}")
        return index, "\n".join(lines)
    if len(ours) != len(theirs):
        return min(len(ours), len(theirs)), f"the traces have {len(ours)} and {len(theirs)} steps"
    return None


def comparison_counts(ours: Sequence[StepRecord], theirs: Sequence[StepRecord],
                      explained: Explained | None = None) -> dict[str, int]:
    """What comparing two traces step by step covers: ``steps`` compared (every step of
    both, when they are as long), ``events`` (KV events) and ``tables`` (block-table rows of
    running requests) compared, and ``differences``: the steps that differ in some key,
    ``explained`` ones (``explained(a, b)`` names every differing key) counted apart."""
    counts = dict.fromkeys(("steps", "events", "tables", "differences", "explained"), 0)
    for a, b in zip(ours, theirs, strict=False):
        counts["steps"] += 1
        counts["events"] += max(len(a.get("kv_events", ())), len(b.get("kv_events", ())))
        counts["tables"] += max(len(a.get("tables", ())), len(b.get("tables", ())))
        if a == b:
            continue
        keys = {k for k in (*a, *b) if a.get(k) != b.get(k)}
        if explained is not None and keys <= explained(a, b):
            counts["explained"] += 1
        else:
            counts["differences"] += 1
    counts["differences"] += abs(len(ours) - len(theirs))
    return counts


def summary(steps: Sequence[StepRecord]) -> dict[str, int]:
    """How much of each kind the trace exercised (the test checks the workloads do)."""
    counts = dict.fromkeys(("steps scheduled", "prefix-cache hit tokens", "chunked prefills",
                            "preemptions", "resumptions", "aborts", "successful resets",
                            "BlockStored", "BlockRemoved", "AllBlocksCleared",
                            "finished by EOS or length"), 0)
    for step in steps:
        counts["aborts"] += sum(a.startswith("abort") for a in step["actions"])
        counts["successful resets"] += sum(a.endswith("-> True") for a in step["actions"])
        if "new" not in step:
            continue
        counts["steps scheduled"] += 1
        counts["preemptions"] += len(step["preempted"])
        counts["resumptions"] += sum(resumed for _, resumed, _, _ in step["cached"])
        stats = step.get("prefix_cache_stats", {})
        counts["prefix-cache hit tokens"] += stats.get("hits", 0) + stats.get(
            "preempted_hits", 0)
        # A scheduled request with no output is part way through its prompt.
        with_output = {o[0] for o in step["outputs"]}
        counts["chunked prefills"] += sum(
            req_id not in with_output for req_id in step["num_scheduled_tokens"])
        for name, _ in step["kv_events"]:
            counts[name] += 1
        counts["finished by EOS or length"] += sum(
            o[2] in ("STOP", "LENGTH") for o in step["outputs"])
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--side", choices=("vllm", "kvspec"), required=True,
                        help="vllm: vLLM's own KV-cache manager; kvspec: through its plugin")
    parser.add_argument("--workloads", default=",".join(ALL_WORKLOADS))
    parser.add_argument("--out", required=True, help="write the traces here (JSON)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    importlib.import_module("vllm.v1.core.sched.scheduler")  # before the plugin, as in vLLM
    if args.side == "kvspec":
        from kvspec import vllm_plugin

        vllm_plugin.install()
        mutant = os.environ.get("KVSPEC_MUTANT")
        if mutant:  # python -m tests.mutants: plant it in kvspec's side only
            from tests.mutants import plant

            plant(mutant)
    traces = {}
    for name in args.workloads.split(","):
        traces[name] = run_trace(ALL_WORKLOADS[name])
    Path(args.out).write_text(json.dumps(traces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
