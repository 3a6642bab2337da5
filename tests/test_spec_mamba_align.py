"""vLLM 0.33's Mamba align mode in the manager model (`spec.manager` under Profile.V0_33).

Pure spec tests from hand-computed tables (a Mamba-only manager and a full+Mamba, Jamba-like,
manager, block size 2), and a comparison that runs the same calls on vLLM 0.33's real
KVCacheManager (skipped unless vLLM 0.33 imports) and compares block ids, ref counts, keys,
the free queue and the align-mode bookkeeping after every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from kvspec.conformance import vllm_internals
from kvspec.spec import manager as M, pool as P
from kvspec.spec.pool import NULL_BLOCK

BS = 2
MAMBA = M.GroupSpec(M.Kind.MAMBA, BS)
FULL = M.GroupSpec(M.Kind.FULL, BS)
PROMPT = (1, 2, 3, 4, 5, 6, 7)


def config(groups: tuple[M.GroupSpec, ...], num_blocks: int = 10,
           profile: P.Profile = P.Profile.V0_33, caching: bool = True) -> M.ManagerConfig:
    return M.ManagerConfig(groups, num_blocks, max_model_len=64, hash_block_size=BS,
                           enable_caching=caching, profile=profile)


@dataclass
class Run:
    """A spec session driven command by command, keeping every output."""

    cfg: M.ManagerConfig
    session: M.Session = field(init=False)
    outputs: list[object] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.session, _ = M.step(None, M.NewManager(self.cfg, M.Hashing()))

    def do(self, command: M.ManagerCommand) -> object:
        before = self.session.manager
        self.session, out = M.step(self.session, command)
        after = self.session.manager
        views = self.session.request_views()
        assert M.violated(after, views) == [], (command, M.violated(after, views))
        if isinstance(command, M.AllocateSlots):
            hits = (M._lookup(self.session.hits, command.request_id)
                    if command.with_hits else None)
            assert M.no_same_step_mamba_hit(before, hits, out)  # type: ignore[arg-type]
        self.outputs.append(out)
        return out

    @property
    def state(self) -> M.ManagerState:
        return self.session.manager

    def table(self, group: int, rid: str) -> tuple[int, ...]:
        return M.get_blocks(self.state, rid)[group]

    def mamba(self, group: int, rid: str) -> M.MambaAlign:
        return M._mamba_get(self.state, group, rid)


def prefill_and_decode(rid: str = "a") -> list[M.ManagerCommand]:
    """Prompt 7 in chunks of 4 and 3, then three decode steps (tokens 8, 9, 10)."""
    return [
        M.AddRequest(rid, PROMPT),
        M.GetComputedBlocks(rid),
        M.AllocateSlots(rid, 4),
        M.NewStep(),
        M.SetComputedTokens(rid, 4),
        M.AllocateSlots(rid, 3),
        M.NewStep(),
        M.SetComputedTokens(rid, 7),
        M.AppendTokens(rid, (8,)),
        M.AllocateSlots(rid, 1),
        M.NewStep(),
        M.SetComputedTokens(rid, 8),
        M.AppendTokens(rid, (9,)),
        M.AllocateSlots(rid, 1),
        M.NewStep(),
        M.SetComputedTokens(rid, 9),
        M.AppendTokens(rid, (10,)),
        M.AllocateSlots(rid, 1),
    ]


def key(run: Run, rid: str, index: int, group: int) -> bytes:
    return P.make_key(run.session.request(rid).block_hashes[index], group)


# --- Pure spec tests -------------------------------------------------------------------------


def test_mamba_only_prefill_in_chunks_and_decode() -> None:
    run = Run(config((MAMBA,)))
    commands = prefill_and_decode()
    outs = [run.do(c) for c in commands[:3]]
    # Chunk 1 (4 tokens): the table is null-padded to cdiv(4, 2) = 2 entries, one real block;
    # allocate_slots returns the padding and the block.
    assert outs[2] == ((NULL_BLOCK, 1),)
    assert run.table(0, "a") == (NULL_BLOCK, 1)
    assert run.mamba(0, "a") == M.MambaAlign(None, 0, True)
    assert run.state.cached_this_step == (key(run, "a", 1, 0),)
    assert run.state.pool.key_of[1] == key(run, "a", 1, 0)
    run.do(commands[3])  # NewStep
    assert not run.state.cached_this_step
    # Chunk 2 (3 tokens, 7 in all): the walk over block 0 (null) retires it; the old state
    # (index 1) is recorded, the table padded to 3 and one block appended. Block 2 of the
    # table (tokens 4-5) is null: its hash is never cached.
    run.do(commands[4])
    assert run.do(commands[5]) == ((NULL_BLOCK, 2),)
    assert run.table(0, "a") == (NULL_BLOCK, 1, NULL_BLOCK, 2)
    assert run.mamba(0, "a") == M.MambaAlign(1, 1, True)
    assert M.mamba_holds_at_most_two_states(run.state)
    # Decode 1 (8 tokens): the walk frees block 1 (the state two steps back); nothing new.
    for c in commands[6:9]:
        run.do(c)
    assert run.do(commands[9]) == ((),)
    assert run.table(0, "a") == (NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 2)
    assert run.mamba(0, "a") == M.MambaAlign(1, 3, True)
    assert run.state.pool.ref[1] == 0 and run.state.pool.free[-1] == 1  # keyed: at the tail
    assert run.state.pool.key_of[2] == key(run, "a", 3, 0)
    # Decode 2 (9 tokens): a new block boundary: one new block, the last state recorded.
    for c in commands[10:13]:
        run.do(c)
    assert run.do(commands[13]) == ((3,),)
    assert run.table(0, "a") == (NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 2, 3)
    assert run.mamba(0, "a") == M.MambaAlign(3, 3, True)
    # Decode 3 (10 tokens): block 2 (index 3) is freed by the walk.
    for c in commands[14:17]:
        run.do(c)
    assert run.do(commands[17]) == ((),)
    assert run.table(0, "a") == (NULL_BLOCK,) * 4 + (3,)
    assert run.mamba(0, "a") == M.MambaAlign(3, 4, True)
    assert run.state.pool.key_of[3] == key(run, "a", 4, 0)


def test_same_step_hit_refused_then_accepted_after_new_step() -> None:
    run = Run(config((MAMBA,)))
    for c in prefill_and_decode()[:3]:  # a computes 4 tokens: block 1 keyed this step
        run.do(c)
    run.do(M.AddRequest("b", PROMPT))
    hits = run.do(M.GetComputedBlocks("b"))
    assert hits == (((NULL_BLOCK, 1),), 4, 0)
    before = run.state
    assert M.same_step_mamba_hit(before, ((NULL_BLOCK, 1),))
    assert run.do(M.AllocateSlots("b", 3, 4, with_hits=True)) is None
    assert run.state == before  # nothing held, nothing freed
    run.do(M.NewStep())
    # Accepted now: the hit (null, 1) heads the table, padded to cdiv(7, 2) - 1 = 3 entries
    # and ended by one new block; the hit block is the state to free later.
    assert run.do(M.AllocateSlots("b", 3, 4, with_hits=True)) == ((NULL_BLOCK, 2),)
    assert run.table(0, "b") == (NULL_BLOCK, 1, NULL_BLOCK, 2)
    assert run.mamba(0, "b") == M.MambaAlign(1, 0, True)
    assert run.state.pool.ref[1] == 2


def test_refusal_for_lack_of_room_counts_one_block() -> None:
    # 3 usable blocks: a takes one per chunk, never more, whatever the chunk's length.
    run = Run(config((MAMBA,), num_blocks=4))
    run.do(M.AddRequest("a", tuple(range(1, 31))))
    assert run.do(M.AllocateSlots("a", 20)) == ((NULL_BLOCK,) * 9 + (1,),)
    run.do(M.SetComputedTokens("a", 20))
    assert run.do(M.AllocateSlots("a", 9)) == ((NULL_BLOCK,) * 4 + (2,),)
    assert sum(1 for b in run.table(0, "a") if b != NULL_BLOCK) == 2
    assert M.align_blocks_to_allocate(MAMBA, 29, 0, 15) == 0
    assert M.align_blocks_to_allocate(MAMBA, 40, 0, 15) == 1
    assert M.align_blocks_to_allocate(MAMBA, 10, 0, 15) == -10


def test_jamba_prefill_decode_and_free_order() -> None:
    run = Run(config((FULL, MAMBA), num_blocks=16))
    commands = prefill_and_decode()
    outs = [run.do(c) for c in commands]
    # Full attention takes its blocks first in every step.
    assert outs[2] == ((1, 2), (NULL_BLOCK, 3))
    assert outs[5] == ((4, 5), (NULL_BLOCK, 6))
    assert outs[9] == ((), ())
    assert outs[13] == ((7,), (8,))
    assert outs[17] == ((), ())
    assert run.table(0, "a") == (1, 2, 4, 5, 7)
    assert run.table(1, "a") == (NULL_BLOCK,) * 4 + (8,)
    # Freed: block 3 (decode 1), block 6 (decode 3).
    assert run.state.pool.ref[3] == run.state.pool.ref[6] == 0
    free_before = run.state.pool.free
    run.do(M.Free("a"))
    assert M.released(run.state, "a")
    # Group 0 reversed, then group 1 (nulls skipped); all keyed but 7 and the tail of group
    # 0... each keyed block goes to the tail, unkeyed ones to the head.
    state = run.state
    unkeyed = [b for b in (7, 5, 4, 2, 1, 8) if state.pool.key_of[b] is None]
    keyed = [b for b in (7, 5, 4, 2, 1, 8) if state.pool.key_of[b] is not None]
    assert state.pool.free == (*reversed(unkeyed), *(b for b in free_before), *keyed) or (
        state.pool.free[-len(keyed):] == tuple(keyed))
    assert state.mamba == ((), ())


def test_jamba_caches_to_the_scheduler_block() -> None:
    # The hybrid rounds cache_blocks down to the scheduler block (here 4) in every group.
    cfg = M.ManagerConfig((FULL, MAMBA), 16, 64, BS, profile=P.Profile.V0_33,
                          scheduler_block_size=4)
    run = Run(cfg)
    run.do(M.AddRequest("a", PROMPT))
    run.do(M.AllocateSlots("a", 6))
    assert run.table(0, "a") == (1, 2, 3)
    assert run.state.pool.key_of[3] is None  # tokens 4-5: past the 4-token boundary
    assert run.state.pool.key_of[2] is not None
    assert run.table(1, "a") == (NULL_BLOCK, NULL_BLOCK, 4)
    assert run.state.cached_this_step == ()  # the Mamba block at index 1 is null


def test_v0_13_and_caching_off_unchanged() -> None:
    for cfg in (config((MAMBA,), profile=P.Profile.V0_13), config((MAMBA,), caching=False)):
        run = Run(cfg)
        assert not M.is_align_mamba(cfg, MAMBA)
        run.do(M.AddRequest("a", PROMPT))
        assert run.do(M.AllocateSlots("a", 4)) == ((1, 2),)
        assert run.state.mamba == () and run.state.cached_this_step == ()
        run.do(M.NewStep())


def test_config_outside_the_modelled_scope_is_refused() -> None:
    with pytest.raises(M.BadConfig):
        M.new_manager(config((M.GroupSpec(M.Kind.MAMBA, BS, num_speculative_blocks=1),)))
    with pytest.raises(M.BadConfig):
        M.new_manager(M.ManagerConfig((FULL, M.GroupSpec(M.Kind.MAMBA, 4)), 10, 64, BS,
                                      profile=P.Profile.V0_33))


def test_align_invariants_catch_bad_tables() -> None:
    run = Run(config((MAMBA,)))
    for c in prefill_and_decode()[:6]:
        run.do(c)
    state = run.state
    tables = ((("a", (NULL_BLOCK, 1, NULL_BLOCK, NULL_BLOCK)),),)
    assert not M.null_blocks_only_where_skipped(replace(state, tables=tables))
    three = ((("a", (3, 1, NULL_BLOCK, 2)),),)
    assert not M.mamba_holds_at_most_two_states(replace(state, tables=three))
    assert M.no_same_step_mamba_hit(state, None, None)


# --- Against vLLM 0.33 -----------------------------------------------------------------------


class Vllm033:
    """vLLM 0.33's KVCacheManager driven by the same commands."""

    def __init__(self, cfg: M.ManagerConfig) -> None:
        import torch
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            MambaSpec,
        )

        from kvspec.conformance.manager_machine import seed_none_hash

        seed_none_hash(init_none_hash, sha256, M.Hashing().hash_seed)
        register_all_kvcache_specs(None)
        specs: list[Any] = []
        for group in cfg.groups:
            if group.kind is M.Kind.FULL:
                specs.append(FullAttentionSpec(block_size=group.block_size, num_kv_heads=1,
                                               head_size=8, dtype=torch.float16))
            else:
                specs.append(MambaSpec(block_size=group.block_size, shapes=((2, 3),),
                                       dtypes=(torch.float16,), mamba_cache_mode="align"))
        kv_config = KVCacheConfig(cfg.num_blocks, [], [
            KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)])
        self.cfg = cfg
        self.manager = KVCacheManager(kv_config, max_model_len=cfg.max_model_len,
                                      scheduler_block_size=cfg.alignment,
                                      hash_block_size=cfg.hash_block_size,
                                      enable_caching=cfg.enable_caching)
        self.sha256 = sha256
        self.requests: dict[str, Any] = {}
        self.hits: dict[str, Any] = {}

    @property
    def managers(self) -> list[Any]:
        return list(self.manager.coordinator.single_type_managers)

    def do(self, c: M.ManagerCommand) -> object:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        if isinstance(c, M.AddRequest):
            self.requests[c.request_id] = Request(
                c.request_id, list(c.prompt), SamplingParams(max_tokens=1 << 20), None,
                block_hasher=get_request_block_hasher(self.cfg.hash_block_size, self.sha256))
            return None
        request: Any = self.requests.get(getattr(c, "request_id", ""))
        if isinstance(c, M.AppendTokens):
            request.append_output_token_ids(list(c.token_ids))
            return None
        if isinstance(c, M.SetComputedTokens):
            request.num_computed_tokens = c.num_tokens
            return None
        if isinstance(c, M.GetComputedBlocks):
            blocks, num, boundary = self.manager.get_computed_blocks(request)
            self.hits[c.request_id] = blocks
            return _ids(blocks.blocks), num, boundary
        if isinstance(c, M.AllocateSlots):
            hits = self.hits[c.request_id] if c.with_hits else None
            new = self.manager.allocate_slots(request, c.num_new_tokens,
                                              c.num_new_computed_tokens, hits,
                                              num_lookahead_tokens=c.num_lookahead_tokens)
            return None if new is None else _ids(new.blocks)
        if isinstance(c, M.Free):
            self.manager.free(request)
            return None
        if isinstance(c, M.NewStep):
            self.manager.new_step_starts()
            return None
        raise AssertionError(f"no vLLM call for {c!r}")

    def view(self) -> dict[str, object]:
        pool = self.manager.block_pool
        n = self.cfg.num_blocks
        mamba: list[object] = []
        for m in self.managers:
            if getattr(m, "mamba_cache_mode", None) == "align":
                retired = vllm_internals.mamba_retired_blocks(m)
                allocated = vllm_internals.mamba_allocated_requests(m)
                rids = set(m.last_state_block_idx) | set(retired) | set(allocated)
                mamba.append(tuple(sorted(
                    (rid, M.MambaAlign(m.last_state_block_idx.get(rid), retired.get(rid, 0),
                                       rid in allocated)) for rid in rids)))
            else:
                mamba.append(())
        return {
            "tables": tuple(tuple(sorted((rid, tuple(b.block_id for b in blocks))
                                         for rid, blocks in m.req_to_blocks.items() if blocks))
                            for m in self.managers),
            "num_cached": tuple(tuple(sorted(m.num_cached_block.items()))
                                for m in self.managers),
            "ref": tuple(pool.blocks[b].ref_cnt for b in range(1, n)),
            "free": tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks()),
            "keys": tuple(None if pool.blocks[b].block_hash is None
                          else bytes(pool.blocks[b].block_hash) for b in range(1, n)),
            "mamba": tuple(mamba),
            "cached_this_step": tuple(sorted(bytes(k) for m in self.managers
                                             for k in getattr(m, "cached_blocks_this_step",
                                                              ()))),
        }


