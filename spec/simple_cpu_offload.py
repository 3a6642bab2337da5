"""vLLM 0.33's SimpleCPUOffloadConnector as two composed block pools (PR #37160).

The connector's scheduler side (vllm/v1/simple_kv_offload/manager.py) keeps its CPU tier in
a second ``BlockPool``: a CPU hit is that pool's prefix-cache hit, a store allocates CPU
blocks from it, and holds are plain pool references (``touch`` / ``free_blocks``) on both
pools. This module states that protocol with `spec.pool` operations only, on two
`spec.pool.PoolState` (GPU and CPU), plus a table of pending CPU hits and transfers in
flight; it adds no pool rule. The call sequence, by line of manager.py (vllm 0.33.0):

- **Phase A**, ``get_num_new_matched_tokens`` (361-425): a stale pending hit of the request
  is released first (369-370, ``_free_pending_cpu_hit`` 1344-1353: ``cpu_pool.free_blocks``);
  the hit is ``find_longest_cache_hit`` on the CPU pool (408-410: `spec.pool.get_cached_prefix`
  here); its non-null blocks are pinned by ``cpu_block_pool.touch`` (412-416) and kept in
  ``_pending_cpu_hits`` (417-421). Without that pin (vLLM #42289) the blocks sit on the CPU
  free queue, and any CPU allocation before phase B (a store's ``get_new_blocks``) may evict
  them: phase B would then load blocks that no longer hold the hit's data.
- **Phase B**, ``update_state_after_alloc`` (427-538): the pending hit is popped (450); the
  leading blocks the scheduler accepted (496-500) are touched again on the CPU pool
  (525), the phase-A pin is released (527: ``_free_pending_cpu_hit``), and the GPU
  destination blocks are touched (530-533) until the load completes. No pending hit: vLLM
  logs and skips (463-470); here that is a refusal (`NoPendingHit`), which changes nothing
  just the same.
- **Load done**, ``_cleanup_load_request`` (1355-1395, from ``update_connector_output``
  1049-1052 or ``request_finished`` 1231-1237): CPU holds freed (1381-1385), GPU holds freed
  (1386-1391). The connector keys no GPU block: the scheduler caches the loaded blocks
  afterwards (a `Gpu` ``CacheFullBlocks`` once the load is done).
- **Store start**, ``_prepare_lazy_store_specs`` (618-672) and ``_prepare_eager_store_specs``
  (674-844): only a keyed GPU block whose hash the CPU pool does not hold and that no store
  in flight reads (657, ``_classify_store_candidate`` 985-999) is stored; the CPU
  destinations come from ``cpu_block_pool.get_new_blocks`` (665, 757, 811) and the GPU
  sources are touched (668, 767, 826-828). A lazy store reads blocks on the GPU free queue
  (ref 0): the touch takes them off it.
- **Store done**, ``_process_store_completion`` (1100-1197): each CPU block is keyed with its
  GPU block's hash (1117-1121, ``_insert_block_hash``: `spec.pool.cache_full_blocks` here)
  and both holds are freed (1194-1197). A store dropped without caching (a reset's abandoned
  event) frees both holds only (``_release_transfer_refs`` 1199-1206): `FinishTransfer` with
  ``success=False``.
- **Cancel**: ``request_finished`` pops and releases a pending hit (1225-1229); so does phase
  B with no external tokens (452-461).

The guard: a `Gpu` or `Cpu` passthrough that would drop a hold (free a block below the
references the protocol holds on it), remove the key of a pinned CPU block or of a store's
GPU source, or key a block a transfer is writing, is refused. Every refusal raises a typed
error (a `SimpleOffloadError` or the pool's `spec.pool.PoolError`, each a ValueError or
LookupError) before a new state is built: nothing changes.

One key space, one KV-cache group (`GROUP`): a block hash (bytes) keys a block of either
pool as `spec.pool.make_key(hash, GROUP)`. Not modelled: several KV-cache groups and the null
padding of sliding-window / mamba groups (452-523's per-group walk), the CPU pool's KV events
(1129-1192), secondary hashes (1122-1128), the lazy cursor and eager per-request bookkeeping
(which blocks to store is the caller's choice), ``reset`` (1422-1481), partial loads (a
transfer is all or nothing) and worker-count accounting of store completions (1058-1064).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvspec.spec import pool as P, pool_invariants
from kvspec.spec.pool import NULL_BLOCK, BlockId, PoolState, Profile

Hash = bytes  # a block hash: keys a block of either pool in group GROUP
Req = str

GROUP = 0


# --- Refusals ------------------------------------------------------------------------------------


class SimpleOffloadError(Exception):
    """A call the model refuses; nothing changes."""


class NotASimpleOffloadCommand(SimpleOffloadError, ValueError):
    """A command outside the model (a passthrough NewPool, a command before the state)."""


class NoPendingHit(SimpleOffloadError, LookupError):
    """StartLoad or CancelHit for a request with no pending CPU hit."""


class BadTransfer(SimpleOffloadError, ValueError):
    """Blocks and keys that do not pair up, nothing to move, a block or key listed twice, the
    null block, or a load of more blocks than the pending hit has."""


class UnknownBlock(SimpleOffloadError, LookupError):
    """A block id outside the GPU pool."""


class DestinationNotFresh(SimpleOffloadError, ValueError):
    """A load into a GPU block that is free or already keyed: a load writes blocks the
    request has just allocated."""


class BlockInTransfer(SimpleOffloadError, ValueError):
    """A GPU block that a transfer in flight already reads or writes."""


class LoadInFlight(SimpleOffloadError, ValueError):
    """StartLoad for a request whose load is still in flight (vLLM asserts, 535)."""


class SourceHoldsNoData(SimpleOffloadError, ValueError):
    """A store of a GPU block that does not hold the given hash's content (no key, or
    another)."""


class AlreadyInCpu(SimpleOffloadError, ValueError):
    """A store of a hash the CPU pool already holds or a store in flight writes (657)."""


class UnknownTransfer(SimpleOffloadError, LookupError):
    """FinishTransfer of no transfer in flight."""


class HoldReleased(SimpleOffloadError, ValueError):
    """A passthrough that would drop a hold, unkey a pinned block or a store's source, or key
    a block a transfer is writing."""


# --- State ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PendingHit:
    """Phase A's pin (``_pending_cpu_hits``): CPU block ``cpu_block_ids[i]`` holds ``keys[i]``."""

    req: Req
    cpu_block_ids: tuple[BlockId, ...]
    keys: tuple[Hash, ...]


