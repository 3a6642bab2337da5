"""The attention-type managers' pure arithmetic (vllm/v1/core/single_type_kv_cache_manager.py).

Every function here is total over its precondition and carries PEP 316 contracts that
``crosshair check --analysis_kind=PEP316`` verifies. ``spec.manager`` builds the manager model
on them; impl/single_type_kv_cache_manager.py has functions of the same names and signatures,
and ``crosshair diffbehavior`` checks that each pair agrees.

A *hit pattern* ``hits`` says, for each block index of a request's hash chain, whether that
block's hash is cached in every group of one attention type. The hit rules turn a pattern into
the blocks a prefix-cache hit uses:

* full attention (and sink full attention): the leading run of hits, left to right;
* sliding window: right to left, the last run of ``cdiv(window - 1, block_size)`` contiguous
  hits (earlier positions become null blocks), or else the leading run;
* chunked local: every block before the current chunk is a null block, then a left-to-right
  run of hits;
* Mamba: right to left, only the last hit (earlier positions are null blocks);
* cross-attention: never.

Every rule looks at no more than ``max_length // block_size`` blocks, and results are rounded
down to ``alignment_tokens`` (the least common multiple of the block sizes of a hybrid model).
"""

from __future__ import annotations

from collections.abc import Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling division.

    pre: b > 0
    post: (__return__ - 1) * b < a <= __return__ * b
    """
    return -(-a // b)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens.

    pre: num_tokens >= 0 and block_size > 0
    post: __return__ * block_size >= num_tokens
    post: __return__ == 0 or (__return__ - 1) * block_size < num_tokens
    """
    return cdiv(num_tokens, block_size)


def num_blocks_to_allocate(
    num_tokens: int,
    block_size: int,
    num_new_computed_blocks: int,
    num_held_blocks: int,
    num_evictable_computed_blocks: int,
) -> int:
    """New blocks one group needs so that it holds ``num_tokens`` tokens: the blocks beyond the
    ones it holds and the cache hits it is about to take, plus one for every hit that is
    currently free (taking it off the free queue costs a free block too). May be negative.

    pre: num_tokens >= 0 and block_size > 0
    pre: 0 <= num_evictable_computed_blocks <= num_new_computed_blocks
    pre: num_held_blocks >= 0
    post: __return__ + num_held_blocks <= blocks_needed(num_tokens, block_size)
    post: __return__ + num_held_blocks + num_new_computed_blocks >= cdiv(num_tokens, block_size)
    """
    return (
        blocks_needed(num_tokens, block_size)
        - num_new_computed_blocks
        - num_held_blocks
        + num_evictable_computed_blocks
    )


def sliding_window_skipped_tokens(num_computed_tokens: int, sliding_window: int) -> int:
    """Tokens no future token of a sliding-window layer attends to (may be <= 0: none).

    pre: num_computed_tokens >= 0 and sliding_window > 0
    post: __return__ <= num_computed_tokens
    post: __return__ == num_computed_tokens - sliding_window + 1
    """
    return num_computed_tokens - sliding_window + 1


def chunked_local_skipped_tokens(num_computed_tokens: int, attention_chunk_size: int) -> int:
    """Tokens of the chunks before the current one.

    pre: num_computed_tokens >= 0 and attention_chunk_size > 0
    post: 0 <= __return__ <= num_computed_tokens
    post: __return__ % attention_chunk_size == 0
    post: num_computed_tokens - __return__ < attention_chunk_size
    """
    return num_computed_tokens // attention_chunk_size * attention_chunk_size


def mamba_skipped_tokens(num_computed_tokens: int) -> int:
    """Every token but the last: a Mamba layer needs only the latest state.

    pre: num_computed_tokens >= 0
    post: __return__ == num_computed_tokens - 1
    """
    return num_computed_tokens - 1


def skipped_blocks(num_skipped_tokens: int, block_size: int) -> int:
    """Leading blocks made entirely of skipped tokens (0 when nothing is skipped).

    pre: block_size > 0
    post: __return__ >= 0
    post: __return__ * block_size <= max(num_skipped_tokens, 0)
    post: (__return__ + 1) * block_size > num_skipped_tokens
    """
    if num_skipped_tokens <= 0:
        return 0
    return num_skipped_tokens // block_size


def sliding_window_blocks_for_hit(sliding_window: int, block_size: int, use_eagle: bool) -> int:
    """Contiguous cached blocks a sliding-window hit must end with (one more with EAGLE).

    pre: sliding_window > 0 and block_size > 0
    post: __return__ >= 0
    post: (__return__ - int(use_eagle)) * block_size >= sliding_window - 1
    """
    return cdiv(sliding_window - 1, block_size) + int(use_eagle)


