"""vLLM 0.13's real ``Scheduler`` on a CPU, and a seeded workload to drive it with.

What benchmarks/bench_scheduler.py (the time of one step) and tests/vllm_loop.py (vLLM's
KV-cache manager against kvspec's, step by step) share. It needs vLLM, and imports it only
inside its functions, so that this module imports without it.

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
``reset_running_requests=True``), and the model samples tokens (``SimulatedModel``): each
request draws from its own ``random.Random`` seeded by the workload seed and the request id,
so a request's tokens do not depend on how it was scheduled; a request stops at EOS, at
``max_tokens`` or at the model length. Small ``num_gpu_blocks`` and
``max_num_batched_tokens`` bring preemption and chunked prefill.
"""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

BLOCK_SIZE = 16
VOCAB = 32_000
EOS_TOKEN_ID = 2
STAND_IN_ARCH = "KvspecLoopForCausalLM"



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
# that running requests are never preempted, and one too small, where allocate_slots refuses
# requests whose blocks have left the window (and frees those blocks first: D7,
# docs/findings.md).
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
