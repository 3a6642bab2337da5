"""The two tiers together: the GPU block pool, the CPU offload tier and the transfers between.

`spec.pool` models the GPU block pool (vLLM's vllm/v1/core/block_pool.py) and `spec.offload`
the CPU tier's manager (vllm/v1/kv_offload/). Neither moves data: vLLM's offloading connector
does (0.13: vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py; 0.33:
.../kv_connector/v1/offloading/scheduler.py). A **store** copies GPU blocks to CPU keys: the
manager's ``prepare_store`` holds the keys pending, and the GPU blocks must not be freed and
reused while the copy reads them (0.33 fences them in ``_block_id_to_pending_jobs`` and
returns them to the pool only when every job on them has finished). A **load** copies ready
CPU keys into GPU blocks the request has just allocated: ``prepare_load`` pins the keys, and
the destination blocks are written until the job completes.

This module composes the two specs, never restating their rules: `TwoTierState` holds a
`spec.pool.PoolState`, a `spec.offload.OffloadState`, the transfers in flight and the
router's view; each command steps the components through their own ``step`` or operations
and adds only what belongs to the composition:

- the **hold**: a transfer holds its GPU blocks by one pool reference each (`spec.pool.touch`,
  released by `spec.pool.free_blocks` when the transfer finishes), so the pool's own rule
  (a referenced block is not free, and ``get_new_blocks`` takes free blocks only) keeps a
  block in flight from being reused;
- the **guard**: a `Gpu` command that would drop a transfer's hold (free a block below the
  references transfers hold on it) or key a block a load is still writing is refused;
- the **router**: the only consumer of both tiers' events (as a KV-aware router consuming
  vLLM's events with medium GPU and CPU); every event drained from either tier is folded
  into its view (`TakeEvents`, or the tiers' own TakeEvents commands routed here).

One key space. The CPU tier keys are ints; the GPU pool keys a block by its block hash and
KV-cache group (`spec.pool.make_key`). CPU key k is the GPU key of the 8-byte big-endian
block hash k in group 0 (`gpu_key`): the pool's events carry a key's low 64 bits
(`spec.pool.external_hash`), so the GPU events name k itself, and the router holds one hash
per content on both media, as vLLM's events do (the offloading connector keys the CPU tier by
the same block hashes). A store copies a block to the CPU key of its own content only.

Every refusal raises a typed error (a `TwoTierError`, or the component's own `PoolError` or
`OffloadError`, all ValueError or LookupError) before the new state is built: nothing changes.
Not modelled: the CPU tier's reset (0.33) and stale jobs, several KV-cache groups per key,
partial stores and loads (a transfer is all or nothing), and what a failed load leaves in its
blocks (they hold no key, so no request can hit them; the request recomputes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvspec.spec import offload as cpu_spec, pool as gpu_spec, pool_invariants
from kvspec.spec.event_consumer import RouterView, consume
from kvspec.spec.offload import OffloadEvent, OffloadState
from kvspec.spec.pool import NULL_BLOCK, BlockId, PoolState, Profile

Key = int  # a CPU key, and the external hash of its GPU key
Req = str

GROUP = 0  # the one KV-cache group whose keys the CPU tier holds
HASH_BYTES = 8  # a block hash of 8 bytes: its external hash (low 64 bits) is the hash itself


# --- Refusals: every bad call raises one of these (or a component's), before anything changes. --


class TwoTierError(Exception):
    """A call the two-tier model must refuse; nothing changes."""


class BadTwoTierKey(TwoTierError, ValueError):
    """A CPU key with no GPU key: not an int in [0, 2**64)."""


class BadTransfer(TwoTierError, ValueError):
    """A transfer whose block ids and keys do not pair one to one (lengths differ, a block
    or key listed twice, nothing to move, the null block)."""


class UnknownBlock(TwoTierError, LookupError):
    """A block id that is not in the GPU pool."""


class BlockHoldsNoData(TwoTierError, ValueError):
    """A store of a GPU block that is free (no request holds it) or has no key."""


class KeyMismatch(TwoTierError, ValueError):
    """A store of a GPU block to a CPU key that is not its content's (`gpu_key`)."""


