"""The attention layer: each attention type's single-type manager driven directly.

The coordinators call a single-type manager (``FullAttentionManager``,
``SlidingWindowManager``, ``ChunkedLocalAttentionManager``, ``MambaManager``) for every group
of its type and read back only what they need, so a manager that returns too long a list for
the second group of a lookup, or frees a null block, passes every manager-level check. This
layer calls the managers' own public methods, one step at a time, against the spec's functions
for one attention type (`spec.manager`'s ``type_cache_hit``, ``skipped_blocks_to_free``,
``type_blocks_to_allocate``, ``type_common_prefix_blocks``, and `spec.pool` under them):

* ``find_longest_cache_hit`` over one or several KV-cache group ids (every list the same
  length: the common-length cut), with and without EAGLE;
* ``get_num_blocks_to_allocate``, ``save_new_computed_blocks`` (after the caller's ``touch``),
  ``allocate_new_blocks``, ``cache_blocks``, ``free``;
* ``remove_skipped_blocks`` (and kvspec's ``skipped_blocks_to_free``, where the target has
  it), whose walk down stops at the first null block;
* ``get_num_common_prefix_blocks``.

Each example builds one pool of 2-16 blocks and one manager per group (1-2 groups of the one
type); request ids flow through a Bundle. After every step the target's tables, cached
counts and pool (ref counts, free order, keys) must equal the spec's, and the named invariants
of the type hold on the target's state.

Targets (`adapter_for`): ``impl``, and ``vllm`` for vLLM 0.13's classes (its API: the
``..._013`` adapter). vLLM 0.33's managers take another constructor and return
``(blocks, hit_length)`` from ``find_longest_cache_hit``: the layer reports them unavailable
until it has an adapter for that API.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from hypothesis import event, note, strategies as st
from hypothesis.stateful import Bundle, initialize, invariant, precondition, rule

from kvspec.conformance.deadline import BoundedSteps
from kvspec.conformance.targets import pool_view
from kvspec.spec import manager as model, pool as P
from kvspec.spec.manager import GroupSpec, Kind
from kvspec.spec.pool import NULL_BLOCK, Profile

KINDS = (Kind.FULL, Kind.SLIDING_WINDOW, Kind.CHUNKED_LOCAL, Kind.MAMBA)
MANAGER_NAMES = {Kind.FULL: "FullAttentionManager", Kind.SLIDING_WINDOW: "SlidingWindowManager",
                 Kind.CHUNKED_LOCAL: "ChunkedLocalAttentionManager", Kind.MAMBA: "MambaManager"}
MAX_HASHES = 6  # a request's prompt: up to this many full blocks
OUT_OF_CONTRACT: tuple[str, ...] = ()


def _hash(i: int, prefix: int) -> bytes:
    """The chain hash of block ``i`` of a prompt of family ``prefix`` (two families share
    their first block, so hits run out part way)."""
    return bytes([0 if i == 0 else prefix, i]) * 16


# --- Targets ---------------------------------------------------------------------------------


class ImplAttention:
    """impl's BlockPool and single-type managers (vLLM 0.13's API)."""

    name = "impl"
    pool_module = "kvspec.impl.block_pool"
    manager_module = "kvspec.impl.single_type_kv_cache_manager"
    has_skipped_blocks_to_free = True
    profile = Profile.V0_13
    mamba_keeps_blocks = False  # vLLM 0.13.0's MambaManager skips nothing (findings M1)
    notes: tuple[str, ...] = ()  # what an audit report says about this target

    def spec_object(self, group: GroupSpec) -> Any:
        from kvspec.impl import kv_cache_interface as kv

        bs = group.block_size
        if group.kind is Kind.FULL:
            return kv.FullAttentionSpec(bs, 1, 8, "float16")
        if group.kind is Kind.SLIDING_WINDOW:
            return kv.SlidingWindowSpec(bs, 1, 8, "float16", sliding_window=group.sliding_window)
        if group.kind is Kind.CHUNKED_LOCAL:
            return kv.ChunkedLocalAttentionSpec(bs, 1, 8, "float16",
                                                attention_chunk_size=group.attention_chunk_size)
        return kv.MambaSpec(bs, shapes=((2, 3),), dtypes=("float16",),
                            num_speculative_blocks=group.num_speculative_blocks)

    def build(self, group: GroupSpec, num_groups: int, num_blocks: int) -> None:
        import importlib

        pool_class = importlib.import_module(self.pool_module).BlockPool
        managers = importlib.import_module(self.manager_module)
        self.pool = pool_class(num_blocks, enable_caching=True, hash_block_size=group.block_size)
        self.manager_class = getattr(managers, MANAGER_NAMES[group.kind])
        self.kv_spec = self.spec_object(group)
        self.managers = [self.manager_class(self.kv_spec, block_pool=self.pool,
                                            kv_cache_group_id=g) for g in range(num_groups)]

    def blocks(self, ids: tuple[int, ...]) -> list[Any]:
        return [self.pool.blocks[b] for b in ids]

    def find_longest_cache_hit(self, hashes: list[bytes], max_length: int, group_ids: list[int],
                               use_eagle: bool, alignment: int) -> tuple[tuple[int, ...], ...]:
        found = self.manager_class.find_longest_cache_hit(
            hashes, max_length, group_ids, self.pool, self.kv_spec, use_eagle, alignment)
        return tuple(tuple(b.block_id for b in blocks) for blocks in found)

    def get_num_blocks_to_allocate(self, g: int, rid: str, num_tokens: int,
                                   hits: tuple[int, ...]) -> int:
        return int(self.managers[g].get_num_blocks_to_allocate(rid, num_tokens, self.blocks(hits)))

    def attach_hits(self, rid: str, hits: tuple[tuple[int, ...], ...]) -> None:
        self.touch([b for group_hits in hits for b in group_hits])
        for manager, group_hits in zip(self.managers, hits, strict=True):
            manager.save_new_computed_blocks(rid, self.blocks(group_hits))

    def touch(self, ids: list[int]) -> None:
        self.pool.touch((self.blocks(tuple(ids)),))

    def allocate_new_blocks(self, g: int, rid: str, num_tokens: int) -> tuple[int, ...]:
        return tuple(b.block_id for b in self.managers[g].allocate_new_blocks(rid, num_tokens))

    def request(self, rid: str, hashes: tuple[bytes, ...], block_size: int) -> Any:
        return SimpleNamespace(
            request_id=rid, block_hashes=list(hashes),
            all_token_ids=list(range(len(hashes) * block_size)), lora_request=None,
            mm_features=[], cache_salt=None, prompt_embeds=None, session_id=None,
            _prompt_embeds_per_block_hashes={})

    def cache_blocks(self, g: int, request: Any, num_tokens: int) -> None:
        self.managers[g].cache_blocks(request, num_tokens)

    def remove_skipped_blocks(self, g: int, rid: str, num_computed: int) -> None:
        self.managers[g].remove_skipped_blocks(rid, num_computed)

    def skipped_blocks_to_free(self, g: int, rid: str, num_computed: int) -> tuple[int, ...]:
        return tuple(self.managers[g].skipped_blocks_to_free(rid, num_computed))

    def free(self, g: int, rid: str) -> None:
        self.managers[g].free(rid)

    def common_prefix(self, g: int, rid: str) -> int:
        return int(self.managers[g].get_num_common_prefix_blocks(rid))

    def tables(self) -> tuple[dict[str, tuple[int, ...]], ...]:
        """Per group, the requests holding blocks (an empty entry is no request: M2)."""
        return tuple({rid: tuple(b.block_id for b in blocks)
                      for rid, blocks in m.req_to_blocks.items() if blocks}
                     for m in self.managers)

    def num_entries(self, g: int) -> int:
        """Request entries of group g's manager, empty ones included."""
        return len(self.managers[g].req_to_blocks)

    def cached_counts(self) -> tuple[dict[str, int], ...]:
        return tuple(dict(m.num_cached_block) for m in self.managers)


