"""Hostile input to the KV-cache manager stack: ``KVCacheManager`` and ``KVCacheBlocks``, the
coordinators, the attention-type managers, and the spec and config classes they are built from.

Subjects are managers over real layouts (full attention, MLA, a sliding window, full + sliding
window with mixed block sizes, full + sliding window + Mamba, chunked local attention, Mamba
with speculative blocks, sink attention, and Whisper's encoder-decoder with cross-attention),
with 4 to 16 blocks, after a random run of what a scheduler does: requests admitted with their
prefix-cache hits, prefill chunks and decode steps with lookahead slots, delayed caching,
preemption, finished requests, evictions, prefix-cache resets and drained events. So a bad call
meets requests holding blocks, keyed and not, shared, slid out of the window, and blocks handed
back. The snapshot is everything a caller can observe: every group's tables
(``req_to_blocks``, ``num_cached_block``, empty entries included), the pool (test_pool's
snapshot: ref counts, keys, free order, key map, pending events, usage, metrics), and the
prefix-cache stats.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from hypothesis import given, strategies as st

from kvspec.conformance.manager_machine import (
    HAND_LAYOUTS,
    PREFIXES,
    Layout,
    model_layout,
)
from kvspec.impl.block_pool import BlockPool
from kvspec.impl.hashing import BlockHash, get_request_block_hasher, sha256
from kvspec.impl.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from kvspec.impl.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    as_kv_cache_config,
    as_kv_cache_spec,
)
from kvspec.impl.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvspec.impl.kv_cache_metrics import KVCacheMetricsCollector
from kvspec.impl.kv_cache_utils import KVCacheBlock
from kvspec.impl.request import LoRARequest, Request
from kvspec.impl.single_type_kv_cache_manager import (
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    get_manager_for_kv_cache_spec,
)
from tests.hostile import BadCall, Verdict, check, judge, values
from tests.hostile.test_pool import PoolSubject, pool_snapshot
from tests.hostile.values import (
    Bad,
    Opaque,
    not_a_bool,
    not_bytes,
    not_iterable,
)


# impl's one integer rule (docs/hostile-input.md): an integer argument is an int or a numpy
# integer, converted. The shared bad values hold np.int64(3), which is an integer in range
# wherever they are drawn here: it is no bad value for the manager stack, and
# test_numpy_integer_arguments_are_taken below checks that it is taken.
def _no_numpy_integer(strategy: st.SearchStrategy[Bad]) -> st.SearchStrategy[Bad]:
    return strategy.filter(lambda bad: not isinstance(bad.value, np.integer))


def bad_int(low: int, high: int | None = None) -> st.SearchStrategy[Bad]:
    return _no_numpy_integer(values.bad_int(low, high))


def bad_count(high: int | None = None) -> st.SearchStrategy[Bad]:
    return _no_numpy_integer(values.bad_count(high))


def bad_positive(high: int | None = None) -> st.SearchStrategy[Bad]:
    return _no_numpy_integer(values.bad_positive(high))


def not_an_int() -> st.SearchStrategy[Bad]:
    return _no_numpy_integer(values.not_an_int())

# Token counts and sizes are int64 on vLLM's worker (positions, slot mappings).
MAX_TOKENS = 2**63 - 1
# World sizes are torch.distributed's int32.
MAX_WORLD_SIZE = 2**31 - 1

LAYOUTS: tuple[Layout, ...] = (
    model_layout("Llama-3.1-8B"),                      # full attention
    model_layout("DeepSeek-V3", block_size=4),         # MLA, hash block size 4
    model_layout("Mistral-7B-v0.1", window=5),         # sliding window
    HAND_LAYOUTS[1],                                   # full (bs 4) + sliding window (bs 2)
    HAND_LAYOUTS[0],                                   # full + sliding window + Mamba
    HAND_LAYOUTS[5],                                   # chunked local attention
    HAND_LAYOUTS[3],                                   # Mamba with a speculative block
    HAND_LAYOUTS[2],                                   # sink attention
    model_layout("Whisper-large-v3", caching=False, encoder_tokens=3),  # cross-attention
)


# ---------------------------------------------------------------------- subjects


@dataclass
class ManagerSubject:
    manager: KVCacheManager
    layout: Layout
    requests: dict[str, Request]        # every request the scheduler knows, by id
    running: list[str]                  # ids of the requests holding blocks
    lookup: tuple[Request, KVCacheBlocks, int] | None  # a waiting request's fresh lookup
    stale: list[KVCacheBlock]           # blocks that finished requests handed back
    other: KVCacheManager               # a manager over the same layout: its blocks are foreign

    def __repr__(self) -> str:
        manager = self.manager
        return (f"ManagerSubject({self.layout.name}, blocks={manager.block_pool.num_gpu_blocks}, "
                f"caching={manager.enable_caching}, running={self.running})")

    @property
    def waiting(self) -> list[str]:
        return sorted(set(self.requests) - set(self.running))


def _max_len(subject: ManagerSubject) -> int:
    return subject.manager.max_model_len


def _new_request(subject: ManagerSubject, draw: st.DrawFn, name: str) -> Request:
    layout = subject.layout
    prefix = PREFIXES[draw(st.integers(0, len(PREFIXES) - 1))]
    prompt = list(prefix[:draw(st.sampled_from([0, 2, 4, 6, 8, 12]))])
    prompt += draw(st.lists(st.integers(0, 3), min_size=1, max_size=5))
    lora = draw(st.sampled_from([None, None, 7]))
    hasher = (get_request_block_hasher(layout.hash_block_size, sha256)
              if subject.manager.enable_caching else None)
    request = Request(name, prompt, lora_request=None if lora is None else LoRARequest("l", lora),
                      block_hasher=hasher)
    subject.requests[name] = request
    return request


def _encoder_tokens(subject: ManagerSubject, request: Request) -> int:
    """Whisper's cross-attention blocks are allocated with the request's first chunk."""
    if subject.manager.coordinator.has_blocks(request.request_id):
        return 0
    return subject.layout.encoder_tokens


def _admit(subject: ManagerSubject, draw: st.DrawFn, request: Request) -> None:
    manager = subject.manager
    hits, num_hit = manager.get_computed_blocks(request)
    chunk = draw(st.integers(1, max(1, request.num_tokens - num_hit)))
    new = manager.allocate_slots(request, chunk, num_hit, hits,
                                 draw(st.sampled_from([0, 0, 1, 3])),
                                 draw(st.sampled_from([False, False, True])),
                                 _encoder_tokens(subject, request))
    if new is not None:
        request.num_computed_tokens = num_hit + chunk
        subject.running.append(request.request_id)


def _step(subject: ManagerSubject, draw: st.DrawFn, request: Request) -> None:
    manager = subject.manager
    if request.num_computed_tokens >= request.num_tokens:
        if request.num_tokens >= manager.max_model_len:
            return
        request.append_output_token_ids(draw(st.integers(0, 3)))
    num_new = min(draw(st.integers(1, 6)), request.num_tokens - request.num_computed_tokens)
    new = manager.allocate_slots(request, num_new, 0, None, draw(st.sampled_from([0, 0, 2])),
                                 draw(st.sampled_from([False, False, True])))
    if new is not None:
        request.num_computed_tokens += num_new


def _build(draw: st.DrawFn, layout: Layout, caching: bool, **options: Any) -> KVCacheManager:
    probe = layout.build(2)
    per_group = draw(st.integers(2, 5))
    num_blocks = min(1 + len(probe.kv_cache_groups) * per_group, 16)
    num_blocks += sum(getattr(g.kv_cache_spec, "sink_len", None) or 0
                      for g in probe.kv_cache_groups) // layout.hash_block_size
    return KVCacheManager(layout.build(max(num_blocks, 4)), max_model_len=layout.max_model_len,
                          hash_block_size=layout.hash_block_size, enable_caching=caching,
                          **options)


@st.composite
def managers(draw: st.DrawFn) -> ManagerSubject:
    layout = draw(st.sampled_from(LAYOUTS))
    caching = layout.caching and draw(st.sampled_from([True, True, True, False]))
    collector = KVCacheMetricsCollector(1.0, rng=random.Random(0)) if draw(st.booleans()) else None
    manager = _build(draw, layout, caching, log_stats=draw(st.booleans()),
                     enable_kv_cache_events=draw(st.booleans()), metrics_collector=collector,
                     strict_free=draw(st.booleans()))
    other = _build(draw, layout, caching)
    subject = ManagerSubject(manager, layout, {}, [], None, [], other)
    foreign = Request("foreign", list(range(100, 105)),
                      block_hasher=get_request_block_hasher(layout.hash_block_size, sha256)
                      if caching else None)
    other.allocate_slots(foreign, 5, num_encoder_tokens=layout.encoder_tokens)
    for step in range(draw(st.integers(0, 8))):
        action = draw(st.sampled_from(["admit", "admit", "step", "step", "finish", "preempt",
                                       "evict", "reset", "events"]))
        if action == "admit":
            waiting = subject.waiting
            if draw(st.booleans()) and waiting:
                request = subject.requests[draw(st.sampled_from(waiting))]
            else:
                request = _new_request(subject, draw, f"r{step}")
            _admit(subject, draw, request)
        elif action == "step" and subject.running:
            _step(subject, draw, subject.requests[draw(st.sampled_from(subject.running))])
        elif action in ("finish", "preempt") and subject.running:
            request_id = draw(st.sampled_from(subject.running))
            blocks = [b for group in manager.get_blocks(request_id).blocks for b in group]
            manager.free(subject.requests[request_id])
            subject.running.remove(request_id)
            subject.stale += [b for b in blocks if b.ref_cnt == 0]
            if action == "finish":
                del subject.requests[request_id]
            else:
                subject.requests[request_id].num_computed_tokens = 0
        elif action == "evict":
            manager.evict_blocks({draw(st.integers(0, manager.block_pool.num_gpu_blocks - 1))})
        elif action == "reset" and not subject.running:
            manager.reset_prefix_cache()
        elif action == "events":
            manager.take_events()
    if caching:
        request = _new_request(subject, draw, "looked-up")
        hits, num_hit = manager.get_computed_blocks(request)
        subject.lookup = (request, hits, num_hit)
    return subject


def manager_snapshot(subject: ManagerSubject) -> object:
    manager = subject.manager
    tables = tuple(
        (tuple(sorted(((rid, tuple(b.block_id for b in blocks))
                       for rid, blocks in single.req_to_blocks.items()), key=repr)),
         tuple(sorted(single.num_cached_block.items(), key=repr)))
        for single in manager.coordinator.single_type_managers
    )
    stats = manager.prefix_cache_stats
    pool = manager.block_pool
    return (
        tables,
        pool_snapshot(PoolSubject(pool, [], [], pool)),
        None if stats is None else tuple(sorted(vars(stats).items())),
        manager.empty_kv_cache_blocks.blocks,
    )


# ---------------------------------------------------------------------- helpers


def _call(describe: str, run: Callable[[Any], object], bad: Bad | None = None,
          **kwargs: Any) -> BadCall:
    if bad is None:
        return BadCall(describe, run, **kwargs)
    return BadCall(describe, run, bad.value, bad.forms, **kwargs)


def _bad(value: Any, label: str | None = None, *named: str) -> Bad:
    return Bad(value, label if label is not None else repr(value), tuple(named))


def _running(subject: ManagerSubject, draw: st.DrawFn) -> Request | None:
    if not subject.running:
        return None
    return subject.requests[draw(st.sampled_from(subject.running))]


def _some_request(subject: ManagerSubject, draw: st.DrawFn) -> Request:
    """A request the manager knows (running or waiting), or a fresh one."""
    if draw(st.booleans()) and subject.requests:
        return subject.requests[draw(st.sampled_from(sorted(subject.requests)))]
    return _new_request(subject, draw, "fresh")


def _slots_held(subject: ManagerSubject, request_id: str) -> int:
    """Tokens the request's blocks hold in its fullest-covered decoder group (the least)."""
    held = [len(single.req_to_blocks.get(request_id) or ()) * single.block_size
            for single in subject.manager.coordinator.single_type_managers
            if not isinstance(single, CrossAttentionManager)]
    return min(held) if held else MAX_TOKENS