@dataclass(frozen=True)
class Transfer:
    """A job in flight. A load copies CPU ``cpu_block_ids[i]`` (keyed ``keys[i]``) into GPU
    ``gpu_block_ids[i]``; a store copies GPU ``gpu_block_ids[i]`` (keyed ``keys[i]``) into
    the new CPU ``cpu_block_ids[i]``. Each block is held by one pool reference."""

    is_store: bool
    req: Req
    gpu_block_ids: tuple[BlockId, ...]
    cpu_block_ids: tuple[BlockId, ...]
    keys: tuple[Hash, ...]


@dataclass(frozen=True)
class SimpleOffloadState:
    gpu: PoolState
    cpu: PoolState
    pending: tuple[PendingHit, ...] = ()  # at most one per request
    transfers: tuple[Transfer, ...] = ()  # in flight, oldest first


# --- Commands ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NewSimpleOffload:
    """A GPU pool of ``gpu_blocks`` and a CPU pool of ``cpu_blocks`` (each with its null
    block 0), prefix caching on, events as asked."""

    gpu_blocks: int
    cpu_blocks: int
    profile: Profile = Profile.V0_33
    enable_events: bool = False


@dataclass(frozen=True)
class LookupCpuHit:
    """Phase A: the longest prefix of ``keys`` cached in the CPU pool, pinned. Output: the
    hit's CPU blocks."""

    req: Req
    keys: tuple[Hash, ...]


@dataclass(frozen=True)
class StartLoad:
    """Phase B: load the leading ``len(gpu_block_ids)`` blocks of the pending hit into
    ``gpu_block_ids``."""

    req: Req
    gpu_block_ids: tuple[BlockId, ...]