class DestinationNotFresh(TwoTierError, ValueError):
    """A load into a GPU block that is not allocated (free) or already holds a key: a load
    writes newly allocated blocks only, so no request can hit half-written data."""


class BlockInTransfer(TwoTierError, ValueError):
    """A load into a block another transfer in flight reads or writes."""


class UnknownTransfer(TwoTierError, LookupError):
    """FinishTransfer of no transfer in flight."""


class HoldReleased(TwoTierError, ValueError):
    """A `Gpu` command that would release a transfer's hold on a block (free it below the
    references transfers hold) or key a block a load is writing."""


class NotATwoTierCommand(TwoTierError, ValueError):
    """A command outside the model: a component command it does not pass on (a second
    NewPool, the CPU tier's stores and loads, which only transfers make, its reset)."""


# --- The key mapping, in one place ---------------------------------------------------------------


def block_hash_of(key: Key) -> bytes:
    """The GPU block hash of CPU key ``key``: its 8 bytes, big-endian.

    raises: BadTwoTierKey
    post: int.from_bytes(__return__, "big") == key
    """
    if type(key) is not int or not 0 <= key < 2 ** (8 * HASH_BYTES):
        raise BadTwoTierKey(f"CPU key {key!r} is not an int in [0, 2**64)")
    return key.to_bytes(HASH_BYTES, "big")


def gpu_key(key: Key) -> gpu_spec.Key:
    """The GPU pool's key for CPU key ``key`` (group `GROUP`).

    raises: BadTwoTierKey
    post: gpu_spec.external_hash(__return__) == key
    """
    return gpu_spec.make_key(block_hash_of(key), GROUP)


# --- State ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    """A job in flight: a store reads ``block_ids`` into ``keys`` (pairwise), a load writes
    ``keys`` into ``block_ids``. ``generation``: the CPU tier's when the job was issued."""

    is_store: bool
    req: Req
    block_ids: tuple[BlockId, ...]
    keys: tuple[Key, ...]
    generation: int = 0


@dataclass(frozen=True)
class Router:
    """What a router rebuilt from every event it took: the GPU view (`spec.event_consumer`,
    copies per external hash) and the CPU keys announced stored and not removed since."""

    gpu: RouterView = RouterView()  # noqa: RUF009 (frozen: one shared default is safe)
    cpu: frozenset[Key] = frozenset()


@dataclass(frozen=True)
class TwoTierState:
    gpu: PoolState
    cpu: OffloadState
    transfers: tuple[Transfer, ...] = ()  # in flight, oldest first
    router: Router = Router()


# --- Commands ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NewTwoTier:
    """A GPU pool of ``num_blocks`` (block 0 the null block, events on: the router reads
    them) and a CPU tier of ``capacity`` keys."""

    num_blocks: int
    capacity: int
    policy: str = "lru"  # the CPU tier's
    profile: Profile = Profile.V0_13
    max_pending_events: int | None = None


@dataclass(frozen=True)
class Gpu:
    """Any `spec.pool` command but NewPool and EmitCachedBlockEvents (its re-announcements
    are copies a counting router cannot tell apart: spec.event_consumer), stepped by
    `spec.pool.step`; the pool's TakeEvents drains into the router."""

    command: gpu_spec.PoolCommand


@dataclass(frozen=True)
class Cpu:
    """The CPU tier's Lookup, Touch, RequestFinished, TakeEvents (drained into the router),
    stepped by `spec.offload.step`. Its stores and loads are the transfers'."""

    command: cpu_spec.Command


@dataclass(frozen=True)
class StartStore:
    """Offer ``keys`` for storing (``prepare_store``) and copy ``block_ids[i]`` to
    ``keys[i]`` for each key it stores. Output: prepare_store's."""

    req: Req
    block_ids: tuple[BlockId, ...]
    keys: tuple[Key, ...]


