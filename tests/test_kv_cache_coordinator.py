"""impl/kv_cache_coordinator.py: the coordinators, one single-type manager per KV-cache group
over one shared pool.

* the configs a coordinator refuses when it is built (through ``KVCacheManager``, as vLLM
  builds it);
* a refused call changes no group: every public method checks its arguments for all groups
  before the first group changes, so a value only the last group refuses leaves the first
  as it was;
* the ``..._unchecked`` twins (docs/architecture.md, "Checked once"): each does what its
  public method does on arguments that pass the checks, and the twins are exactly the
  operations whose checks read the stack's state or scan a list; the others have none and
  refuse a bad request id themselves.

tests/hostile/test_manager.py throws every kind of bad value at every public method of the
coordinators (after random scheduler runs over real layouts); the tests here pin the rules
on small hand-made states.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvspec.conformance.manager_machine import group_spec_of
from kvspec.impl.block_pool import BlockPool
from kvspec.impl.hashing import get_request_block_hasher, sha256
from kvspec.impl.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from kvspec.impl.kv_cache_interface import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from kvspec.impl.kv_cache_manager import (
    InvalidKVCacheConfig,
    InvalidManagerArgument,
    KVCacheManager,
    Request,
)
from kvspec.spec import manager as model

BS = 4

# The operations with an ``..._unchecked`` twin: those whose public method's checks read the
# stack's state or scan a list (docs/architecture.md, "Checked once"). A new twin is a
# decision to write down there, not a habit.
TWINS = {
    "get_num_blocks_to_allocate", "get_max_num_blocks_to_allocate", "num_blocks_freed_by_skip",
    "remove_skipped_blocks", "save_new_computed_blocks", "allocate_new_blocks",
    "cache_blocks", "find_longest_cache_hit",
}
COORDINATORS = (KVCacheCoordinator, KVCacheCoordinatorNoPrefixCache,
                UnitaryKVCacheCoordinator, HybridKVCacheCoordinator)


def config(*specs: KVCacheSpec, num_blocks: int = 16) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, (), tuple(
        KVCacheGroupSpec((f"layer.{i}",), s) for i, s in enumerate(specs)))


def full(bs: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(bs, 1, 8, "float16")


def window(bs: int = BS) -> SlidingWindowSpec:
    return SlidingWindowSpec(bs, 1, 8, "float16", sliding_window=5)


def request(request_id: str, num_tokens: int, hashed: bool = True) -> Request:
    hasher = get_request_block_hasher(BS, sha256) if hashed else None
    return Request(request_id, list(range(num_tokens)), block_hasher=hasher)


def coordinator(*specs: KVCacheSpec, num_blocks: int = 16,
                caching: bool = True) -> KVCacheCoordinator:
    return get_kv_cache_coordinator(config(*specs, num_blocks=num_blocks), max_model_len=64,
                                    use_eagle=False, enable_caching=caching,
                                    enable_kv_cache_events=False, dcp_world_size=1,
                                    pcp_world_size=1, hash_block_size=BS)


def snapshot(c: KVCacheCoordinator) -> Any:
    """Every group's tables (by block id) and the pool: ref counts, keys, free order."""
    pool = c.block_pool
    return (
        [({rid: [b.block_id for b in blocks] for rid, blocks in m.req_to_blocks.items()},
          dict(m.num_cached_block)) for m in c.single_type_managers],
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
    )


# ---------------------------------------------------------------------- configs refused


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


# ---------------------------------------------------------------------- a refusal changes no group


