"""A router's view of the events (spec/event_consumer.py): the fold, its properties on every
reachable spec state of tiny pools, and the two things a router must tolerate (R1, R2)."""

from __future__ import annotations

import pytest

from kvspec.conformance.explore import explore
from kvspec.spec import event_consumer, pool as model, pool_invariants
from kvspec.spec.event_consumer import CachedBlock, router_view
from kvspec.spec.pool import Cleared, Profile, Removed, Stored


def test_the_fold_links_each_block_to_its_parent_and_tokens() -> None:
    view = router_view([Stored((1, 2), None, (10, 11, 12, 13), 2, 7), Stored((3,), 2, (14, 15),
                                                                              2, None)])
    assert dict(view.counts) == {1: 1, 2: 1, 3: 1}
    assert dict(view.blocks)[2] == CachedBlock(1, (12, 13), 2, 7)
    assert dict(view.blocks)[3] == CachedBlock(2, (14, 15), 2, None)
    assert router_view([Stored((1,), None, (1, 1), 2, None), Removed((1,))]).counts == ()
    assert router_view([Stored((1,), None, (1, 1), 2, None), Cleared()]).blocks == ()


@pytest.mark.parametrize("profile", list(Profile), ids=lambda p: p.value)
@pytest.mark.parametrize("num_blocks", [2, 3, 4])
def test_every_reachable_state_keeps_the_routers_properties(num_blocks: int,
                                                            profile: Profile) -> None:
    def check(state: model.PoolState) -> list[str]:
        return pool_invariants.violated(state) + event_consumer.violated(state)

    assert explore(num_blocks, 2, 10, profile=profile, check=check).states > num_blocks


def _cache(state: model.PoolState, blocks: tuple[int, ...], num_cached: int,
           num_full: int) -> model.PoolState:
    hashes = tuple(f"h{i}".encode() for i in range(len(blocks)))
    tokens = tuple(range(2 * (num_full - num_cached)))
    return model.step(state, model.CacheFullBlocks(blocks, hashes, num_cached, num_full, 0,
                                                   tokens, 2))[0]


def test_r1_a_range_with_a_null_block_carries_more_tokens_than_hashes() -> None:
    """A slid-out window position is the null block: no hash, but its tokens are sent."""
    state = model.new_pool(4, True, True)
    state, _ = model.get_new_blocks(state, 1)
    state = _cache(state, (model.NULL_BLOCK, 1), 0, 2)
    [stored] = state.events
    assert isinstance(stored, Stored)
    assert len(stored.hashes) == 1 and len(stored.token_ids) == 2 * stored.block_size
    assert event_consumer.event_stored_covers_whole_blocks(state)


def test_r2_a_parent_can_be_a_hash_the_router_never_saw() -> None:
    """The parent is the chain hash before the range even when that block was null."""
    state = model.new_pool(4, True, True)
    state, _ = model.get_new_blocks(state, 1)
    state = _cache(state, (model.NULL_BLOCK, 1), 1, 2)
    [stored] = state.events
    assert isinstance(stored, Stored) and stored.parent is not None
    assert stored.parent not in dict(router_view(state.events).counts)
