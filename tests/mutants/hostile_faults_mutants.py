"""Fault mutants: bugs that make the target stop returning. The conformance machines must
report them as a discrepancy with a program (the step deadline, conformance/deadline.py),
not hang until the suite times out.
"""

from __future__ import annotations

from typing import Any

from kvspec.impl import block_pool as bp
from tests.mutants import Mutant, replace
from tests.planted_bug_pool import take_until_none_missing

POOL_MACHINE = "tests/test_pool_machine.py"


def negative_count_spins_the_free_queue() -> None:
    """get_new_blocks checks only that the count fits (vLLM 0.13's check), so a negative count
    reaches the free queue's stale-entry loop, which never finds the negative number of blocks
    it is missing and spins."""
    original = bp.BlockPool.get_new_blocks

    def get_new_blocks(self: bp.BlockPool, num_blocks: Any) -> Any:
        if type(num_blocks) is int and num_blocks < 0:
            return take_until_none_missing(self.free_block_queue, num_blocks)
        return original(self, num_blocks)
    replace(bp.BlockPool, "get_new_blocks", get_new_blocks)


MUTANTS: list[Mutant] = [
    Mutant("faults_negative_count_spins_the_free_queue",
           " ".join((negative_count_spins_the_free_queue.__doc__ or "").split()),
           negative_count_spins_the_free_queue, (POOL_MACHINE,), "did not return"),
]