@dataclass(frozen=True)
class StartStore:
    """Copy GPU ``gpu_block_ids[i]`` (holding ``keys[i]``) to new CPU blocks. Output: the
    CPU blocks."""

    req: Req
    gpu_block_ids: tuple[BlockId, ...]
    keys: tuple[Hash, ...]


@dataclass(frozen=True)
class FinishTransfer:
    """Transfer ``index`` (its position among those in flight) is done."""

    index: int
    success: bool = True


@dataclass(frozen=True)
class CancelHit:
    """The request is preempted or finished between phase A and B: its pin is released."""

    req: Req


@dataclass(frozen=True)
class Gpu:
    """Any other GPU pool call (the scheduler's), stepped by `spec.pool.step`, guarded."""

    command: P.PoolCommand


@dataclass(frozen=True)
class Cpu:
    """Any other CPU pool call, stepped by `spec.pool.step`, guarded."""

    command: P.PoolCommand


Command = (NewSimpleOffload | LookupCpuHit | StartLoad | StartStore | FinishTransfer
           | CancelHit | Gpu | Cpu)


# --- Helpers -------------------------------------------------------------------------------------


def key(block_hash: Hash) -> P.Key:
    """The pool key of a block hash (either pool).

    raises: P.BadHash
    """
    return P.make_key(block_hash, GROUP)


def gpu_holds(state: SimpleOffloadState) -> Counter[BlockId]:
    """References the protocol holds on each GPU block: one per transfer on it."""
    return Counter(b for t in state.transfers for b in t.gpu_block_ids)


def cpu_holds(state: SimpleOffloadState) -> Counter[BlockId]:
    """References the protocol holds on each CPU block: one per pending hit and per
    transfer on it."""
    return Counter([b for h in state.pending for b in h.cpu_block_ids]
                   + [b for t in state.transfers for b in t.cpu_block_ids])


def pinned_cpu_blocks(state: SimpleOffloadState) -> tuple[tuple[BlockId, Hash], ...]:
    """(CPU block, the hash it must keep) for every pending hit and load in flight."""
    return tuple(pair for h in state.pending for pair in zip(h.cpu_block_ids, h.keys, strict=True)
                 ) + tuple(pair for t in state.transfers if not t.is_store
                           for pair in zip(t.cpu_block_ids, t.keys, strict=True))


def cpu_hit(cpu: PoolState, keys: Sequence[Hash]) -> tuple[BlockId, ...]:
    """The CPU blocks of the longest cached prefix of ``keys`` (``find_longest_cache_hit``).

    raises: P.BadHash
    """
    return P.get_cached_prefix(cpu, keys, GROUP, len(keys))


def _pending_of(state: SimpleOffloadState, req: Req) -> PendingHit | None:
    return next((h for h in state.pending if h.req == req), None)


def _without_pending(state: SimpleOffloadState, req: Req) -> tuple[PendingHit, ...]:
    return tuple(h for h in state.pending if h.req != req)


def _check_gpu_blocks(gpu: PoolState, block_ids: tuple[BlockId, ...]) -> None:
    if not block_ids:
        raise BadTransfer("nothing to move")
    if len(set(block_ids)) != len(block_ids):
        raise BadTransfer(f"a block is listed twice in {list(block_ids)}")
    for block in block_ids:
        if type(block) is not int or not 0 <= block < gpu.num_blocks:
            raise UnknownBlock(f"block {block!r} is not in the GPU pool of {gpu.num_blocks}")
        if block == NULL_BLOCK:
            raise BadTransfer("the null block holds no data to move")