class NotARequest:
    """Has a request_id and nothing else a request has."""

    request_id = "not-a-request"

    def __repr__(self) -> str:
        return "NotARequest()"


def _not_a_request() -> st.SearchStrategy[Bad]:
    return st.sampled_from([_bad(None), _bad(Opaque()), _bad("r0"), _bad(3),
                            _bad(NotARequest(), "NotARequest()", "NotARequest()")])


@st.composite
def _corrupt_request(draw: st.DrawFn, subject: ManagerSubject, request: Request,
                     fields: tuple[str, ...]) -> tuple[str, Bad]:
    """Set one field the manager reads to a value no vLLM request has; return its name."""
    name = draw(st.sampled_from(fields))
    if name == "request_id":
        bad = draw(st.sampled_from([_bad(None), _bad(3), _bad(b"r0"), _bad(["r0"]),
                                    _bad(Opaque())]))
    elif name == "num_computed_tokens":
        bad = draw(bad_count(MAX_TOKENS))
    elif name == "num_tokens":
        bad = draw(st.sampled_from([_bad(-1), _bad(2.5), _bad(None),
                                    _bad(_max_len(subject) + 1), _bad(2**64)]))
    elif name == "block_hashes":
        bad = draw(st.sampled_from([_bad(None), _bad(Opaque()), _bad("ab"),
                                    _bad(tuple(request.block_hashes), "a tuple of hashes")]))
    elif name == "skip_reading_prefix_cache":
        bad = draw(not_a_bool())
    else:  # num_preemptions
        bad = draw(st.one_of(not_an_int(), st.integers(max_value=-1).map(_bad)))
    if name == "num_tokens":
        # num_tokens is a property of impl's Request: a duck-typed request reports it.
        request._bad_num_tokens = bad.value  # type: ignore[attr-defined]
        request.__class__ = _RequestWithNumTokens
    else:
        setattr(request, name, bad.value)
    return name, bad


class _RequestWithNumTokens(Request):
    """A request whose num_tokens is whatever the test set (a duck-typed request)."""

    @property  # type: ignore[misc]
    def num_tokens(self) -> Any:
        return self._bad_num_tokens  # type: ignore[attr-defined]


def _set_hash(request: Request, index: int, value: Any) -> None:
    hashes = list(request.block_hashes)
    hashes[index] = value
    request.block_hashes = hashes


# ---------------------------------------------------------------------- KVCacheManager


@st.composite
def manager_bad_calls(draw: st.DrawFn, subject: ManagerSubject) -> BadCall:
    operation = draw(st.sampled_from(sorted(_MANAGER_CALLS)))
    call: BadCall = draw(_MANAGER_CALLS[operation](subject))
    return replace(call, operation=operation)


@st.composite
def _allocate_slots(draw: st.DrawFn, s: ManagerSubject) -> BadCall:
    manager = s.manager
    max_len = manager.max_model_len
    kind = draw(st.sampled_from([
        "num_new_tokens", "num_new_computed_tokens", "num_lookahead_tokens",
        "num_encoder_tokens", "delay_cache_blocks", "not a request", "request field",
        "computed beyond slots", "hash not bytes", "too few hashes", "event fields",
        "hits", "beyond max_model_len"]))
    running = _running(s, draw)
    request = running if running is not None and draw(st.booleans()) else _new_request(
        s, draw, "fresh")
    args: dict[str, Any] = {"num_new_tokens": 1, "num_new_computed_tokens": 0,
                            "new_computed_blocks": None, "num_lookahead_tokens": 0,
                            "delay_cache_blocks": False,
                            "num_encoder_tokens": _encoder_tokens(s, request)}
    described = f"manager.allocate_slots(<{'running' if request is running else 'new'} request>"

    def allocate(target: Any, req: Any = request) -> object:
        return target.manager.allocate_slots(req, **args)

    if kind in ("num_new_tokens", "num_new_computed_tokens", "num_lookahead_tokens",
                "num_encoder_tokens"):
        high = MAX_TOKENS if kind == "num_encoder_tokens" else max_len
        bad = draw(bad_positive(max_len) if kind == "num_new_tokens" else bad_count(high))
        args[kind] = bad.value
        return _call(f"{described}, {kind}={bad.label})", allocate, bad)
    if kind == "delay_cache_blocks":
        bad = draw(not_a_bool())
        args[kind] = bad.value
        return _call(f"{described}, delay_cache_blocks={bad.label})", allocate, bad)
    if kind == "not a request":
        bad = draw(_not_a_request())
        return _call(f"manager.allocate_slots({bad.label}, 1)",
                     lambda t: t.manager.allocate_slots(bad.value, 1), bad)
    if kind == "request field":
        name, bad = draw(_corrupt_request(s, request, ("request_id", "num_computed_tokens",
                                                        "num_tokens")))
        return _call(f"{described} with {name}={bad.label}, 1)", allocate, bad)
    if kind == "computed beyond slots":
        # vLLM's callers only count tokens they gave slots to (async scheduling's placeholder
        # tokens included, so num_computed_tokens may pass num_tokens, never the slots).
        beyond = _slots_held(s, request.request_id) + draw(st.integers(1, 8))
        if beyond > MAX_TOKENS:  # an attention-free layout: nothing holds tokens
            beyond = -1
        request.num_computed_tokens = beyond
        return _call(f"{described} with num_computed_tokens={beyond} beyond its slots, 1)",
                     allocate, _bad(beyond))
    if kind in ("hash not bytes", "too few hashes", "event fields"):
        if not manager.enable_caching:
            return draw(_allocate_slots(s))
        # A chunk of the request's own tokens that fills a block the call keys.
        args["num_new_tokens"] = request.num_tokens - request.num_computed_tokens
        first = request.num_computed_tokens // s.layout.hash_block_size
        end = request.num_tokens // s.layout.hash_block_size
        if end <= first or args["num_new_tokens"] < 1 or (
                request.num_computed_tokens > _slots_held(s, request.request_id)):
            return draw(_allocate_slots(s))
        if kind == "hash not bytes":
            bad = draw(not_bytes())
            _set_hash(request, draw(st.integers(first, end - 1)), bad.value)
            return _call(f"{described} whose block hash is {bad.label}, "
                         f"{args['num_new_tokens']})", allocate, bad)
        if kind == "too few hashes":
            kept = draw(st.integers(0, end - 1))
            request.block_hashes = request.block_hashes[:kept]
            return _call(f"{described} with {kept} block hashes, {args['num_new_tokens']})",
                         allocate, _bad(kept, None, f"{kept} block hashes"))
        which = draw(st.sampled_from(["token ids", "lora"]))
        if which == "token ids":
            bad = draw(st.sampled_from([_bad(None), _bad(range(2), "range(0, 2)"),
                                        _bad(["a"] * 64, "['a', ...]", "'a'")]))
            request.all_token_ids = bad.value
        else:
            bad = _bad(Opaque(), "a lora_request without adapter_id", "Opaque()")
            request.lora_request = bad.value
        if not manager.block_pool.enable_kv_cache_events or args["delay_cache_blocks"]:
            return _call(f"{described} with {which} {bad.label} (events off), "
                         f"{args['num_new_tokens']})", allocate, bad,
                         accepted="the token ids and the LoRA are read only to build "
                                  "BlockStored events, which are off")
        return _call(f"{described} with {which} {bad.label}, {args['num_new_tokens']})",
                     allocate, bad)
    if kind == "hits":
        return draw(_bad_hits(s))
    # Beyond max_model_len: capped, as vLLM's min() does for spec decode near the end.
    args["num_lookahead_tokens"] = max_len
    return _call(f"{described}, num_lookahead_tokens=max_model_len)", allocate,
                 accepted="slots past max_model_len are capped at it (vLLM's min(), which "
                          "lookahead and draft tokens near the end of the context rely on)")


