"""Every short program of offload calls keeps every rule: a contract for CrossHair.

`check_program` decodes a list of integer pairs into `spec.offload` commands (two requests,
keys 0..3, key tuples up to length 2 and the chain ``(0, 1, 2)``) and runs them through
`spec.offload.step` from an empty tier, refused calls included. It returns the rules the run
broke: an invariant of `spec.offload.ALL` after an accepted step, a refused step that changed
its state (or raised something other than an `OffloadError`), a ``PrepareStore`` breaking
`spec.offload.store_violations`. CrossHair explores the programs symbolically, for both
policies and both profiles; its postcondition is that nothing was broken.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import permutations

from kvspec.spec import offload as model
from kvspec.spec.offload import OffloadError, OffloadState
from kvspec.spec.pool import Profile

REQUESTS = ("a", "b")
KEY_TUPLES: tuple[tuple[int, ...], ...] = (
    ((), *((k,) for k in range(4)), *permutations(range(4), 2), (0, 0), (0, 1, 2)))
KINDS = 10


def decode(state: OffloadState, opcode: int, argument: int) -> model.Command:
    """The `spec.offload` command an integer pair stands for: opcode (mod 10) picks the kind,
    argument the request (its lowest bit) and the key tuple (the rest)."""
    req = REQUESTS[argument % 2]
    keys = KEY_TUPLES[(argument // 2) % len(KEY_TUPLES)]
    kind = opcode % KINDS
    if kind == 0:
        return model.Lookup(keys)
    if kind == 1:
        return model.PrepareLoad(req, keys)
    if kind == 2:
        return model.Touch(req, keys)
    if kind == 3:
        return model.CompleteLoad(req, keys)
    if kind == 4:
        return model.PrepareStore(req, keys)
    if kind == 5:  # a success, or (odd argument) a late success from before the last reset
        late = argument % 2 == 1 and state.generation > 0
        return model.CompleteStore(req, keys, True, state.generation - 1 if late else None)
    if kind == 6:
        return model.CompleteStore(req, keys, False)
    if kind == 7:
        return model.RequestFinished(req)
    if kind == 8:
        return model.Reset()
    return model.TakeEvents()


def broken_by(state: OffloadState, command: model.Command) -> tuple[OffloadState, list[str]]:
    """One step: the state after it (the same state when refused) and the rules it broke."""
    before = replace(state)
    try:
        after, output = model.step(state, command)
    except OffloadError:
        unchanged = state == before and state.ref == dict(state.refs)
        return state, [] if unchanged else ["refusal_changes_nothing"]
    broken = model.violated(after)
    if isinstance(command, model.PrepareStore):
        stored = output if output is None or isinstance(output, tuple) else ()
        broken += model.store_violations(state, command, stored, after)
    return after, broken


def check_program(capacity: int, arc: bool, v0_33: bool,
                  program: list[tuple[int, int]]) -> list[str]:
    """Run program from an empty tier; the rules broken, each with its step's number.

    pre: 1 <= capacity <= 3
    pre: len(program) <= 6
    pre: all(0 <= op < 10 and 0 <= arg < 64 for op, arg in program)
    post: __return__ == []
    """
    profile = Profile.V0_33 if v0_33 else Profile.V0_13
    state = model.new_offload(capacity, "arc" if arc else "lru", profile)
    broken: list[str] = []
    for number, (opcode, argument) in enumerate(program, 1):
        state, rules = broken_by(state, decode(state, opcode, argument))
        broken += [f"step {number}: {rule}" for rule in rules]
    return broken