def _guard(state: SimpleOffloadState) -> None:
    """Refuse a state a passthrough reached if it broke the protocol's holds or keys."""
    for pool, held, name in ((state.gpu, gpu_holds(state), "GPU"),
                             (state.cpu, cpu_holds(state), "CPU")):
        for block, n in held.items():
            if pool.ref[block] < n:
                raise HoldReleased(f"{name} block {block} is held {n} time(s) by the protocol")
    for block, block_hash in pinned_cpu_blocks(state):
        if key(block_hash) not in P.keys_of(state.cpu, block):
            raise HoldReleased(f"CPU block {block} is pinned for a hit: its key must stay")
    for t in state.transfers:
        written, written_ids = (state.cpu, t.cpu_block_ids) if t.is_store \
            else (state.gpu, t.gpu_block_ids)
        if any(P.keys_of(written, b) for b in written_ids):
            raise HoldReleased("a block a transfer is writing cannot be keyed")
        if t.is_store and any(key(h) not in P.keys_of(state.gpu, b)
                              for b, h in zip(t.gpu_block_ids, t.keys, strict=True)):
            raise HoldReleased("a store's GPU source must keep its key until the copy is done")


# --- Operations ----------------------------------------------------------------------------------


def new_simple_offload(gpu_blocks: int, cpu_blocks: int, profile: Profile = Profile.V0_33,
                       enable_events: bool = False) -> SimpleOffloadState:
    """Both pools empty, nothing pending, nothing in flight.

    raises: P.PoolError
    """
    return SimpleOffloadState(P.new_pool(gpu_blocks, True, enable_events, profile),
                              P.new_pool(cpu_blocks, True, enable_events, profile))


def lookup_cpu_hit(state: SimpleOffloadState, req: Req, keys: tuple[Hash, ...]
                   ) -> tuple[SimpleOffloadState, tuple[BlockId, ...]]:
    """Phase A (361-425): release the request's stale pin (369-370), find the hit, touch its
    blocks (416) and record it (417). An empty hit records nothing.

    raises: P.BadHash
    """
    for block_hash in keys:
        key(block_hash)
    cpu = state.cpu
    stale = _pending_of(state, req)
    if stale is not None:
        cpu = P.free_blocks(cpu, stale.cpu_block_ids)
    hit = cpu_hit(cpu, keys)
    pending = _without_pending(state, req)
    if hit:
        cpu = P.touch(cpu, hit)
        pending += (PendingHit(req, hit, keys[:len(hit)]),)
    return replace(state, cpu=cpu, pending=pending), hit


def start_load(state: SimpleOffloadState, req: Req, gpu_block_ids: tuple[BlockId, ...]
               ) -> SimpleOffloadState:
    """Phase B (427-538): the leading blocks of the pending hit touched again (525), the
    phase-A pin released (527), the GPU destinations touched (530-533).

    raises: SimpleOffloadError, P.PoolError
    """
    hit = _pending_of(state, req)
    if hit is None:
        raise NoPendingHit(f"request {req!r} has no pending CPU hit")
    if any(not t.is_store and t.req == req for t in state.transfers):
        raise LoadInFlight(f"request {req!r} already has a load in flight")
    _check_gpu_blocks(state.gpu, gpu_block_ids)
    n = len(gpu_block_ids)
    if n > len(hit.cpu_block_ids):
        raise BadTransfer(f"{n} destinations for a hit of {len(hit.cpu_block_ids)} blocks")
    busy = gpu_holds(state)
    for block in gpu_block_ids:
        if state.gpu.ref[block] < 1:
            raise DestinationNotFresh(f"GPU block {block} is free: allocate it before loading")
        if P.keys_of(state.gpu, block):
            raise DestinationNotFresh(f"GPU block {block} holds a key: a load writes new blocks")
        if busy[block]:
            raise BlockInTransfer(f"GPU block {block} is in a transfer in flight")
    taken = hit.cpu_block_ids[:n]
    cpu = P.touch(state.cpu, taken)
    cpu = P.free_blocks(cpu, hit.cpu_block_ids)
    gpu = P.touch(state.gpu, gpu_block_ids)
    load = Transfer(False, req, gpu_block_ids, taken, hit.keys[:n])
    return replace(state, gpu=gpu, cpu=cpu, pending=_without_pending(state, req),
                   transfers=state.transfers + (load,))