def test_a_value_only_the_last_group_refuses_leaves_the_first_as_it_was() -> None:
    c = coordinator(full(), window())
    a = request("a", 9)
    c.allocate_new_blocks("a", 9)  # 3 blocks in each group
    c.cache_blocks(a, 8)
    held = c.get_blocks("a")
    foreign = BlockPool(4, True, BS).blocks[1]
    before = snapshot(c)
    # Group 0's hit is fit to attach (a touched block of this pool); group 1's is not.
    with pytest.raises(InvalidManagerArgument, match="not a block of this pool"):
        c.save_new_computed_blocks("b", ([held[0][0]], [foreign]))
    with pytest.raises(InvalidManagerArgument, match=r"needs 32 new blocks, the pool has 9 free"):
        c.allocate_new_blocks("b", 4 * 16)  # 16 blocks in each group: more than are free
    with pytest.raises(InvalidManagerArgument, match="num_computed_tokens=13"):
        c.cache_blocks(a, 13)  # beyond the 12 slots the request holds
    with pytest.raises(InvalidManagerArgument, match="num_computed_tokens=13"):
        c.remove_skipped_blocks("a", 13)
    assert snapshot(c) == before
    assert not c.has_blocks("b")


@pytest.mark.parametrize("specs, caching", [((full(),), True), ((full(), window()), True),
                                             ((full(), window()), False)])
@pytest.mark.parametrize("operation", ["free", "has_blocks", "get_blocks",
                                       "get_num_common_prefix_blocks"])
@pytest.mark.parametrize("bad", [None, 3, ["a"]])
def test_the_methods_without_a_twin_refuse_a_bad_request_id(
        specs: tuple[KVCacheSpec, ...], caching: bool, operation: str, bad: Any) -> None:
    c = coordinator(*specs, caching=caching)
    c.allocate_new_blocks("a", 5)
    before = snapshot(c)
    with pytest.raises(InvalidManagerArgument,
                       match=re.escape(f"a request id must be a str, got {bad!r}")):
        getattr(c, operation)(bad)
    assert snapshot(c) == before


# ---------------------------------------------------------------------- the twins


@pytest.mark.parametrize("coordinator_class", COORDINATORS)
def test_the_twins_are_the_operations_whose_checks_cost(coordinator_class: type) -> None:
    twins = {name.removesuffix("_unchecked") for name in dir(coordinator_class)
             if name.endswith("_unchecked")}
    assert twins == TWINS
    assert all(callable(getattr(coordinator_class, name)) for name in twins)


@pytest.mark.parametrize("specs", [(full(),), (full(), window())])
def test_each_twin_does_what_its_public_method_does(specs: tuple[KVCacheSpec, ...]) -> None:
    """The same calls, with arguments that pass the checks, through the public methods on one
    coordinator and through the twins on another: the same results and the same states."""
    public, twin = coordinator(*specs), coordinator(*specs)
    empty = tuple(() for _ in specs)

    def both(name: str, public_args: tuple[Any, ...], twin_args: tuple[Any, ...]) -> Any:
        result = getattr(public, name)(*public_args)
        assert _ids(getattr(twin, f"{name}_unchecked")(*twin_args)) == _ids(result), name
        assert snapshot(twin) == snapshot(public), name
        return result

    a, b = request("a", 9), request("b", 9)
    both("get_num_blocks_to_allocate", ("a", 9, empty, 0), ("a", 9, empty, 0))
    both("allocate_new_blocks", ("a", 9), ("a", 9, 0))
    both("cache_blocks", (a, 8), (a, 8))
    public.free("a")
    twin.free("a")
    hits, num_hits = public.find_longest_cache_hit(b.block_hashes, 8)
    twin_hits, twin_num_hits = twin.find_longest_cache_hit_unchecked(b.block_hashes, 8)
    assert num_hits == twin_num_hits == 8 and _ids(hits) == _ids(twin_hits)
    public.block_pool.touch(hits)
    twin.block_pool.touch(twin_hits)
    both("get_max_num_blocks_to_allocate", ("b", 12, hits, 0), ("b", 12, twin_hits, 0))
    both("save_new_computed_blocks", ("b", hits), ("b", twin_hits))
    both("allocate_new_blocks", ("b", 12), ("b", 12, 0))
    both("num_blocks_freed_by_skip", ("b", 12), ("b", 12))
    both("remove_skipped_blocks", ("b", 12), ("b", 12))


def _ids(value: Any) -> Any:
    """A result with each block replaced by its id (the two coordinators' blocks differ)."""
    if isinstance(value, (list, tuple)):
        return [_ids(item) for item in value]
    return getattr(value, "block_id", value)
