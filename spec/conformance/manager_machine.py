"""The KV-cache manager conformance machine: drive a target and `spec.manager` side by side.

Rules are what a scheduler does with a KVCacheManager: admit a request (look up its cached
prefix, allocate slots for a chunk of its prompt, maybe with lookahead slots), run a step of a
running request (the next prefill chunk, or a decode step with draft tokens), preempt it (free
everything, recompute later), re-admit it, finish or abort it, continue a finished
conversation with a new turn, cache delayed blocks, reset the prefix cache, ask for the common
prefix and drain events. After every step the target's outputs must equal the spec's, its
abstract state (`ManagerView`: every group's block lists and keyed counts, ref counts, the
free order, block keys) must equal the spec's, and every invariant of `spec.manager` must hold.

Layouts are real models' KV-cache group structures (`models/`) with block sizes, windows and
chunks scaled down so that windows slide and pools run out within a few steps, plus hand-built
ones (three attention types, mixed block sizes, sink attention, Mamba with speculative blocks).
Pools are tiny: a few blocks per group.

`machine_for(make_target, layouts)` builds a machine for any `ManagerTarget`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from hypothesis import event, note, strategies as st
from hypothesis.stateful import (
    initialize,
    invariant,
    precondition,
    rule,
)

from kvspec.spec import manager as model, pool as pool_model
from kvspec.spec.conformance.deadline import BoundedSteps
from kvspec.spec.manager import GroupSpec, Kind, ManagerConfig, ManagerState, RequestView

# --- What the machine sees of a target ---------------------------------------------------------


@dataclass(frozen=True)
class ManagerView:
    """A manager's abstract state: comparable between the spec and any target."""

    # per group, sorted by id; a request holding no block in a group is left out, so that an
    # empty entry (vLLM's defaultdict makes one on a mere read, finding M2) is no difference
    tables: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]
    num_cached: tuple[tuple[tuple[str, int], ...], ...]  # per group, nonzero counts only
    ref: tuple[int, ...]  # per block, null block as 0
    free: tuple[int, ...]
    key_of: tuple[bytes | None, ...]


def view_of(state: ManagerState) -> ManagerView:
    return ManagerView(
        tables=tuple(tuple((r, blocks) for r, blocks in table if blocks)
                     for table in state.tables),
        num_cached=tuple(tuple((r, n) for r, n in counts if n) for counts in state.num_cached),
        ref=state.pool.ref,
        free=state.pool.free,
        key_of=state.pool.key_of,
    )


Hits = tuple[tuple[int, ...], ...]


class ManagerTarget(Protocol):
    """A KV-cache manager with vLLM 0.13's API, seen through request ids and block ids."""

    def build(self, layout: Layout, num_blocks: int, enable_caching: bool,
              enable_events: bool) -> None: ...
    def add_request(self, request_id: str, prompt: Sequence[int], lora: int | None,
                    cache_salt: str | None) -> None: ...
    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None: ...
    def set_num_computed_tokens(self, request_id: str, num_tokens: int) -> None: ...
    def request_view(self, request_id: str) -> RequestView: ...
    def get_computed_blocks(self, request_id: str) -> tuple[Hits, int]: ...
    def allocate_slots(self, request_id: str, num_new_tokens: int,
                       num_new_computed_tokens: int, with_hits: bool,
                       num_lookahead_tokens: int, delay_cache_blocks: bool,
                       num_encoder_tokens: int) -> Hits | None: ...
    def free(self, request_id: str) -> None: ...
    def cache_blocks(self, request_id: str, num_tokens: int) -> None: ...
    def evict_blocks(self, block_ids: set[int]) -> None: ...
    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]: ...
    def reset_prefix_cache(self) -> bool: ...
    def usage(self) -> float: ...
    def take_events(self) -> list[pool_model.Event]: ...
    def view(self) -> ManagerView: ...


