"""Manager adapters for vLLM's own KVCacheManager (`kvspec audit --layer manager`).

`Vllm013Manager` performs `spec.manager` commands on vLLM 0.13's KVCacheManager: the calls and
the view are `manager_machine.ImplManager`'s (the API is the same); the KV-cache config, the
requests (and their block hasher, LoRA requests, sampling parameters) and the hash function are
vLLM's own. vLLM 0.13 writes extra keys untagged (the bare LoRA name and salt), so the spec
hashes that way for it; its chain seed comes from ``PYTHONHASHSEED`` as impl's does.
"""

from __future__ import annotations

from typing import Any

from kvspec.conformance.manager_machine import (
    HASH_SEED,
    ImplManager,
    kv_cache_config,
    seed_none_hash,
)
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
