"""impl/kv_cache_manager.py: the KVCacheManager a scheduler calls, through its public API.

Three parts:

* directed scenarios, each pinning one of vLLM 0.13's rules on impl/ and on the spec side by
  side (the manager machine, tests/test_manager_machine.py, finds such cases by search; these
  find them at once);
* bad input: a typed error naming the value, nothing changed, checked against the
  conformance view (block lists, ref counts, free order, keys) taken before the call, on
  impl/ and, where the spec has the operation, on the spec (tests/hostile/test_manager.py
  throws every kind of bad value at every public method of the stack);
* isolation: requests with different cache_salt or LoRA adapter never share a cached block.
  The block hash chain carries the LoRA name in every block and the cache salt in the first,
  so a prefix cached under one (salt, LoRA) identity must never be a hit for another, however
  the prompts overlap and whatever was evicted in between.

The refusals of the coordinators and the attention-type managers (built through this
manager or on their own) are in tests/test_kv_cache_coordinator.py and
tests/test_single_type_kv_cache_manager.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, strategies as st

from kvspec.conformance.lockstep import Lockstep, Refused
from kvspec.conformance.manager_machine import (
    ImplManager,
    group_spec_of,
    hand_layout,
    manager_state_from_view,
    view_of,
)
from kvspec.impl.hashing import get_request_block_hasher, sha256
from kvspec.impl.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvspec.impl.kv_cache_manager import (
    InvalidAllocationError,
    KVCacheBlocks,
    KVCacheManager,
    Request,
    UnknownRequestError,
)
from kvspec.impl.request import LoRARequest
from kvspec.spec import manager as model
from kvspec.spec.manager import ManagerConfig, Session

# ---------------------------------------------------------------------- directed scenarios

BS = 2


def full(bs: int = BS) -> KVCacheSpec:
    return FullAttentionSpec(bs, 1, 8, "float16")


def sliding(window: int, bs: int = BS) -> KVCacheSpec:
    return SlidingWindowSpec(bs, 1, 8, "float16", sliding_window=window)


def mamba(bs: int = BS) -> KVCacheSpec:
    return MambaSpec(bs, shapes=((2, 2),), dtypes=("float16",))


def chunked(chunk: int, bs: int = BS) -> KVCacheSpec:
    return ChunkedLocalAttentionSpec(bs, 1, 8, "float16", attention_chunk_size=chunk)


class Both:
    """impl/ (through the conformance adapter) and the spec, run in lock step
    (`lockstep.Lockstep`): every call is a `spec.manager` command; after each, the states
    must agree and the spec's invariants hold."""

    def __init__(self, specs: Sequence[KVCacheSpec], num_blocks: int, max_model_len: int = 64,
                 caching: bool = True, eagle: bool = False) -> None:
        layout = hand_layout("example: " + ", ".join(map(repr, specs)), lambda: specs, BS)
        self.target = ImplManager()
        self.lockstep: Lockstep[Session] = Lockstep(model.step, self.target)
        config = ManagerConfig(tuple(group_spec_of(s) for s in specs), num_blocks,
                               max_model_len, BS, caching, use_eagle=eagle)
        self(model.NewManager(config, self.target.hashing(), layout.name))

    def __call__(self, command: Any) -> Any:
        output = self.lockstep(command)
        self.check()
        return output

    @property
    def spec(self) -> model.ManagerState:
        assert self.lockstep.state is not None
        return self.lockstep.state.manager

    @property
    def impl(self) -> Any:
        return self.target.manager

    def check(self) -> None:
        assert self.lockstep.state is not None
        assert self.target.view() == view_of(self.lockstep.state)
        assert model.violated(self.spec, self.lockstep.state.request_views()) == []

    def add(self, request_id: str, prompt: Sequence[int]) -> None:
        self(model.AddRequest(request_id, tuple(prompt)))

    def lookup(self, request_id: str) -> tuple[Any, int]:
        result: tuple[Any, int] = self(model.GetComputedBlocks(request_id))
        return result

    def allocate(self, request_id: str, num_new: int, hit: tuple[Any, int] | None = None,
                 lookahead: int = 0) -> Any:
        assert self.lockstep.state is not None
        request = self.lockstep.state.request(request_id)
        num_hit = 0 if hit is None else hit[1]
        new = self(model.AllocateSlots(request_id, num_new, num_hit, hit is not None,
                                       lookahead))
        if new is not None:
            self(model.SetComputedTokens(request_id, min(
                request.num_computed_tokens + num_hit + num_new, len(request.token_ids))))
        return new

    def admit(self, request_id: str, prompt: Sequence[int], lookahead: int = 0) -> Any:
        self.add(request_id, prompt)
        hit = self.lookup(request_id)
        return self.allocate(request_id, len(prompt) - hit[1], hit, lookahead)

    def append(self, request_id: str, tokens: Sequence[int]) -> None:
        self(model.AppendTokens(request_id, tuple(tokens)))

    def free(self, request_id: str) -> None:
        self(model.Free(request_id))

    def evict(self, block_ids: set[int]) -> None:
        for block in sorted(block_ids):
            self(model.EvictBlocks((block,)))

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        ids: tuple[list[int], ...] = self.impl.get_block_ids(request_id)
        assert tuple(tuple(g) for g in ids) == self(model.GetBlockIds(request_id))
        return ids


