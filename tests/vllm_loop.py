"""vLLM 0.13's real ``Scheduler`` driven step by step, with simulated model outputs.

The driver behind tests/test_vllm_scheduler_loop.py (vLLM's KV-cache manager against
kvspec's, step by step) and benchmarks/bench_scheduler.py (the time of one step). It needs
vLLM, and imports it only inside its functions, so that this module imports without it.

Building the scheduler on a CPU with nothing downloaded (``build_scheduler``): a folder holding
only a small ``config.json`` of a Llama model, read with ``skip_tokenizer_init=True``. Its
architecture is a stand-in registered with vLLM's ``ModelRegistry`` (``STAND_IN_ARCH``): vLLM
inspects a model's class when it builds a ``ModelConfig``, and inspecting
``LlamaForCausalLM`` imports vLLM's model code in a subprocess, which fails in
.venv-vllm-0.13.0 (no ``einops``) and takes seconds where it works; the scheduler never
touches the model. The ``KVCacheConfig`` is made here: one full-attention group, or a
full-attention and a sliding-window group (``Workload.sliding_window``).

A workload (``Workload``) is a seeded stream of what happens to an engine: requests arrive
with prompts that share popular prefixes (some repeat an earlier prompt exactly, some carry a
LoRA adapter or a cache salt), requests are aborted (``finish_requests(...,
FINISHED_ABORTED)``), the prefix cache is reset (``reset_prefix_cache()``, sometimes with
``reset_running_requests=True``), and the model samples tokens: each request draws from its own
``random.Random`` seeded by the workload seed and the request id, so a request's tokens do not
depend on how it was scheduled; a request stops at EOS, at ``max_tokens`` or at the model
length. Small ``num_gpu_blocks`` and ``max_num_batched_tokens`` bring preemption and chunked
prefill. One step is what vLLM's engine core does: ``schedule()`` then
``update_from_output()`` (skipped, as the engine skips it, while the scheduler has nothing).

``run_trace`` records, per step, what the KV-cache manager decides and the scheduler passes
on (``StepRecord``: block ids, computed and scheduled tokens, preempted and finished ids,
common-prefix blocks, KV events, usage, prefix-cache stats, eviction samples, outputs, and
the whole block table of every running request after the step) as
plain JSON-able values, plus two views of the manager used to explain known differences
(``empty_table_entries``; with a sliding-window group, ``RefusalWatcher``'s refusals that
freed blocks); ``first_difference`` compares two traces.

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
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

BLOCK_SIZE = 16
VOCAB = 32_000
EOS_TOKEN_ID = 2
STAND_IN_ARCH = "KvspecLoopForCausalLM"

StepRecord = dict[str, Any]
VLLM_REFUSAL_ORDER = "+vllm-refusal-order"  # suffix of the traces main() adds for it


@dataclass(frozen=True)
class Workload:
    """One seeded stream of engine events and the scheduler's shape. Ranges are inclusive."""

    name: str
    seed: int
    steps: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
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
    lora_rate: float = 0.0
    salt_rate: float = 0.0
    sliding_window: int | None = None
    kv_cache_metrics: bool = False
    kv_events: bool = True
    log_stats: bool = True


SHAPES: tuple[Workload, ...] = (
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
)
# A full-attention group and a sliding-window group sharing one pool: a pool large enough
# that running requests are never preempted, and one too small (see the test for why).
HYBRID_SHAPES: tuple[Workload, ...] = (
    Workload("hybrid", seed=0, steps=1000, num_gpu_blocks=200, max_num_seqs=8,
             max_num_batched_tokens=64, prefix_tokens=(16, 128), suffix_tokens=(1, 40),
             max_tokens=(4, 96), max_model_len=512, arrivals_per_step=0.5, quiet_every=160,
             quiet_steps=70, reset_rate=0.05, sliding_window=48),
    Workload("hybrid-preempt", seed=0, steps=1000, num_gpu_blocks=96, max_num_seqs=12,
             max_num_batched_tokens=64, prefix_tokens=(16, 128), suffix_tokens=(1, 40),
             max_tokens=(4, 96), max_model_len=512, arrivals_per_step=0.5, quiet_every=160,
             quiet_steps=70, reset_rate=0.05, sliding_window=48),
)
SEEDS = (1, 2, 3)


def _seeded(shapes: tuple[Workload, ...]) -> dict[str, Workload]:
    return {f"{shape.name}-{seed}": replace(shape, name=f"{shape.name}-{seed}", seed=seed)
            for shape in shapes for seed in SEEDS}


WORKLOADS = _seeded(SHAPES)
HYBRID_WORKLOADS = _seeded(HYBRID_SHAPES)
ALL_WORKLOADS = {**WORKLOADS, **HYBRID_WORKLOADS}


# -- building the scheduler -------------------------------------------------------------------


