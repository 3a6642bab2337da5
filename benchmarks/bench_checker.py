"""How fast the conformance machine checks: steps per second on a 16-block pool.

A step is one command (`conformance/lockstep.py`) run on the spec and on impl/ in lock
step, outputs compared; after every rule the abstract states are compared and every named
invariant is checked.
"""

from __future__ import annotations

import logging
import time

from hypothesis import HealthCheck, settings
from hypothesis.stateful import initialize, run_state_machine_as_test

from kvspec.conformance.pool_machine import PoolMachine
from kvspec.conformance.targets import VllmApiPool


def steps_per_second(examples: int = 40, steps: int = 100) -> float:
    logging.getLogger("kvspec.impl.block_pool").setLevel(logging.ERROR)
    counted = {"steps": 0}

    class Counting(PoolMachine):
        make_adapter = staticmethod(VllmApiPool)

        def teardown(self) -> None:
            counted["steps"] += len(self.lockstep.performed)  # commands run on both
            super().teardown()

        @initialize()
        def build_16_blocks(self) -> None:
            # No bound on pending events, a consumer that takes them: the figure compares
            # with runs from before the bound existed.
            super().build(16, True, True, event_bound=None, consumer_stalls=False)

    start = time.perf_counter()
    # derandomize: the same programs every run, so that runs compare (random programs moved
    # the figure by a third from run to run).
    run_state_machine_as_test(Counting, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
        derandomize=True, suppress_health_check=list(HealthCheck)))
    return counted["steps"] / (time.perf_counter() - start)


if __name__ == "__main__":
    print(f"{steps_per_second():,.0f} steps/s")