def start_store(state: SimpleOffloadState, req: Req, gpu_block_ids: tuple[BlockId, ...],
                keys: tuple[Hash, ...]) -> tuple[SimpleOffloadState, tuple[BlockId, ...]]:
    """A store (618-844): new CPU blocks (``get_new_blocks``: may evict unpinned cached CPU
    blocks), the GPU sources touched. Each source holds its hash; the hash is neither cached
    in the CPU pool nor being stored (657).

    raises: SimpleOffloadError, P.PoolError
    """
    _check_gpu_blocks(state.gpu, gpu_block_ids)
    if len(keys) != len(gpu_block_ids) or len(set(keys)) != len(keys):
        raise BadTransfer(f"blocks {list(gpu_block_ids)} and hashes {list(keys)} do not pair")
    storing = {h for t in state.transfers if t.is_store for h in t.keys}
    for block, block_hash in zip(gpu_block_ids, keys, strict=True):
        if key(block_hash) not in P.keys_of(state.gpu, block):
            raise SourceHoldsNoData(f"GPU block {block} does not hold {block_hash!r}")
        if block_hash in storing or P.get_cached_block(state.cpu, block_hash, (GROUP,)):
            raise AlreadyInCpu(f"{block_hash!r} is cached in the CPU pool or being stored")
    cpu, cpu_ids = P.get_new_blocks(state.cpu, len(gpu_block_ids))
    gpu = P.touch(state.gpu, gpu_block_ids)
    store = Transfer(True, req, gpu_block_ids, cpu_ids, keys)
    return replace(state, gpu=gpu, cpu=cpu, transfers=state.transfers + (store,)), cpu_ids


def finish_transfer(state: SimpleOffloadState, index: int, success: bool
                    ) -> SimpleOffloadState:
    """A load's end releases both holds (1381-1391; a failed load the same); a store's keys
    its CPU blocks on success (1117) and releases both holds (1194-1197, or 1199-1206).

    raises: SimpleOffloadError, P.PoolError
    """
    if type(index) is not int or not 0 <= index < len(state.transfers):
        raise UnknownTransfer(f"no transfer {index!r} in flight ({len(state.transfers)})")
    job = state.transfers[index]
    cpu = state.cpu
    if job.is_store and success:
        n = len(job.cpu_block_ids)
        cpu = P.cache_full_blocks(cpu, job.cpu_block_ids, job.keys, 0, n, GROUP, (), 1)
    cpu = P.free_blocks(cpu, job.cpu_block_ids)
    gpu = P.free_blocks(state.gpu, job.gpu_block_ids)
    return replace(state, gpu=gpu, cpu=cpu,
                   transfers=state.transfers[:index] + state.transfers[index + 1:])


def cancel_hit(state: SimpleOffloadState, req: Req) -> SimpleOffloadState:
    """Release a pending hit's pin (1225-1229, ``_free_pending_cpu_hit`` 1344-1353).

    raises: NoPendingHit, P.PoolError
    """
    hit = _pending_of(state, req)
    if hit is None:
        raise NoPendingHit(f"request {req!r} has no pending CPU hit")
    return replace(state, cpu=P.free_blocks(state.cpu, hit.cpu_block_ids),
                   pending=_without_pending(state, req))


def pool_step(state: SimpleOffloadState, on_gpu: bool, command: P.PoolCommand
              ) -> tuple[SimpleOffloadState, object]:
    """A passthrough pool call, stepped by `spec.pool.step` and guarded.

    raises: SimpleOffloadError, P.PoolError
    """
    if isinstance(command, P.NewPool):
        raise NotASimpleOffloadCommand("the pools are built by NewSimpleOffload")
    pool, output = P.step(state.gpu if on_gpu else state.cpu, command)
    after = replace(state, gpu=pool) if on_gpu else replace(state, cpu=pool)
    _guard(after)
    return after, output