@dataclass(frozen=True)
class StartLoad:
    """Pin ``keys`` (``prepare_load``) and copy ``keys[i]`` into ``block_ids[i]``."""

    req: Req
    keys: tuple[Key, ...]
    block_ids: tuple[BlockId, ...]


@dataclass(frozen=True)
class FinishTransfer:
    """The worker reports transfer ``index`` (its position among those in flight) done."""

    index: int
    success: bool = True


@dataclass(frozen=True)
class TakeEvents:
    """Drain both tiers' events into the router."""


Command = NewTwoTier | Gpu | Cpu | StartStore | StartLoad | FinishTransfer | TakeEvents

CPU_COMMANDS = (cpu_spec.Lookup, cpu_spec.Touch, cpu_spec.RequestFinished, cpu_spec.TakeEvents)


# --- Small pure helpers --------------------------------------------------------------------------


def holds(transfers: tuple[Transfer, ...]) -> Counter[BlockId]:
    """How many pool references the transfers in flight hold on each block."""
    return Counter(b for t in transfers for b in t.block_ids)


def load_destinations(transfers: tuple[Transfer, ...]) -> frozenset[BlockId]:
    return frozenset(b for t in transfers if not t.is_store for b in t.block_ids)


def gpu_copies(gpu: PoolState) -> Counter[Key]:
    """Each GPU copy's external hash: one per key of each block."""
    return Counter(gpu_spec.external_hash(k) for b in range(gpu.num_blocks)
                   for k in gpu_spec.keys_of(gpu, b))


def _check_pairs(block_ids: tuple[BlockId, ...], keys: tuple[Key, ...],
                 gpu: PoolState) -> None:
    if not block_ids or len(block_ids) != len(keys):
        raise BadTransfer(f"blocks {list(block_ids)} and keys {list(keys)} do not pair up")
    if len(set(block_ids)) != len(block_ids) or len(set(keys)) != len(keys):
        raise BadTransfer(f"a block or key is listed twice in {list(block_ids)}, {list(keys)}")
    for block in block_ids:
        if type(block) is not int or not 0 <= block < gpu.num_blocks:
            raise UnknownBlock(f"block {block!r} is not in the GPU pool of {gpu.num_blocks}")
        if block == NULL_BLOCK:
            raise BadTransfer("the null block holds no data to move")
    for key in keys:
        block_hash_of(key)


def _fold_cpu(view: frozenset[Key], events: tuple[OffloadEvent, ...]) -> frozenset[Key]:
    """The router's CPU view after events: a store adds its keys, a removal drops them (a
    metadata-only removal names keys the router never held: dropping them changes nothing)."""
    for event in events:
        view = view - frozenset(event.keys) if event.removed else view | frozenset(event.keys)
    return view


def _drain_gpu(state: TwoTierState) -> TwoTierState:
    gpu, events = gpu_spec.take_events(state.gpu)
    view = state.router.gpu
    for event in events:
        view = consume(view, event)
    return replace(state, gpu=gpu, router=replace(state.router, gpu=view))


def _drain_cpu(state: TwoTierState) -> TwoTierState:
    cpu, events = cpu_spec.take_events(state.cpu)
    return replace(state, cpu=cpu, router=replace(state.router,
                                                  cpu=_fold_cpu(state.router.cpu, events)))


def drained(state: TwoTierState) -> TwoTierState:
    """Both tiers' pending events folded into the router (the `TakeEvents` command)."""
    return _drain_cpu(_drain_gpu(state))


# --- Operations ----------------------------------------------------------------------------------


