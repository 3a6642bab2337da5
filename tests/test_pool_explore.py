"""Exhaustive small scope: every reachable spec state of tiny pools, replayed against impl/."""

from __future__ import annotations

import pytest

from kvspec.conformance.explore import explore, maximal_traces, replay
from kvspec.conformance.profiles import profile_name
from kvspec.conformance.targets import VllmApiPool
from kvspec.spec import pool as model
from kvspec.spec.pool import Profile

# (blocks, depth): pools of 2-4 blocks are explored to closure; 5 blocks to a bounded depth.
SCOPES = {
    "dev": [(2, 12), (3, 12), (4, 12), (5, 4)],
    "ci": [(2, 12), (3, 12), (4, 12), (5, 6)],
    "nightly": [(2, 12), (3, 12), (4, 12), (5, 9)],
}[profile_name() if profile_name() in ("dev", "ci", "nightly") else "dev"]


@pytest.mark.parametrize("profile", [Profile.V0_13, Profile.V0_33], ids=lambda p: p.value)
@pytest.mark.parametrize(("num_blocks", "max_depth"), SCOPES)
def test_every_reachable_state_keeps_invariants_and_impl_agrees(
    num_blocks: int, max_depth: int, profile: Profile, capsys: pytest.CaptureFixture[str],
    record_property: object,
) -> None:
    found = explore(num_blocks, num_keys=2, max_depth=max_depth, profile=profile)
    traces = maximal_traces(found.traces)
    if profile is Profile.V0_13:  # impl/ follows vLLM 0.13
        for trace in traces:
            replay(trace, VllmApiPool(), num_blocks, profile=profile)
    with capsys.disabled():
        print(f"\n  explored {found.states} states ({found.transitions} transitions, depth "
              f"{found.depth_reached}) of a {num_blocks}-block pool, 2 keys, {profile.value}; "
              f"replayed {len(traces) if profile is Profile.V0_13 else 0} maximal traces on impl/")
    assert found.states > num_blocks


def test_step_refuses_an_unknown_command() -> None:
    """A command that is none of the pool's is refused by name, not read as GetUsage."""

    class NotAPoolCommand:
        def __repr__(self) -> str:
            return "NotAPoolCommand()"

    state = model.new_pool(4, True, False, Profile.V0_13)
    with pytest.raises(model.UnknownCommand, match=r"NotAPoolCommand\(\)"):
        model.step(state, NotAPoolCommand())  # type: ignore[arg-type]
    assert model.step(state, model.GetUsage()) == (state, model.usage(state))
