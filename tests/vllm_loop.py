"""vLLM's real ``Scheduler`` driven step by step, with simulated model outputs, under vLLM 0.13
or 0.33.

The driver behind tests/test_vllm_scheduler_loop.py: vLLM's KV-cache code against kvspec's,
step by step, in the release of vLLM this interpreter imports (or the one ``release`` names).
The scheduler, the request stream and the model are benchmarks/scheduler_loop.py's (shared
with benchmarks/bench_scheduler.py, the time of one step); how the scheduler is built on a
CPU with nothing downloaded, and what a workload is, is said there. It needs vLLM, and imports
it only inside its functions, so that this module imports without it.

What kvspec's plugin puts in place differs by release (docs/plugin.md), and so does what the
loop watches besides the scheduler's output (``replaces_pool``):

- vLLM 0.13: ``kvspec.vllm_plugin.install()`` replaces the ``KVCacheManager`` (and the stack
  under it). The workloads (``LOOP_WORKLOADS["0.13"]``) are chunked prefill, preemption,
  priorities with LoRA and cache salts, and a full + sliding-window hybrid with a roomy and a
  tight pool. Per step the loop also records ``empty_table_entries`` (to explain M2,
  docs/findings.md) and, with a sliding-window group, ``RefusalWatcher``'s refused allocations
  that freed blocks (D7: both vLLM and kvspec free a request's out-of-window blocks before
  refusing it, so these are compared like the rest).
- vLLM 0.33: ``install()`` replaces ``vllm.v1.core.block_pool`` only: vLLM 0.33's managers and
  coordinators run over kvspec's pool. The workloads (``LOOP_WORKLOADS["0.33"]``) are
  chunked prefill, preemption, priorities with forced resets, and a full-attention + Mamba
  hybrid in ``mamba_cache_mode="align"`` with a roomy and a tight pool. The hybrid shapes give
  the scheduler a ``block_size`` (64) coarser than its ``hash_block_size`` (16): vLLM 0.33 then
  enables fine-grained (partial) hash hits (``partial_hash_hits_enabled``, vLLM #46384), and
  ``MambaManager._cache_partial_tail_block`` registers a prompt's last hash boundary inside a
  block through ``BlockPool.cache_partial_block``. ``PoolWatch`` counts and records those
  calls, and the loop records the pool's free blocks, on each side.

One step is what vLLM's engine core does: ``schedule()`` then ``update_from_output()``
(skipped, as the engine skips it, while the scheduler has nothing). ``run_trace`` records, per
step, what the KV-cache code decides and the scheduler passes on (``StepRecord``: block ids,
computed and scheduled tokens, preempted and finished ids, common-prefix blocks, KV events,
usage, prefix-cache stats, eviction samples, outputs, and the whole block table of every
running request after the step) as plain JSON-able values, plus the release's watches above;
``first_difference`` compares two traces and ``comparison_counts`` counts what was compared.

``python -m tests.vllm_loop --side vllm|kvspec --out FILE`` writes the traces of every
workload of the interpreter's release to FILE. ``--side kvspec`` first installs kvspec's
plugin (``kvspec.vllm_plugin.install``), after vLLM's scheduler module is imported, so the
rebinding of names vLLM already took is what is exercised; with ``KVSPEC_MUTANT`` set it then
plants that mutant (tests/mutants), so ``python -m tests.mutants`` can use the loop as a
checker. Run it with PYTHONHASHSEED set (the test sets it): vLLM's ``init_none_hash`` seeds
block hashes from it, and both sides must agree.
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
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from benchmarks.scheduler_loop import (
    RequestStream,
    SimulatedModel,
    Workload,
    build_scheduler,
    request_block_hasher,
    vllm_release,
)

__all__ = ["LOOP_WORKLOADS", "Engine", "StepRecord", "Workload", "build_scheduler",
           "comparison_counts", "first_difference", "run_trace", "summary", "vllm_release"]

StepRecord = dict[str, Any]

SEEDS = (1, 2, 3)


def _seeded(shapes: tuple[Workload, ...]) -> dict[str, Workload]:
    return {f"{shape.name}-{seed}": replace(shape, name=f"{shape.name}-{seed}", seed=seed)
            for shape in shapes for seed in SEEDS}


# vLLM 0.13's workloads: what its KV-cache manager (replaced by kvspec's) does.
SHAPES_013: tuple[Workload, ...] = (
    # Small token budget: prompts are prefilled in chunks over several steps.
    Workload("chunked", seed=0, steps=1000, num_gpu_blocks=160, max_num_seqs=12,
             max_num_batched_tokens=48, arrivals_per_step=0.35, quiet_every=150,
             quiet_steps=50, reset_rate=0.05),
    # A pool far too small for the load: running requests are preempted and resumed; some
    # requests run up to the model length.
    Workload("preempt", seed=0, steps=1000, num_gpu_blocks=40, max_num_seqs=16,
             max_num_batched_tokens=192, prefix_tokens=(16, 96), suffix_tokens=(1, 32),
             max_tokens=(8, 200), max_model_len=256, arrivals_per_step=0.8, abort_rate=0.05,
             eos_rate=0.01, kv_cache_metrics=True),
    # Priority scheduling, LoRA adapters and cache salts (other hash chains), forced resets.
    Workload("priority", seed=0, steps=1000, num_gpu_blocks=64, max_num_seqs=10,
             max_num_batched_tokens=96, num_prefixes=5, arrivals_per_step=0.6,
             quiet_every=120, quiet_steps=40, reset_rate=0.03, reset_running_rate=0.01,
             priority=True, lora_rate=0.3, salt_rate=0.2, repeat_prompt_rate=0.2),
    # A full-attention group and a sliding-window group sharing one pool: a pool large enough
    # that running requests are never preempted, and one too small, where allocate_slots
    # refuses requests whose blocks have left the window (and frees those blocks first: D7,
    # docs/findings.md).
    Workload("hybrid", seed=0, steps=1000, num_gpu_blocks=200, max_num_seqs=8,
             max_num_batched_tokens=64, prefix_tokens=(16, 128), suffix_tokens=(1, 40),
             max_tokens=(4, 96), max_model_len=512, arrivals_per_step=0.5, quiet_every=160,
             quiet_steps=70, reset_rate=0.05, sliding_window=48),
    Workload("hybrid-preempt", seed=0, steps=1000, num_gpu_blocks=96, max_num_seqs=12,
             max_num_batched_tokens=64, prefix_tokens=(16, 128), suffix_tokens=(1, 40),
             max_tokens=(4, 96), max_model_len=512, arrivals_per_step=0.5, quiet_every=160,
             quiet_steps=70, reset_rate=0.05, sliding_window=48),
)

# vLLM 0.33's workloads: what vLLM 0.33's managers ask of the pool (replaced by kvspec's).
# Their requests draw no LoRA adapter (Workload.lora).
SHAPES_033: tuple[Workload, ...] = tuple(replace(shape, lora=False) for shape in (
    # Small token budget: prompts are prefilled in chunks over several steps; resets.
    Workload("chunked", seed=0, steps=1200, num_gpu_blocks=160, max_num_seqs=12,
             max_num_batched_tokens=48, arrivals_per_step=0.35, quiet_every=150,
             quiet_steps=50, reset_rate=0.05, salt_rate=0.1),
    # A pool far too small for the load: running requests are preempted and resumed.
    Workload("preempt", seed=0, steps=1200, num_gpu_blocks=40, max_num_seqs=16,
             max_num_batched_tokens=192, prefix_tokens=(16, 96), suffix_tokens=(1, 32),
             max_tokens=(8, 200), max_model_len=256, arrivals_per_step=0.8, abort_rate=0.05,
             eos_rate=0.01, reset_running_rate=0.01, kv_cache_metrics=True),
    # Priority scheduling, cache salts, forced resets (reset_running_requests=True).
    Workload("priority", seed=0, steps=1200, num_gpu_blocks=64, max_num_seqs=10,
             max_num_batched_tokens=96, num_prefixes=5, arrivals_per_step=0.6,
             quiet_every=120, quiet_steps=40, reset_rate=0.03, reset_running_rate=0.01,
             priority=True, salt_rate=0.2, repeat_prompt_rate=0.2),
    # Full attention + Mamba (align mode), 64-token blocks hashed every 16 tokens: partial
    # prefix-cache entries (cache_partial_block), a roomy and a tight pool.
    Workload("mamba", seed=0, steps=1000, num_gpu_blocks=96, max_num_seqs=8,
             max_num_batched_tokens=128, block_size=64, hash_block_size=16, mamba=True,
             prefix_tokens=(16, 200), suffix_tokens=(1, 60), max_tokens=(4, 64),
             max_model_len=512, arrivals_per_step=0.4, quiet_every=125, quiet_steps=45,
             repeat_prompt_rate=0.25, reset_rate=0.04),
    Workload("mamba-preempt", seed=0, steps=1000, num_gpu_blocks=28, max_num_seqs=10,
             max_num_batched_tokens=128, block_size=64, hash_block_size=16, mamba=True,
             prefix_tokens=(16, 200), suffix_tokens=(1, 60), max_tokens=(8, 128),
             max_model_len=512, arrivals_per_step=0.6, repeat_prompt_rate=0.25,
             abort_rate=0.04, reset_rate=0.02, reset_running_rate=0.01),
))

# Each shape under three seeds: 15 workloads per release.
LOOP_WORKLOADS: dict[str, dict[str, Workload]] = {
    "0.13": _seeded(SHAPES_013), "0.33": _seeded(SHAPES_033)}


def replaces_pool(release: str) -> bool:
    """Whether kvspec's plugin replaces the pool alone (vLLM 0.33: vLLM's managers stay, so
    the loop watches every call they make to the pool and the pool's free blocks) or the
    KV-cache manager with the stack under it (vLLM 0.13: the loop watches the manager's
    tables, whose M2 entries differ; kvspec's pool sits inside kvspec's manager there, and
    0.13's pool has no partial entries to watch)."""
    return release == "0.33"


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


class PoolWatch:
    """Stands between vLLM's single-type managers and their block pool, forwarding
    everything, and records each ``cache_partial_block`` call: the request, the block, the
    tokens it covers, the group and whether it returned a hash. The same on both sides."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.partial_calls: list[list[Any]] = []
        self.total_partial_calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def cache_partial_block(self, *args: Any, **kwargs: Any) -> Any:
        result = self.pool.cache_partial_block(*args, **kwargs)
        request, block = kwargs.get("request"), kwargs.get("block")
        self.total_partial_calls += 1
        self.partial_calls.append([
            getattr(request, "request_id", None), getattr(block, "block_id", None),
            kwargs.get("num_tokens"), kwargs.get("kv_cache_group_id"),
            bool(kwargs.get("replace_existing_hashes", False)),
            None if result is None else plain(bytes(result))])
        return result


class RecordingPublisher:
    """Stands in for the scheduler's KV-event publisher: keeps what is published."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


# -- the engine -------------------------------------------------------------------------------


class Engine:
    """A scheduler, the workload's request stream and model: ``step()`` is one engine step."""

    def __init__(self, workload: Workload, scheduler: Any, release: str | None = None) -> None:
        self.workload = workload
        self.release = release or vllm_release()
        self.scheduler = scheduler
        self.publisher = RecordingPublisher()
        scheduler.kv_event_publisher = self.publisher
        self.manager = scheduler.kv_cache_manager
        self.pool = self.manager.block_pool
        self.watcher: RefusalWatcher | None = None
        if workload.sliding_window is not None:
            self.watcher = RefusalWatcher(self.manager)
            scheduler.kv_cache_manager = self.watcher
        self.watch: PoolWatch | None = None
        if replaces_pool(self.release):
            self.watch = PoolWatch(self.pool)
            for single in self.manager.coordinator.single_type_managers:
                single.block_pool = self.watch
        self.stream = RequestStream(workload, request_block_hasher(workload.hash_block_size),
                                    self.release)
        self.model = SimulatedModel(workload.seed, workload.eos_rate)
        self.rng = random.Random(f"{workload.seed}:actions")
        self.step_index = 0

    def _quiet(self) -> bool:
        w = self.workload
        return bool(w.quiet_every) and self.step_index % w.quiet_every >= (
            w.quiet_every - w.quiet_steps)

    def act(self) -> list[str]:
        """Before the step: arrivals (none in a quiet spell), at most one abort, at most one
        reset, drawn from the workload's rates."""
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

    def step(self) -> StepRecord:
        """One engine step, recorded."""
        actions = self.act()
        record: StepRecord = {"step": self.step_index, "actions": actions}
        self.step_index += 1
        scheduler = self.scheduler
        if not scheduler.has_requests():  # vLLM's engine core skips the step, too
            record["kv_events"] = self._take_events()
            return record
        scheduler_output = scheduler.schedule()
        record.update(scheduled_record(scheduler_output, self.release))
        if self.watch is None:
            record["empty_table_entries"] = empty_table_entries(self.manager)
        if self.watcher is not None:
            record["refusals_that_freed"] = self.watcher.refusals[:]
            self.watcher.refusals.clear()
        engine_outputs = scheduler.update_from_output(
            scheduler_output, self.model.output(scheduler, scheduler_output))
        record.update(outputs_record(engine_outputs, self.release))
        # The whole block table of every running request (the output has only new blocks).
        record["tables"] = {request.request_id: plain(
            self.manager.get_block_ids(request.request_id)) for request in scheduler.running}
        if self.watch is not None:
            record["free_blocks"] = self.pool.get_num_free_blocks()
            record["partial_caches"] = self.watch.partial_calls[:]
            self.watch.partial_calls.clear()
        record["kv_events"] = self._take_events()
        return record

    def _take_events(self) -> list[Any]:
        events = [plain_event(event) for event in self.publisher.events]
        self.publisher.events.clear()
        return events


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


def _field_names(value: Any) -> tuple[str, ...]:
    """A msgspec struct's or a dataclass's (or a plain object's) field names."""
    names: tuple[str, ...] | None = getattr(value, "__struct_fields__", None)
    if names is None:
        names = (tuple(f.name for f in fields(value)) if hasattr(value, "__dataclass_fields__")
                 else tuple(vars(value)))
    return names


def plain_event(event: Any) -> list[Any]:
    """A KV event as ``[class name, {field: value}]`` (msgspec structs or dataclasses)."""
    return [type(event).__name__,
            {name: plain(getattr(event, name)) for name in _field_names(event)}]


def scheduled_record(out: Any, release: str) -> StepRecord:
    cached = out.scheduled_cached_reqs
    record: StepRecord = {
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
    if release == "0.33":
        # vLLM 0.33's SchedulerOutput also hands the workers the blocks to zero and the block
        # copies (Mamba align mode's copy-on-write), decided by the KV-cache code; 0.13's
        # has neither field.
        record["block_ids_to_zero"] = plain(out.new_block_ids_to_zero)
        record["block_copies"] = [[copy.src_block_id, copy.dst_block_id]
                                  for copy in out.kv_cache_block_copies or ()]
    return record


def _cached_tokens(output: Any, release: str) -> Any:
    """What an output says of its request's prefix-cache hit."""
    if release == "0.13":
        return output.num_cached_tokens
    # vLLM 0.33 replaced num_cached_tokens by prefill_stats (the hit by source, and more).
    stats = output.prefill_stats
    if stats is None:
        return None
    return {name: plain(getattr(stats, name)) for name in _field_names(stats)}


def outputs_record(engine_outputs: dict[int, Any], release: str) -> StepRecord:
    outputs: list[list[Any]] = []
    stats = None
    for client in sorted(engine_outputs):
        batch = engine_outputs[client]
        outputs.extend([o.request_id, list(o.new_token_ids), plain(o.finish_reason),
                        _cached_tokens(o, release)] for o in batch.outputs)
        stats = stats or batch.scheduler_stats
    record: StepRecord = {"outputs": outputs}
    if stats is not None:
        prefix = stats.prefix_cache_stats
        record["kv_cache_usage"] = stats.kv_cache_usage
        record["prefix_cache_stats"] = {
            name: getattr(prefix, name)
            for name in ("reset", "requests", "queries", "hits", "preempted_requests",
                         "preempted_queries", "preempted_hits")}
        if release == "0.33":
            # vLLM 0.33's prefix-cache stats split the hits by where they came from; 0.13's
            # do not.
            record["hits_by_source"] = plain(prefix.hits_by_source)
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


def run_trace(workload: Workload, release: str | None = None) -> dict[str, Any]:
    """Every step of ``workload`` on a scheduler built now: ``{"pool": module of the block
    pool class, "kvspec_build": "compiled" or "pure-Python" (None on vLLM's pool), "manager":
    module of the KV-cache manager class, "partial_calls": cache_partial_block calls (0 where
    the pool is not watched), "steps": [StepRecord, ...]}``."""
    release = release or vllm_release()
    with tempfile.TemporaryDirectory(prefix="kvspec-loop-") as tmp:
        scheduler = build_scheduler(workload, Path(tmp) / "model", release)
        engine = Engine(workload, scheduler, release)
        steps = [engine.step() for _ in range(workload.steps)]
    pool_module = type(engine.pool).__module__
    impl = sys.modules.get("kvspec.impl")
    build = None
    if impl is not None and pool_module.startswith("kvspec."):
        build = "compiled" if getattr(impl, "COMPILED", False) else "pure-Python"
    return {"pool": pool_module, "kvspec_build": build,
            "manager": type(engine.manager).__module__,
            "partial_calls": 0 if engine.watch is None else engine.watch.total_partial_calls,
            "steps": steps}


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
                            "partial caches", "block copies", "finished by EOS or length"), 0)
    for step in steps:
        counts["aborts"] += sum(a.startswith("abort") for a in step["actions"])
        counts["successful resets"] += sum(a.endswith("-> True") for a in step["actions"])
        for name, _ in step.get("kv_events", ()):
            counts[name] = counts.get(name, 0) + 1
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
        counts["partial caches"] += len(step.get("partial_caches", ()))
        counts["block copies"] += len(step.get("block_copies", ()))
        counts["finished by EOS or length"] += sum(
            o[2] in ("STOP", "LENGTH") for o in step["outputs"])
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--side", choices=("vllm", "kvspec"), required=True,
                        help="vllm: vLLM's own KV-cache code; kvspec: kvspec's, through its "
                        "plugin (the manager under vLLM 0.13, the pool under 0.33)")
    parser.add_argument("--release", choices=sorted(LOOP_WORKLOADS),
                        help="the vLLM release to drive (default: this interpreter's)")
    parser.add_argument("--workloads", help="comma-separated (default: all of the release's)")
    parser.add_argument("--out", required=True, help="write the traces here (JSON)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    release = args.release or vllm_release()
    workloads = LOOP_WORKLOADS[release]
    importlib.import_module("vllm.v1.core.sched.scheduler")  # before the plugin, as in vLLM
    if args.side == "kvspec":
        from kvspec import vllm_plugin

        vllm_plugin.install()
        mutant = os.environ.get("KVSPEC_MUTANT")
        if mutant:  # python -m tests.mutants: plant it in kvspec's side only
            from tests.mutants import plant

            plant(mutant)
    names = args.workloads.split(",") if args.workloads else list(workloads)
    traces = {name: run_trace(workloads[name], release) for name in names}
    Path(args.out).write_text(json.dumps(traces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
