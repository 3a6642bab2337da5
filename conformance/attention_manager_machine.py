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

Targets (`adapter_for`): ``impl``, and ``vllm`` for vLLM 0.13's classes (`Vllm013Attention`)
or vLLM 0.33's (`Vllm033Attention`, picked by the managers' constructor). 0.33's API: the
managers take ``enable_caching`` and ``scheduler_block_size``; ``find_longest_cache_hit``
returns ``(blocks, hit_length)`` (checked: ``hit_length_matches_blocks``) and takes
``drop_eagle_block``; hits are attached by ``add_local_computed_blocks``, which touches them
itself; ``get_num_blocks_to_allocate`` never returns less than the evictable hits and takes
an admission cap (``apply_admission_cap``); there is no ``get_num_common_prefix_blocks``.
The spec's pool then follows 0.33's (`Profile.V0_33`). Mamba's align mode (0.33's only
cached Mamba mode) is covered by the manager layer, not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from hypothesis import assume, event, note, strategies as st
from hypothesis.stateful import Bundle, initialize, invariant, precondition, rule

from kvspec.conformance.deadline import BoundedSteps
from kvspec.conformance.targets import pool_view
from kvspec.spec import attention_rules as rules, manager as model, pool as P
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
    api = "vLLM 0.13 single-type manager API"
    kinds: tuple[Kind, ...] = KINDS  # the attention types the layer runs
    min_sliding_window = 1
    has_common_prefix = True  # get_num_common_prefix_blocks exists
    attach_skips_window = False  # attaching hits nulls (and does not touch) skipped ones
    clamps_blocks_to_allocate = False  # get_num_blocks_to_allocate >= the evictable hits

    def admission_cap(self, g: int) -> int | None:
        """The manager's ``max_admission_blocks_per_request`` (None: no cap, or no such
        API)."""
        return None

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
        # impl's pool serves the API of the Python's vLLM by default (0.33's inside a vLLM
        # 0.33 process): this adapter is 0.13's API, under the 0.13 profile.
        api = {"vllm_api": "0.13"} if self.name == "impl" else {}
        self.pool = pool_class(num_blocks, enable_caching=True, hash_block_size=group.block_size,
                               **api)
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
                                   hits: tuple[int, ...], apply_cap: bool = False) -> int:
        assert not apply_cap, "vLLM 0.13's API has no admission cap"
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


MAX_IN_FLIGHT_TOKENS = 3  # the managers' admission caps are built for this many tokens in flight
MAX_MODEL_LEN = 64


