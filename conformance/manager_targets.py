"""Manager adapters for vLLM's own KVCacheManager (`kvspec audit --layer manager`).

`Vllm033Manager` does the same for vLLM 0.33's KVCacheManager (``--profile vllm-0.33``): its
constructor takes the scheduler's block size, its lookup returns a third output (the shared
prefix boundary), its ``allocate_slots`` takes its arguments past the hits by keyword, and
``new_step_starts`` opens a scheduler step. Built with ``pool_path``, its managers run over
another BlockPool class (kvspec's, as the plugin installs it).

`Vllm013Manager` performs `spec.manager` commands on vLLM 0.13's KVCacheManager: the calls and
the view are `manager_machine.ImplManager`'s (the API is the same); the KV-cache config, the
requests (and their block hasher, LoRA requests, sampling parameters) and the hash function are
vLLM's own. vLLM 0.13 writes extra keys untagged (the bare LoRA name and salt), so the spec
hashes that way for it; its chain seed comes from ``PYTHONHASHSEED`` as impl's does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from kvspec.conformance.lockstep import NOTHING, Call, Reader, method
from kvspec.conformance.manager_machine import (
    HASH_SEED,
    ImplManager,
    block_ids_or_none,
    hits_arg,
    kv_cache_config,
    request_arg,
    seed_none_hash,
    variable_name,
)
from kvspec.conformance.targets import ids
from kvspec.conformance.vllm_targets import VLLM_MANAGER, vllm_kv_cache_config
from kvspec.spec import hashing as hashing_model, manager as model

MAX_TOKENS = 1 << 20  # the sampling parameters' max_tokens: never the reason a request stops


class Vllm013Manager(ImplManager):
    """vLLM 0.13's KVCacheManager (or a fork's class of the same API, ``manager_path``)."""

    manager_path = VLLM_MANAGER

    def hashing(self) -> model.Hashing:
        return model.Hashing(hashing_model.KeyFormat.UNTAGGED, HASH_SEED)

    def seed(self, hashing: model.Hashing) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash

        seed_none_hash(init_none_hash, sha256, hashing.hash_seed)

    def _manager_class(self) -> Any:
        from kvspec.conformance.vllm_targets import load_class

        return load_class(self.manager_path)

    def new_manager(self, command: model.NewManager) -> Any:
        c = command.config
        return self._manager_class()(
            vllm_kv_cache_config(kv_cache_config(command.layout, c.num_blocks)),
            max_model_len=c.max_model_len, hash_block_size=c.hash_block_size,
            enable_caching=c.enable_caching, use_eagle=c.use_eagle,
            enable_kv_cache_events=c.enable_events)

    def new_request(self, command: model.AddRequest) -> Any:
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        lora = command.lora
        return Request(
            command.request_id, list(command.prompt), SamplingParams(max_tokens=MAX_TOKENS),
            None, None,
            lora_request=None if lora is None else LoRARequest(
                model.lora_name(lora), lora, model.lora_path(lora)),
            cache_salt=command.salt,
            block_hasher=get_request_block_hasher(self.hash_block_size, sha256))

    def stand_in(self, request_id: str) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(request_id=request_id)

    # -- counterexamples -------------------------------------------------------------------

    def imports(self) -> list[str]:
        module_name, _, class_name = self.manager_path.partition(":")
        return ["from types import SimpleNamespace",
                "",
                "from vllm.lora.request import LoRARequest",
                "from vllm.sampling_params import SamplingParams",
                "from vllm.utils.hashing import sha256",
                "from vllm.v1.core.kv_cache_utils import get_request_block_hasher, "
                "init_none_hash",
                "from vllm.v1.request import Request",
                f"from {module_name} import {class_name} as KVCacheManager",
                *self.checker_imports(),
                "from kvspec.conformance.vllm_targets import vllm_kv_cache_config"]

    def config_source(self, command: model.NewManager) -> str:
        return f"vllm_kv_cache_config({super().config_source(command)})"

    def request_source(self, command: model.AddRequest) -> str:
        lora = "None" if command.lora is None else (
            f"LoRARequest({model.lora_name(command.lora)!r}, {command.lora}, "
            f"{model.lora_path(command.lora)!r})")
        return (f"Request({command.request_id!r}, {list(command.prompt)!r}, "
                f"SamplingParams(max_tokens={MAX_TOKENS}), None, None, lora_request={lora}, "
                f"cache_salt={command.salt!r}, "
                f"block_hasher=get_request_block_hasher({self.hash_block_size}, sha256))")

    def stand_in_source(self, request_id: str) -> str:
        return f"SimpleNamespace(request_id={request_id!r})"


def hit_ids_033(result: Any) -> tuple[tuple[tuple[int, ...], ...], int, int]:
    """vLLM 0.33's get_computed_blocks (KVCacheBlocks, num_tokens, shared_prefix_boundary) as
    block ids per group."""
    blocks, num_tokens, boundary = result
    return tuple(ids(g) for g in blocks.blocks), num_tokens, boundary


def _get_computed_blocks_033(adapter: Any, c: model.GetComputedBlocks) -> Any:
    result = adapter.manager.get_computed_blocks(adapter.requests[c.request_id])
    adapter.hits[c.request_id] = result[0]
    return result


def _pop_blocks_for_free(adapter: Any, c: model.PopBlocksForFree) -> Any:
    """The scheduler's deferred free (sched/scheduler.py ``_free_request_blocks``): the
    popped blocks wait in the adapter's queue until the drain."""
    popped = adapter.manager.pop_blocks_for_free(adapter.requests[c.request_id])
    if popped:
        adapter.deferred.append(popped)
    return popped


