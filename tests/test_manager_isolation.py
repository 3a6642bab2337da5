"""Isolation: requests with different cache_salt or LoRA adapter never share a cached block.

The block hash chain carries the LoRA name in every block and the cache salt in the first, so
a prefix cached under one (salt, LoRA) identity must never be a hit for another, however the
prompts overlap and whatever was evicted in between.
"""

from __future__ import annotations

from hypothesis import event, given, strategies as st

from kvspec.impl.hashing import get_request_block_hasher, sha256
from kvspec.impl.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from kvspec.impl.kv_cache_manager import KVCacheManager
from kvspec.impl.request import LoRARequest, Request

BS = 2
SALTS = (None, "tenant-a", "tenant-b")
LORAS = (None, 1, 2)

identities = st.tuples(st.sampled_from(SALTS), st.sampled_from(LORAS))
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=12)
steps = st.lists(st.tuples(identities, prompts, st.booleans()), min_size=2, max_size=12)


def make_manager(hybrid: bool) -> KVCacheManager:
    specs: list[KVCacheSpec] = [FullAttentionSpec(BS, 1, 8, "float16")]
    if hybrid:
        specs.append(SlidingWindowSpec(BS, 1, 8, "float16", sliding_window=3))
    config = KVCacheConfig(24, (), tuple(
        KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)))
    return KVCacheManager(config, max_model_len=64, hash_block_size=BS)


@given(steps=steps, hybrid=st.booleans())
def test_no_block_is_shared_across_identities(
        steps: list[tuple[tuple[str | None, int | None], list[int], bool]],
        hybrid: bool) -> None:
    manager = make_manager(hybrid)
    hasher = get_request_block_hasher(BS, sha256)
    keyed_by: dict[bytes, tuple[str | None, int | None]] = {}
    running: list[tuple[Request, tuple[str | None, int | None]]] = []
    for index, (identity, prompt, keep) in enumerate(steps):
        salt, lora = identity
        request = Request(
            f"r{index}", prompt, cache_salt=salt, block_hasher=hasher,
            lora_request=None if lora is None else LoRARequest(f"adapter-{lora}", lora),
        )
        hits, num_hit = manager.get_computed_blocks(request)
        for group in hits.blocks:
            for block in group:
                if block.is_null:
                    continue
                assert keyed_by[block.block_hash] == identity, (  # type: ignore[index]
                    f"{identity} hit a block cached by {keyed_by[block.block_hash]}")  # type: ignore[index]
        if num_hit:
            event("prefix hit")
        new = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
        if new is None:
            event("pool full")
            continue
        for group in manager.get_blocks(request.request_id).blocks:
            for block in group:
                if block.block_hash is not None:
                    keyed_by.setdefault(block.block_hash, identity)
                    assert keyed_by[block.block_hash] == identity
        for other, other_identity in running:
            if other_identity != identity:
                mine = {id(b) for g in manager.get_blocks(request.request_id).blocks
                        for b in g if not b.is_null}
                theirs = {id(b) for g in manager.get_blocks(other.request_id).blocks
                          for b in g if not b.is_null}
                assert not mine & theirs
        if keep:
            running.append((request, identity))
        else:
            manager.free(request)


def test_same_tokens_different_salt_or_lora_miss() -> None:
    manager = make_manager(hybrid=False)
    hasher = get_request_block_hasher(BS, sha256)
    prompt = list(range(9))
    first = Request("first", prompt, block_hasher=hasher)
    manager.allocate_slots(first, 9)
    manager.free(first)
    twin = Request("twin", prompt, block_hasher=hasher)
    assert manager.get_computed_blocks(twin)[1] == 8
    salted = Request("salted", prompt, cache_salt="s", block_hasher=hasher)
    adapted = Request("adapted", prompt, block_hasher=hasher,
                      lora_request=LoRARequest("adapter", 3))
    assert manager.get_computed_blocks(salted)[1] == 0
    assert manager.get_computed_blocks(adapted)[1] == 0
