"""vLLM's real ``Scheduler`` on a CPU, 0.13 or 0.33, and a seeded workload to drive it with.

What benchmarks/bench_scheduler.py (the time of one step) and tests/vllm_loop.py (vLLM's
KV-cache code against kvspec's, step by step) share. It needs vLLM, and imports it only
inside its functions, so that this module imports without it. Each function serves the
release of vLLM this interpreter imports (``vllm_release()``), or the one it is given; where
the releases differ, the difference is written once, in the function that meets it, with why.

Building the scheduler on a CPU with nothing downloaded (``build_scheduler``): a folder holding
only a small ``config.json`` of a Llama model, read with ``skip_tokenizer_init=True``. Its
architecture is a stand-in registered with vLLM's ``ModelRegistry`` (``STAND_IN_ARCH``): vLLM
inspects a model's class when it builds a ``ModelConfig``, and inspecting
``LlamaForCausalLM`` imports vLLM's model code in a subprocess, which fails in
.venv-vllm-0.13.0 (no ``einops``) and takes seconds where it works; the scheduler never
touches the model. The ``KVCacheConfig`` is made here: one full-attention group, plus a
sliding-window group (``Workload.sliding_window``) or a Mamba group in align mode
(``Workload.mamba``, vLLM 0.33).

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
import importlib.metadata
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK_SIZE = 16
VOCAB = 32_000
EOS_TOKEN_ID = 2
STAND_IN_ARCH = "KvspecLoopForCausalLM"
RELEASES = ("0.13", "0.33")


class UnsupportedRelease(ValueError):
    """A vLLM release the scheduler loop and bench have no recipe for."""


def vllm_release(version: str | None = None) -> str:
    """``"0.13"`` or ``"0.33"``: the release of ``version``, or of the vLLM this interpreter
    has installed; `UnsupportedRelease` for any other."""
    if version is None:
        version = importlib.metadata.version("vllm")
    for release in RELEASES:
        if version == release or version.startswith(f"{release}."):
            return release
    raise UnsupportedRelease(f"vLLM {version!r}: the scheduler loop knows vLLM "
                             f"{' and '.join(f'{r}.x' for r in RELEASES)}")


@dataclass(frozen=True)
class Workload:
    """One seeded stream of engine events and the scheduler's shape. Ranges are inclusive."""

    name: str
    seed: int
    steps: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = BLOCK_SIZE
    # Tokens per block hash; below block_size vLLM 0.33 enables partial (sub-block) hits.
    hash_block_size: int = BLOCK_SIZE
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
    # Whether each request draws a LoRA adapter (with probability lora_rate). vLLM 0.33's loop
    # workloads were written without LoRA and make no such draw, so that their request
    # streams stay the ones compared (tests/vllm_loop.py).
    lora: bool = True
    lora_rate: float = 0.0
    salt_rate: float = 0.0
    sliding_window: int | None = None
    # A Mamba group beside full attention, in align mode (vLLM 0.33).
    mamba: bool = False
    kv_cache_metrics: bool = False
    kv_events: bool = True
    log_stats: bool = True


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


def make_kv_cache_config(workload: Workload) -> Any:
    """vLLM's ``KVCacheConfig``: a full-attention group, plus a sliding-window group or a
    Mamba group (align mode) if the workload asks."""
    import torch
    from vllm.v1 import kv_cache_interface as kv

    block_size = workload.block_size
    groups = [kv.KVCacheGroupSpec(["model.layers.0.attn"], kv.FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float16))]
    if workload.sliding_window is not None:
        groups.append(kv.KVCacheGroupSpec(["model.layers.1.attn"], kv.SlidingWindowSpec(
            block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float16,
            sliding_window=workload.sliding_window)))
    if workload.mamba:
        groups.append(kv.KVCacheGroupSpec(["model.layers.1.mixer"], kv.MambaSpec(
            block_size=block_size, shapes=((1, 1),), dtypes=(torch.float32,),
            mamba_cache_mode="align")))
    return kv.KVCacheConfig(num_blocks=workload.num_gpu_blocks, kv_cache_tensors=[],
                            kv_cache_groups=groups)