PROMPT = list(range(1, 13))  # 12 tokens: 6 blocks of 2


def test_full_hit_is_capped_below_the_prompt_length() -> None:
    both = Both([full()], num_blocks=16)
    both.admit("a", PROMPT[:8])
    both.free("a")
    both.add("b", PROMPT[:8])
    hits, num_hit = both.lookup("b")
    assert num_hit == 6 and len(hits[0]) == 3  # the last token is always recomputed


def test_refused_allocation_with_hits_changes_nothing() -> None:
    both = Both([full()], num_blocks=6)  # 5 usable blocks
    both.admit("a", PROMPT[:6])
    both.free("a")  # 3 cached, evictable blocks
    both.add("b", [*PROMPT[:6], 50, 51, 52, 53])
    hit = both.lookup("b")
    assert hit[1] == 6
    before = both.target.view()
    # 3 hits (taken off the free queue) + 3 new blocks > 5 free blocks.
    assert both.allocate("b", 4, hit, lookahead=2) is None
    assert both.target.view() == before


def test_evictable_hits_count_against_capacity() -> None:
    both = Both([full()], num_blocks=8)  # 7 usable blocks
    both.admit("a", PROMPT[:8])
    both.free("a")
    both.add("b", PROMPT[:8])
    hit = both.lookup("b")
    assert hit[1] == 6  # 3 evictable hits
    # 3 hits + 5 new blocks (2 prompt tokens and 8 lookahead slots) > 7 free: refused.
    assert both.allocate("b", 2, hit, lookahead=8) is None
    assert both.allocate("b", 2, both.lookup("b"), lookahead=6) is not None


def test_sliding_window_frees_exactly_the_blocks_out_of_the_window() -> None:
    both = Both([sliding(5)], num_blocks=16)
    both.admit("a", PROMPT[:9])
    both.append("a", [99])
    both.allocate("a", 1)
    # 9 computed tokens, window 5: tokens 0-4 are out, so blocks 0 and 1 (tokens 0-3) are null.
    ids = both.block_ids("a")[0]
    assert ids[:2] == [0, 0] and 0 not in ids[2:]


def _refused_for_lack_of_room(both: Both, request_id: str, num_new: int) -> None:
    """allocate_slots returns None (a short pool, no bad call); the named rule holds on impl's
    state before the whole states are compared."""
    assert both.lockstep.state is not None
    before = both.spec
    request = both.lockstep.state.request(request_id).view()
    assert both.lockstep(model.AllocateSlots(request_id, num_new)) is None
    after = manager_state_from_view(before, both.target.view())
    assert model.refusal_frees_only_skipped_blocks(before, after, request), (
        f"refusal_frees_only_skipped_blocks: tables before {before.tables}, "
        f"after {after.tables}")
    both.check()


def test_refused_allocation_frees_the_out_of_window_blocks() -> None:
    """D7 (docs/findings.md): a short pool is not a bad call. Like vLLM 0.13 and 0.33,
    allocate_slots frees the blocks that left the window before it returns None."""
    both = Both([sliding(3)], num_blocks=7)  # 6 usable blocks
    both.admit("a", PROMPT[:10])  # 5 blocks, 1 free
    ids = both.block_ids("a")[0]
    # 10 computed tokens, window 3: blocks 0-3 are out of it; 20 more tokens need 10 more
    # blocks, more than the 1 free and the 4 freed: refused, with the 4 freed all the same.
    _refused_for_lack_of_room(both, "a", 20)
    assert both.block_ids("a")[0] == [0, 0, 0, 0, ids[4]]
    assert both.impl.block_pool.get_num_free_blocks() == 5