@st.composite
def _bad_hits(draw: st.DrawFn, s: ManagerSubject) -> BadCall:
    """new_computed_blocks that are not this request's cache hits."""
    manager = s.manager
    num_groups = manager.num_kv_cache_groups
    kind = draw(st.sampled_from(["not blocks", "group count", "group not a list",
                                 "foreign", "stale", "another request's", "count mismatch",
                                 "hits without count", "count without hits", "running",
                                 "caching off", "element", "changed in place",
                                 "evicted since"]))
    request = _new_request(s, draw, "hit")
    lookup = s.lookup
    hits: Any
    num_hit = 0
    if kind == "not blocks":
        bad = draw(st.sampled_from([_bad(Opaque()), _bad(((),)), _bad([[]]), _bad(3)]))
        hits = bad.value
    elif kind == "group count":
        count = draw(st.sampled_from([n for n in (0, 1, 2, 3) if n != num_groups]))
        hits = KVCacheBlocks(tuple(() for _ in range(count)))
        bad = _bad(count, None, f"{count} groups")
    elif kind == "group not a list":
        bad = draw(not_iterable())
        hits = _raw_blocks(tuple(bad.value if g == 0 else () for g in range(num_groups)))
    elif kind == "count without hits":
        num_hit = draw(st.integers(1, 4))
        hits = manager.empty_kv_cache_blocks if draw(st.booleans()) else None
        bad = _bad(num_hit)
    elif kind == "caching off" and not manager.enable_caching:
        block = s.other.block_pool.blocks[1]
        hits = KVCacheBlocks(tuple([block] if g == 0 else [] for g in range(num_groups)))
        bad = _bad(hits, "hits with prefix caching off", "prefix caching is off")
    elif lookup is None or not lookup[2]:
        # No hit to start from: one foreign block per group then, counted as the first
        # group's tokens (groups of other block sizes are refused for the count).
        block = s.other.block_pool.blocks[1]
        hits = KVCacheBlocks(tuple([block] for _ in range(num_groups)))
        num_hit = manager.coordinator.single_type_managers[0].block_size
        bad = _bad(block, "a block of another manager", "block_id=1",
                   f"num_new_computed_tokens={num_hit}")
        if not manager.enable_caching:
            bad = _bad(hits, "hits with prefix caching off", "prefix caching is off")
    else:
        looked_up, found, num_hit = lookup
        groups = [list(g) for g in found.blocks]
        request = looked_up
        if kind == "running" and s.running:
            request = s.requests[s.running[0]]
            bad = _bad(request.request_id, None, repr(request.request_id))
        elif kind == "count mismatch":
            wrong = draw(st.sampled_from([n for n in (0, num_hit - 1, num_hit + 1, num_hit + 4)
                                          if n != num_hit and n >= 0]))
            bad = _bad(wrong)
            num_hit = wrong
        elif kind in ("changed in place", "evicted since"):
            # The lookup's own result: the manager remembers it and must notice the change.
            g = next(i for i, group in enumerate(groups) if any(not b.is_null for b in group))
            position = next(i for i, b in enumerate(groups[g]) if not b.is_null)
            block = groups[g][position]
            hits = found
            if kind == "evicted since":
                manager.evict_blocks({block.block_id})
                bad = _bad(block, f"block {block.block_id} (evicted since the lookup)",
                           f"block {block.block_id}", f"block_id={block.block_id}")
            else:  # a block of this pool the pool itself would take: free, or another's
                free = [b for b in manager.block_pool.free_block_queue.get_all_free_blocks()
                        if all(b not in group for group in groups)]
                stranger = free[0] if free else s.other.block_pool.blocks[1]
                found.blocks[g][position] = stranger  # type: ignore[index]
                bad = _bad(stranger, f"block {stranger.block_id} written into the lookup's "
                           "result", f"block_id={stranger.block_id}")
            return _call(f"manager.allocate_slots(<request {request.request_id!r}>, 1, "
                         f"{num_hit}, <its lookup's hits, {kind}: {bad.label}>)",
                         lambda t: t.manager.allocate_slots(request, 1, num_hit, hits), bad)
        elif kind == "another request's":
            request = _new_request(s, draw, "hit")  # another prompt: the keys are not its own
            if request.block_hashes[:len(groups[0])] == looked_up.block_hashes[:len(groups[0])]:
                request = Request("hit", [9999] * looked_up.num_tokens,
                                  block_hasher=get_request_block_hasher(
                                      s.layout.hash_block_size, sha256))
            block = next(b for g in groups for b in g if not b.is_null)
            bad = _bad(block, f"block {block.block_id} (cached for another prompt)",
                       f"block {block.block_id}", f"block_id={block.block_id}")
        else:
            g = draw(st.integers(0, num_groups - 1))
            position = draw(st.integers(0, len(groups[g]) - 1)) if groups[g] else 0
            choices = {
                "foreign": _bad(s.other.block_pool.blocks[1], "a block of another manager",
                                "block_id=1"),
                "element": draw(st.sampled_from([_bad(None), _bad(3), _bad(Opaque()),
                                                 _bad(KVCacheBlock(2), "KVCacheBlock(2)",
                                                      "block_id=2")])),
            }
            if s.stale:
                block = draw(st.sampled_from(s.stale))
                choices["stale"] = _bad(block, f"block {block.block_id} (handed back)",
                                        f"block {block.block_id}",
                                        f"block_id={block.block_id}")
            bad = choices.get(kind, choices["foreign"])
            if groups[g]:
                groups[g][position] = bad.value
            else:
                groups[g] = [bad.value]
        hits = _raw_blocks(tuple(groups))
    return _call(f"manager.allocate_slots(<request {request.request_id!r}>, 1, {num_hit}, "
                 f"<hits: {kind}: {bad.label}>)",
                 lambda t: t.manager.allocate_slots(request, 1, num_hit, hits), bad)


def _raw_blocks(groups: tuple[Any, ...]) -> Any:
    """A KVCacheBlocks-shaped object holding anything (KVCacheBlocks itself checks its
    groups): what a fork's or a confused caller's object may hold."""
    class RawBlocks:
        blocks = groups

        def __repr__(self) -> str:
            return f"RawBlocks({groups!r})"
    return RawBlocks()


@st.composite
def _get_computed_blocks(draw: st.DrawFn, s: ManagerSubject) -> BadCall:
    kind = draw(st.sampled_from(["not a request", "request field", "hash not bytes",
                                 "too few hashes"]))
    if kind == "not a request":
        bad = draw(_not_a_request())
        return _call(f"manager.get_computed_blocks({bad.label})",
                     lambda t: t.manager.get_computed_blocks(bad.value), bad)
    request = _new_request(s, draw, "lookup")
    manager = s.manager
    # The lookup (and with it the block hashes and num_preemptions) is skipped with caching
    # off, a request that skips reading the cache, or an empty prompt: as in vLLM.
    reads_hashes = (manager.enable_caching and not request.skip_reading_prefix_cache
                    and request.num_tokens > 0)
    fields = ("request_id", "num_tokens", "skip_reading_prefix_cache", "block_hashes",
              *(("num_preemptions",) if manager.log_stats else ()))
    if kind == "request field":
        name, bad = draw(_corrupt_request(s, request, fields))
        accepted = ""
        if name in ("block_hashes", "num_preemptions") and not reads_hashes:
            accepted = (f"{name} is read only when the prefix cache is looked up (caching "
                        "on, skip_reading_prefix_cache False, a prompt of at least a token)")
        return _call(f"manager.get_computed_blocks(<request with {name}={bad.label}>)",
                     lambda t: t.manager.get_computed_blocks(request), bad, accepted=accepted)
    accepted = "" if reads_hashes else (
        "block hashes are read only when the prefix cache is looked up (caching on, "
        "skip_reading_prefix_cache False)")
    if kind == "hash not bytes":
        if not request.block_hashes:
            request.block_hashes = [BlockHash(b"x" * 32)]
        bad = draw(not_bytes())
        position = draw(st.sampled_from([0, len(request.block_hashes) - 1]))
        _set_hash(request, position, bad.value)
        # Full attention reads the first hash of every lookup of at least a block; a hash
        # after the first miss is not read (as a loop of get_cached_block would not).
        reached = position == 0 and request.num_tokens > 1 + max(
            m.block_size for m in manager.coordinator.single_type_managers) and any(
            isinstance(m, FullAttentionManager) for m in manager.coordinator.single_type_managers)
        if not reached and not accepted:
            accepted = "a malformed block hash the lookup does not reach is not read"
        return _call(f"manager.get_computed_blocks(<request whose block hash {position} is "
                     f"{bad.label}>)",
                     lambda t: t.manager.get_computed_blocks(request), bad, accepted=accepted)
    needed = request.num_tokens // s.layout.hash_block_size
    if not needed:
        return draw(_get_computed_blocks(s))
    kept = draw(st.integers(0, needed - 1))
    request.block_hashes = request.block_hashes[:kept]
    return _call(f"manager.get_computed_blocks(<request with {kept} of {needed} hashes>)",
                 lambda t: t.manager.get_computed_blocks(request),
                 _bad(kept, None, f"{kept} block hashes"), accepted=accepted)


