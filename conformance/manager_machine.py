"""The KV-cache manager conformance machine: drive a target and `spec.manager` side by side.

Rules are what a scheduler does with a KVCacheManager and its requests: add a request (its
block hasher hashes the prompt), schedule a waiting request (look up its cached prefix, allocate
slots for a chunk of its prompt, maybe with lookahead slots), run a step of a running request
(the next prefill chunk, or a decode step with draft tokens), preempt it (free everything,
recompute later), finish or abort it, continue a finished conversation with a new turn, cache
delayed blocks, evict cached blocks, reset the prefix cache, ask for the common prefix and
drain events; and make bad calls (one rule per kind: the manager must refuse each with a typed
error and change nothing). A short pool is no bad call: an ``allocate_slots`` that returns
None must have freed the request's blocks that left the window and changed nothing else
(``refusal_frees_only_skipped_blocks``, checked right after the call). Request ids flow
through the ``waiting`` and ``running`` Bundles.

Every call is a `spec.manager` command run on the spec and the target through
`lockstep.Lockstep`, so outputs and refusals are compared as they happen. The spec holds the
requests too and computes each request's block hashes itself (`spec.manager.Hashing`: the
target's hash function, seed and extra-key format), so the target's request hashing is checked
(invariant ``block_hashes_match_spec``), not trusted. After every step the target's abstract
state (`ManagerView`) must equal the spec's (``states_agree``), its usage the spec's, and every
invariant of `spec.manager` must hold on the target's state, each by name.

Layouts are real models' KV-cache group structures (`models/`) with block sizes, windows and
chunks scaled down so that windows slide and pools run out within a few steps, plus hand-built
ones (three attention types, mixed block sizes, sink attention, Mamba with speculative blocks).
Pools are tiny: a few blocks per group.

`machine_for(make_target, layouts)` builds a machine for any adapter (`ImplManager` here,
`manager_targets.Vllm013Manager` for vLLM 0.13's KVCacheManager).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar
from unittest import mock

from hypothesis import event, note, strategies as st
from hypothesis.stateful import (
    Bundle,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvspec.conformance.lockstep import (
    NOTHING,
    Adapter,
    Arg,
    Call,
    Reader,
    Refused,
    attribute,
    method,
)
from kvspec.conformance.machine import LockstepMachine, bad_call
from kvspec.conformance.targets import (
    EVENTS,
    POLICY_CALLS,
    evicted_arg,
    ids,
    load,
    plug_in_arguments,
    plug_in_imports,
    plug_in_source,
    policy_state,
    spec_events,
)
from kvspec.spec import (
    event_consumer,
    hashing as hashing_model,
    manager as model,
    pool as pool_model,
    pool_invariants,
)
from kvspec.spec.eviction import Policy, TokenRangeRetention
from kvspec.spec.manager import GroupSpec, Kind, ManagerConfig, Session

# --- What the machine sees of a target ---------------------------------------------------------


@dataclass(frozen=True)
class ManagerView:
    """A manager's abstract state (and its requests' block hashes): comparable between the
    spec and any target."""

    # per group, sorted by id; a request holding no block in a group is left out, so that an
    # empty entry (vLLM's defaultdict makes one on a mere read, finding M2) is no difference
    tables: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]
    num_cached: tuple[tuple[tuple[str, int], ...], ...]  # per group, nonzero counts only
    ref: tuple[int, ...]  # per block, null block as 0
    free: tuple[int, ...]
    key_of: tuple[bytes | None, ...]
    pending_events: tuple[pool_model.Event, ...]
    block_hashes: tuple[tuple[str, tuple[bytes, ...]], ...]  # per request, sorted by id
    # The pool's eviction-policy state (clock, retention, pinned), as targets.PoolView has it.
    now: int = 0
    retention: tuple[tuple[int, int, int | None], ...] = ()
    pinned: tuple[int, ...] = ()


def view_of(session: Session) -> ManagerView:
    """The spec's session as a target would show it."""
    state = session.manager
    return ManagerView(
        tables=tuple(tuple((r, blocks) for r, blocks in table if blocks)
                     for table in state.tables),
        num_cached=tuple(tuple((r, n) for r, n in counts if n) for counts in state.num_cached),
        ref=state.pool.ref,
        free=state.pool.free,
        key_of=state.pool.key_of,
        pending_events=state.pool.events[state.pool.num_taken:],
        block_hashes=tuple((rid, r.block_hashes) for rid, r in session.requests),
        now=state.pool.now, retention=state.pool.retention, pinned=state.pool.pinned,
    )


def manager_view(manager: Any, requests: Mapping[str, Any]) -> ManagerView:
    """A KVCacheManager (vLLM 0.13's API) and its requests, in the spec's terms (the
    abstraction function)."""
    pool = manager.block_pool
    singles = manager.coordinator.single_type_managers
    blocks = [pool.blocks[i] for i in range(1, pool.num_gpu_blocks)]  # the null block aside
    return ManagerView(
        tuple(tuple(sorted((rid, ids(held)) for rid, held in single.req_to_blocks.items()
                           if held)) for single in singles),
        tuple(tuple(sorted((rid, n) for rid, n in single.num_cached_block.items() if n))
              for single in singles),
        (0, *(b.ref_cnt for b in blocks)),
        ids(pool.free_block_queue.get_all_free_blocks()),
        (None, *(b.block_hash for b in blocks)),
        spec_events(getattr(pool, "kv_event_queue", ())),
        tuple(sorted((rid, tuple(r.block_hashes)) for rid, r in requests.items())),
        *policy_state(pool))


def manager_state_from_view(state: model.ManagerState, view: ManagerView,
                            taken: tuple[pool_model.Event, ...] = ()) -> model.ManagerState:
    """A target's manager state in the spec's terms: the spec's ``state`` with the target's
    tables, keyed counts and pool in it (``taken``: the events already taken)."""
    pool = replace(state.pool, ref=view.ref, free=view.free, key_of=view.key_of,
                   events=taken + view.pending_events, num_taken=len(taken), now=view.now,
                   retention=view.retention, pinned=view.pinned)
    return replace(state, pool=pool, tables=view.tables, num_cached=view.num_cached)