def _ids(groups: Sequence[Sequence[Any]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(b.block_id for b in group) for group in groups)


def spec_view(state: M.ManagerState) -> dict[str, object]:
    n = state.config.num_blocks
    mamba = state.mamba or tuple(() for _ in state.config.groups)
    return {
        "tables": state.tables,
        "num_cached": state.num_cached,
        "ref": state.pool.ref[1:n],
        "free": state.pool.free,
        "keys": state.pool.key_of[1:n],
        "mamba": mamba,
        "cached_this_step": state.cached_this_step,
    }


def _vllm_033() -> None:
    vllm = pytest.importorskip("vllm")
    if not str(vllm.__version__).startswith("0.33"):
        pytest.skip(f"needs vLLM 0.33, found {vllm.__version__}")


Scenario = tuple[tuple[M.GroupSpec, ...], int, list[M.ManagerCommand]]
SCENARIOS: dict[str, Scenario] = {
    "mamba-prefill-decode": ((MAMBA,), 10, [*prefill_and_decode(), M.Free("a")]),
    "mamba-same-step": ((MAMBA,), 10, [
        *prefill_and_decode()[:3], M.AddRequest("b", PROMPT), M.GetComputedBlocks("b"),
        M.AllocateSlots("b", 3, 4, with_hits=True), M.NewStep(),
        M.AllocateSlots("b", 3, 4, with_hits=True), M.SetComputedTokens("b", 7),
        M.AppendTokens("b", (8,)), M.AllocateSlots("b", 1), M.Free("b"), M.Free("a")]),
    "mamba-short-pool": ((MAMBA,), 4, [
        M.AddRequest("a", tuple(range(1, 31))), M.AllocateSlots("a", 20),
        M.SetComputedTokens("a", 20), M.AllocateSlots("a", 9), M.AddRequest("b", (9, 9, 9)),
        M.AllocateSlots("b", 3), M.Free("a"), M.AllocateSlots("b", 3)]),
    "jamba-prefill-decode": ((FULL, MAMBA), 16, [*prefill_and_decode(), M.Free("a")]),
    "jamba-same-step-and-hit": ((FULL, MAMBA), 16, [
        *prefill_and_decode()[:3], M.AddRequest("b", PROMPT), M.GetComputedBlocks("b"),
        M.AllocateSlots("b", 3, 4, with_hits=True), M.NewStep(), M.GetComputedBlocks("b"),
        M.AllocateSlots("b", 3, 4, with_hits=True), M.SetComputedTokens("b", 7),
        M.AppendTokens("b", (8,)), M.AllocateSlots("b", 1), M.SetComputedTokens("a", 4),
        M.AllocateSlots("a", 3), M.Free("a"), M.NewStep(), M.SetComputedTokens("b", 8),
        M.AppendTokens("b", (9,)), M.AllocateSlots("b", 1), M.AddRequest("c", PROMPT + (8, 9)),
        M.GetComputedBlocks("c"), M.AllocateSlots("c", 1, 8, with_hits=True), M.Free("b"),
        M.Free("c")]),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_same_calls_on_vllm_033(name: str) -> None:
    _vllm_033()
    groups, num_blocks, commands = SCENARIOS[name]
    cfg = config(groups, num_blocks)
    run = Run(cfg)
    target = Vllm033(cfg)
    assert spec_view(run.state) == target.view()
    for index, command in enumerate(commands):
        expected = run.do(command)
        got = target.do(command)
        where = f"{name} call {index}: {command!r}"
        assert got == expected, where
        spec, real = spec_view(run.state), target.view()
        for part in spec:
            assert spec[part] == real[part], f"{where}: {part}"


def test_pure_scenarios_keep_the_invariants() -> None:
    for groups, num_blocks, commands in SCENARIOS.values():
        run = Run(config(groups, num_blocks))
        for command in commands:
            run.do(command)
        assert all(M.released(run.state, rid) for rid, _ in run.session.requests
                   if rid not in {r for t in run.state.tables for r, _ in t})


ROLLBACK: list[M.ManagerCommand] = [
    M.AddRequest("a", tuple(range(1, 21))), M.AllocateSlots("a", 12),
    M.SetComputedTokens("a", 4), M.AllocateSlots("a", 1, num_lookahead_tokens=8)]


def test_rolled_back_mamba_surplus_does_not_pay_for_full_attention() -> None:
    """After its computed tokens go back (rejected drafts), an align-mode Mamba table is
    longer than the tokens need. Its surplus is no use to the full-attention group, which
    here needs one block more than the pool has: the spec refuses."""
    run = Run(config((FULL, MAMBA), num_blocks=8))
    outs = [run.do(c) for c in ROLLBACK]
    assert outs[1] == ((1, 2, 3, 4, 5, 6), (NULL_BLOCK,) * 5 + (7,))
    assert outs[3] is None


def test_vllm_033_lets_a_mamba_surplus_pay_for_another_group() -> None:
    """Candidate vLLM 0.33 bug: MambaManager.get_num_blocks_to_allocate returns a negative
    count in align mode (single_type_kv_cache_manager.py:1736-1741, unclamped) and the
    coordinator sums the groups' counts as they are (kv_cache_coordinator.py:236-262), so
    allocate_slots passes its capacity check (kv_cache_manager.py:583-588) and the
    full-attention group's get_new_blocks raises ValueError mid-allocation."""
    _vllm_033()
    cfg = config((FULL, MAMBA), num_blocks=8)
    target = Vllm033(cfg)
    for command in ROLLBACK[:3]:
        target.do(command)
    with pytest.raises(ValueError, match="free blocks"):
        target.do(ROLLBACK[3])