@st.composite
def _free(draw: st.DrawFn, s: ManagerSubject) -> BadCall:
    kind = draw(st.sampled_from(["not a request", "request_id", "unknown"]))
    if kind == "not a request":
        bad = draw(_not_a_request().filter(lambda b: not isinstance(b.value, NotARequest)))
        return _call(f"manager.free({bad.label})", lambda t: t.manager.free(bad.value), bad)
    request = _new_request(s, draw, "ghost")
    if kind == "request_id":
        _, bad = draw(_corrupt_request(s, request, ("request_id",)))
        return _call(f"manager.free(<request with request_id={bad.label}>)",
                     lambda t: t.manager.free(request), bad)
    if s.manager.strict_free:
        return _call("manager.free(<a request holding no blocks>) (strict_free)",
                     lambda t: t.manager.free(request), _bad("ghost"))
    return _call("manager.free(<a request holding no blocks>)",
                 lambda t: t.manager.free(request),
                 accepted="vLLM's scheduler frees every finished request, including those "
                          "that never got blocks (strict_free=True refuses)")


@st.composite
def _cache_blocks(draw: st.DrawFn, s: ManagerSubject) -> BadCall:
    kind = draw(st.sampled_from(["not a request", "request field", "count",
                                 "beyond slots"]))
    if kind == "not a request":
        bad = draw(_not_a_request())
        return _call(f"manager.cache_blocks({bad.label}, 0)",
                     lambda t: t.manager.cache_blocks(bad.value, 0), bad)
    request = _some_request(s, draw)
    if kind == "request field":
        _, bad = draw(_corrupt_request(s, request, ("request_id",)))
        return _call(f"manager.cache_blocks(<request with request_id={bad.label}>, 0)",
                     lambda t: t.manager.cache_blocks(request, 0), bad)
    if kind == "count":
        bad = draw(bad_count(s.manager.max_model_len))
        return _call(f"manager.cache_blocks(<request>, {bad.label})",
                     lambda t: t.manager.cache_blocks(request, bad.value), bad)
    beyond = _slots_held(s, request.request_id) + draw(st.integers(1, 8))
    if beyond > s.manager.max_model_len:
        beyond = s.manager.max_model_len + 1
    return _call(f"manager.cache_blocks(<request>, {beyond}) beyond its slots",
                 lambda t: t.manager.cache_blocks(request, beyond), _bad(beyond))


@st.composite
def _request_id_calls(draw: st.DrawFn, s: ManagerSubject) -> BadCall:
    method = draw(st.sampled_from(["get_blocks", "get_block_ids",
                                   "get_num_common_prefix_blocks"]))
    if draw(st.integers(0, 3)) == 0:
        return _call(f"manager.{method}('ghost')",
                     lambda t: getattr(t.manager, method)("ghost"),
                     accepted="an id holding no blocks has no blocks (vLLM's scheduler asks for "
                              "the blocks of requests an attention-free model never gives any)")
    bad = draw(st.sampled_from([_bad(None), _bad(3), _bad(b"r0"), _bad(["r0"]),
                                _bad(Opaque())]))
    return _call(f"manager.{method}({bad.label})",
                 lambda t: getattr(t.manager, method)(bad.value), bad)


@st.composite
def _evict_blocks(draw: st.DrawFn, s: ManagerSubject) -> BadCall:
    pool = s.manager.block_pool
    if draw(st.booleans()):
        bad = draw(not_iterable())
        return _call(f"manager.evict_blocks({bad.label})",
                     lambda t: t.manager.evict_blocks(bad.value), bad)
    bad = draw(bad_int(0, pool.num_gpu_blocks - 1))
    return _call(f"manager.evict_blocks([1, {bad.label}])",
                 lambda t: t.manager.evict_blocks([1, bad.value]), bad)


@st.composite
def _create_kv_cache_blocks(draw: st.DrawFn, s: ManagerSubject) -> BadCall:
    num_groups = s.manager.num_kv_cache_groups
    kind = draw(st.sampled_from(["not a tuple", "group count", "group"]))
    if kind == "not a tuple":
        bad = draw(st.sampled_from([_bad(None), _bad([[]] * num_groups, "a list of groups",
                                                     "list"), _bad(Opaque())]))
        value = bad.value
    elif kind == "group count":
        count = num_groups + draw(st.sampled_from([-1, 1, 2]))
        if count < 0:
            count = 1
        value = tuple([] for _ in range(count))
        bad = _bad(count, None, f"{count} groups")
    else:
        bad = draw(not_iterable())
        value = tuple(bad.value if g == 0 else [] for g in range(max(num_groups, 1)))
        if num_groups == 0:
            bad = _bad(1, None, "1 groups")
    return _call(f"manager.create_kv_cache_blocks({bad.label})",
                 lambda t: t.manager.create_kv_cache_blocks(value), bad)


_MANAGER_CALLS: dict[str, Any] = {
    "allocate_slots": _allocate_slots,
    "get_computed_blocks": _get_computed_blocks,
    "free": _free,
    "cache_blocks": _cache_blocks,
    "get_blocks/get_block_ids/common prefix": _request_id_calls,
    "evict_blocks": _evict_blocks,
    "create_kv_cache_blocks": _create_kv_cache_blocks,
}


@given(st.data())
def test_kv_cache_manager_refuses_bad_calls_and_changes_nothing(data: st.DataObject) -> None:
    subject = data.draw(managers())
    call = data.draw(manager_bad_calls(subject))
    check(subject, manager_snapshot, call)


# ---------------------------------------------------------------------- KVCacheBlocks


@given(st.data())
def test_kv_cache_blocks_refuse_bad_calls(data: st.DataObject) -> None:
    subject = data.draw(managers())
    manager = subject.manager
    blocks = manager.get_blocks(subject.running[0]) if subject.running else (
        manager.empty_kv_cache_blocks)
    operation = data.draw(st.sampled_from(["KVCacheBlocks()", "__add__", "get_block_ids",
                                           "get_unhashed_block_ids"]))
    call: BadCall
    if operation == "KVCacheBlocks()":
        bad = data.draw(st.sampled_from([_bad(None), _bad([[]], "[[]]"), _bad(Opaque()),
                                         _bad((None,), "(None,)", "None"),
                                         _bad((3,), "(3,)", "3")]))
        call = _call(f"KVCacheBlocks({bad.label})", lambda _: KVCacheBlocks(bad.value), bad)
    elif operation == "__add__":
        count = len(blocks.blocks)
        bad = data.draw(st.sampled_from([
            _bad(None), _bad(Opaque()), _bad(3),
            _bad(KVCacheBlocks(tuple(() for _ in range(count + 1))),
                 f"KVCacheBlocks of {count + 1} groups", f"{count + 1} groups")]))
        call = _call(f"<KVCacheBlocks of {count} groups> + {bad.label}",
                     lambda _: blocks + bad.value, bad)
    elif operation == "get_block_ids":
        if data.draw(st.booleans()):
            bad = data.draw(not_a_bool())
            call = _call(f"blocks.get_block_ids(allow_none={bad.label})",
                         lambda _: blocks.get_block_ids(bad.value), bad)
        else:
            bad = data.draw(st.sampled_from([_bad(None), _bad(3), _bad(Opaque())]))
            odd = KVCacheBlocks(([bad.value],))
            call = _call(f"KVCacheBlocks(([{bad.label}],)).get_block_ids()",
                         lambda _: odd.get_block_ids(), bad)
    else:
        bad = data.draw(st.sampled_from([_bad(None), _bad(3), _bad(Opaque())]))
        odd = KVCacheBlocks(([bad.value],))
        call = _call(f"KVCacheBlocks(([{bad.label}],)).get_unhashed_block_ids()",
                     lambda _: odd.get_unhashed_block_ids(), bad)
    check(subject, manager_snapshot, replace(call, operation=operation))


# ---------------------------------------------------------------------- coordinators