class Vllm013Attention(ImplAttention):
    """vLLM 0.13's BlockPool and single-type managers (no ``skipped_blocks_to_free``)."""

    name = "vllm"
    pool_module = "vllm.v1.core.block_pool"
    manager_module = "vllm.v1.core.single_type_kv_cache_manager"
    has_skipped_blocks_to_free = False
    mamba_keeps_blocks = True
    notes = ("vLLM 0.13 has no skipped_blocks_to_free: remove_skipped_blocks is compared by "
             "its effect", "Mamba keeps its blocks in vLLM 0.13.0 (findings M1): the spec "
             "is run with mamba_keeps_blocks")

    def spec_object(self, group: GroupSpec) -> Any:
        from kvspec.conformance.vllm_targets import vllm_spec

        return vllm_spec(super().spec_object(group))

    def skipped_blocks_to_free(self, g: int, rid: str, num_computed: int) -> tuple[int, ...]:
        raise NotImplementedError("vLLM has no skipped_blocks_to_free")


def adapter_for(target: str) -> type[ImplAttention]:
    """The adapter maker for ``impl`` or ``vllm`` (vLLM 0.13's API)."""
    from kvspec.conformance.vllm_targets import LayerUnavailable, TargetError, vllm_version

    if target == "impl":
        return ImplAttention
    if target != "vllm":
        raise LayerUnavailable(f"the attention layer audits impl or vllm, not {target!r}")
    version = vllm_version()
    if version is None:
        from kvspec.conformance.vllm_targets import no_vllm_message

        raise TargetError(no_vllm_message())
    import inspect

    from vllm.v1.core import single_type_kv_cache_manager as stm

    parameters = inspect.signature(stm.SingleTypeKVCacheManager.__init__).parameters
    if "scheduler_block_size" in parameters:
        raise LayerUnavailable(
            f"no attention-layer adapter for vLLM {version}'s single-type managers yet "
            "(constructor takes enable_caching and scheduler_block_size; "
            "find_longest_cache_hit returns (blocks, hit_length))")
    return Vllm013Attention