def _drain_deferred_frees(adapter: Any, c: model.DrainDeferredFrees) -> None:
    """``_drain_deferred_frees``: every batch back to the pool, reversed, in pop order."""
    for batch in adapter.deferred:
        adapter.manager.block_pool.free_blocks(reversed(batch))
    adapter.deferred.clear()


def _allocate_slots_033(adapter: Any, c: model.AllocateSlots) -> Any:
    hits = hits_arg(adapter, c)
    return adapter.manager.allocate_slots(
        adapter.requests[c.request_id], c.num_new_tokens, c.num_new_computed_tokens,
        None if hits is None else hits.get(), num_lookahead_tokens=c.num_lookahead_tokens,
        delay_cache_blocks=c.delay_cache_blocks, num_encoder_tokens=c.num_encoder_tokens)


def _allocate_slots_033_source(adapter: Any, c: model.AllocateSlots) -> str:
    hits = hits_arg(adapter, c)
    return (f"manager.allocate_slots({request_arg(adapter, c.request_id).source}, "
            f"{c.num_new_tokens}, {c.num_new_computed_tokens}, "
            f"{'None' if hits is None else hits.source}, "
            f"num_lookahead_tokens={c.num_lookahead_tokens}, "
            f"delay_cache_blocks={c.delay_cache_blocks}, "
            f"num_encoder_tokens={c.num_encoder_tokens})")


def _new_manager_033_source(adapter: Any, c: model.NewManager) -> str:
    adapter.hash_block_size = c.config.hash_block_size
    adapter.written = []
    k = c.config
    return (f"seed_none_hash(init_none_hash, sha256, {c.hashing.hash_seed!r}) or "
            f"register_033_managers() or KVCacheManager(\n        "
            f"vllm_033_kv_cache_config(kv_cache_config({c.layout!r}, {k.num_blocks}), "
            f"{k.enable_caching}), max_model_len={k.max_model_len}, "
            f"scheduler_block_size={k.alignment}, hash_block_size={k.hash_block_size},\n"
            f"        enable_caching={k.enable_caching}, use_eagle={k.use_eagle}, "
            f"enable_kv_cache_events={k.enable_events})")


