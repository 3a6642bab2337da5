"""The eviction policies (impl/eviction.py) on their own, over a toy pool that offers only the
public policy API (``PolicyPool``, with a real free queue as its ``PolicyQueue``): policies by
name, one pool per policy, the order each hands out free blocks, retention hints checked and
expiring, and the pin share. Each policy inside impl's pool and manager, against
spec/eviction.py: tests/test_policy_machines.py and tests/test_audit_policy.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from kvspec.impl.eviction import (
    POLICY_NAMES,
    EvictionPolicy,
    InvalidRetentionError,
    LruLifoUnhashed,
    PinnedPolicy,
    PolicyNotSupportedError,
    PriorityPolicy,
    TokenRangeRetention,
    check_retention,
    make_policy,
)
from kvspec.impl.kv_cache_blocks import FreeKVCacheBlockQueue, KVCacheBlock


@dataclass
class ToyPool:
    """What a policy may read of its pool (``PolicyPool``): block 0 is the null block, the
    others start free in id order. The test moves blocks in and out of use as a pool does."""

    num_gpu_blocks: int
    enable_caching: bool = True
    clock: int = 0
    blocks: list[KVCacheBlock] = field(init=False)
    null_block: KVCacheBlock = field(init=False)
    free_block_queue: FreeKVCacheBlockQueue = field(init=False)
    cached_blocks: set[KVCacheBlock] = field(default_factory=set)
    blocks_in_use: set[KVCacheBlock] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(self.num_gpu_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])

    def take(self, policy: EvictionPolicy, n: int) -> list[int]:
        taken = policy.take(n)
        self.blocks_in_use.update(taken)
        return [block.block_id for block in taken]

    def free(self, policy: EvictionPolicy, *ids: int) -> None:
        blocks = [self.blocks[i] for i in ids]
        self.blocks_in_use.difference_update(blocks)
        policy.freed(blocks)

    def free_ids(self) -> list[int]:
        return [block.block_id for block in self.free_block_queue.get_all_free_blocks()]


def attached(policy: EvictionPolicy, pool: ToyPool) -> EvictionPolicy:
    policy.attach(pool)
    return policy


def test_policies_by_name() -> None:
    assert make_policy("lru") is None  # vLLM 0.13's pool, its fast path
    for name in POLICY_NAMES[1:]:
        policy = make_policy(name)
        assert policy is not None and policy.name == name
    pinned = make_policy("pinned", max_pinned_share=0.5)
    assert isinstance(pinned, PinnedPolicy) and pinned.max_pinned_share == 0.5
    with pytest.raises(PolicyNotSupportedError, match="no eviction policy 'fifo'") as refused:
        make_policy("fifo")
    assert isinstance(refused.value, ValueError)


def test_a_policy_serves_one_pool() -> None:
    policy = LruLifoUnhashed()
    with pytest.raises(PolicyNotSupportedError, match="serves no pool yet"):
        policy.take(1)
    policy.attach(ToyPool(3))
    with pytest.raises(PolicyNotSupportedError, match="already serves a pool"):
        policy.attach(ToyPool(3))


def test_lru_takes_from_the_head_and_frees_to_the_tail() -> None:
    pool = ToyPool(5)
    policy = attached(EvictionPolicy(), pool)
    assert pool.take(policy, 2) == [1, 2]
    pool.free(policy, 2, 1)
    assert pool.free_ids() == [3, 4, 2, 1]


@pytest.mark.parametrize(("caching", "expected"), [(True, [1, 3, 2, 4]), (False, [1, 2, 3, 4])])
def test_lru_lifo_unhashed_reuses_blocks_without_a_key_first(caching: bool,
                                                               expected: list[int]) -> None:
    pool = ToyPool(5, enable_caching=caching)
    policy = attached(LruLifoUnhashed(), pool)
    assert pool.take(policy, 4) == [1, 2, 3, 4]
    pool.cached_blocks.update(pool.blocks[i] for i in (2, 4))
    pool.free(policy, 1, 2, 3, 4)
    assert pool.free_ids() == expected


def test_priority_takes_unkeyed_then_lowest_priority_then_lru_and_priorities_expire() -> None:
    pool = ToyPool(6)
    policy = attached(PriorityPolicy(), pool)
    assert pool.take(policy, 5) == [1, 2, 3, 4, 5]
    pool.cached_blocks.update(pool.blocks[i] for i in (1, 2, 3, 4))  # 5 stays unkeyed
    policy.set(pool.blocks[1], 80, None)
    policy.set(pool.blocks[3], 10, None)
    policy.set(pool.blocks[4], 10, 5)  # block 2 keeps the default, 35
    assert policy.retention() == ((1, 80, None), (3, 10, None), (4, 10, 5))
    pool.free(policy, 4, 3, 2, 1, 5)
    policy.check()
    pool.clock = 5
    policy.advance_clock(5)  # block 4's priority expires: the default, at its place in the LRU
    assert policy.retention() == ((1, 80, None), (3, 10, None))
    policy.check()
    assert pool.take(policy, 5) == [5, 3, 4, 2, 1]


def test_priority_reads_a_requests_hints_checked() -> None:
    policy = PriorityPolicy()
    hint = TokenRangeRetention(0, 16, 90, 3)
    assert policy.check_hints(SimpleNamespace(kv_retention=[hint])) == [hint]
    assert policy.check_hints(SimpleNamespace()) is None
    with pytest.raises(InvalidRetentionError, match="got 101"):
        policy.check_hints(SimpleNamespace(kv_retention=[TokenRangeRetention(0, None, 101)]))
    with pytest.raises(InvalidRetentionError, match="got 7"):
        policy.check_hints(SimpleNamespace(kv_retention=7))


def test_check_retention_takes_integers_and_names_what_it_refuses() -> None:
    checked = check_retention(np.int64(0), None, np.int32(100), 1)
    assert checked == (0, None, 100, 1)
    assert [type(value) for value in checked] == [int, type(None), int, int]
    for arguments, named in [((0, 8, True, None), "priority must be an int in [0, 100], got True"),
                             ((0, 8, -1, None), "got -1"),
                             ((0, 8, 50, 0), "duration must be None or an int >= 1, got 0"),
                             ((8, 4, 50, None), "[8, 4)"),
                             ((-1, None, 50, None), "[-1, None)"),
                             ((0.5, None, 50, None), "[0.5, None)")]:
        with pytest.raises(InvalidRetentionError) as refused:
            check_retention(*arguments)  # type: ignore[arg-type]
        assert named in str(refused.value)


def test_the_pin_share_is_a_fraction_of_the_pool() -> None:
    policy = attached(PinnedPolicy(0.5), ToyPool(9))
    assert policy.cap == 4 and policy.has_pins
    assert attached(EvictionPolicy(), ToyPool(9)).cap == 0
    for share in (1.5, -0.1, True, "0.5"):
        with pytest.raises(InvalidRetentionError, match="max_pinned_share"):
            PinnedPolicy(share)  # type: ignore[arg-type]