# --- Layouts -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A KV-cache group structure to run the machine on, as impl's config objects.

    ``build(num_blocks)`` gives the ``KVCacheConfig``; ``caching`` says whether prefix caching
    may be on (never with cross-attention); ``blocks_per_group`` sizes the tiny pool.
    """

    name: str
    build: Callable[[int], Any]
    hash_block_size: int
    max_model_len: int = 64
    caching: bool = True
    encoder_tokens: int = 0
    blocks_per_group: tuple[int, int] = (3, 7)
    use_eagle: bool = False


def group_spec_of(kv_cache_spec: Any) -> GroupSpec:
    """The spec model's view of one of impl's KVCacheSpec objects (matched by class name, so
    spec/ does not depend on impl/ for this)."""
    name = type(kv_cache_spec).__name__
    identity = repr(kv_cache_spec)
    bs = kv_cache_spec.block_size
    if name in ("FullAttentionSpec", "MLAAttentionSpec"):
        return GroupSpec(Kind.FULL, bs, identity=identity)
    if name == "SinkFullAttentionSpec":
        return GroupSpec(Kind.SINK_FULL, bs, sink_len=kv_cache_spec.sink_len, identity=identity)
    if name == "SlidingWindowSpec":
        return GroupSpec(Kind.SLIDING_WINDOW, bs, sliding_window=kv_cache_spec.sliding_window,
                         identity=identity)
    if name == "ChunkedLocalAttentionSpec":
        return GroupSpec(Kind.CHUNKED_LOCAL, bs,
                         attention_chunk_size=kv_cache_spec.attention_chunk_size,
                         identity=identity)
    if name == "MambaSpec":
        return GroupSpec(Kind.MAMBA, bs,
                         num_speculative_blocks=kv_cache_spec.num_speculative_blocks,
                         identity=identity)
    if name == "CrossAttentionSpec":
        return GroupSpec(Kind.CROSS, bs, identity=identity)
    raise model.BadConfig(f"no manager models {name}")


def spec_config(layout: Layout, kv_cache_config: Any, enable_caching: bool,
                enable_events: bool) -> ManagerConfig:
    return ManagerConfig(
        groups=tuple(group_spec_of(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups),
        num_blocks=kv_cache_config.num_blocks,
        max_model_len=layout.max_model_len,
        hash_block_size=layout.hash_block_size,
        enable_caching=enable_caching,
        use_eagle=layout.use_eagle,
        enable_events=enable_events,
    )


def _shrink(kv_cache_config: Any, block_size: int, window: int, chunk: int,
            num_blocks: int) -> Any:
    """A real model's group structure with a tiny block size, window and chunk."""
    from kvspec.impl.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        changes: dict[str, int] = {"block_size": block_size}
        if hasattr(spec, "sliding_window") and spec.sliding_window is not None:
            changes["sliding_window"] = window
        if hasattr(spec, "attention_chunk_size") and spec.attention_chunk_size is not None:
            changes["attention_chunk_size"] = chunk
        groups.append(KVCacheGroupSpec(group.layer_names, replace(spec, **changes)))
    return KVCacheConfig(num_blocks, kv_cache_config.kv_cache_tensors, tuple(groups))


def model_layout(model_name: str, block_size: int = 2, window: int = 5, chunk: int = 4,
                 **options: Any) -> Layout:
    """The group structure of a model in models/, shrunk for the machine."""

    def build(num_blocks: int) -> Any:
        from kvspec.models import get_layout
        from kvspec.models.bridge import to_kv_cache_config

        config = to_kv_cache_config(get_layout(model_name), num_blocks=num_blocks,
                                    block_size=16)
        return _shrink(config, block_size, window, chunk, num_blocks)

    return Layout(model_name, build, hash_block_size=block_size, **options)


def hand_layout(name: str, specs: Callable[[], Sequence[Any]], hash_block_size: int,
                **options: Any) -> Layout:
    """A hand-built layout: one group per spec."""

    def build(num_blocks: int) -> Any:
        from kvspec.impl.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

        return KVCacheConfig(num_blocks, (), tuple(
            KVCacheGroupSpec((f"layer.{i}",), spec) for i, spec in enumerate(specs())
        ))

    return Layout(name, build, hash_block_size=hash_block_size, **options)


def _full(bs: int, heads: int = 1) -> Any:
    from kvspec.impl.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(bs, heads, 8, "float16")


def _sliding(bs: int, window: int) -> Any:
    from kvspec.impl.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(bs, 1, 8, "float16", sliding_window=window)


def _mamba(bs: int, speculative: int = 0) -> Any:
    from kvspec.impl.kv_cache_interface import MambaSpec

    return MambaSpec(bs, shapes=((2, 3),), dtypes=("float16",),
                     num_speculative_blocks=speculative)


def _sink(bs: int, sink_len: int) -> Any:
    from kvspec.impl.kv_cache_interface import SinkFullAttentionSpec

    return SinkFullAttentionSpec(bs, 1, 8, "float16", sink_len=sink_len)


