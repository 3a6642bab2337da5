"""A router's view of the events (spec/event_consumer.py): the fold, its properties on every
reachable spec state of tiny pools, and the two things a router must tolerate (R1, R2)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvspec.conformance.explore import explore
from kvspec.spec import event_consumer, events as wire, pool as model, pool_invariants
from kvspec.spec.event_consumer import CachedBlock, router_view, router_view_of_bytes
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


# --- vLLM 0.33's wire and report modes (spec/events.py) -------------------------------------------


def _batches(profile: Profile) -> list[bytes]:
    return [wire.encode_batch(1.0, [wire.WireStored((1, 2), None, (5, 6, 7, 8), 2, None,
                                                    lora_name=None, group_idx=0)], None, profile),
            wire.encode_batch(2.0, [wire.WireRemoved((1,), group_idx=0)], 0, profile)]


def test_the_router_reads_both_releases_bytes_alike() -> None:
    old, new = (router_view_of_bytes(_batches(p)) for p in (Profile.V0_13, Profile.V0_33))
    assert old == new and dict(new.counts) == {2: 1}
    assert dict(new.blocks)[2] == CachedBlock(1, (7, 8), 2, None)


def test_a_router_that_assumes_arrays_breaks_on_0_33() -> None:
    """vLLM #42892 made events maps; consumers decoding arrays refused every batch."""
    router_view_of_bytes(_batches(Profile.V0_13), wire.read_event_array_only)
    with pytest.raises(wire.WireError, match="Expected `array`"):
        router_view_of_bytes(_batches(Profile.V0_33), wire.read_event_array_only)


def test_report_modes_bound_or_match_the_copies() -> None:
    """Incremental: stores less removes are the copies. Full: a reused block's report adds a
    store with no remove to come, so they only bound the copies; the two caches below give one
    stream, so no consumer can be exact under full."""
    stored = Stored((1,), None, (0,), 1, None)
    incremental = (stored, Removed((1,)))
    full = (stored, stored, Removed((1,)))  # a re-report, or a second copy: the same bytes
    assert wire.copies_accounted(incremental, {}, wire.ReportMode.INCREMENTAL)
    assert wire.copies_accounted(full, {}, wire.ReportMode.FULL)  # one copy re-reported...
    assert wire.copies_accounted(full, {1: 1}, wire.ReportMode.FULL)  # ...or two stored
    assert not wire.copies_accounted(full, {}, wire.ReportMode.INCREMENTAL)
    assert not wire.copies_accounted((stored,), {1: 2}, wire.ReportMode.FULL)
    assert not wire.copies_accounted((Removed((1,)),), {}, wire.ReportMode.FULL)
    assert wire.report_mode("full") is wire.ReportMode.FULL
    assert wire.report_mode("Full") is wire.report_mode(None) is wire.ReportMode.INCREMENTAL


def test_a_full_report_keeps_every_copy_held() -> None:
    """The vllm-0.33 pool's report of reused blocks: the router's count goes above the copies
    but never below (event_stream_holds_every_copy)."""
    state = model.new_pool(4, True, True, profile=Profile.V0_33)
    state, _ = model.get_new_blocks(state, 2)
    state = _cache(state, (1, 2), 0, 2)
    reported = model.emit_cached_block_events(state, (b"h0", b"h1"), 2, 2, 0)
    assert len(reported.events) == len(state.events) + 1
    assert event_consumer.event_stream_holds_every_copy(reported)
    assert dict(wire.stream_balance(reported.events)) != dict(
        wire.stream_balance(state.events))


# Finding E2 (docs/findings.md), run on vLLM 0.33's own KVCacheManager: a "full" report of a
# sliding-window hit names the null positions' hashes, so a router folding the events keeps
# keys the cache removed. Prints the hit, the group block ids and the stale keys' groups.
VLLM_033_FULL_REPORT = """
import json
import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        SlidingWindowSpec)
from vllm.v1.request import Request

ku.init_none_hash(sha256)
bs = 2
shape = dict(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
groups = [KVCacheGroupSpec(["f"], FullAttentionSpec(**shape)),
          KVCacheGroupSpec(["s"], SlidingWindowSpec(**shape, sliding_window=4))]
m = KVCacheManager(KVCacheConfig(num_blocks=15, kv_cache_tensors=[], kv_cache_groups=groups),
                   max_model_len=64, scheduler_block_size=bs, hash_block_size=bs,
                   enable_caching=True, enable_kv_cache_events=True)
hasher = ku.get_request_block_hasher(bs, sha256)
held = {}  # (group, hash) -> stores less removes: a router that counts


def request(name, prompt, mode="incremental"):
    params = SamplingParams(max_tokens=4, extra_args={"kv_cache_report_mode": mode})
    return Request(name, prompt, params, None, block_hasher=hasher)


def run(r):
    blocks, n, _ = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - n, n, blocks) is not None
    r.num_computed_tokens = r.num_tokens


def fold(events):
    for e in events:
        sign = 1 if isinstance(e, BlockStored) else -1 if isinstance(e, BlockRemoved) else 0
        for h in e.block_hashes if sign else ():
            held[(e.group_idx, h)] = held.get((e.group_idx, h), 0) + sign
            if not held[(e.group_idx, h)]:
                del held[(e.group_idx, h)]


a = request("a", list(range(100, 110)))  # 5 blocks per group
run(a)
a.append_output_token_ids(7)
assert m.allocate_slots(a, 1) is not None  # frees a's blocks that left the window
a.num_computed_tokens = a.num_tokens
run(request("d", list(range(300, 304))))  # takes the free blocks: evicts slid-out ones
m.free(a)
fold(m.take_events())
c = request("c", list(range(100, 110)) + [1, 2], mode="full")  # hits a's prefix again
blocks, n, _ = m.get_computed_blocks(c)
fold(m.take_events())
cached = {(ku.get_group_id(k), ku.maybe_convert_block_hash(ku.get_block_hash(k)))
          for k in m.block_pool.cached_block_hash_to_block._cache}
print(json.dumps({"hit": n, "groups": [[b.block_id for b in g] for g in blocks.blocks],
                  "stale": sorted(g for g, h in held if (g, h) not in cached)}))
"""


@pytest.mark.slow
def test_e2_full_report_of_a_sliding_window_hit_leaves_stale_keys_in_vllm_0_33() -> None:
    python = Path(__file__).resolve().parent.parent / ".venv-vllm-0.33.0" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv-vllm-0.33.0 (make vllm-env VLLM=0.33.0 builds it)")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", PYTHONHASHSEED="0")
    proc = subprocess.run([str(python), "-c", VLLM_033_FULL_REPORT], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["hit"] == 10 and result["groups"][1][:3] == [0, 0, 0]  # null positions
    assert result["stale"] == [1, 1], result  # two removed sliding-window keys, held again
