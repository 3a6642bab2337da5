"""Exhaustive small scope: every reachable state of tiny offload tiers keeps every rule.

`conformance.offload_explore` runs every command of its alphabet (two requests, keys 0..3,
key tuples up to length 2 and ``(0, 1, 2)``, refused calls included) on every state reached,
checking the invariants, that a refusal changes nothing and the store rules. Tiers of 1 and 2
keys under 0.13 are explored to closure; the rest to a depth bound (0.33's per-request records
make the space grow fast: docs/audit.md).
"""

from __future__ import annotations

import pytest

from kvspec.conformance.offload_explore import check_step, explore
from kvspec.spec import offload as model
from kvspec.spec.pool import Profile

ALL_KEYS = (0, 1, 2, 3)

# (capacity, policy, profile, depth, keys, closed): the small 0.13 scopes and 0.33 over one
# key are explored to closure (every reachable state); 0.33's per-request records make its
# space far larger beyond that (a 1-key LRU tier over keys 0 and 1 closes at 47,848 states in
# about 2 minutes: docs/audit.md), so the larger scopes are explored to a depth bound.
SCOPES = [
    (1, "lru", Profile.V0_13, 64, ALL_KEYS, True),
    (1, "arc", Profile.V0_13, 64, (0, 1, 2), True),
    (2, "lru", Profile.V0_13, 64, (0, 1), True),
    (2, "arc", Profile.V0_13, 64, (0, 1), True),
    *((3, p, Profile.V0_13, 4, ALL_KEYS, False) for p in model.POLICIES),
    *((1, p, Profile.V0_33, 64, (0,), True) for p in model.POLICIES),
    *((c, p, Profile.V0_33, 3 if c < 3 else 2, ALL_KEYS, False)
      for c in (1, 2, 3) for p in model.POLICIES),
]


@pytest.mark.parametrize(("capacity", "policy", "profile", "max_depth", "keys", "closes"),
                         SCOPES, ids=lambda v: v.value if isinstance(v, Profile) else str(v))
def test_every_reachable_offload_state_keeps_the_rules(
    capacity: int, profile: Profile, max_depth: int, policy: str, keys: tuple[int, ...],
    closes: bool, capsys: pytest.CaptureFixture[str],
) -> None:
    found = explore(capacity, policy, profile, max_depth, keys=keys)
    with capsys.disabled():
        print(f"\n  explored {found.states} offload states ({found.transitions} transitions, "
              f"{found.refused} refused, depth {found.depth_reached}"
              f"{', closed' if found.closed else ''}) of a {capacity}-key {policy} tier over "
              f"keys {keys}, {profile.value}")
    assert found.states > capacity
    assert found.closed or not closes


def test_the_checks_catch_a_broken_store() -> None:
    """A store that evicts a key it is offered (vLLM #35846) is reported by name."""
    state = model.new_offload(1, "lru", Profile.V0_13)
    for command in (model.PrepareStore("a", (0,)), model.CompleteStore("a", (0,))):
        state = model.step(state, command)[0]
    command = model.PrepareStore("a", (0, 1))
    assert check_step(state, command)[1] == []  # the spec refuses to evict 0: no room
    assert model.step(state, command)[1] is None
    broken = model.store_violations(state, command, ((1,), (0,)), state)
    assert "store_keeps_offered_keys" in broken