class Vllm033Attention(ImplAttention):
    """vLLM 0.33's BlockPool and single-type managers, built directly (no registry), each
    attention type's manager with the admission cap vLLM's factory gives it
    (single_type_kv_cache_manager.py ``get_manager_for_kv_cache_spec``)."""

    name = "vllm"
    pool_module = "vllm.v1.core.block_pool"
    manager_module = "vllm.v1.core.single_type_kv_cache_manager"
    has_skipped_blocks_to_free = False
    profile = Profile.V0_33
    api = "vLLM 0.33 single-type manager API"
    kinds = (Kind.FULL, Kind.SLIDING_WINDOW, Kind.CHUNKED_LOCAL)
    min_sliding_window = 2
    has_common_prefix = False
    attach_skips_window = True
    clamps_blocks_to_allocate = True
    notes = ("vLLM 0.33 has no skipped_blocks_to_free: remove_skipped_blocks is compared by "
             "its effect",
             "vLLM 0.33 has no get_num_common_prefix_blocks: that rule is not run",
             "Mamba align mode is covered by the manager layer: the attention layer runs "
             "full, sliding-window and chunked-local attention",
             "sliding_window=1 is left out: 0.33's reachable_block_mask keys no block of such "
             "a group (a hit needs 0 contiguous blocks), which the spec does not model",
             f"admission caps: vLLM's own max_admission_blocks_per_request "
             f"(max_in_flight_tokens={MAX_IN_FLIGHT_TOKENS}, max_model_len={MAX_MODEL_LEN}); "
             "the layer checks the clamp, not the cap's value")

    def spec_object(self, group: GroupSpec) -> Any:
        import torch
        from vllm.v1 import kv_cache_interface as kv

        common: dict[str, Any] = {"block_size": group.block_size, "num_kv_heads": 1,
                                  "head_size": 8, "dtype": torch.float16}
        if group.kind is Kind.FULL:
            return kv.FullAttentionSpec(**common)
        if group.kind is Kind.SLIDING_WINDOW:
            return kv.SlidingWindowSpec(**common, sliding_window=group.sliding_window)
        if group.kind is Kind.CHUNKED_LOCAL:
            return kv.ChunkedLocalAttentionSpec(
                **common, attention_chunk_size=group.attention_chunk_size)
        raise NotImplementedError("Mamba align mode is covered by the manager layer")

    def build(self, group: GroupSpec, num_groups: int, num_blocks: int) -> None:
        import importlib

        pool_class = importlib.import_module(self.pool_module).BlockPool
        managers = importlib.import_module(self.manager_module)
        self.block_size = group.block_size
        self.pool = pool_class(num_blocks, enable_caching=True, hash_block_size=group.block_size)
        self.manager_class = getattr(managers, MANAGER_NAMES[group.kind])
        self.kv_spec = self.spec_object(group)
        self.cap: int | None = None
        if group.kind is not Kind.FULL:
            self.cap = int(self.kv_spec.max_admission_blocks_per_request(
                max_in_flight_tokens=MAX_IN_FLIGHT_TOKENS, max_model_len=MAX_MODEL_LEN))
        self.managers = [self.manager_class(
            self.kv_spec, block_pool=self.pool, enable_caching=True, kv_cache_group_id=g,
            scheduler_block_size=group.block_size, max_admission_blocks_per_request=self.cap)
            for g in range(num_groups)]

    def admission_cap(self, g: int) -> int | None:
        return self.cap

    def find_longest_cache_hit(self, hashes: list[bytes], max_length: int, group_ids: list[int],
                               use_eagle: bool, alignment: int) -> tuple[tuple[int, ...], ...]:
        found, hit_length = self.manager_class.find_longest_cache_hit(
            hashes, max_length, group_ids, self.pool, self.kv_spec, drop_eagle_block=use_eagle,
            alignment_tokens=alignment)
        blocks = tuple(tuple(b.block_id for b in group_blocks) for group_blocks in found)
        expected_length = len(blocks[0]) * self.block_size if blocks else 0
        if hit_length != expected_length:
            raise AssertionError(
                f"hit_length_matches_blocks: find_longest_cache_hit(max_length={max_length}, "
                f"kv_cache_group_ids={group_ids}) returned hit_length {hit_length} with "
                f"{len(blocks[0]) if blocks else 0} block(s) of {self.block_size} tokens")
        return blocks

    def get_num_blocks_to_allocate(self, g: int, rid: str, num_tokens: int,
                                   hits: tuple[int, ...], apply_cap: bool = False) -> int:
        # What allocate_slots passes for a request with no external tokens: the local hit is
        # every computed token (a running request takes the fast path, which reads neither).
        computed = len(hits) * self.block_size
        return int(self.managers[g].get_num_blocks_to_allocate(
            rid, num_tokens, self.blocks(hits), computed, computed, num_tokens,
            apply_admission_cap=apply_cap))

    def attach_hits(self, rid: str, hits: tuple[tuple[int, ...], ...]) -> None:
        for manager, group_hits in zip(self.managers, hits, strict=True):
            manager.add_local_computed_blocks(rid, self.blocks(group_hits),
                                              len(group_hits) * self.block_size, 0)

    def touch(self, ids: list[int]) -> None:
        self.pool.touch(self.blocks(tuple(ids)))

    def allocate_new_blocks(self, g: int, rid: str, num_tokens: int) -> tuple[int, ...]:
        return tuple(b.block_id
                     for b in self.managers[g].allocate_new_blocks(rid, num_tokens, num_tokens))

    def request(self, rid: str, hashes: tuple[bytes, ...], block_size: int) -> Any:
        request = super().request(rid, hashes, block_size)
        request.shared_prefix_boundary = 0
        request.num_prompt_tokens = request.num_tokens = len(hashes) * block_size
        return request

    def cache_blocks(self, g: int, request: Any, num_tokens: int) -> None:
        self.managers[g].cache_blocks(request, num_tokens, replay_boundaries=())

    def skipped_blocks_to_free(self, g: int, rid: str, num_computed: int) -> tuple[int, ...]:
        raise NotImplementedError("vLLM has no skipped_blocks_to_free")

    def common_prefix(self, g: int, rid: str) -> int:
        raise NotImplementedError("vLLM 0.33 has no get_num_common_prefix_blocks")


