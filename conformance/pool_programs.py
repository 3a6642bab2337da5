"""Every short program of pool operations keeps every invariant: a contract for CrossHair.

`run_program` decodes a list of integer pairs into `spec.pool` commands (the vocabulary the
machines, the explorer and the audit share) and runs them through `spec.pool.step` from a
fresh pool, refused calls included (a refusal leaves the state as it was). CrossHair
explores the programs symbolically; its postcondition is that every invariant of
`spec.pool_invariants` holds at the end, for both profiles.
"""

from __future__ import annotations

import contextlib

from kvspec.spec import (
    pool as model,
    pool_invariants,  # noqa: F401  (named by the contract below)
)
from kvspec.spec.pool import PoolError, PoolState, Profile

_KEYS = (b"kvspec-key-0", b"kvspec-key-1")


def decode(state: PoolState, opcode: int, argument: int) -> model.PoolCommand:
    """The `spec.pool` command an integer pair stands for: opcode (mod 7) picks the kind,
    argument the block or count."""
    block = argument % state.num_blocks
    kind = opcode % 7
    if kind == 0:
        return model.GetNewBlocks(argument % 3)
    if kind == 1:
        return model.FreeBlocks((block,))
    if kind == 2:
        return model.Touch((block,))
    if kind == 3:
        key = _KEYS[(argument // state.num_blocks) % 2]
        return model.CacheFullBlocks((block,), (key,), 0, 1, 0, (argument,), 1)
    if kind == 4:
        return model.EvictBlocks((block,))
    if kind == 5:
        return model.ResetPrefixCache()
    return model.TakeEvents()


def run_program(num_blocks: int, v0_33: bool, program: list[tuple[int, int]]) -> PoolState:
    """Run program from a fresh pool (caching and events on) and return the final state.

    pre: 1 <= num_blocks <= 4
    pre: len(program) <= 6
    pre: all(0 <= op < 7 and 0 <= arg < 64 for op, arg in program)
    post: pool_invariants.violated(__return__) == []
    """
    profile = Profile.V0_33 if v0_33 else Profile.V0_13
    state = model.new_pool(num_blocks, True, True, profile)
    for opcode, argument in program:
        with contextlib.suppress(PoolError):  # a refused call changes nothing
            state = model.step(state, decode(state, opcode, argument))[0]
    return state