def _aligned(num_blocks: int, block_size: int, alignment_tokens: int) -> bool:
    return (num_blocks * block_size) % alignment_tokens == 0


def full_attention_hit_blocks(
    hits: Sequence[bool],
    max_length: int,
    block_size: int,
    alignment_tokens: int,
    use_eagle: bool,
) -> int:
    """Blocks of a full-attention hit: the leading run of hits within ``max_length`` tokens,
    one block fewer with EAGLE, rounded down to ``alignment_tokens``.

    pre: 0 <= max_length <= len(hits) * block_size
    pre: block_size > 0 and alignment_tokens > 0 and alignment_tokens % block_size == 0
    post: 0 <= __return__ * block_size <= max_length
    post: all(hits[:__return__])
    post: (__return__ * block_size) % alignment_tokens == 0
    """
    max_blocks = max_length // block_size
    num_blocks = 0
    while num_blocks < max_blocks and hits[num_blocks]:
        num_blocks += 1
    if use_eagle and num_blocks > 0:
        num_blocks -= 1
    while not _aligned(num_blocks, block_size, alignment_tokens):
        num_blocks -= 1
    return num_blocks


def sliding_window_hit(
    hits: Sequence[bool],
    max_length: int,
    block_size: int,
    sliding_window: int,
    alignment_tokens: int,
    use_eagle: bool,
) -> tuple[int, int]:
    """A sliding-window hit as ``(first, end)``: blocks ``[first, end)`` are cached hits and
    the ``first`` blocks before them are null blocks (outside the window).

    Scans right to left from ``max_length // block_size``; a run may only start (at its
    right end) on an aligned boundary; the first run of ``sliding_window_blocks_for_hit``
    hits wins. With no such run the leading run (from block 0) is the hit. EAGLE drops the
    last block.

    pre: 0 <= max_length <= len(hits) * block_size
    pre: block_size > 0 and sliding_window > 0
    pre: alignment_tokens > 0 and alignment_tokens % block_size == 0
    post: 0 <= __return__[0] <= __return__[1] <= max_length // block_size
    post: all(hits[__return__[0]:__return__[1]])
    """
    need = sliding_window_blocks_for_hit(sliding_window, block_size, use_eagle)
    max_blocks = max_length // block_size
    run = 0
    first, end = 0, -1
    for i in range(max_blocks - 1, -1, -1):
        if not hits[i]:
            run = 0
            continue
        if run == 0 and not _aligned(i + 1, block_size, alignment_tokens):
            continue
        run += 1
        if run >= need:
            first, end = i, i + run
            break
    if end < 0:
        first, end = 0, run
        while not _aligned(end, block_size, alignment_tokens):
            end -= 1
    if use_eagle and end > 0:
        end -= 1
    return min(first, end), end


def chunked_local_hit(
    hits: Sequence[bool],
    max_length: int,
    block_size: int,
    attention_chunk_size: int,
) -> tuple[int, int]:
    """A chunked-local hit as ``(first, end)``: the ``first`` blocks before the chunk that
    holds token ``max_length`` are null blocks, then blocks ``[first, end)`` are the run of
    hits from there.

    pre: 0 <= max_length <= len(hits) * block_size
    pre: block_size > 0 and attention_chunk_size > 0
    post: 0 <= __return__[0] <= __return__[1] <= max_length // block_size
    post: all(hits[__return__[0]:__return__[1]])
    post: __return__[0] * block_size <= max_length
    """
    max_blocks = max_length // block_size
    first = max_length // attention_chunk_size * attention_chunk_size // block_size
    end = first
    while end < max_blocks and hits[end]:
        end += 1
    return first, end


def mamba_hit_blocks(
    hits: Sequence[bool],
    max_length: int,
    block_size: int,
    alignment_tokens: int,
) -> int:
    """Blocks of a Mamba hit: the last aligned hit within ``max_length`` tokens and null
    blocks before it; 0 when there is none.

    pre: 0 <= max_length <= len(hits) * block_size
    pre: block_size > 0 and alignment_tokens > 0 and alignment_tokens % block_size == 0
    post: 0 <= __return__ * block_size <= max_length
    post: __return__ == 0 or hits[__return__ - 1]
    post: (__return__ * block_size) % alignment_tokens == 0
    """
    for i in range(max_length // block_size - 1, -1, -1):
        if hits[i] and _aligned(i + 1, block_size, alignment_tokens):
            return i + 1
    return 0