def new_two_tier(num_blocks: int, capacity: int, policy: str = "lru",
                 profile: Profile = Profile.V0_13,
                 max_pending_events: int | None = None) -> TwoTierState:
    """Both tiers empty, nothing in flight, the router empty.

    raises: gpu_spec.PoolError, cpu_spec.OffloadError
    post: not __return__.transfers
    """
    gpu = gpu_spec.new_pool(num_blocks, True, True, profile, max_pending_events)
    return TwoTierState(gpu, cpu_spec.new_offload(capacity, policy, profile))


def _guard(gpu: PoolState, transfers: tuple[Transfer, ...]) -> None:
    """Refuse a pool state that broke a transfer: a hold released, a load target keyed."""
    for block, n in holds(transfers).items():
        if gpu.ref[block] < n:
            raise HoldReleased(f"block {block} is held by {n} transfer(s) in flight: a request "
                               f"cannot free it below that")
    for block in load_destinations(transfers):
        if gpu_spec.keys_of(gpu, block):
            raise HoldReleased(f"block {block} is being written by a load: it cannot be keyed")


def gpu_step(state: TwoTierState, command: gpu_spec.PoolCommand) -> tuple[TwoTierState, object]:
    """A pool command, stepped by `spec.pool.step`, guarded by the transfers."""
    if isinstance(command, gpu_spec.NewPool | gpu_spec.EmitCachedBlockEvents):
        raise NotATwoTierCommand(f"{type(command).__name__} is outside the two-tier model")
    if isinstance(command, gpu_spec.TakeEvents):
        before = state.gpu.num_taken
        after = _drain_gpu(state)
        return after, after.gpu.events[before:]
    gpu, output = gpu_spec.step(state.gpu, command)
    _guard(gpu, state.transfers)
    return replace(state, gpu=gpu), output


def cpu_step(state: TwoTierState, command: cpu_spec.Command) -> tuple[TwoTierState, object]:
    """A CPU tier command that moves no data, stepped by `spec.offload.step`."""
    if not isinstance(command, CPU_COMMANDS):
        raise NotATwoTierCommand(f"{type(command).__name__} is not passed to the CPU tier: "
                                 f"stores and loads are StartStore and StartLoad")
    if isinstance(command, cpu_spec.TakeEvents):
        events = cpu_spec.take_events(state.cpu)[1]
        return _drain_cpu(state), events
    cpu, output = cpu_spec.step(state.cpu, command)
    return replace(state, cpu=cpu), output


def start_store(state: TwoTierState, req: Req, block_ids: tuple[BlockId, ...],
                keys: tuple[Key, ...]
                ) -> tuple[TwoTierState, tuple[tuple[Key, ...], tuple[Key, ...]] | None]:
    """Offer keys to the CPU tier and copy the blocks of the keys it stores.

    Each block must hold data: a request holds it (ref >= 1) and its content is its key's
    (`gpu_key`). The tier stores the keys it does not hold yet (`spec.offload.prepare_store`,
    evicting what it needs room for) or nothing (None: no room; the tier still learns, as
    vLLM's does). The stored keys' blocks are held by a `spec.pool.touch` each.

    Why touch: it is the pool's plain reference (a prefix-cache hit's), on any block, keyed
    or not, under every eviction policy, stackable (two jobs on one block hold two), and
    `spec.pool.free_blocks` releases exactly it; a block returns to the free queue when its
    last reference goes, which is 0.33's fence (``_block_id_to_pending_jobs``: a block the
    request frees mid-job is returned when the job finishes). A pin (`spec.pool.pin_blocks`)
    would not do: ``lru`` has none, pins are capped, and a pinned block must keep its key.

    raises: TwoTierError, gpu_spec.PoolError, cpu_spec.OffloadError
    post: len(__return__[0].transfers) - len(state.transfers) in (0, 1)
    """
    _check_pairs(block_ids, keys, state.gpu)
    for block, key in zip(block_ids, keys, strict=True):
        if state.gpu.ref[block] < 1:
            raise BlockHoldsNoData(f"block {block} is free: no request holds data in it")
        held = gpu_spec.keys_of(state.gpu, block)
        if not held:
            raise BlockHoldsNoData(f"block {block} has no key: its content is not a full block")
        if gpu_key(key) not in held:
            raise KeyMismatch(f"block {block} does not hold the content of CPU key {key}")
    cpu, output = cpu_spec.prepare_store(state.cpu, req, keys)
    if output is None or not output[0]:
        return replace(state, cpu=cpu), output
    stored = output[0]
    blocks = tuple(b for b, k in zip(block_ids, keys, strict=True) if k in stored)
    transfer = Transfer(True, req, blocks, stored, state.cpu.generation)
    gpu = gpu_spec.touch(state.gpu, blocks)
    return replace(state, gpu=gpu, cpu=cpu, transfers=state.transfers + (transfer,)), output