def write_model_config(folder: Path) -> Path:
    """A small Llama ``config.json`` in ``folder`` (which becomes the model path)."""
    config = {
        "architectures": [STAND_IN_ARCH],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "float16",
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def register_stand_in_model() -> None:
    """Register ``STAND_IN_ARCH``: a text-generation model class with nothing in it."""
    from torch import nn
    from vllm import ModelRegistry

    if STAND_IN_ARCH in ModelRegistry.get_supported_archs():
        return

    class StandIn(nn.Module):
        """The methods by which vLLM recognises a text-generation model; never called."""

        def forward(self, input_ids: Any, positions: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

        def compute_logits(self, hidden_states: Any) -> Any:
            raise NotImplementedError

        def embed_input_ids(self, input_ids: Any) -> Any:
            raise NotImplementedError

        def get_input_embeddings(self, input_ids: Any) -> Any:
            raise NotImplementedError

    StandIn.__name__ = StandIn.__qualname__ = STAND_IN_ARCH
    ModelRegistry.register_model(STAND_IN_ARCH, StandIn)


def make_kv_cache_config(num_blocks: int, sliding_window: int | None = None) -> Any:
    """vLLM's ``KVCacheConfig``: a full-attention group, plus a sliding-window one if asked."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    groups = [KVCacheGroupSpec(["model.layers.0.attn"],
                               FullAttentionSpec(BLOCK_SIZE, 2, 16, torch.float16))]
    if sliding_window is not None:
        groups.append(KVCacheGroupSpec(
            ["model.layers.1.attn"],
            SlidingWindowSpec(BLOCK_SIZE, 2, 16, torch.float16, sliding_window=sliding_window)))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def build_scheduler(workload: Workload, model_dir: Path) -> Any:
    """vLLM's ``Scheduler`` for ``workload``, with whichever ``KVCacheManager`` its module
    holds now (vLLM's, or kvspec's once the plugin is installed)."""
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
    from vllm.v1.structured_output import StructuredOutputManager

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
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
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
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=make_kv_cache_config(workload.num_gpu_blocks, workload.sliding_window),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=workload.log_stats,
    )


def request_block_hasher() -> Callable[[Any], list[Any]]:
    """The block hasher of the ``kv_cache_utils`` vLLM's name resolves to now, seeded as
    vLLM's engine core seeds it (``init_none_hash`` with vLLM's sha256)."""
    from vllm.utils.hashing import sha256

    kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    kv_cache_utils.init_none_hash(sha256)
    hasher: Callable[[Any], list[Any]] = kv_cache_utils.get_request_block_hasher(
        BLOCK_SIZE, sha256)
    return hasher


class RefusalWatcher:
    """Forwards everything to a KV-cache manager, noting each refused ``allocate_slots`` that
    changed the number of free blocks: vLLM 0.13's ``allocate_slots`` frees a sliding-window
    request's out-of-window blocks (``remove_skipped_blocks``) before its capacity check, even
    when it then refuses; kvspec's refusal changes nothing.

    ``vllm_refusal_order=True`` puts vLLM 0.13's order in front of kvspec's manager: it calls
    the coordinator's ``remove_skipped_blocks`` first, as vLLM 0.13's ``allocate_slots`` does,
    so that a trace can be compared with vLLM's past such a refusal."""

    def __init__(self, manager: Any, vllm_refusal_order: bool = False) -> None:
        self.manager = manager
        self.vllm_refusal_order = vllm_refusal_order
        self.refusals: list[list[Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)

    def allocate_slots(self, request: Any, num_new_tokens: int, *args: Any,
                       **kwargs: Any) -> Any:
        pool = self.manager.block_pool
        free_before = pool.get_num_free_blocks()
        if self.vllm_refusal_order and num_new_tokens > 0:
            self.manager.coordinator.remove_skipped_blocks(request.request_id,
                                                           request.num_computed_tokens)
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


class RequestStream:
    """The requests of a workload, in arrival order, built as vLLM's ``Request``."""

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
        from vllm.lora.request import LoRARequest
        from vllm.v1.request import Request

        w, rng = self.workload, self.rng
        if self.prompts and rng.random() < w.repeat_prompt_rate:
            prompt = list(rng.choice(self.prompts))
        else:
            prefix = rng.choices(self.prefixes, weights=self.popularity)[0]
            prompt = prefix + self._tokens(rng.randint(*w.suffix_tokens))
        self.prompts.append(prompt)
        max_tokens = max(1, min(rng.randint(*w.max_tokens), w.max_model_len - len(prompt)))
        lora = None
        if rng.random() < w.lora_rate:
            adapter = rng.randint(1, 2)
            lora = LoRARequest(f"adapter-{adapter}", adapter, f"/adapters/{adapter}")
        salt = f"tenant-{rng.randint(1, 2)}" if rng.random() < w.salt_rate else None
        priority = rng.randint(0, 3) if w.priority else 0
        request_id = f"r{self.count}"
        self.count += 1
        return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), None,
                       EOS_TOKEN_ID, arrival_time=arrival_time, lora_request=lora,
                       cache_salt=salt, priority=priority, block_hasher=self.block_hasher)