def build_scheduler(workload: Workload, model_dir: Path, release: str | None = None) -> Any:
    """vLLM's ``Scheduler`` for ``workload``, with the KV-cache code vLLM's modules hold now
    (vLLM's, or kvspec's once the plugin is installed: its ``KVCacheManager`` under 0.13,
    its ``BlockPool`` under 0.33)."""
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

    release = release or vllm_release()
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
    mamba: dict[str, Any] = {"mamba_cache_mode": "align"} if workload.mamba else {}
    cache_config = CacheConfig(block_size=workload.block_size, enable_prefix_caching=True,
                               **mamba)
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
    hashing: dict[str, Any] = {}
    if release == "0.33":
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

        # vLLM 0.33 finds each group's single-type manager in a registry that the engine
        # fills from the config before it builds the scheduler; 0.13 maps spec classes to
        # managers in a fixed table.
        register_all_kvcache_specs(vllm_config)
        # vLLM 0.33 hashes blocks in units of their own (hash_block_size), which may be finer
        # than a KV-cache block; 0.13 hashes whole blocks and takes no such argument.
        hashing["hash_block_size"] = workload.hash_block_size
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=make_kv_cache_config(workload),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=workload.block_size,
        log_stats=workload.log_stats,
        **hashing,
    )


def request_block_hasher(hash_block_size: int = BLOCK_SIZE) -> Callable[[Any], list[Any]]:
    """The block hasher of the ``kv_cache_utils`` vLLM's name resolves to now, seeded as
    vLLM's engine core seeds it (``init_none_hash`` with vLLM's sha256)."""
    from vllm.utils.hashing import sha256

    kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    kv_cache_utils.init_none_hash(sha256)
    hasher: Callable[[Any], list[Any]] = kv_cache_utils.get_request_block_hasher(
        hash_block_size, sha256)
    return hasher


def make_request(release: str, request_id: str, prompt: list[int], max_tokens: int,
                 arrival_time: float, block_hasher: Callable[[Any], list[Any]],
                 lora: Any = None, cache_salt: str | None = None, priority: int = 0) -> Any:
    """vLLM's ``Request`` as its engine hands it to the scheduler: sampling ``max_tokens``
    and stopping at ``EOS_TOKEN_ID``."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    if release == "0.13":
        # vLLM 0.13's Request takes the EOS token as an argument of its own.
        return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), None,
                       EOS_TOKEN_ID, arrival_time=arrival_time, lora_request=lora,
                       cache_salt=cache_salt, priority=priority, block_hasher=block_hasher)
    # vLLM 0.33's Request dropped that argument: it stops at the sampling parameters' EOS,
    # which the engine sets from the model's generation config, as done here.
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(request_id, prompt, params, None, arrival_time=arrival_time,
                   lora_request=lora, cache_salt=cache_salt, priority=priority,
                   block_hasher=block_hasher)


class RequestStream:
    """The requests of a workload, in arrival order, built as vLLM's ``Request``."""

    def __init__(self, workload: Workload, block_hasher: Callable[[Any], list[Any]],
                 release: str | None = None) -> None:
        self.workload = workload
        self.block_hasher = block_hasher
        self.release = release or vllm_release()
        self.rng = random.Random(f"{workload.seed}:prompts")
        self.prefixes = [self._tokens(self.rng.randint(*workload.prefix_tokens))
                         for _ in range(workload.num_prefixes)]
        self.popularity = [1.0 / (rank + 1) for rank in range(workload.num_prefixes)]
        self.prompts: list[list[int]] = []
        self.count = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, VOCAB) for _ in range(n)]

    def _lora(self) -> Any:
        """A LoRA adapter for the next request, or None."""
        if not self.workload.lora:
            return None
        from vllm.lora.request import LoRARequest

        if self.rng.random() >= self.workload.lora_rate:
            return None
        adapter = self.rng.randint(1, 2)
        return LoRARequest(f"adapter-{adapter}", adapter, f"/adapters/{adapter}")

    def next_request(self, arrival_time: float) -> Any:
        w, rng = self.workload, self.rng
        if self.prompts and rng.random() < w.repeat_prompt_rate:
            prompt = list(rng.choice(self.prompts))
        else:
            prefix = rng.choices(self.prefixes, weights=self.popularity)[0]
            prompt = prefix + self._tokens(rng.randint(*w.suffix_tokens))
        self.prompts.append(prompt)
        max_tokens = max(1, min(rng.randint(*w.max_tokens), w.max_model_len - len(prompt)))
        lora = self._lora()
        salt = f"tenant-{rng.randint(1, 2)}" if rng.random() < w.salt_rate else None
        priority = rng.randint(0, 3) if w.priority else 0
        request_id = f"r{self.count}"
        self.count += 1
        return make_request(self.release, request_id, prompt, max_tokens, arrival_time,
                            self.block_hasher, lora, salt, priority)


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