def hit_ids(result: Any) -> tuple[tuple[tuple[int, ...], ...], int]:
    """get_computed_blocks's (KVCacheBlocks, num_tokens) as block ids per group."""
    blocks, num_tokens = result
    return tuple(ids(g) for g in blocks.blocks), num_tokens


def block_ids_or_none(result: Any) -> tuple[tuple[int, ...], ...] | None:
    """allocate_slots's KVCacheBlocks (or None) as block ids per group."""
    return None if result is None else tuple(ids(g) for g in result.blocks)


def id_tuples(block_ids: Any) -> tuple[tuple[int, ...], ...]:
    """get_block_ids's lists per group as tuples."""
    return tuple(tuple(g) for g in block_ids)


def seed_none_hash(init_none_hash: Callable[[Any], None], hash_fn: Any, seed: str) -> None:
    """Seed every chain as ``PYTHONHASHSEED=seed`` does: ``init_none_hash(hash_fn)`` with the
    variable set for the call (NONE_HASH is then ``hash_fn(seed)``, not random bytes)."""
    with mock.patch.dict(os.environ, PYTHONHASHSEED=seed):
        init_none_hash(hash_fn)


def variable_name(request_id: str) -> str:
    """The Python variable a request is held in, in a written counterexample."""
    name = re.sub(r"\W", "_", request_id)
    return name if name.isidentifier() and not name[0].isdigit() else f"r_{name}"


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


# Every layout by name: a NewManager command names its layout, and a target (or a written
# counterexample, in a fresh process) builds the KV-cache config from the name.
LAYOUTS_BY_NAME: dict[str, Layout] = {}


def register(layout: Layout) -> Layout:
    """Make layout buildable by name (`kv_cache_config`); a later layout of the same name
    replaces it."""
    LAYOUTS_BY_NAME[layout.name] = layout
    return layout


def kv_cache_config(layout_name: str, num_blocks: int) -> Any:
    """impl's KVCacheConfig of the layout called layout_name, with num_blocks blocks."""
    try:
        layout = LAYOUTS_BY_NAME[layout_name]
    except KeyError:
        raise LookupError(f"no layout named {layout_name!r}: register() it") from None
    return layout.build(num_blocks)


# impl's KVCacheSpec classes the spec models, by class name (so that spec/ does not depend on
# impl/ for this): the spec's kind and the field it takes from the class, if any.
GROUP_KINDS: dict[str, tuple[Kind, str | None]] = {
    "FullAttentionSpec": (Kind.FULL, None),
    "MLAAttentionSpec": (Kind.FULL, None),
    "SinkFullAttentionSpec": (Kind.SINK_FULL, "sink_len"),
    "SlidingWindowSpec": (Kind.SLIDING_WINDOW, "sliding_window"),
    "ChunkedLocalAttentionSpec": (Kind.CHUNKED_LOCAL, "attention_chunk_size"),
    "MambaSpec": (Kind.MAMBA, "num_speculative_blocks"),
    "CrossAttentionSpec": (Kind.CROSS, None),
}


def group_spec_of(kv_cache_spec: Any) -> GroupSpec:
    """The spec model's view of one of impl's KVCacheSpec objects (matched by class name)."""
    name = type(kv_cache_spec).__name__
    if name not in GROUP_KINDS:
        raise model.BadConfig(f"no manager models {name}")
    kind, option = GROUP_KINDS[name]
    options = {} if option is None else {option: getattr(kv_cache_spec, option)}
    return GroupSpec(kind, kv_cache_spec.block_size, identity=repr(kv_cache_spec), **options)


def spec_config(layout: Layout, config: Any, enable_caching: bool,
                enable_events: bool) -> ManagerConfig:
    """The spec's config of a layout's KVCacheConfig (impl's classes)."""
    return ManagerConfig(
        groups=tuple(group_spec_of(g.kv_cache_spec) for g in config.kv_cache_groups),
        num_blocks=config.num_blocks,
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

    return register(Layout(model_name, build, hash_block_size=block_size, **options))


def hand_layout(name: str, specs: Callable[[], Sequence[Any]], hash_block_size: int,
                **options: Any) -> Layout:
    """A hand-built layout: one group per spec."""

    def build(num_blocks: int) -> Any:
        from kvspec.impl.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

        return KVCacheConfig(num_blocks, (), tuple(
            KVCacheGroupSpec((f"layer.{i}",), spec) for i, spec in enumerate(specs())
        ))

    return register(Layout(name, build, hash_block_size=hash_block_size, **options))


def _attention(kind: str, bs: int, heads: int = 1, **options: Any) -> Any:
    """impl's ``<kind>Spec`` (block size bs, ``heads`` KV heads of size 8, float16)."""
    from kvspec.impl import kv_cache_interface

    return getattr(kv_cache_interface, f"{kind}Spec")(bs, heads, 8, "float16", **options)


def _mamba(bs: int, speculative: int = 0) -> Any:
    from kvspec.impl.kv_cache_interface import MambaSpec

    return MambaSpec(bs, shapes=((2, 3),), dtypes=("float16",),
                     num_speculative_blocks=speculative)


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
    hand_layout("full+sliding+mamba", lambda: (_attention("FullAttention", 2), _attention(
        "SlidingWindow", 2, sliding_window=5), _mamba(2)), 2),
    hand_layout("full(bs4)+sliding(bs2)", lambda: (_attention("FullAttention", 4), _attention(
        "SlidingWindow", 2, sliding_window=4)), 2),
    hand_layout("sink", lambda: (_attention("SinkFullAttention", 2, sink_len=2),), 2),
    hand_layout("mamba+speculative", lambda: (_mamba(2, speculative=1),), 2),
    hand_layout("two full groups", lambda: tuple(
        _attention("FullAttention", 2, heads) for heads in (1, 2, 1)), 2),
    hand_layout("chunked local", lambda: (
        _attention("ChunkedLocalAttention", 2, attention_chunk_size=6),), 2),
    hand_layout("sliding window 2", lambda: (
        _attention("SlidingWindow", 2, sliding_window=2),), 2),
)

ALL_LAYOUTS = MODEL_LAYOUTS + HAND_LAYOUTS


# --- The impl/ target --------------------------------------------------------------------------