def adapter_for(target: str) -> type[ImplAttention]:
    """The adapter maker for ``impl`` or ``vllm`` (vLLM 0.13's API, or 0.33's where the
    managers' constructor takes ``scheduler_block_size``)."""
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
        if "enable_caching" not in parameters:
            raise LayerUnavailable(f"no attention-layer adapter for vLLM {version}'s "
                                   "single-type manager constructor")
        return Vllm033Attention
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
        # A type the target's layer leaves out (its notes say why) is no example.
        assume(kind in self.target.kinds)
        assume(kind is not Kind.SLIDING_WINDOW or window >= self.target.min_sliding_window)
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

    def _blocks_to_allocate(self, num_tokens: int, held: tuple[int, ...],
                            hits: tuple[int, ...]) -> int:
        """The spec's ``get_num_blocks_to_allocate``; a target that clamps (vLLM 0.33:
        ``max(num_new_blocks, 0) + num_evictable_blocks``) never says fewer than the hits it
        would take off the free queue."""
        m = self.spec
        value = model.type_blocks_to_allocate(m.pool, m.group, num_tokens, held, hits)
        if self.target.clamps_blocks_to_allocate:
            evictable = sum(1 for b in hits if b != NULL_BLOCK and m.pool.ref[b] == 0)
            value = max(value - evictable, 0) + evictable
        return value

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
        cap = self.target.admission_cap(g)
        apply_cap = cap is not None and data.draw(st.booleans(), "apply_admission_cap")
        # The cap clamps the blocks required: as many as for cap * block_size tokens.
        capped = min(num_tokens, cap * m.group.block_size) if apply_cap and cap else num_tokens
        expected = self._blocks_to_allocate(capped, held, ())
        actual = self.target.get_num_blocks_to_allocate(g, rid, num_tokens, (), apply_cap)
        if actual != expected:
            raise AssertionError(f"get_num_blocks_to_allocate({rid!r}, {num_tokens}"
                                 f"{', apply_admission_cap=True' if apply_cap else ''}): "
                                 f"target {actual}, spec {expected}")
        event("get_num_blocks_to_allocate" + (" (admission cap)" if apply_cap else ""))

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
            expected = self._blocks_to_allocate(num_tokens, (), hit[g])
            actual = self.target.get_num_blocks_to_allocate(g, rid, num_tokens, hit[g])
            if actual != expected:
                raise AssertionError(f"get_num_blocks_to_allocate({rid!r}, {num_tokens}, hits "
                                     f"{hit[g]}): target {actual}, spec {expected}")
            wanted += max(expected, 0)
        if wanted > P.num_free(m.pool):
            event("schedule_new_request: pool too small")
            return
        real = [b for group_hits in hit for b in group_hits if b != NULL_BLOCK]
        attached = tuple(self._attached(group_hits) for group_hits in hit)
        m.pool = P.touch(m.pool, [b for group_hits in attached for b in group_hits])
        self.target.attach_hits(rid, hit)
        for g in group_ids:
            m.tables[g][rid] = attached[g]
            m.cached[g][rid] = len(attached[g])
        event(f"schedule_new_request: {'hit' if real else 'no hit'}")
        self._allocate(rid, num_tokens)
        # Each manager keys its blocks when its caller says: some groups now, the rest later
        # (so that groups of one type can hold different cached prefixes of the same hashes).
        groups = data.draw(st.sampled_from([group_ids, group_ids[:1], group_ids[1:]]),
                           "groups cached now")
        self._cache(rid, num_tokens, groups)

    def _attached(self, hits: tuple[int, ...]) -> tuple[int, ...]:
        """A group's hits as the request's table holds them. vLLM 0.33's
        ``add_local_computed_blocks`` nulls the hits the computed tokens have already left
        behind (and touches only the rest); the hits a lookup returns have nulls there."""
        if not self.target.attach_skips_window:
            return hits
        m = self.spec
        bs = m.group.block_size
        skipped = rules.skipped_blocks(model.skipped_tokens(m.group, len(hits) * bs), bs)
        return (NULL_BLOCK,) * skipped + hits[skipped:]

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
        if rid not in m.tables[g] or not self.target.has_common_prefix:
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
           "Vllm033Attention", "adapter_for", "machine_for"]
