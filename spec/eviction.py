"""Eviction policies: which free block the pool reuses next, as a parameter of the pool model.

A policy is not a copy of the pool: `spec.pool` keeps one free order (`PoolState.free`, the
blocks with ref count 0 in the order they became free, so every invariant of
`spec.pool_invariants` still applies) and asks its policy two small pure questions:

- **where does a freed block go?** `place_freed`: at the tail (LRU), or, for the blocks
  that hold nothing cached, at the head (``lru-lifo-unhashed``, vLLM 0.33);
- **which free block goes next?** `eviction_order`: the free order itself, or, for
  ``priority``, the free order sorted by retention priority (stable: LRU within a priority).

The policies:

- ``lru`` (vLLM 0.13): freed blocks join the tail; the head goes first.
- ``lru-lifo-unhashed`` (vLLM 0.33): a block freed without a key (or with caching off) is
  reused first: such blocks join the head, in the order given.
- ``priority`` (TensorRT-LLM's prioritised LRU): a cached block carries a retention priority
  in [0, 100] (default 35) and, optionally, an expiry time. The lowest priority goes first,
  LRU within a priority; a free block with no key holds nothing worth keeping and goes before
  any cached one (`UNCACHED_PRIORITY`). Priorities come from the request, per token range
  (`TokenRangeRetention`), when its blocks are cached. Time is an explicit input
  (`spec.pool.advance_clock`): when it reaches a priority's expiry the priority reverts to
  the default, so the state never holds an expired priority.
- ``pinned``: LRU, and a cached block may be pinned: the pin holds a reference of its own,
  so the block is never free and never evicted while pinned. At most ``max_pinned_share`` of
  the pool's blocks may be pinned (`pin_cap`); a pin beyond the cap is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

BlockId = int

MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority
UNCACHED_PRIORITY = -1  # a free block without a key: below every retention priority


class PolicyName(Enum):
    LRU = "lru"
    LRU_LIFO_UNHASHED = "lru-lifo-unhashed"
    PRIORITY = "priority"
    PINNED = "pinned"


@dataclass(frozen=True)
class Policy:
    """A pool's eviction policy. ``max_pinned_share`` is read by ``pinned`` only."""

    name: PolicyName = PolicyName.LRU
    max_pinned_share: float = 0.25

    @property
    def has_priorities(self) -> bool:
        return self.name is PolicyName.PRIORITY

    @property
    def has_pins(self) -> bool:
        return self.name is PolicyName.PINNED


@dataclass(frozen=True)
class TokenRangeRetention:
    """A request's hint: tokens [start, end) (end None: to the end) are worth ``priority``,
    for ``duration`` time units after they are cached (None: until evicted)."""

    start: int
    end: int | None
    priority: int
    duration: int | None = None


# A block's retention, as the pool keeps it: (block, priority, expires_at or None), only for
# cached blocks whose priority is not the default; sorted by block id.
Retention = tuple[tuple[BlockId, int, int | None], ...]


def policy_named(name: str, max_pinned_share: float = 0.25) -> Policy:
    """The policy called ``name`` (``lru``, ``lru-lifo-unhashed``, ``priority``, ``pinned``).

    raises: ValueError
    post: __return__.name.value == name
    """
    try:
        return Policy(PolicyName(name), max_pinned_share)
    except ValueError:
        known = ", ".join(p.value for p in PolicyName)
        raise ValueError(f"no eviction policy {name!r}: the policies are {known}") from None


def place_freed(policy: Policy, free: tuple[BlockId, ...], zeroed: tuple[BlockId, ...],
                unkeyed: frozenset[BlockId]) -> tuple[BlockId, ...]:
    """The free order after ``zeroed`` (in the order they reached ref 0) became free.

    pre: not set(free) & set(zeroed)
    post: sorted(__return__) == sorted(free + zeroed)
    post: tuple(b for b in __return__ if b in free) == free
    post: policy.name is PolicyName.LRU_LIFO_UNHASHED or __return__ == free + zeroed
    """
    if policy.name is PolicyName.LRU_LIFO_UNHASHED:
        to_head = tuple(b for b in zeroed if b in unkeyed)
        return to_head + free + tuple(b for b in zeroed if b not in unkeyed)
    return free + zeroed


