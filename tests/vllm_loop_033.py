"""vLLM 0.33's real ``Scheduler`` driven step by step, with simulated model outputs.

The driver behind tests/test_vllm_scheduler_loop_033.py: vLLM 0.33's scheduler, managers and
coordinators over vLLM's own ``BlockPool`` against the same over kvspec's (under vLLM 0.33
``kvspec.vllm_plugin.install()`` replaces ``vllm.v1.core.block_pool`` only). It needs vLLM
0.33, and imports it only inside its functions, so that this module imports without it.

The scheduler is built on a CPU with nothing downloaded, as tests/vllm_loop.py does for 0.13
(benchmarks/scheduler_loop.py: a folder holding a small Llama ``config.json`` read with
``skip_tokenizer_init=True``, a registered stand-in architecture). The ``KVCacheConfig`` is
made here: one full-attention group, or a full-attention and a Mamba group in
``mamba_cache_mode="align"`` with prefix caching on. The hybrid shapes give the scheduler a
``block_size`` (64) coarser than its ``hash_block_size`` (16): vLLM 0.33 then enables
fine-grained (partial) hash hits (``partial_hash_hits_enabled``, vLLM #46384), and
``MambaManager._cache_partial_tail_block`` registers a prompt's last hash boundary inside a
block through ``BlockPool.cache_partial_block``. ``PoolWatch`` counts and records those calls
on each side (vLLM's managers call them the same way on both).

A workload (``Workload``) is a seeded stream: requests arrive with prompts that share popular
prefixes (some repeat an earlier prompt, some carry a cache salt), requests are aborted, the
prefix cache is reset (sometimes with ``reset_running_requests=True``), and the model samples
each request's tokens from its own seeded stream (EOS with probability ``eos_rate``). One step
is what vLLM's engine core does: ``schedule()`` then ``update_from_output()`` (skipped, as
the engine skips it, while the scheduler has nothing).

``python -m tests.vllm_loop_033 --side vllm|kvspec --out FILE`` writes the traces of every
workload to FILE. ``--side kvspec`` installs the plugin after vLLM's scheduler module is
imported (so the rebinding of names vLLM already took is what runs). Run it with
PYTHONHASHSEED set (the test sets it): ``init_none_hash`` seeds block hashes from it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.scheduler_loop import EOS_TOKEN_ID, VOCAB, SimulatedModel
from tests.vllm_loop import (
    EngineActions,
    RecordingPublisher,
    StepRecord,
    comparison_counts,
    first_difference,
    plain,
    plain_event,
)

__all__ = ["ALL_WORKLOADS", "StepRecord", "Workload", "comparison_counts", "first_difference",
           "run_trace", "summary"]



@dataclass(frozen=True)
class Workload:
    """One seeded stream of engine events and the scheduler's shape. Ranges are inclusive."""

    name: str
    seed: int
    steps: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = 16
    hash_block_size: int = 16
    mamba: bool = False
    max_model_len: int = 1024
    num_prefixes: int = 8
    prefix_tokens: tuple[int, int] = (16, 160)
    suffix_tokens: tuple[int, int] = (1, 48)
    max_tokens: tuple[int, int] = (1, 64)
    arrivals_per_step: float = 0.5
    # Every ``quiet_every`` steps arrivals stop for ``quiet_steps`` steps, so the engine
    # drains and a plain reset_prefix_cache() can succeed.
    quiet_every: int = 0
    quiet_steps: int = 0
    repeat_prompt_rate: float = 0.1
    abort_rate: float = 0.03
    reset_rate: float = 0.02
    reset_running_rate: float = 0.0
    eos_rate: float = 0.02
    priority: bool = False
    salt_rate: float = 0.0
    kv_cache_metrics: bool = False
    kv_events: bool = True


SHAPES: tuple[Workload, ...] = (
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
)
SEEDS = (1, 2, 3)
ALL_WORKLOADS: dict[str, Workload] = {
    f"{shape.name}-{seed}": replace(shape, name=f"{shape.name}-{seed}", seed=seed)
    for shape in SHAPES for seed in SEEDS}


# -- building the scheduler -------------------------------------------------------------------