def step(state: SimpleOffloadState | None, command: Command
         ) -> tuple[SimpleOffloadState, object]:
    """One command: the new state and its output. A refused command raises and changes
    nothing."""
    if isinstance(command, NewSimpleOffload):
        c = command
        return new_simple_offload(c.gpu_blocks, c.cpu_blocks, c.profile, c.enable_events), None
    if state is None:
        raise NotASimpleOffloadCommand(f"a program starts with NewSimpleOffload: {command!r}")
    if isinstance(command, LookupCpuHit):
        return lookup_cpu_hit(state, command.req, command.keys)
    if isinstance(command, StartLoad):
        return start_load(state, command.req, command.gpu_block_ids), None
    if isinstance(command, StartStore):
        return start_store(state, command.req, command.gpu_block_ids, command.keys)
    if isinstance(command, FinishTransfer):
        return finish_transfer(state, command.index, command.success), None
    if isinstance(command, CancelHit):
        return cancel_hit(state, command.req), None
    if isinstance(command, Gpu):
        return pool_step(state, True, command.command)
    if isinstance(command, Cpu):
        return pool_step(state, False, command.command)
    raise NotASimpleOffloadCommand(f"not a command of the model: {command!r}")


# --- Invariants ----------------------------------------------------------------------------------


def pinned_cpu_hits_stay_cached(state: SimpleOffloadState) -> bool:
    """Every CPU block of a pending hit or a load in flight is referenced (not free, so no
    allocation can evict it) and keeps the hit's key (vLLM #42289)."""
    return all(state.cpu.ref[b] >= 1 and b not in state.cpu.free
               and key(h) in P.keys_of(state.cpu, b) for b, h in pinned_cpu_blocks(state))


def transfer_gpu_blocks_not_reused(state: SimpleOffloadState) -> bool:
    """Every GPU block of a transfer in flight is referenced and not free."""
    return all(0 < b < state.gpu.num_blocks and state.gpu.ref[b] >= 1 and b not in state.gpu.free
               for t in state.transfers for b in t.gpu_block_ids)


def store_destinations_unkeyed_until_done(state: SimpleOffloadState) -> bool:
    """A CPU block a store is writing holds no key: no lookup hits half-written data."""
    return all(not P.keys_of(state.cpu, b)
               for t in state.transfers if t.is_store for b in t.cpu_block_ids)


def load_destinations_unkeyed_until_done(state: SimpleOffloadState) -> bool:
    """A GPU block a load is writing holds no key."""
    return all(not P.keys_of(state.gpu, b)
               for t in state.transfers if not t.is_store for b in t.gpu_block_ids)


def store_sources_keep_their_key(state: SimpleOffloadState) -> bool:
    """A GPU block a store reads still holds the hash the CPU block will be keyed with."""
    return all(key(h) in P.keys_of(state.gpu, b) for t in state.transfers if t.is_store
               for b, h in zip(t.gpu_block_ids, t.keys, strict=True))


def holds_are_accounted(state: SimpleOffloadState) -> bool:
    """Each block's ref count, in either pool, is at least the holds the protocol has on it."""
    return (all(state.gpu.ref[b] >= n for b, n in gpu_holds(state).items())
            and all(state.cpu.ref[b] >= n for b, n in cpu_holds(state).items()))


def gpu_pool_keeps_its_invariants(state: SimpleOffloadState) -> bool:
    """Every `spec.pool_invariants` predicate holds on the GPU pool."""
    return not pool_invariants.violated(state.gpu)


def cpu_pool_keeps_its_invariants(state: SimpleOffloadState) -> bool:
    """Every `spec.pool_invariants` predicate holds on the CPU pool."""
    return not pool_invariants.violated(state.cpu)


Invariant = Callable[[SimpleOffloadState], bool]

ALL: tuple[Invariant, ...] = (
    pinned_cpu_hits_stay_cached, transfer_gpu_blocks_not_reused,
    store_destinations_unkeyed_until_done, load_destinations_unkeyed_until_done,
    store_sources_keep_their_key, holds_are_accounted,
    gpu_pool_keeps_its_invariants, cpu_pool_keeps_its_invariants)


def violated(state: SimpleOffloadState) -> list[str]:
    """The names of the invariants that do not hold; a pool's own are named ``gpu.<name>``
    and ``cpu.<name>``."""
    names = [inv.__name__ for inv in ALL[:-2] if not inv(state)]
    names += [f"gpu.{name}" for name in pool_invariants.violated(state.gpu)]
    return names + [f"cpu.{name}" for name in pool_invariants.violated(state.cpu)]