HASH_SEED = "0"  # PYTHONHASHSEED for every chain's seed: hashes are the same in every process


def _new_manager(adapter: ImplManager, c: model.NewManager) -> None:
    adapter.hash_block_size = c.config.hash_block_size
    adapter.seed(c.hashing)
    adapter.manager = adapter.new_manager(c)
    adapter.requests, adapter.hits = {}, {}


def _new_manager_source(adapter: ImplManager, c: model.NewManager) -> str:
    adapter.hash_block_size = c.config.hash_block_size
    adapter.written = []
    k = c.config
    return (f"seed_none_hash(init_none_hash, sha256, {c.hashing.hash_seed!r}) or "
            f"KVCacheManager(\n        {adapter.config_source(c)}, "
            f"max_model_len={k.max_model_len}, hash_block_size={k.hash_block_size},\n"
            f"        enable_caching={k.enable_caching}, use_eagle={k.use_eagle}, "
            f"enable_kv_cache_events={k.enable_events}"
            f"{plug_in_source(adapter.policy_path, k.policy)})")


def _add_request(adapter: ImplManager, c: model.AddRequest) -> None:
    adapter.requests[c.request_id] = adapter.new_request(c)
    adapter.hits.pop(c.request_id, None)


def _add_request_source(adapter: ImplManager, c: model.AddRequest) -> str:
    if c.request_id not in adapter.written:  # the counterexample has made it from here on
        adapter.written.append(c.request_id)
    return f"{variable_name(c.request_id)} = {adapter.request_source(c)}"


def _get_computed_blocks(adapter: ImplManager, c: model.GetComputedBlocks) -> Any:
    result = adapter.manager.get_computed_blocks(adapter.requests[c.request_id])
    adapter.hits[c.request_id] = result[0]
    return result


def request_arg(adapter: ImplManager, request_id: str) -> Arg:
    return Arg(variable_name(request_id), lambda: adapter.requests[request_id])


def hits_arg(adapter: ImplManager, c: model.AllocateSlots) -> Arg | None:
    """The hits allocate_slots is given: a request's last lookup result, or None."""
    if not c.with_hits:
        return None
    owner = c.hits_of or c.request_id
    return Arg(f"hits_{variable_name(owner)}[0]", lambda: adapter.hits[owner])


class ImplManager(Adapter):
    """Performs `spec.manager` commands on a KVCacheManager with vLLM 0.13's API: impl's
    here; `manager_targets.Vllm013Manager` swaps in vLLM's classes.

    Requests are the target's own Request objects, made with its block hasher; in a written
    counterexample each is a variable named after its id (``req_001``), and a request's last
    lookup result is ``hits_req_001``.
    """

    variable = "manager"
    manager_path = "kvspec.impl.kv_cache_manager:KVCacheManager"

    def __init__(self, policy_path: str | None = None) -> None:
        # An eviction-policy plug-in class (``module:Class``) the manager is built with.
        self.policy_path = policy_path
        self.manager: Any = None
        self.requests: dict[str, Any] = {}
        self.hits: dict[str, Any] = {}  # request id -> its last get_computed_blocks blocks
        self.hash_block_size = 1
        self.written: list[str] = []  # the requests a counterexample has made so far

    # -- what the target is ----------------------------------------------------------------

    def hashing(self) -> model.Hashing:
        """How this target hashes: impl writes extra keys in its EXTRA_KEY_FORMAT setting
        (tagged unless a vllm-0.13 profile chose untagged)."""
        from kvspec.impl import hashing

        return model.Hashing(hashing_model.KeyFormat(hashing.EXTRA_KEY_FORMAT.value), HASH_SEED)

    def seed(self, hashing: model.Hashing) -> None:
        from kvspec.impl.hashing import init_none_hash, sha256

        seed_none_hash(init_none_hash, sha256, hashing.hash_seed)

    def new_manager(self, command: model.NewManager) -> Any:
        from kvspec.impl.kv_cache_manager import KVCacheManager

        c = command.config
        policy = {} if self.policy_path is None else {
            "eviction_policy": load(self.policy_path)(**plug_in_arguments(c.policy))}
        return KVCacheManager(
            kv_cache_config(command.layout, c.num_blocks), max_model_len=c.max_model_len,
            hash_block_size=c.hash_block_size, enable_caching=c.enable_caching,
            use_eagle=c.use_eagle, enable_kv_cache_events=c.enable_events, **policy)

    def new_request(self, command: model.AddRequest) -> Any:
        from kvspec.impl.hashing import get_request_block_hasher, sha256
        from kvspec.impl.request import LoRARequest, Request

        lora = command.lora
        return Request(
            command.request_id, list(command.prompt),
            lora_request=None if lora is None else LoRARequest(
                model.lora_name(lora), lora, model.lora_path(lora)),
            cache_salt=command.salt,
            block_hasher=get_request_block_hasher(self.hash_block_size, sha256),
            kv_retention=list(command.retention))

    def stand_in(self, request_id: str) -> Any:
        """A request the manager never saw, to free."""
        from kvspec.impl.request import Request

        return Request(request_id, [0])

    # -- the commands: how each runs on the manager, and is written as a call ---------------

    calls: ClassVar[dict[type, Call]] = {
        model.NewManager: Call(_new_manager, _new_manager_source),
        model.AddRequest: Call(_add_request, _add_request_source),
        model.AppendTokens: Call(
            lambda a, c: a.requests[c.request_id].append_output_token_ids(list(c.token_ids)),
            lambda a, c: (f"{variable_name(c.request_id)}.append_output_token_ids("
                          f"{list(c.token_ids)!r})"), NOTHING),
        model.SetComputedTokens: Call(
            lambda a, c: setattr(a.requests[c.request_id], "num_computed_tokens", c.num_tokens),
            lambda a, c: f"{variable_name(c.request_id)}.num_computed_tokens = {c.num_tokens}"),
        model.GetComputedBlocks: Call(_get_computed_blocks, lambda a, c: (
            f"(hits_{variable_name(c.request_id)} := manager.get_computed_blocks("
            f"{variable_name(c.request_id)}))"), Reader(hit_ids, "hit_ids({})")),
        model.AllocateSlots: method("allocate_slots", lambda a, c: (
            request_arg(a, c.request_id), c.num_new_tokens, c.num_new_computed_tokens,
            hits_arg(a, c), c.num_lookahead_tokens, c.delay_cache_blocks,
            c.num_encoder_tokens), Reader(block_ids_or_none, "block_ids_or_none({})")),
        model.Free: Call(
            lambda a, c: a.manager.free(a.requests.get(c.request_id) or a.stand_in(c.request_id)),
            lambda a, c: "manager.free({})".format(
                variable_name(c.request_id) if c.request_id in a.written
                else a.stand_in_source(c.request_id)), NOTHING),
        model.CacheBlocks: method("cache_blocks", lambda a, c: (
            request_arg(a, c.request_id), c.num_tokens), NOTHING),
        model.EvictBlocks: method("evict_blocks", lambda a, c: (evicted_arg(c.block_ids),),
                                  NOTHING),
        model.GetNumCommonPrefixBlocks: method("get_num_common_prefix_blocks",
                                               lambda a, c: (c.request_id,),
                                               Reader(tuple, "tuple({})")),
        model.GetBlockIds: method("get_block_ids", lambda a, c: (c.request_id,),
                                  Reader(id_tuples, "id_tuples({})")),
        model.ResetPrefixCache: method("reset_prefix_cache", read=Reader(bool)),
        model.TakeEvents: method("take_events", read=EVENTS),
        model.Usage: attribute("usage", Reader(float)),
        **POLICY_CALLS,
    }

    def view(self) -> ManagerView:
        return manager_view(self.manager, self.requests)

    def representation_target(self) -> Any:
        return self.manager.block_pool

    # -- the commands as calls on the manager's own API (counterexamples) ------------------

    def imports(self) -> list[str]:
        return ["from kvspec.impl.hashing import get_request_block_hasher, init_none_hash, "
                "sha256",
                "from kvspec.impl.kv_cache_manager import KVCacheManager",
                "from kvspec.impl.request import LoRARequest, Request",
                *self.checker_imports()]

    def checker_imports(self) -> list[str]:
        plug_in = plug_in_imports(self.policy_path)
        if plug_in:
            plug_in.append("from kvspec.spec.eviction import TokenRangeRetention")
        return [*plug_in, "from kvspec.conformance.manager_machine import (ManagerView, "
                "block_ids_or_none, hit_ids,\n    id_tuples, kv_cache_config, manager_view, "
                "seed_none_hash)",
                "from kvspec.conformance.targets import spec_events",
                "from kvspec.spec.pool import Cleared, Removed, Stored"]

    def config_source(self, command: model.NewManager) -> str:
        return f"kv_cache_config({command.layout!r}, {command.config.num_blocks})"

    def request_source(self, command: model.AddRequest) -> str:
        lora = "None" if command.lora is None else (
            f"LoRARequest({model.lora_name(command.lora)!r}, {command.lora}, "
            f"{model.lora_path(command.lora)!r})")
        hints = f", kv_retention={list(command.retention)!r}" if command.retention else ""
        return (f"Request({command.request_id!r}, {list(command.prompt)!r}, "
                f"lora_request={lora}, cache_salt={command.salt!r}, "
                f"block_hasher=get_request_block_hasher({self.hash_block_size}, sha256)"
                f"{hints})")

    def stand_in_source(self, request_id: str) -> str:
        return f"Request({request_id!r}, [0])"

    def view_source(self) -> str:
        requests = ", ".join(f"{r!r}: {variable_name(r)}" for r in self.written)
        return f"manager_view(manager, {{{requests}}})"