def start_load(state: TwoTierState, req: Req, keys: tuple[Key, ...],
               block_ids: tuple[BlockId, ...]) -> TwoTierState:
    """Pin ready keys (`spec.offload.prepare_load`: a pending or unknown key is refused) and
    hold their destination blocks (`spec.pool.touch`, as for a store). Each destination is
    allocated (ref >= 1), has no key, and no other transfer reads or writes it.

    raises: TwoTierError, gpu_spec.PoolError, cpu_spec.OffloadError
    post: len(__return__.transfers) == len(state.transfers) + 1
    """
    _check_pairs(block_ids, keys, state.gpu)
    busy = holds(state.transfers)
    for block in block_ids:
        if state.gpu.ref[block] < 1:
            raise DestinationNotFresh(f"block {block} is free: allocate it before loading")
        if gpu_spec.keys_of(state.gpu, block):
            raise DestinationNotFresh(f"block {block} holds a key: a load writes new blocks")
        if busy[block]:
            raise BlockInTransfer(f"block {block} is in a transfer in flight")
    cpu = cpu_spec.prepare_load(state.cpu, req, keys)
    transfer = Transfer(False, req, block_ids, keys, state.cpu.generation)
    gpu = gpu_spec.touch(state.gpu, block_ids)
    return replace(state, gpu=gpu, cpu=cpu, transfers=state.transfers + (transfer,))


def finish_transfer(state: TwoTierState, index: int, success: bool) -> TwoTierState:
    """A job's end: a store completes its keys (`spec.offload.complete_store`: ready and
    announced, or dropped on failure), a load unpins its keys (`complete_load`); either
    releases its hold on the GPU blocks (`spec.pool.free_blocks`).

    raises: TwoTierError, gpu_spec.PoolError, cpu_spec.OffloadError
    post: len(__return__.transfers) == len(state.transfers) - 1
    """
    if type(index) is not int or not 0 <= index < len(state.transfers):
        raise UnknownTransfer(f"no transfer {index!r} in flight ({len(state.transfers)})")
    job = state.transfers[index]
    if job.is_store:
        cpu = cpu_spec.complete_store(state.cpu, job.keys, success, job.generation)
    else:
        cpu = cpu_spec.complete_load(state.cpu, job.keys)
    gpu = gpu_spec.free_blocks(state.gpu, job.block_ids)
    return replace(state, gpu=gpu, cpu=cpu,
                   transfers=state.transfers[:index] + state.transfers[index + 1:])


def step(state: TwoTierState | None, command: Command) -> tuple[TwoTierState, object]:
    """One command: the new state and its output. A refused command raises (a
    `TwoTierError`, `PoolError` or `OffloadError`) and changes nothing."""
    if isinstance(command, NewTwoTier):
        c = command
        return new_two_tier(c.num_blocks, c.capacity, c.policy, c.profile,
                            c.max_pending_events), None
    if state is None:
        raise NotATwoTierCommand(f"a two-tier program starts with NewTwoTier, not {command!r}")
    if isinstance(command, Gpu):
        return gpu_step(state, command.command)
    if isinstance(command, Cpu):
        return cpu_step(state, command.command)
    if isinstance(command, StartStore):
        return start_store(state, command.req, command.block_ids, command.keys)
    if isinstance(command, StartLoad):
        return start_load(state, command.req, command.keys, command.block_ids), None
    if isinstance(command, FinishTransfer):
        return finish_transfer(state, command.index, command.success), None
    if isinstance(command, TakeEvents):
        return drained(state), None
    raise NotATwoTierCommand(f"not a two-tier command: {command!r}")