def test_refused_hybrid_allocation_frees_only_the_window_group() -> None:
    """docs/findings.md D7's reproducer, scaled to blocks of 2 tokens: a full-attention and
    a sliding-window group (window 4) in an 11-block pool."""
    both = Both([full(), sliding(4)], num_blocks=11)  # 10 usable blocks
    both.admit("a", PROMPT[:8])  # 4 blocks in each group, 2 free
    full_ids, window_ids = both.block_ids("a")
    # 6 more tokens need 3 + 3 blocks > 2 free + 2 freed: refused; the window's first two
    # blocks (tokens 0-3, outside the window of token 8) are freed anyway.
    _refused_for_lack_of_room(both, "a", 6)
    assert both.block_ids("a") == (full_ids, [0, 0, *window_ids[2:]])
    assert both.impl.block_pool.get_num_free_blocks() == 4


def test_hybrid_lookup_repeats_until_every_type_agrees() -> None:
    both = Both([full(), sliding(5), mamba()], num_blocks=40)
    both.admit("a", PROMPT)
    full_ids, window_ids, mamba_ids = both.block_ids("a")
    both.free("a")
    # Sliding window misses block 2; Mamba keeps states only up to block 3.
    both.evict({window_ids[2], mamba_ids[4], mamba_ids[5]})
    both.add("b", [*PROMPT, 77])
    hits, num_hit = both.lookup("b")
    # Pass 1: full 12, window 12, Mamba 8. Pass 2: window at 8 finds blocks 0-1 only -> 4.
    assert num_hit == 4
    assert hits == (tuple(full_ids[:2]), tuple(window_ids[:2]), (0, mamba_ids[1]))


def test_sliding_window_hit_needs_contiguous_blocks() -> None:
    both = Both([sliding(5)], num_blocks=16)
    both.admit("a", PROMPT)
    ids = both.block_ids("a")[0]
    both.free("a")
    both.evict({ids[4]})
    both.add("b", [*PROMPT, 77])
    hits, num_hit = both.lookup("b")
    assert num_hit == 8 and hits == ((0, 0, ids[2], ids[3]),)


@pytest.mark.parametrize("spec, expected_tokens", [(full(), 8), (sliding(5), 8)])
def test_eagle_drops_the_last_hit_block(spec: KVCacheSpec, expected_tokens: int) -> None:
    both = Both([spec], num_blocks=16, eagle=True)
    both.admit("a", PROMPT[:10])
    both.free("a")
    both.add("b", [*PROMPT[:10], 77])
    assert both.lookup("b")[1] == expected_tokens  # 10 without EAGLE


def test_chunked_local_pads_earlier_chunks_with_null_blocks() -> None:
    both = Both([chunked(4)], num_blocks=16)
    both.admit("a", PROMPT[:10])
    ids = both.block_ids("a")[0]
    both.free("a")
    both.evict({ids[0]})
    both.add("b", [*PROMPT[:10], 77])
    hits, num_hit = both.lookup("b")
    assert num_hit == 10 and hits == ((0, 0, 0, 0, ids[4]),)


def test_mamba_hit_is_the_last_cached_state() -> None:
    both = Both([mamba()], num_blocks=16)
    both.admit("a", PROMPT[:8])
    ids = both.block_ids("a")[0]
    both.free("a")
    both.add("b", [*PROMPT[:8], 77])
    hits, num_hit = both.lookup("b")
    assert num_hit == 8 and hits == ((0, 0, 0, ids[3]),)


def test_lookahead_slots_are_never_cached() -> None:
    both = Both([full()], num_blocks=16)
    both.add("a", PROMPT[:10])
    both.allocate("a", 4, lookahead=4)
    keyed = [b for b in both.impl.get_blocks("a").blocks[0] if b.block_hash is not None]
    assert len(keyed) == 2