@st.composite
def coordinator_bad_calls(draw: st.DrawFn, s: ManagerSubject) -> BadCall:
    coordinator = s.manager.coordinator
    num_groups = len(coordinator.single_type_managers)
    operation = draw(st.sampled_from([
        "get_num_blocks_to_allocate", "get_max_num_blocks_to_allocate",
        "num_blocks_freed_by_skip", "save_new_computed_blocks", "allocate_new_blocks",
        "cache_blocks", "free", "get_num_common_prefix_blocks", "remove_skipped_blocks",
        "get_blocks", "has_blocks", "find_longest_cache_hit"]))
    running = _running(s, draw)
    rid = running.request_id if running is not None else "ghost"
    empty = tuple(() for _ in range(num_groups))
    bad_id = st.sampled_from([_bad(None), _bad(3), _bad(["r0"]), _bad(Opaque())])
    if operation in ("free", "get_num_common_prefix_blocks", "get_blocks", "has_blocks"):
        bad = draw(bad_id)
        call = _call(f"coordinator.{operation}({bad.label})",
                     lambda t: getattr(t.manager.coordinator, operation)(bad.value), bad)
    elif operation in ("get_num_blocks_to_allocate", "get_max_num_blocks_to_allocate"):
        which = draw(st.sampled_from(["request_id", "num_tokens", "blocks", "encoder"]))
        args: list[Any] = [rid, 4, empty, 0]
        if which == "request_id":
            bad = draw(bad_id)
            args[0] = bad.value
        elif which == "num_tokens":
            bad = draw(bad_count(MAX_TOKENS))
            args[1] = bad.value
        elif which == "encoder":
            bad = draw(bad_count(MAX_TOKENS))
            args[3] = bad.value
        else:
            bad = draw(st.one_of(not_iterable(), st.sampled_from([
                _bad(tuple([None] for _ in range(num_groups)), "groups holding None",
                     "None"),
                _bad(tuple(() for _ in range(num_groups + 1)), f"{num_groups + 1} groups",
                     f"{num_groups + 1} groups")])))
            args[2] = bad.value
        call = _call(f"coordinator.{operation}(<{which}: {bad.label}>)",
                     lambda t: getattr(t.manager.coordinator, operation)(*args), bad)
    elif operation in ("num_blocks_freed_by_skip", "remove_skipped_blocks"):
        which = draw(st.sampled_from(["request_id", "count", "beyond slots"]))
        count: Any = 0
        if which == "request_id":
            bad = draw(bad_id)
            rid = bad.value
        elif which == "count":
            bad = draw(bad_count(MAX_TOKENS))
            count = bad.value
        else:
            count = _slots_held(s, rid) + draw(st.integers(1, 8))
            if count > MAX_TOKENS:
                count = -1
            bad = _bad(count)
        call = _call(f"coordinator.{operation}({rid!r}, {count!r})",
                     lambda t: getattr(t.manager.coordinator, operation)(rid, count), bad)
    elif operation == "save_new_computed_blocks":
        which = draw(st.sampled_from(["request_id", "blocks", "foreign", "free",
                                      "request holds blocks"]))
        blocks: Any = empty
        target = "fresh"
        if which == "request_id":
            bad = draw(bad_id)
            target = bad.value
        elif which == "blocks":
            bad = draw(st.one_of(not_iterable(), st.just(
                _bad(tuple([None] for _ in range(num_groups)), "groups holding None",
                     "None"))))
            blocks = bad.value
        elif which == "foreign":
            block = s.other.block_pool.blocks[1]
            blocks = tuple([block] for _ in range(num_groups))
            bad = _bad(block, "a block of another manager", "block_id=1")
        elif which == "free":
            free = s.manager.block_pool.free_block_queue.get_all_free_blocks()
            block = free[0] if free else s.other.block_pool.blocks[1]
            blocks = tuple([block] for _ in range(num_groups))
            bad = _bad(block, f"block {block.block_id} (free, not touched)",
                       f"block {block.block_id}", f"block_id={block.block_id}")
        else:
            target = rid
            held = [b for g in s.manager.get_blocks(rid).blocks for b in g if not b.is_null]
            if not held or running is None:
                held = [s.other.block_pool.blocks[1]]
            blocks = tuple([held[0]] for _ in range(num_groups))
            bad = _bad(rid, None, repr(rid), "block_id=1")
        call = _call(f"coordinator.save_new_computed_blocks({target!r}, <{which}: "
                     f"{bad.label}>)",
                     lambda t: t.manager.coordinator.save_new_computed_blocks(target, blocks),
                     bad)
    elif operation == "allocate_new_blocks":
        which = draw(st.sampled_from(["request_id", "num_tokens", "encoder", "too many"]))
        args = [rid, 1, 0]
        if which == "request_id":
            bad = draw(bad_id)
            args[0] = bad.value
        elif which == "num_tokens":
            bad = draw(bad_count(MAX_TOKENS))
            args[1] = bad.value
        elif which == "encoder":
            bad = draw(bad_count(MAX_TOKENS))
            args[2] = bad.value
        else:  # more blocks than are free: refused before any group takes one
            pool = s.manager.block_pool
            args[1] = (pool.num_gpu_blocks + 2) * 4
            bad = _bad(args[1])
        call = _call(f"coordinator.allocate_new_blocks(<{which}: {bad.label}>)",
                     lambda t: t.manager.coordinator.allocate_new_blocks(*args), bad)
    elif operation == "cache_blocks":
        request = running if running is not None else _new_request(s, draw, "fresh")
        which = draw(st.sampled_from(["not a request", "count", "beyond slots"]))
        num: Any = 0
        target_request: Any = request
        if which == "not a request":
            bad = draw(_not_a_request())
            target_request = bad.value
        elif which == "count":
            bad = draw(bad_count(MAX_TOKENS))
            num = bad.value
        else:
            num = min(_slots_held(s, request.request_id) + draw(st.integers(1, 8)),
                      s.manager.max_model_len + 1)
            bad = _bad(num)
        call = _call(f"coordinator.cache_blocks(<{which}: {bad.label}>)",
                     lambda t: t.manager.coordinator.cache_blocks(target_request, num), bad)
    else:  # find_longest_cache_hit
        which = draw(st.sampled_from(["hashes", "hash", "length"]))
        hashes: Any = [b"\x00" * 32]
        length: Any = 2
        if which == "hashes":
            bad = draw(not_iterable())
            hashes = bad.value
        elif which == "hash":
            bad = draw(not_bytes())
            hashes = [bad.value]
        else:
            bad = draw(bad_count(MAX_TOKENS))
            length = bad.value
        call = _call(f"coordinator.find_longest_cache_hit(<{which}: {bad.label}>)",
                     lambda t: t.manager.coordinator.find_longest_cache_hit(hashes, length),
                     bad)
    return replace(call, operation=operation)


@given(st.data())
def test_coordinators_refuse_bad_calls_and_change_nothing(data: st.DataObject) -> None:
    subject = data.draw(managers())
    call = data.draw(coordinator_bad_calls(subject))
    check(subject, manager_snapshot, call)


# ---------------------------------------------------------------------- attention-type managers


@st.composite
def single_type_bad_calls(draw: st.DrawFn, s: ManagerSubject) -> BadCall:
    singles = s.manager.coordinator.single_type_managers
    index = draw(st.integers(0, len(singles) - 1))
    single = singles[index]
    name = f"managers[{index}]"
    operation = draw(st.sampled_from([
        "get_num_blocks_to_allocate", "save_new_computed_blocks", "allocate_new_blocks",
        "cache_blocks", "free", "get_num_skipped_tokens", "remove_skipped_blocks",
        "get_num_common_prefix_blocks", "find_longest_cache_hit"]))
    running = _running(s, draw)
    rid = running.request_id if running is not None else "ghost"
    bad_id = st.sampled_from([_bad(None), _bad(3), _bad(["r0"]), _bad(Opaque())])

    def on(t: ManagerSubject) -> Any:
        return t.manager.coordinator.single_type_managers[index]

    if operation in ("free", "get_num_common_prefix_blocks"):
        bad = draw(bad_id)
        call = _call(f"{name}.{operation}({bad.label})",
                     lambda t: getattr(on(t), operation)(bad.value), bad)
    elif operation == "get_num_skipped_tokens":
        bad = draw(bad_count(MAX_TOKENS))
        call = _call(f"{name}.get_num_skipped_tokens({bad.label})",
                     lambda t: on(t).get_num_skipped_tokens(bad.value), bad)
    elif operation in ("get_num_blocks_to_allocate", "allocate_new_blocks",
                       "remove_skipped_blocks"):
        which = draw(st.sampled_from(["request_id", "num_tokens", *(
            ("blocks",) if operation == "get_num_blocks_to_allocate" else ()), *(
            ("beyond slots",) if operation == "remove_skipped_blocks" else ()), *(
            ("too many",) if operation == "allocate_new_blocks" else ())]))
        args: list[Any] = [rid, 2] + ([[]] if operation == "get_num_blocks_to_allocate" else [])
        if which == "request_id":
            bad = draw(bad_id)
            args[0] = bad.value
        elif which == "num_tokens":
            bad = draw(bad_count(MAX_TOKENS))
            args[1] = bad.value
        elif which == "blocks":
            bad = draw(st.one_of(not_iterable(), st.just(_bad([None], "[None]", "None")),
                                 st.just(_bad([KVCacheBlock(3)], "[KVCacheBlock(3)]"))))
            args[2] = bad.value
            if isinstance(bad.value, list) and bad.value[0] is not None:
                return replace(_call(
                    f"{name}.get_num_blocks_to_allocate(<blocks made outside the pool>)",
                    lambda t: on(t).get_num_blocks_to_allocate(*args),
                    accepted="a count of hits made outside the pool changes nothing (vLLM's "
                             "tests count them)"), operation=f"{type(single).__name__}."
                                                        f"{operation}")
        elif which == "beyond slots":
            args[1] = len(single.req_to_blocks.get(rid) or ()) * single.block_size + 1
            bad = _bad(args[1])
        else:
            args[1] = (s.manager.block_pool.num_gpu_blocks + 2) * single.block_size * 2
            bad = _bad(args[1])
        call = _call(f"{name}.{operation}(<{which}: {bad.label}>)",
                     lambda t: getattr(on(t), operation)(*args), bad)
    elif operation == "save_new_computed_blocks":
        which = draw(st.sampled_from(["request_id", "blocks", "foreign", "free", "holds"]))
        target: Any = "fresh"
        blocks: Any = []
        if which == "request_id":
            bad = draw(bad_id)
            target = bad.value
        elif which == "blocks":
            bad = draw(st.one_of(not_iterable(), st.just(_bad([None], "[None]", "None"))))
            blocks = bad.value
        elif which == "foreign":
            blocks = [s.other.block_pool.blocks[1]]
            bad = _bad(blocks[0], "a block of another manager", "block_id=1")
        elif which == "free":
            free = s.manager.block_pool.free_block_queue.get_all_free_blocks()
            block = free[0] if free else s.other.block_pool.blocks[1]
            blocks = [block]
            bad = _bad(block, f"block {block.block_id} (free)", f"block {block.block_id}",
                       f"block_id={block.block_id}")
        else:
            held = [b for b in single.req_to_blocks.get(rid) or () if not b.is_null]
            blocks = held[:1] or [s.other.block_pool.blocks[1]]
            target = rid
            bad = _bad(rid, None, repr(rid), "block_id=1")
        if isinstance(single, CrossAttentionManager) and which in ("foreign", "free", "holds"):
            bad = _bad(blocks, "hits for cross-attention", "cross-attention", repr(target))
        call = _call(f"{name}.save_new_computed_blocks({target!r}, <{which}: {bad.label}>)",
                     lambda t: on(t).save_new_computed_blocks(target, blocks), bad)
    elif operation == "cache_blocks":
        request = running if running is not None else _new_request(s, draw, "fresh")
        which = draw(st.sampled_from(["not a request", "count", "beyond slots"]))
        target_request: Any = request
        num: Any = 0
        if which == "not a request":
            bad = draw(_not_a_request())
            target_request = bad.value
        elif which == "count":
            bad = draw(bad_count(MAX_TOKENS))
            num = bad.value
        else:
            num = len(single.req_to_blocks.get(request.request_id) or ()) * single.block_size
            num += single.block_size
            bad = _bad(num)
        if isinstance(single, CrossAttentionManager):
            bad = _bad(num, "cross-attention is never cached", "prefix caching")
        call = _call(f"{name}.cache_blocks(<{which}: {bad.label}>)",
                     lambda t: on(t).cache_blocks(target_request, num), bad)
    else:  # find_longest_cache_hit (a classmethod: the group's own arguments, one bad)
        call = draw(_find_longest_cache_hit(s, index, single))
    return replace(call, operation=f"{type(single).__name__}.{operation}")