class Vllm033Manager(Vllm013Manager):
    """vLLM 0.33's KVCacheManager, over vLLM's BlockPool or (``pool_path``) another class
    with 0.33's pool API, which the coordinator builds in place of vLLM's."""

    pool_path: str | None = None

    def __init__(self, policy_path: str | None = None) -> None:
        super().__init__(policy_path)
        self.deferred: list[Any] = []  # batches popped for a deferred free, not yet drained

    def hashing(self) -> model.Hashing:
        # 0.33 tags its extra keys (LoRA name, salt) as kvspec does.
        return model.Hashing(hashing_model.KeyFormat.TAGGED, HASH_SEED)

    def new_manager(self, command: model.NewManager) -> Any:
        from kvspec.conformance import vllm_targets

        vllm_targets.register_033_managers()
        self.deferred = []
        c = command.config
        arguments = dict(
            max_model_len=c.max_model_len, scheduler_block_size=c.alignment,
            hash_block_size=c.hash_block_size, enable_caching=c.enable_caching,
            use_eagle=c.use_eagle, enable_kv_cache_events=c.enable_events)
        config = vllm_targets.vllm_033_kv_cache_config(
            kv_cache_config(command.layout, c.num_blocks), c.enable_caching)
        with self._pool_in_place():
            return self._manager_class()(config, **arguments)

    def _pool_in_place(self) -> Any:
        """The coordinator builds its pool from the module global it imported
        (kv_cache_coordinator.BlockPool): patched for the call, as the plugin replaces the
        module vLLM imports it from."""
        import contextlib
        from unittest import mock

        if self.pool_path is None:
            return contextlib.nullcontext()
        from functools import partial

        from kvspec.conformance.vllm_targets import load_class

        pool_class = load_class(self.pool_path)
        return mock.patch("vllm.v1.core.kv_cache_coordinator.BlockPool",
                          partial(pool_class, vllm_api="0.33"))

    calls: ClassVar[dict[type, Call]] = {
        **ImplManager.calls,
        model.GetComputedBlocks: Call(_get_computed_blocks_033, lambda a, c: (
            f"(hits_{variable_name(c.request_id)} := manager.get_computed_blocks("
            f"{variable_name(c.request_id)}))"), Reader(hit_ids_033, "hit_ids_033({})")),
        model.AllocateSlots: Call(_allocate_slots_033, _allocate_slots_033_source,
                                  Reader(block_ids_or_none, "block_ids_or_none({})")),
        model.NewStep: method("new_step_starts", read=NOTHING),
        model.PopBlocksForFree: Call(_pop_blocks_for_free, lambda a, c: (
            f"deferred.append(manager.pop_blocks_for_free({variable_name(c.request_id)}))"),
            Reader(ids, "ids({})")),
        model.DrainDeferredFrees: Call(_drain_deferred_frees, lambda a, c: (
            "[manager.block_pool.free_blocks(reversed(batch)) for batch in deferred] and "
            "deferred.clear()"), NOTHING),
        model.NewManager: Call(ImplManager.calls[model.NewManager].run, _new_manager_033_source),
    }

    def imports(self) -> list[str]:
        found = [*super().imports(), "",
                 "deferred: list = []  # batches popped for a deferred free, not yet drained"]
        if self.pool_path is not None:  # the counterexample builds its managers over this pool
            found.append("# run under: mock.patch('vllm.v1.core.kv_cache_coordinator.BlockPool', "
                         f"partial({self.pool_path.replace(':', '.')}, vllm_api='0.33'))")
        return found

    def checker_imports(self) -> list[str]:
        return [*super().checker_imports(),
                "from kvspec.conformance.manager_targets import hit_ids_033",
                "from kvspec.conformance.vllm_targets import register_033_managers, "
                "vllm_033_kv_cache_config"]


def kvspec_pool_under_033(pool_path: str = "kvspec.impl.block_pool:BlockPool"
                          ) -> Callable[[], Vllm033Manager]:
    """An adapter maker: vLLM 0.33's managers over kvspec's pool (what ``install()`` runs)."""
    def make() -> Vllm033Manager:
        adapter = Vllm033Manager()
        adapter.pool_path = pool_path
        return adapter
    return make