# --- The machine -------------------------------------------------------------------------------

# Retention hints a request may carry (token positions of its prompt): none, a kept system
# prefix, a short-lived conversation, a demoted tail.
REQUEST_HINTS = st.sampled_from([
    (), (),
    (TokenRangeRetention(0, 8, 90),),
    (TokenRangeRetention(0, None, 60, 3),),
    (TokenRangeRetention(0, 8, 80), TokenRangeRetention(8, None, 5, 2)),
])

PREFIXES: tuple[tuple[int, ...], ...] = (
    tuple(range(100, 124)),
    tuple(range(100, 108)) + tuple(range(200, 216)),
    tuple(range(300, 324)),
)


@dataclass
class Tracked:
    """What the machine's scheduler knows of a request beyond the spec's session."""

    request_id: str
    preempted: int = 0
    encoder_tokens: int = 0
    encoder_done: bool = False
    delayed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


MAX_LIVE_REQUESTS = 6


class ManagerMachine(LockstepMachine[Session]):
    """Runs a manager adapter against `spec.manager`; ``machine_for`` sets the adapter and
    the layouts. Every step runs under the step deadline (`deadline.BoundedSteps`)."""

    spec_step = staticmethod(model.step)
    view_of = staticmethod(view_of)
    layouts: tuple[Layout, ...] = ()  # set by machine_for (ALL_LAYOUTS by default)
    policy: Policy | None = None  # the pool's eviction policy (spec.eviction)
    profile: pool_model.Profile = pool_model.Profile.V0_13  # the release the spec follows
    waiting = Bundle("waiting")
    running = Bundle("running")

    def __init__(self) -> None:
        super().__init__()
        self.target: ImplManager = self.adapter
        self.layout: Layout = self.layouts[0]
        self.tracked: dict[str, Tracked] = {}
        self.finished_tokens: list[tuple[int, ...]] = []
        self.next_id = 0
        self.taken: tuple[pool_model.Event, ...] = ()  # every event take_events handed out

    # -- helpers -------------------------------------------------------------------------

    @property
    def state(self) -> model.ManagerState:
        return self.spec.manager

    def _request(self, request_id: str) -> model.Request:
        return self.spec.request(request_id)

    def bad_calls_now(self) -> bool:
        """Bad-call rules are enabled on one step in five."""
        return self.every(5)

    def _encoder_tokens(self, tracked: Tracked) -> int:
        return 0 if tracked.encoder_done else tracked.encoder_tokens

    def _allocate(self, request_id: str, num_new_tokens: int, num_new_computed: int,
                  with_hits: bool, lookahead: int, delay: bool) -> bool:
        tracked = self.tracked[request_id]
        encoder = self._encoder_tokens(tracked)
        before = self.state
        hits = self.spec.last_lookup(request_id) if with_hits else None
        if hits is not None and model.same_step_mamba_hit(before, hits):
            event("allocate_slots: Mamba hit on a key cached this step")
            self.same_step_hit = (before, hits)  # judged on the target's output (`judge`)
        new = self.lockstep(model.AllocateSlots(request_id, num_new_tokens, num_new_computed,
                                                with_hits, lookahead, delay, encoder))
        self.same_step_hit = None
        note(f"allocate_slots({request_id}, new={num_new_tokens}, hit={num_new_computed}, "
             f"lookahead={lookahead}, delay={delay}, encoder={encoder}) -> {new}")
        assert not isinstance(new, Refused), f"allocate_slots refused by the spec: {new}"
        if new is None:
            event("allocate_slots: pool too small (None)")
            self._check_refusal_for_lack_of_room(before, request_id)
            return False
        if encoder:
            tracked.encoder_done = True
        if delay:
            tracked.delayed = True
            event("allocate_slots: delay_cache_blocks")
        if lookahead:
            event("allocate_slots: lookahead tokens")
        if any(new):
            event("allocate_slots: new blocks")
        return True

    def _check_refusal_for_lack_of_room(self, before: model.ManagerState,
                                        request_id: str) -> None:
        """Rule refusal_frees_only_skipped_blocks (`spec.manager`), on the target's state
        right after an allocate_slots that returned None: the request's blocks that left the
        window are freed (`Profile.refusal_frees_skipped_blocks`), nothing else changed. A
        short pool is not a bad call, so the "a refusal changes nothing" rule of bad calls
        does not apply; this one does, named."""
        after = self.target_state()
        if after is None:
            return
        request = self._request(request_id).view()
        assert model.refusal_frees_only_skipped_blocks(before, after.manager, request), (
            f"rule refusal_frees_only_skipped_blocks violated by the target: allocate_slots "
            f"for {request_id!r} returned None; tables before {before.tables}, target "
            f"after {after.manager.tables}, spec after {self.state.tables}; free queue "
            f"target {after.manager.pool.free}, spec {self.state.pool.free}")
        if after.manager.tables != before.tables:
            event("allocate_slots: None, out-of-window blocks freed")

    same_step_hit: tuple[model.ManagerState, model.GroupBlocks] | None = None

    def judge(self, command: Any, output: Any) -> None:
        """Rule no_same_step_mamba_hit (`spec.manager`), on the target's own output before
        it is compared with the spec's, so that it is reported by name: an allocation with
        a Mamba hit on a key cached this step waits for the next step (the hit's state is
        written by this step)."""
        if isinstance(command, model.AllocateSlots) and self.same_step_hit is not None:
            before, hits = self.same_step_hit
            assert model.no_same_step_mamba_hit(before, hits, output), (
                f"rule no_same_step_mamba_hit violated by the target: allocate_slots for "
                f"{command.request_id!r} took a Mamba hit on a key cached this step: {output}")

    # -- set-up --------------------------------------------------------------------------

    @initialize(data=st.data(), caching=st.sampled_from([True, True, True, False]),
                events=st.booleans())
    def build(self, data: st.DataObject, caching: bool, events: bool) -> None:
        layout = register(data.draw(st.sampled_from(self.layouts), label="layout"))
        probe = layout.build(2)
        num_groups = len(probe.kv_cache_groups)
        low, high = layout.blocks_per_group
        # Up to a whole max_model_len request per group now and then, so long requests run.
        per_group = data.draw(st.integers(low, high) | st.just(high + 6), label="blocks per group")
        num_blocks = 1 + num_groups * per_group + _sink_blocks(probe)
        caching = caching and layout.caching
        kinds = {type(g.kv_cache_spec).__name__ for g in probe.kv_cache_groups}
        if (caching and num_groups == 1 and "ChunkedLocalAttentionSpec" not in kinds
                and data.draw(st.integers(0, 2), label="eagle") == 0):
            layout = replace(layout, use_eagle=True)
            event("EAGLE")
        self.layout = layout
        config = spec_config(layout, kv_cache_config(layout.name, num_blocks), caching, events)
        config = replace(config, policy=self.policy, profile=self.profile)
        self.lockstep(model.NewManager(config, self.target.hashing(), layout.name))
        event(f"layout {layout.name}")
        event(f"caching {'on' if caching else 'off'}")

    # -- rules: what a scheduler does ----------------------------------------------------

    @precondition(lambda self: len(self.tracked) < MAX_LIVE_REQUESTS)
    @rule(target=waiting, prefix=st.integers(0, len(PREFIXES) - 1),
          prefix_len=st.sampled_from([0, 4, 8, 12, 16, 20, 24]) | st.integers(0, 24),
          suffix=st.lists(st.integers(0, 3), min_size=1, max_size=6),
          salt=st.sampled_from([None, None, None, None, None, "salt-a", "lora-1"]),
          lora=st.sampled_from([None, None, None, None, 1]), hints=REQUEST_HINTS)
    def add_request(self, prefix: int, prefix_len: int, suffix: list[int], salt: str | None,
                    lora: int | None, hints: tuple[TokenRangeRetention, ...]) -> str:
        """A new prompt: a shared prefix (so prefixes hit) and a short own suffix. (A salt
        equal to a LoRA name is where untagged extra keys collide.) It may carry retention
        hints, which a pool with the priority policy reads."""
        if salt is not None:
            event("cache salt")
        if lora is not None:
            event("LoRA adapter")
        return self._add(PREFIXES[prefix][:prefix_len] + tuple(suffix), salt, lora, hints)

    def _add(self, prompt: tuple[int, ...], salt: str | None, lora: int | None,
             hints: tuple[TokenRangeRetention, ...] = ()) -> str:
        prompt = prompt[-(self.layout.max_model_len - 1):]
        request_id = f"req-{self.next_id:03d}"
        self.next_id += 1
        self.lockstep(model.AddRequest(request_id, prompt, lora, salt, hints))
        self.tracked[request_id] = Tracked(request_id, encoder_tokens=self.layout.encoder_tokens)
        return request_id

    @precondition(lambda self: self.finished_tokens and len(self.tracked) < MAX_LIVE_REQUESTS)
    @rule(target=waiting, data=st.data(), more=st.lists(st.integers(0, 3), min_size=1,
                                                        max_size=4))
    def continue_conversation(self, data: st.DataObject, more: list[int]) -> str:
        """The next turn of a finished conversation: its whole history plus new tokens."""
        history = data.draw(st.sampled_from(self.finished_tokens))
        event("multi-turn continuation")
        return self._add(history + tuple(more), None, None)

    @precondition(lambda self: len(self.tracked) < MAX_LIVE_REQUESTS)
    @rule(target=waiting, request_id=running)
    def resubmit_prompt(self, request_id: str) -> str:
        """The same prompt again, from the same tenant (a retry, or a shared system prompt and
        question): it hits every block the running request has cached."""
        request = self._request(request_id)
        event("same prompt again")
        return self._add(request.prompt, request.salt, request.lora)

    @rule(target=running, request_id=consumes(waiting), chunk=st.integers(1, 12),
          lookahead=st.sampled_from([0, 0, 0, 1, 3]),
          delay=st.sampled_from([False, False, False, False, True]))
    def schedule_waiting(self, request_id: str, chunk: int, lookahead: int,
                         delay: bool) -> Any:
        """Admit (or re-admit) a waiting request: look up its prefix, allocate a chunk. One
        that does not fit goes back to the waiting queue (`requeue`)."""
        hits, num_hit, *boundary = self.lockstep(model.GetComputedBlocks(request_id))
        if boundary and boundary[0]:
            event("lookup: shared prefix boundary past the hit")
        assert model.hit_is_valid(self.state, self._request(request_id).view(), hits, num_hit)
        if num_hit:
            event("prefix hit")
            if any(self.state.pool.ref[b] == 0 for g in hits for b in g if b):
                event("prefix hit on an evictable block")
            if any(pool_model.NULL_BLOCK in g for g in hits):
                event("prefix hit with null blocks")
        if self.tracked[request_id].preempted:
            event("re-admission after preemption")
        num_tokens = len(self._request(request_id).token_ids)
        num_new = min(chunk, num_tokens - num_hit)
        if not self._allocate(request_id, num_new, num_hit, True, lookahead, delay):
            self.tracked[request_id].extra["stalled"] = True
            return multiple()
        self.lockstep(model.SetComputedTokens(request_id, num_hit + num_new))
        return request_id

    @precondition(lambda self: any(t.extra.get("stalled") for t in self.tracked.values()))
    @rule(target=waiting)
    def requeue(self) -> Any:
        """Requests that did not fit go back to the waiting queue."""
        stalled = sorted(r for r, t in self.tracked.items() if t.extra.pop("stalled", False))
        return multiple(*stalled)

    @rule(request_id=running, chunk=st.integers(1, 8), drafts=st.sampled_from([0, 0, 0, 1, 2]),
          lookahead=st.sampled_from([0, 0, 0, 1, 3]),
          delay=st.sampled_from([False, False, False, False, True]),
          token=st.integers(0, 3))
    def step_running(self, request_id: str, chunk: int, drafts: int, lookahead: int,
                     delay: bool, token: int) -> None:
        """One engine step of a running request: a prefill chunk, or a decode step (a new
        token, maybe with draft tokens that are then rejected)."""
        config = self.state.config
        if any(model.is_align_mamba(config, group) for group in config.groups):
            # Why: vLLM 0.33 runs drafts over an align-mode Mamba group only with its
            # speculative blocks (num_speculative_blocks = the draft count), which the
            # 0.33 model leaves out; drafts without them are no configuration vLLM makes.
            drafts = 0
        request = self._request(request_id)
        if request.num_computed_tokens >= len(request.token_ids):
            if len(request.token_ids) >= self.layout.max_model_len:
                return
            self.lockstep(model.AppendTokens(request_id, (token,)))
            request = self._request(request_id)
            event("decode step")
        num_tokens = len(request.token_ids)
        remaining = num_tokens - request.num_computed_tokens
        num_new = min(chunk, remaining)
        if num_new == remaining:
            num_new += drafts
            if drafts:
                event("draft tokens")
        if self._allocate(request_id, num_new, 0, False, lookahead, delay):
            self.lockstep(model.SetComputedTokens(
                request_id, min(request.num_computed_tokens + num_new, num_tokens)))

    @rule(target=waiting, request_id=consumes(running))
    def preempt(self, request_id: str) -> str:
        """Free a running request's blocks; it waits to be recomputed."""
        self._free(request_id)
        self.lockstep(model.SetComputedTokens(request_id, 0))
        tracked = self.tracked[request_id]
        tracked.preempted += 1
        tracked.encoder_done = False
        tracked.delayed = False
        event("preemption")
        return request_id

    @rule(request_id=consumes(running))
    def finish(self, request_id: str) -> None:
        """A running request finishes: free it, forget it."""
        self.finished_tokens.append(self._request(request_id).token_ids)
        event("finish running request")
        self._free(request_id)
        del self.tracked[request_id]

    @precondition(lambda self: self.profile is pool_model.Profile.V0_33)
    @rule(request_id=consumes(running))
    def finish_in_flight(self, request_id: str) -> None:
        """A running request finishes while a step that may still write its blocks is in
        flight (vLLM 0.33's scheduler with ``defer_block_free``): its blocks are popped for
        a deferred free; it is forgotten."""
        self.finished_tokens.append(self._request(request_id).token_ids)
        popped = self.lockstep(model.PopBlocksForFree(request_id))
        assert model.released(self.state, request_id)
        event("finish with a deferred free" + (" (no blocks)" if not popped else ""))
        del self.tracked[request_id]

    @precondition(lambda self: self.built and bool(self.state.deferred))
    @rule()
    def drain_deferred_frees(self) -> None:
        """The in-flight step is done: the deferred blocks go back to the pool."""
        if len(self.state.deferred) > 1:
            event("drain: several deferred batches")
        self.lockstep(model.DrainDeferredFrees())

    @precondition(lambda self: self.every(4, 3))
    @rule(request_id=consumes(waiting))
    def abort_waiting(self, request_id: str) -> None:
        """A waiting request is aborted (it may hold nothing, or blocks of an earlier run)."""
        event("abort waiting request")
        self._free(request_id)
        del self.tracked[request_id]

    def _free(self, request_id: str) -> None:
        self.lockstep(model.Free(request_id))
        assert model.released(self.state, request_id)

    @precondition(lambda self: self.every(11, 4))
    @rule()
    def free_unknown_request(self) -> None:
        """Free a request the manager never saw: nothing changes. (Enabled on one step in
        eleven, as are the other rare calls: Hypothesis favours rules without arguments.)"""
        self.lockstep(model.Free("never-seen"))

    @precondition(lambda self: self.profile.mamba_align_mode and self.every(2, 1))
    @rule()
    def new_step(self) -> None:
        """The scheduler starts a step (vLLM 0.33's ``new_step_starts``): a Mamba hit on a
        key cached in the last step may now be taken."""
        held_back = bool(self.state.cached_this_step)
        self.lockstep(model.NewStep())
        if held_back:
            event("new step: Mamba keys of the last step released")

    @precondition(lambda self: self.every(3, 2))
    @rule()
    def take_events(self) -> None:
        """A consumer (a KV-aware router) takes the pending events."""
        self.taken += self.lockstep(model.TakeEvents())

    @precondition(lambda self: self.every(9, 1))
    @rule()
    def reset_prefix_cache(self) -> None:
        """Reset the prefix cache (refused while any request holds blocks); enabled on one
        step in nine, so that cached prefixes live long enough to hit."""
        done = self.lockstep(model.ResetPrefixCache())
        event(f"reset_prefix_cache {'done' if done else 'refused'}")

    @precondition(lambda self: any(t.delayed for t in self.tracked.values()))
    @rule(request_id=running)
    def cache_delayed_blocks(self, request_id: str) -> None:
        """A KV transfer finished: key the blocks of a request that delayed caching."""
        if not self.tracked[request_id].delayed:
            return
        request = self._request(request_id)
        num_tokens = min(request.num_computed_tokens, len(request.token_ids))
        self.lockstep(model.CacheBlocks(request_id, num_tokens))
        self.tracked[request_id].delayed = False
        event("cache delayed blocks")

    @precondition(lambda self: self.built and any(
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
            self.lockstep(model.EvictBlocks((block,)))
        event("evict cached blocks")

    # -- rules: what an eviction policy offers (spec.eviction), through the manager --------

    def _policy_has(self, what: str) -> bool:
        return self.built and getattr(self.state.pool.policy, what)

    def _cached_blocks(self) -> list[int]:
        pool = self.state.pool
        return [b for b, key in enumerate(pool.key_of) if key is not None]

    @precondition(lambda self: (self._policy_has("has_priorities") or self._policy_has(
        "has_pins")) and self.every(3, 1))
    @rule(delta=st.sampled_from([1, 1, 2, 4]))
    def advance_clock(self, delta: int) -> None:
        """Time passes: priorities whose expiry has come revert to the default."""
        live = len(self.state.pool.retention)
        self.lockstep(pool_model.AdvanceClock(self.state.pool.now + delta))
        if len(self.state.pool.retention) < live:
            event("a priority expired")

    @precondition(lambda self: self._policy_has("has_priorities") and self.every(3, 2))
    @rule(pick=st.integers(0, 63), priority=st.sampled_from([0, 20, 35, 80]),
          duration=st.sampled_from([None, 2]))
    def set_retention(self, pick: int, priority: int, duration: int | None) -> None:
        """A client re-prioritises a cached block (demotes or keeps it)."""
        cached = self._cached_blocks()
        if cached:
            self.lockstep(pool_model.SetRetention((cached[pick % len(cached)],), priority,
                                                  duration))

    @precondition(lambda self: self._policy_has("has_pins") and self.every(2, 1))
    @rule(pick=st.integers(0, 63))
    def pin_cached_block(self, pick: int) -> None:
        """Pin a cached block (a system prompt's): refused over the cap."""
        pinned = self.state.pool.pinned
        cached = [b for b in self._cached_blocks() if b not in pinned]
        if cached:
            output = self.lockstep(pool_model.PinBlocks((cached[pick % len(cached)],)))
            event("pin refused" if isinstance(output, Refused) else "pinned")

    @precondition(lambda self: self._policy_has("has_pins") and bool(
        self.state.pool.pinned) and self.every(2))
    @rule(pick=st.integers(0, 63))
    def unpin_block(self, pick: int) -> None:
        pinned = self.state.pool.pinned
        self.lockstep(pool_model.UnpinBlocks((pinned[pick % len(pinned)],)))
        event("unpinned")

    @rule(request_id=running)
    def inspect_request(self, request_id: str) -> None:
        """What the scheduler reads of a running request: the blocks every running request
        shares with it (cascade attention) and its block ids (the block table's rows)."""
        if any(self.lockstep(model.GetNumCommonPrefixBlocks(request_id))):
            event("common prefix > 0")
        self.lockstep(model.GetBlockIds(request_id))

    # -- rules: bad calls, each refused with a typed error and no change ------------------

    @bad_call(bad_calls_now, request_id=running)
    def bad_allocate_no_tokens(self, request_id: str) -> None:
        """allocate_slots for no new token (vLLM 0.13 raises ValueError too)."""
        self.refuse(model.AllocateSlots(request_id, 0))

    @bad_call(bad_calls_now, request_id=running, extra=st.integers(1, 3))
    def bad_allocate_beyond_max_model_len(self, request_id: str, extra: int) -> None:
        """More new tokens in one call than max_model_len."""
        self.refuse(model.AllocateSlots(request_id, self.layout.max_model_len + extra))

    @bad_call(bad_calls_now, request_id=running, extra=st.integers(1, 8))
    def bad_allocate_computed_beyond_slots(self, request_id: str, extra: int) -> None:
        """num_computed_tokens past the request's slots (stage 1 would free blocks the
        request still attends to): refused; the count is then set back."""
        request = self._request(request_id)
        slots = min((len(blocks) * group.block_size
                     for group, blocks in zip(self.state.config.groups,
                                              model.get_blocks(self.state, request_id),
                                              strict=True) if group.kind is not Kind.CROSS),
                    default=None)
        if slots is None:
            return
        self.lockstep(model.SetComputedTokens(request_id, slots + extra))
        self.refuse(model.AllocateSlots(request_id, 1))
        self.lockstep(model.SetComputedTokens(request_id, request.num_computed_tokens))

    @bad_call(bad_calls_now, request_id=running, extra=st.integers(1, 8))
    def bad_cache_blocks_beyond_slots(self, request_id: str, extra: int) -> None:
        """cache_blocks for more tokens than the request has slots for."""
        if not self.state.config.enable_caching or any(
                g.kind is Kind.CROSS for g in self.state.config.groups):
            return
        held = min(len(blocks) * group.block_size for group, blocks in zip(
            self.state.config.groups, model.get_blocks(self.state, request_id), strict=True))
        self.refuse(model.CacheBlocks(request_id, held + extra))

    @bad_call(bad_calls_now, request_id=waiting, other=running)
    def bad_allocate_foreign_hits(self, request_id: str, other: str) -> None:
        """A waiting request allocated with another request's lookup result as its hits."""
        if request_id == other or not self.state.config.enable_caching:
            return
        mine = self._request(request_id)
        hits, num_hit, *_ = self.lockstep(model.GetComputedBlocks(other))
        if not num_hit or num_hit >= len(mine.token_ids):
            return
        if model.hit_is_valid(self.state, mine.view(), hits, num_hit):
            return  # the other request's prefix is this one's: they are its own hits too
        self.refuse(model.AllocateSlots(request_id, 1, num_hit, True, hits_of=other))

    @bad_call(bad_calls_now, request_id=running, encoder=st.integers(1, 4))
    def bad_allocate_encoder_tokens_without_cross_attention(self, request_id: str,
                                                            encoder: int) -> None:
        if any(g.kind is Kind.CROSS for g in self.state.config.groups):
            return
        self.refuse(model.AllocateSlots(request_id, 1, num_encoder_tokens=encoder))

    # -- checks after every step ---------------------------------------------------------
    # Hypothesis runs invariants in name order: the named checks on the target's state come
    # before the whole-state comparison (states_agree), so a broken one is reported by name.

    def state_from_view(self, view: ManagerView) -> Session:
        """The target's state in the spec's terms: the spec's session with the target's
        tables, keyed counts, pool and request hashes in it."""
        spec = self.spec
        hashes = dict(view.block_hashes)
        requests = tuple((rid, replace(r, block_hashes=hashes.get(rid, r.block_hashes)))
                         for rid, r in spec.requests)
        manager = manager_state_from_view(spec.manager, view, self.taken)
        return replace(spec, manager=manager, requests=requests)

    @invariant()
    def block_hashes_match_spec(self) -> None:
        """Every request's block hashes are the spec's: its hash function, chain seed and
        extra keys (LoRA adapter, cache salt) in the target's key format."""
        if not self.built:
            return
        actual = dict(self.target_view().block_hashes)
        for rid, request in self.spec.requests:
            got = actual.get(rid)
            assert got == request.block_hashes, (
                f"invariant block_hashes_match_spec violated: request {rid!r} "
                f"(lora={request.lora}, salt={request.salt!r}, "
                f"{len(request.token_ids)} tokens): target hashes {got}, spec "
                f"{request.block_hashes}")

    @invariant()
    def states_agree(self) -> None:
        if not self.built:
            return
        actual, expected = self.target_view(), view_of(self.spec)
        if actual != expected:
            note(f"target: {actual}\nspec:   {expected}")
        for name in ("tables", "num_cached", "ref", "free", "key_of", "pending_events", "now",
                     "retention", "pinned"):
            assert getattr(actual, name) == getattr(expected, name), (
                f"{name}: target {getattr(actual, name)}, spec {getattr(expected, name)}")

    @invariant()
    def usage_matches_spec(self) -> None:
        if not self.built:
            return
        actual = self.adapter.perform(model.Usage())
        expected = model.usage(self.state)
        assert isinstance(actual, float) and math.isclose(actual, expected), \
            f"usage: target {actual}, spec {expected}"


# Situations vLLM's own scheduler never creates (it never passes such arguments): an audit with
# --scope contract leaves them out. A zero-token allocation is refused by vLLM too.
OUT_OF_CONTRACT = ManagerMachine.bad_call_rules - {"bad_allocate_no_tokens"}


def _on(parts: Callable[[Session], tuple[Any, ...]], predicate: Callable[..., bool],
        ) -> Callable[[Session], bool]:
    """predicate, named as it is, checked on parts of a session."""
    def check(session: Session) -> bool:
        return predicate(*parts(session))

    check.__name__, check.__doc__ = predicate.__name__, predicate.__doc__
    return check


# One @invariant per predicate of `spec.manager`, checked on the target's state (the spec's
# must equal it by states_agree); a router's view of the events every group's pool calls
# emitted (spec.event_consumer); the eviction policies' (spec.eviction), on the manager's pool.
ManagerMachine.add_invariants(
    [_on(lambda s: (s.manager,), p) for p in model.INVARIANTS]
    + [_on(lambda s: (s.manager, s.request_views()), p) for p in (
        model.request_blocks_match_hashes, model.blocks_cover_computed_tokens)]
    + [_on(lambda s: (s.manager.pool,), p) for p in event_consumer.ALL + pool_invariants.POLICY],
    show_state=False)


def _sink_blocks(config: Any) -> int:
    """The blocks a config's sink-attention groups hold for their sinks."""
    return sum((getattr(group.kv_cache_spec, "sink_len", None) or 0)
               // group.kv_cache_spec.block_size for group in config.kv_cache_groups)


def machine_for(make_target: Callable[[], Any],
                layouts: tuple[Layout, ...] = ALL_LAYOUTS,
                policy: Policy | None = None,
                profile: pool_model.Profile = pool_model.Profile.V0_13) -> type[ManagerMachine]:
    """A ManagerMachine subclass checking adapters made by make_target on layouts (under an
    eviction policy: the profile's when None), the spec following ``profile``'s release."""
    return ManagerMachine.for_target(make_target, layouts=tuple(layouts), policy=policy,
                                     profile=profile)