class SimulatedModel:
    """Sampled tokens: one per request whose prompt is computed once this step ends, drawn
    from that request's own seeded stream (EOS with probability ``eos_rate``)."""

    def __init__(self, seed: int, eos_rate: float) -> None:
        self.seed = seed
        self.eos_rate = eos_rate
        self.streams: dict[str, random.Random] = {}

    def sample(self, request_id: str) -> int:
        stream = self.streams.get(request_id)
        if stream is None:
            stream = self.streams[request_id] = random.Random(f"{self.seed}:{request_id}")
        if stream.random() < self.eos_rate:
            return EOS_TOKEN_ID
        return stream.randrange(3, VOCAB)

    def output(self, scheduler: Any, scheduler_output: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            # schedule() has already advanced num_computed_tokens by the scheduled tokens.
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([self.sample(req_id)] if done else [])
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, logprobs=None,
                                 prompt_logprobs_dict={}, pooler_output=[])


class Engine:
    """A scheduler, the workload's request stream and model: ``step()`` is one engine step."""

    def __init__(self, workload: Workload, scheduler: Any,
                 block_hasher: Callable[[Any], list[Any]],
                 vllm_refusal_order: bool = False) -> None:
        self.workload = workload
        self.scheduler = scheduler
        self.publisher = RecordingPublisher()
        scheduler.kv_event_publisher = self.publisher
        self.manager = scheduler.kv_cache_manager
        self.watcher: RefusalWatcher | None = None
        if workload.sliding_window is not None:
            self.watcher = RefusalWatcher(self.manager, vllm_refusal_order)
            scheduler.kv_cache_manager = self.watcher
        self.stream = RequestStream(workload, block_hasher)
        self.model = SimulatedModel(workload.seed, workload.eos_rate)
        self.rng = random.Random(f"{workload.seed}:actions")
        self.step_index = 0

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
        record["tables"] = {request.request_id: _plain(
            self.manager.get_block_ids(request.request_id)) for request in scheduler.running}
        record["kv_events"] = [plain_event(event) for event in self.publisher.events]
        self.publisher.events.clear()
        return record


# -- what is recorded -------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """JSON-able: bytes as hex, sequences and sets as lists, enums by name."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot record a {type(value).__name__}: {value!r}")


def plain_event(event: Any) -> list[Any]:
    """A KV event as ``[class name, {field: value}]`` (msgspec structs or dataclasses)."""
    names = getattr(event, "__struct_fields__", None)
    if names is None:
        names = tuple(f.name for f in fields(event))
    return [type(event).__name__, {name: _plain(getattr(event, name)) for name in names}]


def scheduled_record(out: Any) -> StepRecord:
    cached = out.scheduled_cached_reqs
    return {
        "new": [[r.req_id, _plain(r.block_ids), r.num_computed_tokens]
                for r in out.scheduled_new_reqs],
        "cached": [[req_id, req_id in cached.resumed_req_ids, _plain(new_blocks), computed]
                   for req_id, new_blocks, computed in zip(
                       cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                       strict=True)],
        "num_scheduled_tokens": dict(out.num_scheduled_tokens),
        "num_common_prefix_blocks": _plain(out.num_common_prefix_blocks),
        "preempted": _plain(out.preempted_req_ids or set()),
        "finished": _plain(out.finished_req_ids),
    }


def outputs_record(engine_outputs: dict[int, Any]) -> StepRecord:
    outputs: list[list[Any]] = []
    stats = None
    for client in sorted(engine_outputs):
        batch = engine_outputs[client]
        outputs.extend([o.request_id, list(o.new_token_ids), _plain(o.finish_reason),
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


def run_trace(workload: Workload, vllm_refusal_order: bool = False) -> dict[str, Any]:
    """Every step of ``workload`` on a scheduler built now: ``{"manager": module of the
    KV-cache manager class, "steps": [StepRecord, ...]}`` (``vllm_refusal_order``: see
    ``RefusalWatcher``)."""
    with tempfile.TemporaryDirectory(prefix="kvspec-loop-") as tmp:
        scheduler = build_scheduler(workload, Path(tmp) / "model")
        engine = Engine(workload, scheduler, request_block_hasher(), vllm_refusal_order)
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
    parser.add_argument("--vllm-refusal-order", action="store_true",
                        help="also trace each sliding-window workload with vLLM 0.13's order "
                             "of freeing before a refusal, as NAME+vllm-refusal-order")
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
        workload = ALL_WORKLOADS[name]
        traces[name] = run_trace(workload)
        if args.vllm_refusal_order and workload.sliding_window is not None:
            traces[f"{name}{VLLM_REFUSAL_ORDER}"] = run_trace(workload, vllm_refusal_order=True)
    Path(args.out).write_text(json.dumps(traces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