def make_kv_cache_config(workload: Workload) -> Any:
    """vLLM 0.33's ``KVCacheConfig``: full attention, plus Mamba in align mode if asked."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    groups = [KVCacheGroupSpec(["model.layers.0.attn"], FullAttentionSpec(
        block_size=workload.block_size, num_kv_heads=2, head_size=16, dtype=torch.float16))]
    if workload.mamba:
        groups.append(KVCacheGroupSpec(["model.layers.1.mixer"], MambaSpec(
            block_size=workload.block_size, shapes=((1, 1),), dtypes=(torch.float32,),
            mamba_cache_mode="align")))
    return KVCacheConfig(num_blocks=workload.num_gpu_blocks, kv_cache_tensors=[],
                         kv_cache_groups=groups)


def build_scheduler(workload: Workload, model_dir: Path) -> Any:
    """vLLM 0.33's ``Scheduler`` for ``workload``, over whichever ``BlockPool`` vLLM's
    coordinator module holds now (vLLM's, or kvspec's once the plugin is installed)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        ModelConfig,
        ObservabilityConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.structured_output import StructuredOutputManager

    from benchmarks.scheduler_loop import register_stand_in_model, write_model_config

    register_stand_in_model()
    write_model_config(model_dir)
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                               max_model_len=workload.max_model_len, dtype="float16", seed=0)
    scheduler_config = SchedulerConfig(
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        max_model_len=workload.max_model_len,
        enable_chunked_prefill=True,
        policy="priority" if workload.priority else "fcfs",
        is_encoder_decoder=False,
        watermark=0.0,
    )
    cache_kwargs: dict[str, Any] = {"mamba_cache_mode": "align"} if workload.mamba else {}
    cache_config = CacheConfig(block_size=workload.block_size, enable_prefix_caching=True,
                               **cache_kwargs)
    cache_config.num_gpu_blocks = workload.num_gpu_blocks
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig("cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=workload.kv_events,
                                        publisher="null"),
        observability_config=ObservabilityConfig(kv_cache_metrics=workload.kv_cache_metrics,
                                                 kv_cache_metrics_sample=1.0),
    )
    register_all_kvcache_specs(vllm_config)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=make_kv_cache_config(workload),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=workload.block_size,
        hash_block_size=workload.hash_block_size,
        log_stats=True,
    )


def request_block_hasher(hash_block_size: int) -> Callable[[Any], list[Any]]:
    """vLLM 0.33's block hasher (per hash unit), seeded as its engine core seeds it."""
    from vllm.utils.hashing import sha256

    kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    kv_cache_utils.init_none_hash(sha256)
    hasher: Callable[[Any], list[Any]] = kv_cache_utils.get_request_block_hasher(
        hash_block_size, sha256)
    return hasher


class RequestStream:
    """The requests of a workload, in arrival order, built as vLLM 0.33's ``Request``."""

    def __init__(self, workload: Workload, block_hasher: Callable[[Any], list[Any]]) -> None:
        self.workload = workload
        self.block_hasher = block_hasher
        self.rng = random.Random(f"{workload.seed}:prompts")
        self.prefixes = [self._tokens(self.rng.randint(*workload.prefix_tokens))
                         for _ in range(workload.num_prefixes)]
        self.popularity = [1.0 / (rank + 1) for rank in range(workload.num_prefixes)]
        self.prompts: list[list[int]] = []
        self.count = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, VOCAB) for _ in range(n)]

    def next_request(self, arrival_time: float) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        w, rng = self.workload, self.rng
        if self.prompts and rng.random() < w.repeat_prompt_rate:
            prompt = list(rng.choice(self.prompts))
        else:
            prefix = rng.choices(self.prefixes, weights=self.popularity)[0]
            prompt = prefix + self._tokens(rng.randint(*w.suffix_tokens))
        self.prompts.append(prompt)
        max_tokens = max(1, min(rng.randint(*w.max_tokens), w.max_model_len - len(prompt)))
        salt = f"tenant-{rng.randint(1, 2)}" if rng.random() < w.salt_rate else None
        priority = rng.randint(0, 3) if w.priority else 0
        request_id = f"r{self.count}"
        self.count += 1
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        return Request(request_id, prompt, params, None, arrival_time=arrival_time,
                       cache_salt=salt, priority=priority, block_hasher=self.block_hasher)


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


# -- the workload -----------------------------------------------------------------------------


class Engine(EngineActions):
    """A scheduler, the workload's request stream and model: ``step()`` is one engine step."""

    def __init__(self, workload: Workload, scheduler: Any) -> None:
        self.workload = workload
        self.scheduler = scheduler
        self.publisher = RecordingPublisher()
        scheduler.kv_event_publisher = self.publisher
        self.manager = scheduler.kv_cache_manager
        self.pool = self.manager.block_pool
        self.watch = PoolWatch(self.pool)
        for single in self.manager.coordinator.single_type_managers:
            single.block_pool = self.watch
        self.stream = RequestStream(workload, request_block_hasher(workload.hash_block_size))
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
            record["kv_events"] = self._take_events()
            return record
        scheduler_output = scheduler.schedule()
        record.update(scheduled_record(scheduler_output))
        engine_outputs = scheduler.update_from_output(
            scheduler_output, self.model.output(scheduler, scheduler_output))
        record.update(outputs_record(engine_outputs))
        # The whole block table of every running request (the output has only new blocks).
        record["tables"] = {request.request_id: plain(
            self.manager.get_block_ids(request.request_id)) for request in scheduler.running}
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
        "block_ids_to_zero": plain(out.new_block_ids_to_zero),
        "block_copies": [[copy.src_block_id, copy.dst_block_id]
                         for copy in out.kv_cache_block_copies or ()],
    }


