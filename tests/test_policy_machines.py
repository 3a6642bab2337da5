"""Every eviction policy's impl/ plug-in, checked by the pool and manager machines against
spec.eviction.

``lru`` is impl's default pool (tests/test_pool_machine.py); the other three are plug-ins
(impl/eviction.py) the machine builds the pool with, against the spec with the same policy.
"""

from __future__ import annotations

from kvspec.conformance.manager_machine import (
    ImplManager,
    ManagerMachine,
    machine_for as manager_machine_for,
)
from kvspec.conformance.pool_machine import PoolMachine, machine_for
from kvspec.conformance.targets import IMPL_POLICIES, VllmApiPool
from kvspec.spec.eviction import policy_named

# Half the pool may be pinned in the machines (the default is a quarter), so that pins, the cap
# and a pool of pinned blocks all happen in pools of 2 to 8 blocks.
PIN_SHARE = 0.5


def _machine(name: str) -> type[PoolMachine]:
    return machine_for(lambda: VllmApiPool(policy_path=IMPL_POLICIES[name]),
                       policy=policy_named(name, PIN_SHARE))


TestLruLifoUnhashedConforms = _machine("lru-lifo-unhashed").TestCase
TestPriorityConforms = _machine("priority").TestCase
TestPinnedConforms = _machine("pinned").TestCase


def _manager_machine(name: str) -> type[ManagerMachine]:
    return manager_machine_for(lambda: ImplManager(policy_path=IMPL_POLICIES[name]),
                               policy=policy_named(name, PIN_SHARE))


TestManagerLruLifoUnhashedConforms = _manager_machine("lru-lifo-unhashed").TestCase
TestManagerPriorityConforms = _manager_machine("priority").TestCase
TestManagerPinnedConforms = _manager_machine("pinned").TestCase
