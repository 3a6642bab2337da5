"""vLLM 0.33's real free queue, map and pool, driven through 0.33's new operations.

Under the vllm-0.33 profile the machines add 0.33's operations (`pool_machine.PoolMachine033`:
partial entries and their promotion, move_block_hashes, unpin_blocks with reuse watchers,
is_block_writable, emit_cached_block_events, frees forwarded to a foreign owner;
``prepend_n`` on the free queue, ``contain`` on the map). Here they run against vLLM 0.33's
own classes, within vLLM's caller contract: the bad calls and the situations already filed
in docs/findings.md (V-numbers) are left out, so any failure is a new discrepancy.

Run from the project's main environment, the test runs itself again under
.venv-vllm-0.33.0's Python (the environment passed on, so a planted mutant goes with it);
it is skipped where that environment has not been built (`make vllm-env VLLM=0.33.0`).
"""

from __future__ import annotations

from tests.vllm_033 import rerun_under_vllm_033, running_vllm_033

if running_vllm_033():
    from kvspec.conformance import free_queue_machine, hash_map_machine, pool_machine
    from kvspec.conformance.vllm_targets import pool_target
    from kvspec.spec.pool import Profile

    # The free queue and the map first: a bug in one shows there before the pool, which
    # uses both, shows it.
    TestVllm033FreeQueue = free_queue_machine.machine_for(
        free_queue_machine.adapter_for("vllm"), free_queue_machine.OUT_OF_CONTRACT,
        Profile.V0_33).TestCase

    TestVllm033HashMap = hash_map_machine.machine_for(
        hash_map_machine.adapter_for("vllm"), hash_map_machine.OUT_OF_CONTRACT,
        Profile.V0_33).TestCase

    # Filed in docs/findings.md: the bad calls vLLM does not refuse (B3-B5, B7, D5),
    # caching off keying blocks (D4), and a second watcher on a block replacing the first
    # (B11).
    POOL_KNOWN = pool_machine.OUT_OF_CONTRACT | {pool_machine.WATCHED_TWICE}

    _Pool = pool_machine.machine_for(pool_target("vllm").make, Profile.V0_33)
    _Pool.excluded = frozenset(POOL_KNOWN)
    TestVllm033Pool = _Pool.TestCase

else:

    def test_vllm_033_machines_under_its_python() -> None:
        """The classes above, run by .venv-vllm-0.33.0's Python."""
        rerun_under_vllm_033(__file__)