def effective_priority(retention: Retention, cached: bool, block: BlockId) -> int:
    """What a free block is worth keeping under ``priority``: nothing without a key, else
    its retention priority (the default when none is set).

    pre: all(MIN_PRIORITY <= priority <= MAX_PRIORITY for _, priority, _ in retention)
    post: (__return__ == UNCACHED_PRIORITY) == (not cached)
    """
    if not cached:
        return UNCACHED_PRIORITY
    for b, priority, _ in retention:
        if b == block:
            return priority
    return DEFAULT_PRIORITY


def eviction_order(policy: Policy, free: tuple[BlockId, ...], keyed: frozenset[BlockId],
                   retention: Retention) -> tuple[BlockId, ...]:
    """The free blocks in the order get_new_blocks takes them: the free order, or under
    ``priority`` the free order stably sorted by effective priority (LRU within one).

    pre: all(MIN_PRIORITY <= priority <= MAX_PRIORITY for _, priority, _ in retention)
    post: sorted(__return__) == sorted(free)
    post: policy.has_priorities or __return__ == free
    """
    if not policy.has_priorities:
        return free
    return tuple(sorted(free, key=lambda b: effective_priority(retention, b in keyed, b)))


def block_retention(ranges: Sequence[TokenRangeRetention], index: int,
                    size: int) -> TokenRangeRetention | None:
    """The hint that sets a cached block's priority: of the ranges that overlap the block's
    tokens [index * size, (index + 1) * size), the one with the highest priority (the first
    listed among equals); None when none overlaps.

    pre: index >= 0 and size >= 1
    post: __return__ is None or __return__ in ranges
    post: not __return__ or all(h.priority <= __return__.priority for h in _over(ranges,index,size))
    """
    best: TokenRangeRetention | None = None
    for hint in _over(ranges, index, size):
        if best is None or hint.priority > best.priority:
            best = hint
    return best


def _over(ranges: Sequence[TokenRangeRetention], block_index: int,
          block_size: int) -> list[TokenRangeRetention]:
    """The hints whose token range overlaps block ``block_index``'s tokens."""
    first, end = block_index * block_size, (block_index + 1) * block_size
    return [h for h in ranges if h.start < end and (h.end is None or h.end > first)]


def check_hint(hint: TokenRangeRetention) -> None:
    """Refuse a hint that cannot be honoured (a ValueError naming it).

    raises: ValueError
    """
    if type(hint.priority) is not int or not MIN_PRIORITY <= hint.priority <= MAX_PRIORITY:
        raise ValueError(f"retention priority must be an int in [{MIN_PRIORITY}, "
                         f"{MAX_PRIORITY}], got {hint.priority!r}")
    if hint.duration is not None and (type(hint.duration) is not int or hint.duration < 1):
        raise ValueError(f"retention duration must be None or an int >= 1, got "
                         f"{hint.duration!r}")
    if type(hint.start) is not int or hint.start < 0 or (
            hint.end is not None and (type(hint.end) is not int or hint.end < hint.start)):
        raise ValueError(f"retention token range [{hint.start!r}, {hint.end!r}) is not a "
                         f"range of token positions")


def expire(retention: Retention, now: int) -> Retention:
    """The retention entries still live at time ``now``: an expired priority reverts to the
    default, which the pool does not store.

    post: all(expires is None or expires > now for _, _, expires in __return__)
    post: set(__return__) <= set(retention)
    """
    return tuple(entry for entry in retention if entry[2] is None or entry[2] > now)


def pin_cap(policy: Policy, num_blocks: int) -> int:
    """How many blocks may be pinned at once: ``max_pinned_share`` of the non-null blocks,
    rounded down; none under a policy without pins.

    pre: 1 <= num_blocks <= 2 ** 20
    pre: 0.0 <= policy.max_pinned_share <= 1.0
    post: 0 <= __return__ <= num_blocks - 1
    """
    if not policy.has_pins:
        return 0
    return int(policy.max_pinned_share * (num_blocks - 1))
