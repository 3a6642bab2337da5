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
from kvspec.conformance.vllm_targets import IMPL_POOL, Vllm033Pool
from kvspec.spec.eviction import policy_named
from kvspec.spec.pool import Profile

# Half the pool may be pinned in the machines (the default is a quarter), so that pins, the cap
# and a pool of pinned blocks all happen in pools of 2 to 8 blocks.
PIN_SHARE = 0.5


def _machine(name: str) -> type[PoolMachine]:
    return machine_for(lambda: VllmApiPool(policy_path=IMPL_POLICIES[name]),
                       policy=policy_named(name, PIN_SHARE))


TestLruLifoUnhashedConforms = _machine("lru-lifo-unhashed").TestCase
TestPriorityConforms = _machine("priority").TestCase
TestPinnedConforms = _machine("pinned").TestCase


def _machine_033(name: str) -> type[PoolMachine]:
    """The policy in impl's pool built for vLLM 0.33's API, against the vllm-0.33 spec (a
    request's retention hints reach the policy through 0.33's cache_full_blocks too)."""
    return machine_for(lambda: Vllm033Pool(IMPL_POOL, policy_path=IMPL_POLICIES[name],
                                           pool_arguments={"vllm_api": "0.33"}),
                       Profile.V0_33, policy_named(name, PIN_SHARE))


TestPriorityConforms033 = _machine_033("priority").TestCase
TestPinnedConforms033 = _machine_033("pinned").TestCase


def _manager_machine(name: str) -> type[ManagerMachine]:
    return manager_machine_for(lambda: ImplManager(policy_path=IMPL_POLICIES[name]),
                               policy=policy_named(name, PIN_SHARE))


TestManagerLruLifoUnhashedConforms = _manager_machine("lru-lifo-unhashed").TestCase
TestManagerPriorityConforms = _manager_machine("priority").TestCase
TestManagerPinnedConforms = _manager_machine("pinned").TestCase