# --- The spec side ---------------------------------------------------------------------------


@dataclass
class Model:
    """The spec's state for one attention type: the pool and, per group, each request's block
    list and how many of its blocks are keyed."""

    group: GroupSpec
    pool: P.PoolState
    tables: list[dict[str, tuple[int, ...]]]
    cached: list[dict[str, int]]

    def num_slots(self, g: int, rid: str) -> int:
        return len(self.tables[g].get(rid, ())) * self.group.block_size


# --- The machine -----------------------------------------------------------------------------


class AttentionMachine(BoundedSteps):
    """One attention type's managers over one pool, against `spec.manager`'s functions."""

    make_adapter: type[ImplAttention]
    requests = Bundle("requests")
    # Known vLLM findings a regression run steps around (an audit tolerates none):
    # "B1": caching a range that holds null blocks (0.13 keys the null block, then asserts);
    # "M2": get_num_common_prefix_blocks while a refused request left an empty entry behind.
    tolerate: frozenset[str] = frozenset()

    def __init__(self) -> None:
        super().__init__()
        self.target = type(self).make_adapter()
        self.profile = self.target.profile
        self.model: Model | None = None
        self.counter = 0
        self.hashes: dict[str, tuple[bytes, ...]] = {}

    # -- building ----------------------------------------------------------------------------

    @initialize(kind=st.sampled_from(KINDS), block_size=st.sampled_from([1, 2, 4]),
                num_blocks=st.integers(2, 16), num_groups=st.sampled_from([2, 1]),
                window=st.integers(1, 9), chunk_blocks=st.integers(1, 3),
                speculative=st.integers(0, 1))
    def build(self, kind: Kind, block_size: int, num_blocks: int, num_groups: int, window: int,
              chunk_blocks: int, speculative: int) -> None:
        group = GroupSpec(
            kind, block_size,
            sliding_window=window if kind is Kind.SLIDING_WINDOW else 0,
            attention_chunk_size=chunk_blocks * block_size if kind is Kind.CHUNKED_LOCAL else 0,
            num_speculative_blocks=speculative if kind is Kind.MAMBA else 0)
        event(f"attention type {kind.value}, {num_groups} group(s)")
        self.target.build(group, num_groups, num_blocks)
        self.model = Model(group, P.new_pool(num_blocks, True, False, self.profile),
                           [{} for _ in range(num_groups)], [{} for _ in range(num_groups)])

    @property
    def spec(self) -> Model:
        assert self.model is not None
        return self.model

    def groups(self) -> range:
        return range(len(self.spec.tables))

    # -- rules: what a coordinator does with its managers ------------------------------------

    @initialize(target=requests, prefix=st.integers(1, 2),
                num_hashes=st.integers(1, MAX_HASHES))
    def first_request(self, prefix: int, num_hashes: int) -> str:
        """A request exists from the start (every other rule takes one)."""
        return self._make_request(prefix, num_hashes)

    @rule(target=requests, prefix=st.integers(1, 2), num_hashes=st.integers(0, MAX_HASHES))
    def new_request(self, prefix: int, num_hashes: int) -> str:
        """A request whose prompt is ``num_hashes`` full blocks of family ``prefix`` (requests
        of one family hit each other's blocks; the two families share their first block)."""
        return self._make_request(prefix, num_hashes)

    def _make_request(self, prefix: int, num_hashes: int) -> str:
        rid = f"r{self.counter}"
        self.counter += 1
        self.hashes[rid] = tuple(_hash(i, prefix) for i in range(num_hashes))
        return rid

    @rule(rid=requests, data=st.data())
    def look_up_hit(self, rid: str, data: st.DataObject) -> None:
        """find_longest_cache_hit over the request's hashes, for all groups or a subset."""
        m = self.spec
        group_ids = data.draw(st.sampled_from(
            [list(self.groups()), [0]] + ([[1, 0], [1]] if len(m.tables) > 1 else [])),
            "group_ids")
        hashes = self.hashes[rid]
        bs = m.group.block_size
        # Within the hashes: a coordinator never asks past them (vLLM indexes them).
        max_length = data.draw(st.integers(0, len(hashes) * bs), "max_length")
        eagle = m.group.kind is not Kind.CHUNKED_LOCAL and data.draw(st.booleans(), "eagle")
        alignment = bs
        expected = model.type_cache_hit(m.pool, m.group, group_ids, hashes, max_length,
                                        alignment, eagle)
        actual = self.target.find_longest_cache_hit(list(hashes), max_length, group_ids, eagle,
                                                    alignment)
        if actual != expected:
            raise AssertionError(
                f"find_longest_cache_hit(max_length={max_length}, kv_cache_group_ids="
                f"{group_ids}, use_eagle={eagle}): target {actual}, spec {expected}")
        assert model.same_length_in_every_group(expected)
        event(f"find_longest_cache_hit: {len(group_ids)} group id(s), "
              f"{'a hit' if expected and expected[0] else 'no hit'}")

    @precondition(lambda self: self.model is not None)
    @rule(rid=requests, data=st.data())
    def ask_blocks_to_allocate(self, rid: str, data: st.DataObject) -> None:
        """get_num_blocks_to_allocate for a request that holds blocks (a running one)."""
        m = self.spec
        g = data.draw(st.sampled_from(list(self.groups())), "group")
        held = m.tables[g].get(rid)
        if held is None:
            return
        num_tokens = data.draw(st.integers(0, (MAX_HASHES + 2) * m.group.block_size), "tokens")
        expected = model.type_blocks_to_allocate(m.pool, m.group, num_tokens, held, ())
        actual = self.target.get_num_blocks_to_allocate(g, rid, num_tokens, ())
        if actual != expected:
            raise AssertionError(f"get_num_blocks_to_allocate({rid!r}, {num_tokens}): target "
                                 f"{actual}, spec {expected}")
        event("get_num_blocks_to_allocate")

    @rule(rid=requests, data=st.data())
    def schedule_new_request(self, rid: str, data: st.DataObject) -> None:
        """A new request: look up its hit in every group, count, touch and save the hits,
        allocate the rest of its prompt (when it fits), key its full blocks."""
        m = self.spec
        if any(rid in table for table in m.tables):
            return
        hashes = self.hashes[rid]
        bs = m.group.block_size
        num_tokens = max(len(hashes) * bs, 1)
        group_ids = list(self.groups())
        # The lookup in group order, and in reverse (a manager's lists follow the ids' order).
        for ids in (group_ids, group_ids[::-1]):
            expected_hit = model.type_cache_hit(m.pool, m.group, ids, hashes, num_tokens - 1,
                                                bs, False)
            actual_hit = self.target.find_longest_cache_hit(list(hashes), num_tokens - 1, ids,
                                                            False, bs)
            if actual_hit != expected_hit:
                raise AssertionError(f"find_longest_cache_hit(max_length={num_tokens - 1}, "
                                     f"kv_cache_group_ids={ids}): target {actual_hit}, spec "
                                     f"{expected_hit}")
        hit = model.type_cache_hit(m.pool, m.group, group_ids, hashes, num_tokens - 1, bs, False)
        wanted = 0
        for g in group_ids:
            expected = model.type_blocks_to_allocate(m.pool, m.group, num_tokens, (), hit[g])
            actual = self.target.get_num_blocks_to_allocate(g, rid, num_tokens, hit[g])
            if actual != expected:
                raise AssertionError(f"get_num_blocks_to_allocate({rid!r}, {num_tokens}, hits "
                                     f"{hit[g]}): target {actual}, spec {expected}")
            wanted += max(expected, 0)
        if wanted > P.num_free(m.pool):
            event("schedule_new_request: pool too small")
            return
        real = [b for group_hits in hit for b in group_hits if b != NULL_BLOCK]
        m.pool = P.touch(m.pool, [b for group_hits in hit for b in group_hits])
        self.target.attach_hits(rid, hit)
        for g in group_ids:
            m.tables[g][rid] = hit[g]
            m.cached[g][rid] = len(hit[g])
        event(f"schedule_new_request: {'hit' if real else 'no hit'}")
        self._allocate(rid, num_tokens)
        # Each manager keys its blocks when its caller says: some groups now, the rest later
        # (so that groups of one type can hold different cached prefixes of the same hashes).
        groups = data.draw(st.sampled_from([group_ids, group_ids[:1], group_ids[1:]]),
                           "groups cached now")
        self._cache(rid, num_tokens, groups)

    def _allocate(self, rid: str, num_tokens: int) -> None:
        m = self.spec
        for g in self.groups():
            held = m.tables[g].get(rid, ())
            missing = model.type_blocks_to_allocate(m.pool, m.group, num_tokens, held, ())
            taken: tuple[int, ...] = ()
            if missing > 0:
                m.pool, taken = P.get_new_blocks(m.pool, missing)
            actual = self.target.allocate_new_blocks(g, rid, num_tokens)
            if actual != taken:
                raise AssertionError(f"allocate_new_blocks({rid!r}, {num_tokens}) in group {g}: "
                                     f"target {actual}, spec {taken}")
            m.tables[g][rid] = held + taken

    def _cache(self, rid: str, num_tokens: int, groups: Sequence[int] | None = None) -> None:
        m = self.spec
        hashes = self.hashes[rid]
        bs = m.group.block_size
        num_tokens = min(num_tokens, len(hashes) * bs)
        request = self.target.request(rid, hashes, bs)
        for g in self.groups() if groups is None else groups:
            blocks = m.tables[g].get(rid, ())
            num_full = min(num_tokens, len(blocks) * bs) // bs
            num_cached = m.cached[g].get(rid, 0)
            if "B1" in self.tolerate and NULL_BLOCK in blocks[num_cached:num_full]:
                event("cache_blocks: a range with null blocks left out (B1)")
                continue
            if num_cached < num_full:
                m.pool = P.cache_full_blocks(
                    m.pool, blocks, hashes, num_cached, num_full, g,
                    token_ids=tuple(range(num_cached * bs, num_full * bs)), block_size=bs)
                m.cached[g][rid] = num_full
            self.target.cache_blocks(g, request, num_full * bs)

    @rule(rid=requests, data=st.data())
    def cache_blocks(self, rid: str, data: st.DataObject) -> None:
        """cache_blocks of one group's manager, for tokens the request holds slots for."""
        m = self.spec
        g = data.draw(st.sampled_from(list(self.groups())), "group")
        if rid not in m.tables[g]:
            return
        self._cache(rid, data.draw(st.integers(0, m.num_slots(g, rid)), "num_tokens"), [g])
        event("cache_blocks")

    @rule(rid=requests, data=st.data())
    def decode(self, rid: str, data: st.DataObject) -> None:
        """A running request grows by a few tokens: its out-of-window blocks go first, then
        new blocks (when they fit), then its full blocks are keyed."""
        m = self.spec
        if rid not in m.tables[0]:
            return
        bs = m.group.block_size
        held_tokens = min(m.num_slots(g, rid) for g in self.groups())
        computed = data.draw(st.integers(0, held_tokens), "num_computed_tokens")
        self._remove_skipped(rid, computed)
        grow = data.draw(st.integers(1, 2 * bs), "new_tokens")
        num_tokens = computed + grow
        wanted = sum(max(model.type_blocks_to_allocate(m.pool, m.group, num_tokens,
                                                       m.tables[g][rid], ()), 0)
                     for g in self.groups())
        if wanted > P.num_free(m.pool):
            event("decode: pool too small")
            return
        self._allocate(rid, num_tokens)
        self._cache(rid, computed)
        event("decode")

    def _remove_skipped(self, rid: str, computed: int) -> None:
        m = self.spec
        for g in self.groups():
            blocks = m.tables[g][rid]
            indices = model.skipped_blocks_to_free(blocks, m.group, computed,
                                                   self.target.mamba_keeps_blocks)
            if self.target.has_skipped_blocks_to_free:
                actual = self.target.skipped_blocks_to_free(g, rid, computed)
                if actual != indices:
                    raise AssertionError(
                        f"skipped_blocks_to_free({rid!r}, {computed}) in group {g}: target "
                        f"{list(actual)}, spec {list(indices)} (blocks {blocks})")
            if indices:
                m.pool = P.free_blocks(m.pool, [blocks[i] for i in indices])
                nulled = list(blocks)
                for i in indices:
                    nulled[i] = NULL_BLOCK
                m.tables[g][rid] = tuple(nulled)
                event(f"remove_skipped_blocks frees {min(len(indices), 3)}+ block(s)"
                      + (" after null blocks" if NULL_BLOCK in blocks else ""))
            self.target.remove_skipped_blocks(g, rid, computed)

    @rule(rid=requests, data=st.data())
    def remove_skipped_blocks(self, rid: str, data: st.DataObject) -> None:
        """remove_skipped_blocks on its own, for a count of tokens the request holds slots for
        (called twice in a row, the second walk stops at the null blocks of the first)."""
        m = self.spec
        if rid not in m.tables[0]:
            return
        held_tokens = min(m.num_slots(g, rid) for g in self.groups())
        computed = data.draw(st.integers(0, held_tokens), "num_computed_tokens")
        self._remove_skipped(rid, computed)
        self._remove_skipped(rid, computed)

    @rule(rid=requests)
    def finish(self, rid: str) -> None:
        """free in every group: each list released last block first."""
        m = self.spec
        for g in self.groups():
            blocks = m.tables[g].pop(rid, None)
            m.cached[g].pop(rid, None)
            if blocks:
                m.pool = P.free_blocks(m.pool, tuple(reversed(blocks)))
            self.target.free(g, rid)
        event("free")

    @rule(rid=requests, data=st.data())
    def common_prefix(self, rid: str, data: st.DataObject) -> None:
        m = self.spec
        g = data.draw(st.sampled_from(list(self.groups())), "group")
        if rid not in m.tables[g]:
            return
        if "M2" in self.tolerate and self.target.num_entries(g) != len(m.tables[g]):
            event("get_num_common_prefix_blocks: left out after an empty entry (M2)")
            return
        expected = model.type_common_prefix_blocks(m.pool, m.group, m.tables[g][rid],
                                                   len(m.tables[g]))
        actual = self.target.common_prefix(g, rid)
        if actual != expected:
            raise AssertionError(f"get_num_common_prefix_blocks({rid!r}): target {actual}, "
                                 f"spec {expected}")

    # -- invariants on the target's state ----------------------------------------------------

    @invariant()
    def tables_match_spec(self) -> None:
        if self.model is None:
            return
        expected = tuple({r: b for r, b in t.items() if b} for t in self.spec.tables)
        actual = self.target.tables()
        if actual != expected:
            raise AssertionError(f"tables_match_spec: target {actual}, spec {expected}")
        cached = tuple(dict(c) for c in self.spec.cached)
        if self.target.cached_counts() != cached:
            raise AssertionError(f"tables_match_spec: cached counts target "
                                 f"{self.target.cached_counts()}, spec {cached}")

    @invariant()
    def pool_matches_spec(self) -> None:
        if self.model is None:
            return
        view = pool_view(self.target.pool)
        state = self.spec.pool
        ref = tuple(0 if i == NULL_BLOCK else r for i, r in enumerate(state.ref))
        for name, actual, expected in (("ref counts", view.ref, ref),
                                       ("free order", view.free, state.free),
                                       ("keys", view.key_of, state.key_of)):
            if tuple(actual) != tuple(expected):
                note(f"target {name}: {actual}\nspec {name}:   {expected}")
                raise AssertionError(f"pool_matches_spec: {name}: target {tuple(actual)}, "
                                     f"spec {tuple(expected)}")

    @invariant()
    def null_blocks_only_where_skipped(self) -> None:
        """The type's invariant on the target's tables: full attention holds no null block;
        the others null blocks only before their real ones."""
        if self.model is None:
            return
        state = self._as_manager_state()
        if not model.null_blocks_only_where_skipped(state):
            raise AssertionError("invariant null_blocks_only_where_skipped violated")

    @invariant()
    def ref_counts_are_references(self) -> None:
        """Every real block's ref count is the number of lists holding it (on the target)."""
        if self.model is None:
            return
        if not model.ref_counts_are_references(self._as_manager_state()):
            raise AssertionError("invariant ref_counts_are_references violated")

    def _as_manager_state(self) -> model.ManagerState:
        """The target's tables and the spec's pool as a `spec.manager` state."""
        m = self.spec
        view = pool_view(self.target.pool)
        ref = tuple(0 if i == NULL_BLOCK else r for i, r in enumerate(view.ref))
        groups = tuple(m.group for _ in m.tables)
        config = model.ManagerConfig(groups, m.pool.num_blocks, 1 << 20, m.group.block_size,
                                     profile=self.profile)
        tables = tuple(tuple(sorted(t.items())) for t in self.target.tables())
        counts = tuple(tuple(sorted(c.items())) for c in self.target.cached_counts())
        return model.ManagerState(config, replace(m.pool, ref=ref), tables, counts,
                                  tuple(() for _ in m.tables))


def machine_for(make_adapter: type[ImplAttention],
                tolerate: frozenset[str] = frozenset()) -> type[AttentionMachine]:
    """An AttentionMachine subclass that checks the targets make_adapter makes (``tolerate``:
    known findings to step around, for a regression run)."""
    return type("AttentionConformance", (AttentionMachine,),
                {"make_adapter": staticmethod(make_adapter), "tolerate": tolerate})


__all__ = ["OUT_OF_CONTRACT", "AttentionMachine", "ImplAttention", "Vllm013Attention",
           "adapter_for", "machine_for"]