def _chunked(bs: int, chunk: int) -> Any:
    from kvspec.impl.kv_cache_interface import ChunkedLocalAttentionSpec

    return ChunkedLocalAttentionSpec(bs, 1, 8, "float16", attention_chunk_size=chunk)


MODEL_LAYOUTS: tuple[Layout, ...] = (
    model_layout("Llama-3.1-8B"),
    model_layout("DeepSeek-V3", block_size=4),
    model_layout("Mistral-7B-v0.1", window=5),
    model_layout("Gemma-3-27B", window=3, blocks_per_group=(2, 4)),
    model_layout("Llama-4-Scout", chunk=4),
    model_layout("Jamba-v0.1", blocks_per_group=(2, 4)),
    model_layout("Whisper-large-v3", caching=False, encoder_tokens=3),
)

HAND_LAYOUTS: tuple[Layout, ...] = (
    hand_layout("full+sliding+mamba", lambda: (_full(2), _sliding(2, 5), _mamba(2)), 2),
    hand_layout("full(bs4)+sliding(bs2)", lambda: (_full(4), _sliding(2, 4)), 2),
    hand_layout("sink", lambda: (_sink(2, 2),), 2),
    hand_layout("mamba+speculative", lambda: (_mamba(2, speculative=1),), 2),
    hand_layout("two full groups", lambda: (_full(2), _full(2, heads=2), _full(2)), 2),
    hand_layout("chunked local", lambda: (_chunked(2, 6),), 2),
    hand_layout("sliding window 2", lambda: (_sliding(2, 2),), 2),
)

ALL_LAYOUTS = MODEL_LAYOUTS + HAND_LAYOUTS


# --- The impl/ target --------------------------------------------------------------------------


class ImplManager:
    """impl.kv_cache_manager.KVCacheManager behind the ManagerTarget interface."""

    def __init__(self) -> None:
        self.manager: Any = None
        self.requests: dict[str, Any] = {}
        self.last_hits: dict[str, Any] = {}
        self.hash_block_size = 1

    def build(self, layout: Layout, num_blocks: int, enable_caching: bool,
              enable_events: bool) -> None:
        from kvspec.impl.kv_cache_manager import KVCacheManager

        self.hash_block_size = layout.hash_block_size
        self.manager = KVCacheManager(
            layout.build(num_blocks), max_model_len=layout.max_model_len,
            hash_block_size=layout.hash_block_size, enable_caching=enable_caching,
            use_eagle=layout.use_eagle, enable_kv_cache_events=enable_events,
        )

    def add_request(self, request_id: str, prompt: Sequence[int], lora: int | None,
                    cache_salt: str | None) -> None:
        from kvspec.impl.hashing import get_request_block_hasher, sha256
        from kvspec.impl.request import LoRARequest, Request

        self.requests[request_id] = Request(
            request_id, list(prompt),
            lora_request=None if lora is None else LoRARequest(f"lora-{lora}", lora),
            cache_salt=cache_salt,
            block_hasher=get_request_block_hasher(self.hash_block_size, sha256),
        )

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.requests[request_id].append_output_token_ids(list(token_ids))

    def set_num_computed_tokens(self, request_id: str, num_tokens: int) -> None:
        self.requests[request_id].num_computed_tokens = num_tokens

    def request_view(self, request_id: str) -> RequestView:
        request = self.requests[request_id]
        lora = request.lora_request
        return RequestView(
            request_id, request.num_tokens, request.num_computed_tokens,
            tuple(request.block_hashes), tuple(request.all_token_ids),
            None if lora is None else lora.adapter_id,
        )

    def get_computed_blocks(self, request_id: str) -> tuple[Hits, int]:
        blocks, num_tokens = self.manager.get_computed_blocks(self.requests[request_id])
        self.last_hits[request_id] = blocks
        return tuple(tuple(b.block_id for b in g) for g in blocks.blocks), num_tokens

    def allocate_slots(self, request_id: str, num_new_tokens: int,
                       num_new_computed_tokens: int, with_hits: bool,
                       num_lookahead_tokens: int, delay_cache_blocks: bool,
                       num_encoder_tokens: int) -> Hits | None:
        hits = self.last_hits.pop(request_id, None) if with_hits else None
        result = self.manager.allocate_slots(
            self.requests[request_id], num_new_tokens, num_new_computed_tokens, hits,
            num_lookahead_tokens, delay_cache_blocks, num_encoder_tokens,
        )
        if result is None:
            return None
        return tuple(tuple(b.block_id for b in g) for g in result.blocks)

    def free(self, request_id: str) -> None:
        from kvspec.impl.request import Request

        request = self.requests.get(request_id) or Request(request_id, [0])
        self.manager.free(request)

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        self.manager.cache_blocks(self.requests[request_id], num_tokens)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.manager.evict_blocks(block_ids)

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        return list(self.manager.get_num_common_prefix_blocks(request_id))

    def reset_prefix_cache(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    def usage(self) -> float:
        return float(self.manager.usage)

    def take_events(self) -> list[pool_model.Event]:
        from kvspec.impl.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        converted: list[pool_model.Event] = []
        for item in self.manager.take_events():
            if isinstance(item, BlockStored):
                parent = item.parent_block_hash
                converted.append(pool_model.Stored(
                    tuple(_external(h) for h in item.block_hashes),
                    None if parent is None else _external(parent), tuple(item.token_ids),
                    item.block_size, item.lora_id,
                ))
            elif isinstance(item, BlockRemoved):
                converted.append(pool_model.Removed(
                    tuple(_external(h) for h in item.block_hashes)))
            elif isinstance(item, AllBlocksCleared):
                converted.append(pool_model.Cleared())
        return converted

    def view(self) -> ManagerView:
        manager = self.manager
        pool = manager.block_pool
        tables = []
        counts = []
        for single in manager.coordinator.single_type_managers:
            tables.append(tuple(sorted(
                (rid, tuple(b.block_id for b in blocks))
                for rid, blocks in single.req_to_blocks.items() if blocks
            )))
            counts.append(tuple(sorted(
                (rid, n) for rid, n in single.num_cached_block.items() if n
            )))
        blocks = [pool.blocks[i] for i in range(pool.num_gpu_blocks)]
        return ManagerView(
            tables=tuple(tables),
            num_cached=tuple(counts),
            ref=(0, *tuple(b.ref_cnt for b in blocks[1:])),
            free=tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks()),
            key_of=(None, *tuple(b.block_hash for b in blocks[1:])),
        )