def test_free_releases_the_chain_tail_first() -> None:
    both = Both([full()], num_blocks=8)
    both.admit("a", PROMPT[:6])
    ids = both.block_ids("a")[0]
    both.free("a")
    free_order = [b.block_id for b in both.impl.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_order[-3:] == ids[::-1]


def test_common_prefix_counts_blocks_every_running_request_holds() -> None:
    both = Both([full()], num_blocks=24)
    both.admit("a", PROMPT[:6])
    both.admit("b", [*PROMPT[:4], 60, 61])
    assert both(model.GetNumCommonPrefixBlocks("a")) == (2,)
    both.admit("c", [70, 71, 72])
    assert both(model.GetNumCommonPrefixBlocks("a")) == (0,)


def test_slots_never_exceed_max_model_len() -> None:
    both = Both([full()], num_blocks=16, max_model_len=10)
    both.add("a", PROMPT[:9])
    new = both.allocate("a", 9, lookahead=4)
    assert len(new[0]) == 5


def test_caching_off_never_hits_and_never_keys() -> None:
    both = Both([full()], num_blocks=16, caching=False)
    both.admit("a", PROMPT)
    both.free("a")
    both.add("b", PROMPT)
    assert both.lookup("b") == (((),), 0)
    assert all(b.block_hash is None for b in both.impl.block_pool.blocks)


def test_preempted_request_leaves_nothing_behind() -> None:
    both = Both([full(), sliding(3)], num_blocks=20)
    both.admit("a", PROMPT[:8])
    both.free("a")
    assert model.released(both.spec, "a")
    assert both.impl.get_block_ids("a") == ([], [])
    assert all(b.ref_cnt == 0 for b in list(both.impl.block_pool.blocks)[1:])


def make_request(request_id: str, prompt: list[int], **kwargs: Any) -> Request:
    return Request(request_id, prompt, block_hasher=get_request_block_hasher(BS, sha256),
                   **kwargs)


@pytest.mark.parametrize("specs", [[full()], [full(), sliding(4)]])
def test_kv_cache_blocks_round_trip(specs: list[KVCacheSpec]) -> None:
    config = KVCacheConfig(16, (), tuple(
        KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)))
    manager = KVCacheManager(config, max_model_len=64, hash_block_size=BS)
    request = make_request("a", PROMPT[:5])
    hits, num_hit = manager.get_computed_blocks(request)
    assert hits is manager.empty_kv_cache_blocks and num_hit == 0
    new = manager.allocate_slots(request, 5)
    assert new is not None
    both = hits + new
    assert both.get_block_ids() == manager.get_block_ids("a")
    assert new.new_empty().get_block_ids(allow_none=True) is None


# ---------------------------------------------------------------------- bad input

BS4 = 4  # the block size of the bad-input examples


def config(*specs: KVCacheSpec, num_blocks: int = 16) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, (), tuple(
        KVCacheGroupSpec((f"layer.{i}",), s) for i, s in enumerate(specs)))


def request(request_id: str, num_tokens: int, hashed: bool = True) -> Request:
    hasher = get_request_block_hasher(BS4, sha256) if hashed else None
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
    manager = KVCacheManager(config(full(BS4)), max_model_len=64, hash_block_size=BS4)
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
        (group_spec_of(full(BS4)),), 8, 64, BS4))
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
    cached = KVCacheManager(config(full(BS4)), max_model_len=64, hash_block_size=BS4)
    a = request("a", 9)
    cached.allocate_slots(a, 9)
    cached.free(a)
    hits, _ = cached.get_computed_blocks(request("b", 9))
    uncached = KVCacheManager(config(full(BS4)), max_model_len=64, hash_block_size=BS4,
                              enable_caching=False)
    before = snapshot(uncached)
    with pytest.raises(InvalidAllocationError, match="prefix caching is off"):
        uncached.allocate_slots(request("b", 9), 1, 8, hits)
    assert snapshot(uncached) == before


def test_request_without_block_hashes_is_refused_before_anything_changes() -> None:
    manager = KVCacheManager(config(full(BS4)), max_model_len=64, hash_block_size=BS4)
    before = snapshot(manager)
    with pytest.raises(InvalidAllocationError, match="block_hasher"):
        manager.allocate_slots(request("a", 9, hashed=False), 9)
    assert snapshot(manager) == before


def test_unknown_request_on_free(running: tuple[KVCacheManager, Request]) -> None:
    manager, _ = running
    before = snapshot(manager)
    manager.free(request("ghost", 3))  # vLLM's scheduler frees never-scheduled requests
    assert snapshot(manager) == before
    strict = KVCacheManager(config(full(BS4)), max_model_len=64, hash_block_size=BS4,
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
    state = model.new_manager(model.ManagerConfig((group_spec_of(full(BS4)),), 8, 64, BS4))
    assert model.free(state, "ghost") == state
    with pytest.raises(model.UnknownRequest):
        model.free(state, "ghost", strict=True)


def test_conformance_target_refuses_alike() -> None:
    """The spec and impl refuse the same zero-token call, and neither changes."""
    layout = hand_layout("bad input: one full group", lambda: (full(BS4),), BS4)
    target = ImplManager()
    run: Lockstep[model.Session] = Lockstep(model.step, target)
    run(model.NewManager(model.ManagerConfig((group_spec_of(full(BS4)),), 8, 64, BS4),
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


# ---------------------------------------------------------------------- isolation

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