# --- Invariants: one named predicate per property ------------------------------------------------


def transfer_blocks_not_reused(state: TwoTierState) -> bool:
    """A GPU block in a transfer in flight is referenced at least once per transfer on it
    and is not free: ``get_new_blocks`` cannot hand it out while the copy runs."""
    return all(0 < b < state.gpu.num_blocks and state.gpu.ref[b] >= n
               and b not in state.gpu.free for b, n in holds(state.transfers).items())


def load_destinations_hold_no_key(state: TwoTierState) -> bool:
    """A block a load is writing has no key: no prefix-cache hit reads half-written data."""
    return all(not gpu_spec.keys_of(state.gpu, b) for b in load_destinations(state.transfers))


def loads_read_ready_keys(state: TwoTierState) -> bool:
    """Every key of a load in flight is ready in the CPU tier and pinned once per load that
    reads it (so eviction cannot take it)."""
    readers = Counter(k for t in state.transfers if not t.is_store for k in t.keys)
    return all(state.cpu.ref.get(k, cpu_spec.PENDING) >= n for k, n in readers.items())


def stores_write_pending_keys(state: TwoTierState) -> bool:
    """Every key of a store in flight is pending in the CPU tier, written by that store
    alone (or the store's generation is stale: a reset dropped its keys)."""
    live = [k for t in state.transfers if t.is_store and t.generation >= state.cpu.generation
            for k in t.keys]
    return len(live) == len(set(live)) and all(
        state.cpu.ref.get(k) == cpu_spec.PENDING for k in live)


def pending_keys_have_a_store(state: TwoTierState) -> bool:
    """Every pending CPU key is being written by a store in flight: none is stuck pending."""
    writing = {k for t in state.transfers if t.is_store for k in t.keys}
    return all(k in writing for k, r in state.cpu.refs if r == cpu_spec.PENDING)


def router_view_matches_both_tiers(state: TwoTierState) -> bool:
    """The router, once the pending events of both tiers are drained into it, holds exactly
    the GPU pool's copies (per external hash) and the CPU tier's ready keys: a key evicted
    from both tiers is in neither view."""
    after = drained(state)
    return (Counter(dict(after.router.gpu.counts)) == gpu_copies(state.gpu)
            and after.router.cpu == cpu_spec.ready_keys(state.cpu))


def gpu_pool_keeps_its_invariants(state: TwoTierState) -> bool:
    """Every `spec.pool_invariants` predicate holds on the GPU pool."""
    return not pool_invariants.violated(state.gpu)


def cpu_tier_keeps_its_invariants(state: TwoTierState) -> bool:
    """Every `spec.offload.ALL` predicate holds on the CPU tier."""
    return not cpu_spec.violated(state.cpu)


Invariant = Callable[[TwoTierState], bool]

ALL: tuple[Invariant, ...] = (
    transfer_blocks_not_reused, load_destinations_hold_no_key, loads_read_ready_keys,
    stores_write_pending_keys, pending_keys_have_a_store, router_view_matches_both_tiers,
    gpu_pool_keeps_its_invariants, cpu_tier_keeps_its_invariants)


def violated(state: TwoTierState) -> list[str]:
    """The names of the invariants that do not hold; a component's are named
    ``gpu.<name>`` and ``cpu.<name>``."""
    names = [inv.__name__ for inv in ALL[:-2] if not inv(state)]
    names += [f"gpu.{name}" for name in pool_invariants.violated(state.gpu)]
    return names + [f"cpu.{name}" for name in cpu_spec.violated(state.cpu)]
