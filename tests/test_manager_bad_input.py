"""Bad input to the KV-cache manager stack: a typed error naming the value, nothing changed.

Every refusal is checked against the conformance view (block lists, ref counts, free order,
keys) taken before the call, on impl/ and, where the spec has the operation, on the spec.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvspec.conformance.lockstep import Lockstep, Refused
from kvspec.conformance.manager_machine import (
    ImplManager,
    group_spec_of,
    hand_layout,
    view_of,
)
from kvspec.impl.hashing import get_request_block_hasher, sha256
from kvspec.impl.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from kvspec.impl.kv_cache_manager import (
    InvalidAllocationError,
    InvalidKVCacheConfig,
    KVCacheBlocks,
    KVCacheManager,
    Request,
    UnknownRequestError,
    UnsupportedKVCacheSpec,
)
from kvspec.spec import manager as model

BS = 4


def config(*specs: KVCacheSpec, num_blocks: int = 16) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, (), tuple(
        KVCacheGroupSpec((f"layer.{i}",), s) for i, s in enumerate(specs)))


def full(bs: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(bs, 1, 8, "float16")


def request(request_id: str, num_tokens: int, hashed: bool = True) -> Request:
    hasher = get_request_block_hasher(BS, sha256) if hashed else None
    return Request(request_id, list(range(num_tokens)), block_hasher=hasher)


def snapshot(manager: KVCacheManager) -> Any:
    pool = manager.block_pool
    blocks = list(pool.blocks)
    return (
        manager.get_block_ids("a"),
        [b.ref_cnt for b in blocks],
        [b.block_hash for b in blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
    )


@pytest.fixture
def running() -> tuple[KVCacheManager, Request]:
    """A manager with request "a" running (12 tokens, 3 blocks cached)."""
    manager = KVCacheManager(config(full()), max_model_len=64, hash_block_size=BS)
    a = request("a", 13)
    assert manager.allocate_slots(a, 13) is not None
    a.num_computed_tokens = 13
    return manager, a


def test_zero_new_tokens_is_refused(running: tuple[KVCacheManager, Request]) -> None:
    manager, a = running
    before = snapshot(manager)
    with pytest.raises(InvalidAllocationError, match="num_new_tokens must be greater than 0"):
        manager.allocate_slots(a, 0)
    with pytest.raises(ValueError, match="-3"):
        manager.allocate_slots(a, -3)
    assert snapshot(manager) == before


@pytest.mark.parametrize("name", ["num_new_computed_tokens", "num_lookahead_tokens",
                                  "num_encoder_tokens"])
def test_negative_token_counts_are_refused(running: tuple[KVCacheManager, Request],
                                           name: str) -> None:
    manager, a = running
    before = snapshot(manager)
    kwargs: dict[str, Any] = {name: -1}
    with pytest.raises(InvalidAllocationError, match=name):
        manager.allocate_slots(a, 1, **kwargs)
    assert snapshot(manager) == before


def test_spec_refuses_zero_new_tokens_too() -> None:
    state = model.new_manager(model.ManagerConfig(
        (group_spec_of(full()),), 8, 64, BS))
    view = model.RequestView("a", 4, 0, ())
    with pytest.raises(model.BadAllocation):
        model.allocate_slots(state, view, 0)


def test_hits_for_a_running_request_are_refused(running: tuple[KVCacheManager, Request]) -> None:
    manager, a = running
    b = request("b", 13)
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 12
    before = snapshot(manager)
    with pytest.raises(InvalidAllocationError, match="'a' already holds blocks"):
        manager.allocate_slots(a, 1, num_hit, hits)
    assert snapshot(manager) == before


def test_hits_with_the_wrong_number_of_groups_are_refused(
        running: tuple[KVCacheManager, Request]) -> None:
    manager, _ = running
    before = snapshot(manager)
    with pytest.raises(InvalidAllocationError, match="2 groups"):
        manager.allocate_slots(request("b", 5), 5, 0, KVCacheBlocks(((), ())))
    assert snapshot(manager) == before


def test_hits_with_caching_off_are_refused() -> None:
    cached = KVCacheManager(config(full()), max_model_len=64, hash_block_size=BS)
    a = request("a", 9)
    cached.allocate_slots(a, 9)
    cached.free(a)
    hits, _ = cached.get_computed_blocks(request("b", 9))
    uncached = KVCacheManager(config(full()), max_model_len=64, hash_block_size=BS,
                              enable_caching=False)
    before = snapshot(uncached)
    with pytest.raises(InvalidAllocationError, match="prefix caching is off"):
        uncached.allocate_slots(request("b", 9), 1, 8, hits)
    assert snapshot(uncached) == before


def test_request_without_block_hashes_is_refused_before_anything_changes() -> None:
    manager = KVCacheManager(config(full()), max_model_len=64, hash_block_size=BS)
    before = snapshot(manager)
    with pytest.raises(InvalidAllocationError, match="block_hasher"):
        manager.allocate_slots(request("a", 9, hashed=False), 9)
    assert snapshot(manager) == before


def test_unknown_request_on_free(running: tuple[KVCacheManager, Request]) -> None:
    manager, _ = running
    before = snapshot(manager)
    manager.free(request("ghost", 3))  # vLLM's scheduler frees never-scheduled requests
    assert snapshot(manager) == before
    strict = KVCacheManager(config(full()), max_model_len=64, hash_block_size=BS,
                            strict_free=True)
    a = request("a", 5)
    strict.allocate_slots(a, 5)
    before = snapshot(strict)
    with pytest.raises(UnknownRequestError, match="'ghost'"):
        strict.free(request("ghost", 3))
    with pytest.raises(LookupError):
        strict.free(request("ghost", 3))
    assert snapshot(strict) == before
    strict.free(a)
    with pytest.raises(UnknownRequestError, match="'a'"):
        strict.free(a)  # freed twice


def test_spec_strict_free_refuses_unknown_ids() -> None:
    state = model.new_manager(model.ManagerConfig((group_spec_of(full()),), 8, 64, BS))
    assert model.free(state, "ghost") == state
    with pytest.raises(model.UnknownRequest):
        model.free(state, "ghost", strict=True)


@dataclass(frozen=True)
class NovelSpec(KVCacheSpec):
    """A spec type no manager handles."""

    @property
    def page_size_bytes(self) -> int:
        return 1


def test_spec_type_no_manager_handles() -> None:
    with pytest.raises(UnsupportedKVCacheSpec, match="NovelSpec") as refused:
        KVCacheManager(config(NovelSpec(BS)), max_model_len=64, hash_block_size=BS)
    assert isinstance(refused.value, LookupError) and isinstance(refused.value, KeyError)
    with pytest.raises(LookupError):
        KVCacheManager(config(full(), NovelSpec(BS)), max_model_len=64, hash_block_size=BS,
                       enable_caching=False)


def test_block_size_must_equal_hash_block_size_with_one_group() -> None:
    with pytest.raises(InvalidKVCacheConfig, match="block size 8 must equal hash_block_size 4"):
        KVCacheManager(config(full(8)), max_model_len=64, hash_block_size=4)
    # Without prefix caching nothing is hashed, so any block size does.
    KVCacheManager(config(full(8)), max_model_len=64, hash_block_size=4, enable_caching=False)


def test_hybrid_block_sizes_must_be_multiples_of_the_hash_block_size() -> None:
    specs = (full(8), SlidingWindowSpec(6, 1, 8, "float16", sliding_window=4))
    with pytest.raises(InvalidKVCacheConfig, match="block size 6 of KV-cache group 1"):
        KVCacheManager(config(*specs), max_model_len=64, hash_block_size=4)
    with pytest.raises(model.BadConfig):
        model.new_manager(model.ManagerConfig(
            tuple(group_spec_of(s) for s in specs), 16, 64, 4))


def test_cross_attention_is_never_prefix_cached() -> None:
    specs = (full(), CrossAttentionSpec(BS, 1, 8, "float16"))
    with pytest.raises(InvalidKVCacheConfig, match="cross-attention"):
        KVCacheManager(config(*specs), max_model_len=64, hash_block_size=BS)
    manager = KVCacheManager(config(*specs), max_model_len=64, hash_block_size=BS,
                             enable_caching=False)
    a = request("a", 5)
    new = manager.allocate_slots(a, 5, num_encoder_tokens=9)
    assert new is not None and [len(g) for g in new.blocks] == [2, 3]


def test_sink_length_must_be_whole_blocks() -> None:
    with pytest.raises(InvalidKVCacheConfig, match="sink_len"):
        KVCacheManager(config(SinkFullAttentionSpec(BS, 1, 8, "float16", sink_len=6)),
                       max_model_len=64, hash_block_size=BS)
    manager = KVCacheManager(config(SinkFullAttentionSpec(BS, 1, 8, "float16", sink_len=8)),
                             max_model_len=64, hash_block_size=BS)
    assert manager.block_pool.get_num_free_blocks() == 16 - 1 - 2


def test_conformance_target_refuses_alike() -> None:
    """The spec and impl refuse the same zero-token call, and neither changes."""
    layout = hand_layout("bad input: one full group", lambda: (full(),), BS)
    target = ImplManager()
    run: Lockstep[model.Session] = Lockstep(model.step, target)
    run(model.NewManager(model.ManagerConfig((group_spec_of(full()),), 8, 64, BS),
                         target.hashing(), layout.name))
    run(model.AddRequest("a", tuple(range(6))))
    refused = run(model.AllocateSlots("a", 0))
    assert isinstance(refused, Refused) and refused.base == "ValueError"
    assert run.state is not None and target.view() == view_of(run.state)


def test_refusals_work_under_python_dash_o() -> None:
    """No input check is an assert: -O strips asserts, and the errors must still come."""
    script = (
        "from kvspec.impl.kv_cache_interface import *\n"
        "from kvspec.impl.kv_cache_manager import KVCacheManager, Request, InvalidAllocationError\n"
        "c = KVCacheConfig(8, (), (KVCacheGroupSpec(('l',), "
        "FullAttentionSpec(4, 1, 8, 'float16')),))\n"
        "m = KVCacheManager(c, max_model_len=64, hash_block_size=4)\n"
        "try:\n"
        "    m.allocate_slots(Request('a', [1, 2]), 0)\n"
        "except InvalidAllocationError:\n"
        "    print('refused')\n"
    )
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-O", "-c", script], cwd=root, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.stdout.strip() == "refused", result.stderr