def outputs_record(engine_outputs: dict[int, Any]) -> StepRecord:
    outputs: list[list[Any]] = []
    stats = None
    for client in sorted(engine_outputs):
        batch = engine_outputs[client]
        outputs.extend([o.request_id, list(o.new_token_ids), plain(o.finish_reason),
                        _prefill_stats(o.prefill_stats)] for o in batch.outputs)
        stats = stats or batch.scheduler_stats
    record: StepRecord = {"outputs": outputs}
    if stats is not None:
        prefix = stats.prefix_cache_stats
        record["kv_cache_usage"] = stats.kv_cache_usage
        record["prefix_cache_stats"] = {
            name: getattr(prefix, name)
            for name in ("reset", "requests", "queries", "hits", "preempted_requests",
                         "preempted_queries", "preempted_hits")}
        record["hits_by_source"] = plain(prefix.hits_by_source)
        # Eviction samples carry wall-clock ages: only how many there are is comparable.
        record["kv_cache_eviction_events"] = len(stats.kv_cache_eviction_events)
    return record


def _prefill_stats(stats: Any) -> Any:
    if stats is None:
        return None
    names = getattr(stats, "__struct_fields__", None) or tuple(vars(stats))
    return {name: plain(getattr(stats, name)) for name in names}


def run_trace(workload: Workload) -> dict[str, Any]:
    """Every step of ``workload`` on a scheduler built now: ``{"pool": module of the block
    pool class, "kvspec_build": "compiled" or "pure-Python" (None on vLLM's pool),
    "partial_calls": cache_partial_block calls, "steps": [StepRecord, ...], ...}``."""
    with tempfile.TemporaryDirectory(prefix="kvspec-loop-") as tmp:
        scheduler = build_scheduler(workload, Path(tmp) / "model")
        engine = Engine(workload, scheduler)
        steps = [engine.step() for _ in range(workload.steps)]
    pool_module = type(engine.pool).__module__
    impl = sys.modules.get("kvspec.impl")
    build = None
    if impl is not None and pool_module.startswith("kvspec."):
        build = "compiled" if getattr(impl, "COMPILED", False) else "pure-Python"
    return {"pool": pool_module, "kvspec_build": build,
            "manager": type(engine.manager).__module__,
            "partial_calls": engine.watch.total_partial_calls, "steps": steps}


def summary(steps: list[StepRecord]) -> dict[str, int]:
    """How much of each kind the trace exercised (the test checks the workloads do)."""
    counts = dict.fromkeys(("steps scheduled", "prefix-cache hit tokens", "chunked prefills",
                            "preemptions", "resumptions", "aborts", "successful resets",
                            "BlockStored", "BlockRemoved", "AllBlocksCleared",
                            "partial caches", "block copies", "finished by EOS or length"), 0)
    for step in steps:
        counts["aborts"] += sum(a.startswith("abort") for a in step["actions"])
        counts["successful resets"] += sum(a.endswith("-> True") for a in step["actions"])
        for name, _ in step["kv_events"]:
            counts[name] = counts.get(name, 0) + 1
        if "new" not in step:
            continue
        counts["steps scheduled"] += 1
        counts["preemptions"] += len(step["preempted"])
        counts["resumptions"] += sum(resumed for _, resumed, _, _ in step["cached"])
        stats = step.get("prefix_cache_stats", {})
        counts["prefix-cache hit tokens"] += stats.get("hits", 0) + stats.get(
            "preempted_hits", 0)
        with_output = {o[0] for o in step["outputs"]}
        counts["chunked prefills"] += sum(
            req_id not in with_output for req_id in step["num_scheduled_tokens"])
        counts["partial caches"] += len(step["partial_caches"])
        counts["block copies"] += len(step["block_copies"])
        counts["finished by EOS or length"] += sum(
            o[2] in ("STOP", "LENGTH") for o in step["outputs"])
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--side", choices=("vllm", "kvspec"), required=True,
                        help="vllm: vLLM's own BlockPool; kvspec: kvspec's, through its plugin")
    parser.add_argument("--workloads", default=",".join(ALL_WORKLOADS))
    parser.add_argument("--out", required=True, help="write the traces here (JSON)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    importlib.import_module("vllm.v1.core.sched.scheduler")  # before the plugin, as in vLLM
    if args.side == "kvspec":
        from kvspec import vllm_plugin

        vllm_plugin.install()
    traces = {name: run_trace(ALL_WORKLOADS[name]) for name in args.workloads.split(",")}
    Path(args.out).write_text(json.dumps(traces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