@st.composite
def _find_longest_cache_hit(draw: st.DrawFn, s: ManagerSubject, index: int,
                            single: SingleTypeKVCacheManager) -> BadCall:
    pool = s.manager.block_pool
    args: dict[str, Any] = {
        "block_hashes": [b"\x00" * 32], "max_length": 2, "kv_cache_group_ids": [index],
        "block_pool": pool, "kv_cache_spec": single.kv_cache_spec, "use_eagle": False,
        "alignment_tokens": single.block_size,
    }
    which = draw(st.sampled_from(sorted(args)))
    if which == "block_hashes":
        bad = draw(st.one_of(not_iterable(), not_bytes().map(
            lambda b: Bad([b.value], f"[{b.label}]", b.forms))))
    elif which == "max_length":
        bad = draw(bad_count(MAX_TOKENS))
    elif which == "kv_cache_group_ids":
        bad = draw(st.one_of(not_iterable(), bad_int(0, 2**32 - 1).map(
            lambda b: Bad([b.value], f"[{b.label}]", b.forms))))
    elif which == "block_pool":
        bad = draw(st.sampled_from([_bad(None), _bad(Opaque())]))
    elif which == "kv_cache_spec":
        bad = draw(st.sampled_from([_bad(None), _bad(Opaque()), _bad(3)]))
    elif which == "use_eagle":
        bad = draw(not_a_bool())
    else:
        bad = draw(bad_positive(MAX_TOKENS))
    args[which] = bad.value
    if isinstance(single, CrossAttentionManager):
        bad = _bad(args, "cross-attention has no cache hits", "never prefix-cached")
    return _call(f"{type(single).__name__}.find_longest_cache_hit(<{which}: {bad.label}>)",
                 lambda t: type(single).find_longest_cache_hit(**args), bad)


@given(st.data())
def test_attention_type_managers_refuse_bad_calls_and_change_nothing(
        data: st.DataObject) -> None:
    subject = data.draw(managers())
    call = data.draw(single_type_bad_calls(subject))
    check(subject, manager_snapshot, call)


# ---------------------------------------------------------------------- constructors


def _config(*specs: Any, num_blocks: int = 8) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, (), tuple(
        KVCacheGroupSpec((f"layer.{i}",), spec) for i, spec in enumerate(specs)))


FULL = FullAttentionSpec(2, 1, 8, "float16")


@given(st.data())
def test_kv_cache_manager_constructor_refuses_bad_arguments(data: st.DataObject) -> None:
    names = ["kv_cache_config", "max_model_len", "hash_block_size", "enable_caching", "use_eagle",
             "log_stats", "enable_kv_cache_events", "dcp_world_size", "pcp_world_size",
             "metrics_collector", "strict_free"]
    which = data.draw(st.sampled_from(names))
    args: dict[str, Any] = {"kv_cache_config": _config(FULL), "max_model_len": 64,
                            "hash_block_size": 2}
    if which == "kv_cache_config":
        bad = data.draw(st.sampled_from([_bad(None), _bad(Opaque()), _bad(3),
                                         _bad([FULL], "[FullAttentionSpec]", "FullAttention")]))
    elif which in ("max_model_len", "hash_block_size"):
        bad = data.draw(bad_positive(MAX_TOKENS))
    elif which in ("dcp_world_size", "pcp_world_size"):
        bad = data.draw(bad_positive(MAX_WORLD_SIZE))
    elif which == "metrics_collector":
        bad = data.draw(st.sampled_from([_bad(Opaque()), _bad(1.0), _bad("collector")]))
    else:
        bad = data.draw(not_a_bool())
    args[which] = bad.value
    check(None, lambda _: None, _call(f"KVCacheManager({which}={bad.label})",
                                       lambda _: KVCacheManager(**args), bad,
                                       operation=f"KVCacheManager({which})"))


@given(st.data())
def test_get_kv_cache_coordinator_refuses_bad_arguments(data: st.DataObject) -> None:
    which = data.draw(st.sampled_from(["kv_cache_config", "max_model_len", "use_eagle",
                                       "enable_caching", "enable_kv_cache_events",
                                       "dcp_world_size", "pcp_world_size", "hash_block_size"]))
    args: dict[str, Any] = {"kv_cache_config": _config(FULL, SlidingWindowSpec(
        2, 1, 8, "float16", sliding_window=4)), "max_model_len": 64, "use_eagle": False,
        "enable_caching": True, "enable_kv_cache_events": False, "dcp_world_size": 1,
        "pcp_world_size": 1, "hash_block_size": 2}
    if which == "kv_cache_config":
        bad = data.draw(st.sampled_from([_bad(None), _bad(Opaque()), _bad(3)]))
    elif which in ("max_model_len", "hash_block_size"):
        bad = data.draw(bad_positive(MAX_TOKENS))
    elif which in ("dcp_world_size", "pcp_world_size"):
        bad = data.draw(bad_positive(MAX_WORLD_SIZE))
    else:
        bad = data.draw(not_a_bool())
    args[which] = bad.value
    check(None, lambda _: None, _call(f"get_kv_cache_coordinator({which}={bad.label})",
                                       lambda _: get_kv_cache_coordinator(**args), bad,
                                       operation=f"get_kv_cache_coordinator({which})"))


@given(st.data())
def test_attention_type_manager_constructors_refuse_bad_arguments(data: st.DataObject) -> None:
    pool = BlockPool(8, True, 2)
    cls, spec = data.draw(st.sampled_from([
        (FullAttentionManager, FULL),
        (SlidingWindowManager, SlidingWindowSpec(2, 1, 8, "float16", sliding_window=4)),
        (MambaManager, MambaSpec(2, ((2, 3),), ("float16",))),
        (CrossAttentionManager, CrossAttentionSpec(2, 1, 8, "float16")),
    ]))
    which = data.draw(st.sampled_from(["kv_cache_spec", "block_pool", "kv_cache_group_id",
                                       "dcp_world_size", "pcp_world_size", "factory spec",
                                       "factory argument"]))
    args: dict[str, Any] = {"kv_cache_spec": spec, "block_pool": pool, "kv_cache_group_id": 0}
    if which == "kv_cache_spec":
        bad = data.draw(st.sampled_from([_bad(None), _bad(Opaque()), _bad(3)]))
    elif which == "block_pool":
        bad = data.draw(st.sampled_from([_bad(None), _bad(Opaque()), _bad(8)]))
    elif which == "kv_cache_group_id":
        bad = data.draw(bad_int(0, 2**32 - 1))
    elif which in ("dcp_world_size", "pcp_world_size"):
        bad = data.draw(bad_positive(MAX_WORLD_SIZE))
    elif which == "factory spec":
        bad = data.draw(st.sampled_from([_bad(None), _bad(Opaque()), _bad(3)]))
        spec_value = bad.value
        call = _call(f"get_manager_for_kv_cache_spec({bad.label}, ...)",
                     lambda _: get_manager_for_kv_cache_spec(
                         spec_value, block_pool=pool, kv_cache_group_id=0), bad)
        check(pool, _pool_only, replace(call, operation="get_manager_for_kv_cache_spec"))
        return
    else:
        bad = _bad("block_size", "an unknown keyword", "block_size")
        call = _call("get_manager_for_kv_cache_spec(spec, block_size=2)",
                     lambda _: get_manager_for_kv_cache_spec(
                         spec, block_pool=pool, kv_cache_group_id=0, block_size=2), bad)
        check(pool, _pool_only, replace(call, operation="get_manager_for_kv_cache_spec"))
        return
    args[which] = bad.value
    check(pool, _pool_only, _call(f"{cls.__name__}({which}={bad.label})",
                                  lambda _: cls(**args), bad,
                                  operation=f"{cls.__name__}({which})"))


def _pool_only(pool: BlockPool) -> object:
    return pool_snapshot(PoolSubject(pool, [], [], pool))


# ---------------------------------------------------------------------- specs and configs


_SPEC_FIELDS: dict[type, dict[str, Any]] = {
    FullAttentionSpec: {"block_size": 2, "num_kv_heads": 1, "head_size": 8, "dtype": "float16"},
    MLAAttentionSpec: {"block_size": 2, "num_kv_heads": 1, "head_size": 8, "dtype": "float16"},
    SlidingWindowSpec: {"block_size": 2, "num_kv_heads": 1, "head_size": 8, "dtype": "float16",
                        "sliding_window": 4},
    ChunkedLocalAttentionSpec: {"block_size": 2, "num_kv_heads": 1, "head_size": 8,
                                "dtype": "float16", "attention_chunk_size": 4},
    CrossAttentionSpec: {"block_size": 2, "num_kv_heads": 1, "head_size": 8, "dtype": "float16"},
    SinkFullAttentionSpec: {"block_size": 2, "num_kv_heads": 1, "head_size": 8,
                            "dtype": "float16", "sink_len": 2},
    MambaSpec: {"block_size": 2, "shapes": ((2, 3),), "dtypes": ("float16",)},
}