def _external(block_hash: bytes | int) -> int:
    """An event's block hash as the spec's events carry it (the low 64 bits, as an int)."""
    if isinstance(block_hash, int):
        return block_hash
    return int.from_bytes(block_hash, "big") & (2**64 - 1)


# --- The machine -------------------------------------------------------------------------------

PREFIXES: tuple[tuple[int, ...], ...] = (
    tuple(range(100, 124)),
    tuple(range(100, 108)) + tuple(range(200, 216)),
    tuple(range(300, 324)),
)


@dataclass
class Tracked:
    """A request the machine's scheduler knows about."""

    request_id: str
    running: bool = False
    preempted: int = 0
    prompt_len: int = 0
    encoder_tokens: int = 0
    encoder_done: bool = False
    delayed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


MAX_LIVE_REQUESTS = 6


class ManagerMachine(BoundedSteps):
    """Runs a ManagerTarget against spec.manager; subclasses set make_target and layouts.
    Every step runs under the step deadline (`deadline.BoundedSteps`)."""

    make_target: Callable[[], ManagerTarget]
    layouts: tuple[Layout, ...] = ALL_LAYOUTS

    def __init__(self) -> None:
        super().__init__()
        self.target = type(self).make_target()
        self.layout: Layout = self.layouts[0]
        self.spec: ManagerState | None = None
        self.tracked: dict[str, Tracked] = {}
        self.finished_tokens: list[tuple[int, ...]] = []
        self.next_id = 0
        self.max_model_len = 64

    # -- helpers -------------------------------------------------------------------------

    @property
    def state(self) -> ManagerState:
        assert self.spec is not None
        return self.spec

    def _view(self, request_id: str) -> RequestView:
        return self.target.request_view(request_id)

    def _requests(self) -> dict[str, RequestView]:
        return {rid: self._view(rid) for rid in self.tracked}

    def _running(self) -> list[str]:
        return sorted(r for r, t in self.tracked.items() if t.running)

    def _waiting(self) -> list[str]:
        return sorted(r for r, t in self.tracked.items() if not t.running)

    def _encoder_tokens(self, tracked: Tracked) -> int:
        return 0 if tracked.encoder_done else tracked.encoder_tokens

    def _allocate(self, request_id: str, num_new_tokens: int, num_new_computed: int,
                  hits: model.GroupBlocks | None, lookahead: int, delay: bool) -> bool:
        tracked = self.tracked[request_id]
        encoder = self._encoder_tokens(tracked)
        request = self._view(request_id)
        before = self.target.view()
        self.spec, expected = model.allocate_slots(
            self.state, request, num_new_tokens, num_new_computed, hits, lookahead, delay,
            encoder,
        )
        actual = self.target.allocate_slots(
            request_id, num_new_tokens, num_new_computed, hits is not None, lookahead, delay,
            encoder,
        )
        note(f"allocate_slots({request_id}, new={num_new_tokens}, hit={num_new_computed}, "
             f"lookahead={lookahead}, delay={delay}, encoder={encoder}) -> {actual}")
        if expected is None:
            assert actual is None, f"allocate_slots: spec None, target allocated {actual}"
            assert self.target.view() == before, "allocate_slots returned None but changed state"
            event("allocate_slots: pool too small (None)")
            return False
        assert actual is not None, f"allocate_slots: spec allocated {expected}, target None"
        assert actual == expected, f"allocate_slots: target {actual}, spec {expected}"
        if encoder:
            tracked.encoder_done = True
        if delay:
            tracked.delayed = True
            event("allocate_slots: delay_cache_blocks")
        if lookahead:
            event("allocate_slots: lookahead tokens")
        if any(expected):
            event("allocate_slots: new blocks")
        return True

    # -- set-up --------------------------------------------------------------------------

    @initialize(data=st.data(), caching=st.sampled_from([True, True, True, False]),
                events=st.booleans())
    def build(self, data: st.DataObject, caching: bool, events: bool) -> None:
        layout = data.draw(st.sampled_from(self.layouts), label="layout")
        probe = layout.build(2)
        num_groups = len(probe.kv_cache_groups)
        low, high = layout.blocks_per_group
        # Up to a whole max_model_len request per group now and then, so long requests run.
        per_group = data.draw(st.integers(low, high) | st.just(high + 6), label="blocks per group")
        num_blocks = 1 + num_groups * per_group + _sink_blocks(probe)
        caching = caching and layout.caching
        kinds = {type(g.kv_cache_spec).__name__ for g in probe.kv_cache_groups}
        if (caching and num_groups == 1 and "ChunkedLocalAttentionSpec" not in kinds
                and data.draw(st.integers(0, 4), label="eagle") == 0):
            layout = replace(layout, use_eagle=True)
            event("EAGLE")
        self.layout = layout
        config = replace(spec_config(layout, probe, caching, events), num_blocks=num_blocks)
        self.spec = model.new_manager(config)
        self.target.build(layout, num_blocks, caching, events)
        event(f"layout {layout.name}")
        event(f"caching {'on' if caching else 'off'}")

    # -- rules ---------------------------------------------------------------------------

    @precondition(lambda self: len(self.tracked) < MAX_LIVE_REQUESTS)
    @rule(prefix=st.integers(0, len(PREFIXES) - 1),
          prefix_len=st.sampled_from([0, 4, 8, 12, 16, 20, 24]) | st.integers(0, 24),
          suffix=st.lists(st.integers(0, 3), min_size=1, max_size=6),
          salt=st.sampled_from([None, None, None, "salt-a", "salt-b"]),
          lora=st.sampled_from([None, None, None, 1, 2]))
    def add_request(self, prefix: int, prefix_len: int, suffix: list[int], salt: str | None,
                    lora: int | None) -> None:
        """A new prompt: a shared prefix (so prefixes hit) and a short own suffix."""
        self._add(PREFIXES[prefix][:prefix_len] + tuple(suffix), salt, lora)

    def _add(self, prompt: tuple[int, ...], salt: str | None, lora: int | None) -> str:
        prompt = prompt[-(self.max_model_len - 1):]
        request_id = f"req-{self.next_id:03d}"
        self.next_id += 1
        self.target.add_request(request_id, prompt, lora, salt)
        self.tracked[request_id] = Tracked(request_id, prompt_len=len(prompt),
                                           encoder_tokens=self.layout.encoder_tokens)
        return request_id

    @precondition(lambda self: self.finished_tokens and len(self.tracked) < MAX_LIVE_REQUESTS)
    @rule(data=st.data(), more=st.lists(st.integers(0, 3), min_size=1, max_size=4))
    def continue_conversation(self, data: st.DataObject, more: list[int]) -> None:
        """The next turn of a finished conversation: its whole history plus new tokens."""
        history = data.draw(st.sampled_from(self.finished_tokens))
        self._add(history + tuple(more), None, None)
        event("multi-turn continuation")

    @precondition(lambda self: any(not t.running for t in self.tracked.values()))
    @rule(data=st.data(), chunk=st.integers(1, 12), lookahead=st.sampled_from([0, 0, 0, 1, 3]),
          delay=st.sampled_from([False, False, False, False, True]))
    def schedule_waiting(self, data: st.DataObject, chunk: int, lookahead: int,
                         delay: bool) -> None:
        """Admit (or re-admit) a waiting request: look up its prefix, allocate a chunk."""
        request_id = data.draw(st.sampled_from(self._waiting()))
        request = self._view(request_id)
        expected_hits, expected_n = model.get_computed_blocks(self.state, request)
        actual_hits, actual_n = self.target.get_computed_blocks(request_id)
        assert (actual_hits, actual_n) == (expected_hits, expected_n), (
            f"get_computed_blocks({request_id}): target {actual_hits} ({actual_n} tokens), "
            f"spec {expected_hits} ({expected_n} tokens)")
        assert model.hit_is_valid(self.state, request, expected_hits, expected_n)
        if expected_n:
            event("prefix hit")
            if any(self.state.pool.ref[b] == 0 for g in expected_hits for b in g if b):
                event("prefix hit on an evictable block")
            if any(pool_model.NULL_BLOCK in g for g in expected_hits):
                event("prefix hit with null blocks")
        if self.tracked[request_id].preempted:
            event("re-admission after preemption")
        remaining = request.num_tokens - expected_n
        num_new = min(chunk, remaining)
        if self._allocate(request_id, num_new, expected_n, expected_hits, lookahead, delay):
            self.target.set_num_computed_tokens(request_id, expected_n + num_new)
            self.tracked[request_id].running = True

    @precondition(lambda self: any(t.running for t in self.tracked.values()))
    @rule(data=st.data(), chunk=st.integers(1, 8), drafts=st.sampled_from([0, 0, 0, 1, 2]),
          lookahead=st.sampled_from([0, 0, 0, 1, 3]),
          delay=st.sampled_from([False, False, False, False, True]),
          token=st.integers(0, 3))
    def step_running(self, data: st.DataObject, chunk: int, drafts: int, lookahead: int,
                     delay: bool, token: int) -> None:
        """One engine step of a running request: a prefill chunk, or a decode step (a new
        token, maybe with draft tokens that are then rejected)."""
        request_id = data.draw(st.sampled_from(self._running()))
        request = self._view(request_id)
        if request.num_computed_tokens >= request.num_tokens:
            if request.num_tokens >= self.max_model_len:
                return
            self.target.append_tokens(request_id, [token])
            request = self._view(request_id)
            event("decode step")
        remaining = request.num_tokens - request.num_computed_tokens
        num_new = min(chunk, remaining)
        if num_new == remaining:
            num_new += drafts
            if drafts:
                event("draft tokens")
        if self._allocate(request_id, num_new, 0, None, lookahead, delay):
            self.target.set_num_computed_tokens(
                request_id, min(request.num_computed_tokens + num_new, request.num_tokens))

    @precondition(lambda self: any(t.running for t in self.tracked.values()))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """Free a running request's blocks; it waits to be recomputed."""
        request_id = data.draw(st.sampled_from(self._running()))
        self._free(request_id)
        self.target.set_num_computed_tokens(request_id, 0)
        tracked = self.tracked[request_id]
        tracked.running = False
        tracked.preempted += 1
        tracked.encoder_done = False
        tracked.delayed = False
        event("preemption")

    @precondition(lambda self: self.tracked)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A request finishes or is aborted (running or waiting): free it, forget it."""
        request_id = data.draw(st.sampled_from(sorted(self.tracked)))
        request = self._view(request_id)
        if self.tracked[request_id].running:
            self.finished_tokens.append(request.token_ids)
            event("finish running request")
        else:
            event("abort waiting request")
        self._free(request_id)
        del self.tracked[request_id]

    def _free(self, request_id: str) -> None:
        self.spec = model.free(self.state, request_id)
        self.target.free(request_id)
        assert model.released(self.state, request_id)

    @precondition(lambda self: any(t.running for t in self.tracked.values()))
    @rule(choice=st.integers(0, 7))
    def housekeeping(self, choice: int) -> None:
        """Rare calls: free a request never seen (nothing changes), drain events, and now and
        then reset the prefix cache (refused while any request holds blocks)."""
        if choice <= 3:
            before = self.target.view()
            self.spec = model.free(self.state, "never-seen")
            self.target.free("never-seen")
            assert self.target.view() == before, "freeing an unknown request changed state"
        elif choice <= 6:
            self.spec, expected = model.take_events(self.state)
            actual = self.target.take_events()
            assert tuple(actual) == expected, f"events: target {actual}, spec {expected}"
        else:
            self.spec, done = model.reset_prefix_cache(self.state)
            reset = self.target.reset_prefix_cache()
            assert reset == done, f"reset_prefix_cache: target {reset}, spec {done}"
            event(f"reset_prefix_cache {'done' if done else 'refused'}")

    @precondition(lambda self: any(t.running and t.delayed for t in self.tracked.values()))
    @rule(data=st.data())
    def cache_delayed_blocks(self, data: st.DataObject) -> None:
        """A KV transfer finished: key the blocks of a request that delayed caching."""
        candidates = sorted(r for r, t in self.tracked.items() if t.running and t.delayed)
        request_id = data.draw(st.sampled_from(candidates))
        request = self._view(request_id)
        num_tokens = min(request.num_computed_tokens, request.num_tokens)
        self.spec = model.cache_blocks(self.state, request, num_tokens)
        self.target.cache_blocks(request_id, num_tokens)
        self.tracked[request_id].delayed = False
        event("cache delayed blocks")

    @precondition(lambda self: self.spec is not None and any(
        k is not None and r == 0 for k, r in zip(self.state.pool.key_of, self.state.pool.ref,
                                                 strict=True)))
    @rule(data=st.data())
    def evict_cached_blocks(self, data: st.DataObject) -> None:
        """A KV connector drops some cached free blocks: holes appear in cached chains, in
        some groups and not others. (Blocks in use are left alone: an evicted block of a
        running request would break cached_prefix_is_keyed by design.)"""
        pool = self.state.pool
        keyed = [b for b, k in enumerate(pool.key_of) if k is not None and pool.ref[b] == 0]
        chosen = data.draw(st.sets(st.sampled_from(keyed), min_size=1, max_size=4))
        for block in sorted(chosen):  # one call per block: the order of a set is no contract
            self.spec = replace(self.state,
                                pool=pool_model.evict_blocks(self.state.pool, [block]))
            self.target.evict_blocks({block})
        event("evict cached blocks")

    @precondition(lambda self: any(t.running for t in self.tracked.values()))
    @rule(data=st.data())
    def common_prefix(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(self._running()))
        expected = list(model.get_num_common_prefix_blocks(self.state, request_id))
        actual = self.target.get_num_common_prefix_blocks(request_id)
        assert actual == expected, f"common prefix: target {actual}, spec {expected}"
        if any(expected):
            event("common prefix > 0")

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def states_agree(self) -> None:
        if self.spec is None:
            return
        expected = view_of(self.state)
        actual = self.target.view()
        for name in ("tables", "num_cached", "ref", "free", "key_of"):
            assert getattr(actual, name) == getattr(expected, name), (
                f"{name}: target {getattr(actual, name)}, spec {getattr(expected, name)}")
        assert math.isclose(self.target.usage(), model.usage(self.state))

    @invariant()
    def spec_invariants_hold(self) -> None:
        if self.spec is None:
            return
        broken = model.violated(self.state, self._requests())
        assert not broken, f"invariants violated: {broken}"


def _sink_blocks(kv_cache_config: Any) -> int:
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        sink_len = getattr(group.kv_cache_spec, "sink_len", None)
        if sink_len:
            total += sink_len // group.kv_cache_spec.block_size
    return total


def machine_for(make_target: Callable[[], ManagerTarget],
                layouts: tuple[Layout, ...] = ALL_LAYOUTS) -> type[ManagerMachine]:
    """A ManagerMachine subclass checking targets made by make_target on layouts."""
    return type("ManagerConformance", (ManagerMachine,),
                {"make_target": staticmethod(make_target), "layouts": layouts})