@given(st.data())
def test_spec_constructors_refuse_bad_fields(data: st.DataObject) -> None:
    cls = data.draw(st.sampled_from(sorted(_SPEC_FIELDS, key=lambda c: c.__name__)))
    args = dict(_SPEC_FIELDS[cls])
    optional = {FullAttentionSpec: ["sliding_window", "attention_chunk_size", "head_size_v"],
                MLAAttentionSpec: ["cache_dtype_str"],
                MambaSpec: ["page_size_padded", "num_speculative_blocks", "mamba_type"]}
    which = data.draw(st.sampled_from(sorted(args) + optional.get(cls, [])))
    if which == "dtype":
        bad = data.draw(st.sampled_from([_bad(None), _bad("float13"), _bad(3), _bad(Opaque())]))
    elif which == "shapes":
        bad = data.draw(st.sampled_from([_bad(None), _bad(((0, 3),), "((0, 3),)", "(0, 3)"),
                                         _bad(((2.5,),), "((2.5,),)", "2.5"),
                                         _bad((("a",),), "(('a',),)", "'a'"),
                                         _bad(3)]))
    elif which == "dtypes":
        bad = data.draw(st.sampled_from([_bad(None), _bad(("float13",), "('float13',)",
                                                          "float13"), _bad(3)]))
    elif which in ("mamba_type", "cache_dtype_str"):
        bad = data.draw(st.sampled_from([_bad(3), _bad(b"fp8", "b'fp8'"), _bad(Opaque())]))
    elif which == "num_speculative_blocks":
        bad = data.draw(bad_count(2**31 - 1))
    elif which in ("sliding_window", "attention_chunk_size", "head_size_v", "sink_len",
                   "page_size_padded"):  # None is their default: "no window", ...
        bad = data.draw(bad_positive(MAX_TOKENS).filter(lambda b: b.value is not None))
    else:
        bad = data.draw(bad_positive(MAX_TOKENS))
    args[which] = bad.value
    check(None, lambda _: None, _call(f"{cls.__name__}({which}={bad.label})",
                                       lambda _: cls(**args), bad,
                                       operation=f"{cls.__name__}({which})"))


_NOT_NAMES = st.sampled_from([_bad(None), _bad(3), _bad((3,), "(3,)", "3"), _bad("layer.0")])


@st.composite
def _config_bad_calls(draw: st.DrawFn) -> BadCall:
    """One bad value for a config class's field, or for a converter."""
    group = KVCacheGroupSpec(("layer.0",), FULL)
    operation = draw(st.sampled_from(["KVCacheTensor.size", "KVCacheTensor.shared_by",
                                      "KVCacheGroupSpec.layer_names",
                                      "KVCacheGroupSpec.kv_cache_spec", "KVCacheConfig.num_blocks",
                                      "KVCacheConfig.kv_cache_tensors",
                                      "KVCacheConfig.kv_cache_groups", "as_kv_cache_spec",
                                      "as_kv_cache_config"]))
    builds: dict[str, tuple[st.SearchStrategy[Bad], Callable[[Any], object]]] = {
        "KVCacheTensor.size": (bad_count(MAX_TOKENS), lambda v: KVCacheTensor(v, ("layer.0",))),
        "KVCacheTensor.shared_by": (_NOT_NAMES, lambda v: KVCacheTensor(64, v)),
        "KVCacheGroupSpec.layer_names": (_NOT_NAMES, lambda v: KVCacheGroupSpec(v, FULL)),
        "KVCacheGroupSpec.kv_cache_spec": (
            st.sampled_from([_bad(None), _bad(Opaque()), _bad(3)]),
            lambda v: KVCacheGroupSpec(("layer.0",), v)),
        "KVCacheConfig.num_blocks": (bad_count(MAX_TOKENS),
                                     lambda v: KVCacheConfig(v, (), (group,))),
        "KVCacheConfig.kv_cache_tensors": (
            st.sampled_from([_bad(None), _bad(3), _bad((3,), "(3,)", "3"),
                             _bad((Opaque(),), "(Opaque(),)", "Opaque()")]),
            lambda v: KVCacheConfig(8, v, (group,))),
        "KVCacheConfig.kv_cache_groups": (
            st.sampled_from([_bad(None), _bad(3), _bad((3,), "(3,)", "3"),
                             _bad((FULL,), "(FullAttentionSpec,)", "FullAttentionSpec")]),
            lambda v: KVCacheConfig(8, (), v)),
        "as_kv_cache_spec": (
            st.sampled_from([_bad(None), _bad(Opaque()), _bad(3), _bad("full"),
                             _bad(_foreign_spec("FullAttentionSpec", block_size=0),
                                  "FullAttentionSpec(block_size=0)", "0"),
                             _bad(_foreign_spec("SlidingWindowSpec"),
                                  "SlidingWindowSpec without sliding_window", "sliding_window")]),
            as_kv_cache_spec),
        "as_kv_cache_config": (
            st.sampled_from([_bad(None), _bad(Opaque()), _bad(3),
                             _bad(_foreign_config(groups=None),
                                  "a config whose kv_cache_groups is None", "None"),
                             _bad(_foreign_config(num_blocks=-1), "a config of -1 blocks",
                                  "-1")]),
            as_kv_cache_config),
    }
    values, build = builds[operation]
    bad = draw(values)
    return _call(f"{operation}(<{bad.label}>)", lambda _: build(bad.value), bad,
                 operation=operation)


@given(st.data())
def test_config_classes_and_converters_refuse_bad_values(data: st.DataObject) -> None:
    check(None, lambda _: None, data.draw(_config_bad_calls()))


def _foreign_spec(kind: str, **fields: Any) -> Any:
    """A spec object of vLLM's shape (a class of that name), not impl's."""
    values = {"block_size": 2, "num_kv_heads": 1, "head_size": 8, "dtype": "float16", **fields}
    return type(kind, (), values)()


def _foreign_config(num_blocks: int = 8, groups: Any = ()) -> Any:
    class Config:
        kv_cache_tensors: tuple[Any, ...] = ()

        def __repr__(self) -> str:
            return f"Config(num_blocks={num_blocks}, kv_cache_groups={groups!r})"
    config = Config()
    config.num_blocks = num_blocks  # type: ignore[attr-defined]
    config.kv_cache_groups = groups  # type: ignore[attr-defined]
    return config


# ---------------------------------------------------------------------- the defects found


def _refused(subject: Any, snapshot: Callable[[Any], object], call: BadCall) -> None:
    """``check`` outside Hypothesis: the call must be refused (typed, named, nothing changed)."""
    verdict, detail = judge(subject, snapshot, call)
    if verdict is not Verdict.REFUSED:
        raise AssertionError(f"{call.describe}\n  {verdict.value}\n  {detail}")


def _sliding_subject() -> ManagerSubject:
    """Mistral's layout (a 5-token sliding window, 2-token blocks), 16 blocks, one running
    request whose 13-token prompt is computed and cached."""
    layout = LAYOUTS[2]
    manager = KVCacheManager(layout.build(16), max_model_len=64, hash_block_size=2)
    request = Request("a", list(range(100, 113)),
                      block_hasher=get_request_block_hasher(2, sha256))
    assert manager.allocate_slots(request, 13) is not None
    request.num_computed_tokens = 13
    other = KVCacheManager(layout.build(8), max_model_len=64, hash_block_size=2)
    return ManagerSubject(manager, layout, {"a": request}, ["a"], None, [], other)


def test_a_block_hash_that_is_not_bytes_is_refused_before_allocating() -> None:
    """allocate_slots used to allocate the new blocks, then fail keying them: the request kept
    blocks it was refused."""
    subject = _sliding_subject()
    request = subject.requests["a"]
    request.append_output_token_ids([1, 2, 3])  # completes block 6 (tokens 12, 13)
    _set_hash(request, 6, "not bytes")
    _refused(subject, manager_snapshot, _call(
        "manager.allocate_slots(<request whose 7th block hash is 'not bytes'>, 3)",
        lambda s: s.manager.allocate_slots(request, 3), _bad("not bytes")))


def test_num_computed_tokens_beyond_the_slots_is_refused_and_frees_nothing() -> None:
    """A request claiming 40 computed tokens (it has slots for 14) used to have its blocks
    slide out of a 5-token window and go back to the pool."""
    subject = _sliding_subject()
    request = subject.requests["a"]
    request.num_computed_tokens = 40
    _refused(subject, manager_snapshot, _call(
        "manager.allocate_slots(<request with num_computed_tokens=40, 14 slots>, 1)",
        lambda s: s.manager.allocate_slots(request, 1), _bad(40)))


def test_num_computed_tokens_past_num_tokens_within_the_slots_is_accepted() -> None:
    """Async scheduling counts the placeholder tokens of steps in flight as computed, so
    num_computed_tokens passes num_tokens; within the request's slots that is no error."""
    subject = _sliding_subject()
    manager, request = subject.manager, subject.requests["a"]
    request.num_computed_tokens = 14  # 13 tokens, 7 blocks of 2: 14 slots
    assert manager.allocate_slots(request, 1) is not None
    assert manager.get_block_ids("a")[0][:5] == [0, 0, 0, 0, 0]  # slid out, as vLLM


def test_max_model_len_must_fit_int64() -> None:
    """KVCacheManager(max_model_len=2**64) used to be accepted."""
    _refused(None, lambda _: None, _call(
        "KVCacheManager(max_model_len=2**64)",
        lambda _: KVCacheManager(_config(FULL), max_model_len=2**64, hash_block_size=2),
        _bad(2**64)))


def test_adding_kv_cache_blocks_of_other_group_counts_is_a_typed_refusal() -> None:
    """KVCacheBlocks.__add__ used to raise zip's bare ValueError."""
    one, two = KVCacheBlocks(([],)), KVCacheBlocks(([], []))
    _refused(None, lambda _: None, _call("KVCacheBlocks(([],)) + KVCacheBlocks(([], []))",
                                       lambda _: one + two, _bad(2, None, "2 groups")))
    try:
        one + two
    except ValueError as error:
        assert type(error) is not ValueError, "a bare ValueError"


def test_hits_that_are_not_the_requests_are_refused() -> None:
    """Hits from another prompt's lookup (keyed blocks, wrong keys) used to be attached."""
    layout = LAYOUTS[0]
    manager = KVCacheManager(layout.build(16), max_model_len=64, hash_block_size=2)
    hasher = get_request_block_hasher(2, sha256)
    a = Request("a", list(range(9)), block_hasher=hasher)
    manager.allocate_slots(a, 9)
    manager.free(a)
    hits, num_hit = manager.get_computed_blocks(Request("b", list(range(9)), block_hasher=hasher))
    assert num_hit == 8
    c = Request("c", list(range(50, 59)), block_hasher=hasher)
    subject = ManagerSubject(manager, layout, {"c": c}, [], None, [], manager)
    _refused(subject, manager_snapshot, _call(
        "manager.allocate_slots(<c>, 1, 8, <the hits of another prompt>)",
        lambda s: s.manager.allocate_slots(c, 1, 8, hits),
        _bad(hits.blocks[0][0], "a block cached for another prompt", "block_id=")))


def test_uncached_coordinator_cache_blocks_refuses_before_any_group_changes() -> None:
    """Whisper without prefix caching: coordinator.cache_blocks used to record keyed counts in
    the decoder group, then fail in the cross-attention group."""
    layout = LAYOUTS[-1]
    manager = KVCacheManager(layout.build(16), max_model_len=64, hash_block_size=2,
                             enable_caching=False)
    request = Request("a", list(range(5)))
    manager.allocate_slots(request, 5, num_encoder_tokens=3)
    subject = ManagerSubject(manager, layout, {"a": request}, ["a"], None, [], manager)
    _refused(subject, manager_snapshot, _call(
        "coordinator.cache_blocks(<a>, 9) (a holds 6 slots)",
        lambda s: s.manager.coordinator.cache_blocks(request, 9), _bad(9)))
    before = manager_snapshot(subject)
    manager.coordinator.cache_blocks(request, 4)  # nothing is keyed without prefix caching
    assert manager_snapshot(subject) == before


def test_allocate_new_blocks_beyond_the_pool_changes_nothing() -> None:
    """A single-type manager's allocate_new_blocks used to make the request's (empty) entry
    before the pool refused the count."""
    subject = _sliding_subject()
    _refused(subject, manager_snapshot, _call(
        "managers[0].allocate_new_blocks('new', 1000)",
        lambda s: s.manager.coordinator.single_type_managers[0].allocate_new_blocks("new",
                                                                                  1000),
        _bad(1000)))


def _hit_subject() -> tuple[ManagerSubject, Request, KVCacheBlocks, int]:
    """A full-attention manager where request "b" has just looked up a 4-block hit that
    request "a" left cached."""
    layout = LAYOUTS[0]
    manager = KVCacheManager(layout.build(16), max_model_len=64, hash_block_size=2)
    hasher = get_request_block_hasher(2, sha256)
    a = Request("a", list(range(9)), block_hasher=hasher)
    manager.allocate_slots(a, 9)
    manager.free(a)
    b = Request("b", list(range(9)), block_hasher=hasher)
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    other = KVCacheManager(layout.build(8), max_model_len=64, hash_block_size=2)
    other.allocate_slots(Request("x", [1, 2, 3], block_hasher=hasher), 3)
    return ManagerSubject(manager, layout, {"b": b}, [], None, [], other), b, hits, num_hit


def test_the_lookups_own_hits_changed_in_place_are_refused() -> None:
    """allocate_slots trusts the very result of the last lookup; written into, it is not."""
    subject, b, hits, num_hit = _hit_subject()
    # A free, never cached block of the same pool: the pool would touch it without a word.
    stranger = subject.manager.block_pool.free_block_queue.get_all_free_blocks()[0]
    hits.blocks[0][2] = stranger  # type: ignore[index]
    _refused(subject, manager_snapshot, _call(
        "manager.allocate_slots(b, 1, 8, <its hits with block 2 replaced by a free block>)",
        lambda s: s.manager.allocate_slots(b, 1, num_hit, hits),
        _bad(stranger, None, f"block_id={stranger.block_id}")))


def test_the_lookups_own_hits_evicted_since_are_refused() -> None:
    """... nor after a call that may have evicted one of them."""
    subject, b, hits, num_hit = _hit_subject()
    block = hits.blocks[0][3]
    subject.manager.evict_blocks({block.block_id})
    _refused(subject, manager_snapshot, _call(
        f"manager.allocate_slots(b, 1, 8, <its hits, block {block.block_id} evicted since>)",
        lambda s: s.manager.allocate_slots(b, 1, num_hit, hits),
        _bad(block, None, f"block_id={block.block_id}")))
    # Unchanged and nothing evicted: taken as they are.
    subject, b, hits, num_hit = _hit_subject()
    assert subject.manager.allocate_slots(b, 1, num_hit, hits) is not None
    assert subject.manager.get_block_ids("b")[0][:4] == [b.block_id for b in hits.blocks[0]]


_EXAMPLES: list[tuple[str, Callable[[Any], object], Bad]] = [
    ("MambaSpec(2, shapes=((2.5,),), ...)",
     lambda _: MambaSpec(2, ((2.5,),), ("float16",)), _bad(2.5)),  # type: ignore[arg-type]
    ("KVCacheConfig(8, None, ())", lambda _: KVCacheConfig(8, None, ()), _bad(None)),  # type: ignore[arg-type]
    ("KVCacheGroupSpec('layer.0', FULL)", lambda _: KVCacheGroupSpec("layer.0", FULL),  # type: ignore[arg-type]
     _bad("layer.0")),
    ("manager.get_computed_blocks(None)", lambda s: s.manager.get_computed_blocks(None),
     _bad(None)),
    ("manager.free(Opaque())", lambda s: s.manager.free(Opaque()), _bad(Opaque())),
    ("coordinator.free(None)", lambda s: s.manager.coordinator.free(None), _bad(None)),
    ("managers[0].free(['a'])",
     lambda s: s.manager.coordinator.single_type_managers[0].free(["a"]), _bad(["a"])),
    ("coordinator.allocate_new_blocks('a', 1000)",
     lambda s: s.manager.coordinator.allocate_new_blocks("a", 1000), _bad(1000)),
    ("manager.allocate_slots(<a>, 1, num_lookahead_tokens=-1)",
     lambda s: s.manager.allocate_slots(s.requests["a"], 1, num_lookahead_tokens=-1),
     _bad(-1)),
]


def test_one_example_of_each_refusal() -> None:
    """The refusals the generated suite draws, once each, on a fixed subject (the mutants'
    sure kill)."""
    for describe, run, bad in _EXAMPLES:
        _refused(_sliding_subject(), manager_snapshot, _call(describe, run, bad))


def test_manager_classes_answer_isinstance_for_themselves() -> None:
    """Compiled by mypyc, the managers and coordinators, then subclasses of ``abc.ABC``,
    shared ``abc.ABC``'s instance-check cache: after one check that cached a class,
    ``isinstance(full_attention_manager, CrossAttentionManager)`` answered True (and
    ``issubclass(MambaManager, FullAttentionManager)`` could, which orders hybrid lookups)."""
    pool = BlockPool(8, True, 2)
    full = FullAttentionManager(FULL, pool, 0)
    mamba = MambaManager(MambaSpec(2, ((2, 3),), ("float16",)), pool, 1)
    assert issubclass(FullAttentionManager, SingleTypeKVCacheManager)
    assert issubclass(MambaManager, SingleTypeKVCacheManager)
    assert isinstance(full, FullAttentionManager)
    assert not isinstance(full, CrossAttentionManager)
    assert not isinstance(mamba, FullAttentionManager)
    assert not issubclass(MambaManager, FullAttentionManager)
    unitary = KVCacheManager(_config(FULL), max_model_len=64, hash_block_size=2).coordinator
    assert isinstance(unitary, UnitaryKVCacheCoordinator)
    assert not isinstance(unitary, HybridKVCacheCoordinator)


def test_an_empty_prompt_gets_slots_and_no_hit() -> None:
    """vLLM's own tests allocate slots for a request of no tokens (lookahead slots): accepted,
    and its lookup finds nothing."""
    manager = KVCacheManager(_config(FullAttentionSpec(4, 1, 8, "float16")), max_model_len=100,
                             hash_block_size=4)
    request = Request("0", [], block_hasher=get_request_block_hasher(4, sha256))
    assert manager.get_computed_blocks(request) == (manager.empty_kv_cache_blocks, 0)
    blocks = manager.allocate_slots(request, 3, num_lookahead_tokens=2)
    assert blocks is not None
    assert len(manager.get_block_ids("0")[0]) == 2


def test_numpy_integer_arguments_are_taken() -> None:
    """impl's integer rule: numpy integers are integer arguments, converted to ints once."""
    layout = LAYOUTS[0]
    manager = KVCacheManager(layout.build(16), max_model_len=np.int64(64),
                             hash_block_size=np.int32(layout.hash_block_size))
    assert type(manager.max_model_len) is int and manager.max_model_len == 64

    def request() -> Request:
        return Request("np", list(range(9)), block_hasher=get_request_block_hasher(
            layout.hash_block_size, sha256))

    blocks = manager.allocate_slots(request(), np.int64(9), num_lookahead_tokens=np.int16(1))
    assert blocks is not None
    plain = KVCacheManager(layout.build(16), max_model_len=64,
                           hash_block_size=layout.hash_block_size)
    expected = plain.allocate_slots(request(), 9, num_lookahead_tokens=1)
    assert expected is not None and blocks.get_block_ids() == expected.get_block_ids()
    coordinator = manager.coordinator
    assert coordinator.get_num_blocks_to_allocate("np", np.int64(12), ((),), np.int8(0)) == \
        coordinator.get_num_blocks_to_allocate("np", 12, ((),), 0)
    single = coordinator.single_type_managers[0]
    assert single.get_num_skipped_tokens(np.uint8(5)) == 0
