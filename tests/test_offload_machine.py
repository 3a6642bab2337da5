"""The offload machine (conformance/offload_machine.py) against impl's offloading managers, and
the findings it makes on vLLM's, each as the short program that shows it.

impl's LRU and ARC managers (vLLM 0.13's API) must conform to `spec.offload` under the
vllm-0.13 profile, bad calls included. vLLM's own managers are driven where this Python
imports vLLM (run this file with .venv-vllm-0.13.0's or .venv-vllm-0.33.0's Python): within
vLLM's caller contract, with the findings of docs/findings.md left out, they conform; and
each finding is reproduced by its program (`FINDINGS_013`, `FINDINGS_033`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest

from kvspec.conformance import offload_machine
from kvspec.conformance.lockstep import Discrepancy, Lockstep
from kvspec.spec import offload as model
from kvspec.spec.offload import (
    CompleteLoad,
    CompleteStore,
    NewOffload,
    PrepareLoad,
    PrepareStore,
    RequestFinished,
    Reset,
    TakeEvents,
    Touch,
)
from kvspec.spec.pool import Profile

TestImplOffloadConforms = offload_machine.machine_for(
    offload_machine.adapter_for("impl")).TestCase
TestImplOffloadConforms033 = offload_machine.machine_for(
    offload_machine.adapter_for("impl", Profile.V0_33), Profile.V0_33).TestCase


def _vllm_release() -> Profile | None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm
    except ImportError:
        return None
    version = str(getattr(vllm, "__version__", ""))
    return {"0.13": Profile.V0_13, "0.33": Profile.V0_33}.get(version[:4])


RELEASE = _vllm_release()
needs_013 = pytest.mark.skipif(RELEASE is not Profile.V0_13, reason="needs vLLM 0.13")
needs_033 = pytest.mark.skipif(RELEASE is not Profile.V0_33, reason="needs vLLM 0.33")

# The findings' situations and bad calls (docs/findings.md, "Offload tier"), left out of the
# machine runs below so that they look for anything else.
KNOWN_013 = frozenset({"store_offers_held_keys", "touch_of_a_pending_key",
                       "store_evicts_past_busy_keys", "store_larger_than_room"})
KNOWN_033 = frozenset({"reset_drops_ready_keys"})

if RELEASE is not None:
    _known = KNOWN_013 if RELEASE is Profile.V0_13 else KNOWN_033
    TestVllmOffloadWithinContract = offload_machine.machine_for(
        offload_machine.adapter_for("vllm", RELEASE), RELEASE,
        excluded=frozenset(offload_machine.OUT_OF_CONTRACT) | _known).TestCase


def test_vllm_033_offload_within_contract() -> None:
    """vLLM 0.33's CPUOffloadingManager within the connector's contract, from any
    environment: run again under .venv-vllm-0.33.0 (where this Python is not vLLM 0.33), so
    that a mutant planted into vLLM 0.33 (tests/mutants/) is checked from the catalogue."""
    if RELEASE is Profile.V0_33:
        return  # TestVllmOffloadWithinContract runs here
    if RELEASE is not None:
        pytest.skip("under another vLLM: CI runs this file under .venv-vllm-0.33.0 as well")
    from tests.vllm_033 import rerun_under_vllm_033

    rerun_under_vllm_033(__file__, "-k", "TestVllmOffloadWithinContract")


def _run(program: Sequence[model.Command], target: str = "vllm"
         ) -> Discrepancy | AssertionError | None:
    """Run a program in lock step on the spec and a target, as the machine checks each step
    (outputs, refusals, the store rules, the view, the invariants); the first disagreement."""
    first = program[0]
    assert isinstance(first, NewOffload)
    profile = first.profile
    adapter = offload_machine.adapter_for(target, profile)()
    before: list[model.OffloadState | None] = [None]

    def judge(command: object, output: object) -> None:
        if isinstance(command, PrepareStore) and before[0] is not None:
            after = model.from_view(before[0], adapter.view())
            broken = model.store_violations(before[0], command, output, after)  # type: ignore[arg-type]
            if broken:
                raise Discrepancy(f"rule {broken[0]} violated by the target: {output!r}")

    lockstep: Lockstep[model.OffloadState] = Lockstep(model.step, adapter, judge=judge)
    try:
        for command in program:
            before[0] = lockstep.state
            lockstep(command)
            state = lockstep.state
            assert state is not None
            view = adapter.view()
            # The named invariants first, as the machine runs them (by name, before the
            # whole-view comparison).
            broken_invariants = model.violated(model.from_view(state, view))
            if broken_invariants:
                raise AssertionError(f"invariant {broken_invariants[0]} violated by the "
                                     f"target after {command}")
            if view != model.view_of(state):
                raise AssertionError(f"view differs after {command}: target {view}, spec "
                                     f"{model.view_of(state)}")
    except AssertionError as error:  # a Discrepancy is one
        return error
    return None


def _013(policy: str) -> NewOffload:
    return NewOffload(2, policy, Profile.V0_13)


def _033(policy: str) -> NewOffload:
    return NewOffload(2, policy, Profile.V0_33)


def _stored(*keys: int) -> list[model.Command]:
    return [PrepareStore("r", keys), CompleteStore("r", keys)]


# Each finding: (name, program, what the first disagreement says). docs/findings.md, "Offload
# tier", writes each up.
FINDINGS_013: list[tuple[str, list[model.Command], str]] = [
    # O1: ARC's touch of a key whose store is pending pops it from T1, then fails.
    ("O1 arc touch of a pending key", [_013("arc"), PrepareStore("r", (0,)), Touch("r", (0,))],
     "target refused with KeyError"),
    # O2 (#35846): a store evicts a key it offers itself (already held, ready, unpinned).
    ("O2 lru store evicts an offered key", [_013("lru"), *_stored(0), PrepareStore("r", (0, 1, 2))],
     "target"),
    ("O2 arc store evicts an offered key", [_013("arc"), *_stored(0), PrepareStore("r", (0, 1, 2))],
     "target"),
    # O3 (#37874): ARC evicts the first victim, then finds no second and returns None.
    ("O3 arc partial eviction", [_013("arc"), *_stored(0, 1), PrepareLoad("r", (1,)),
                                 PrepareStore("r", (2, 3))], "store_is_all_or_nothing"),
    # O4 (#55461): ARC gives up when T1 is under its target and T2 has nothing to give,
    # though T1 has an evictable key.
    ("O4 arc no T1 fallback", [_013("arc"), *_stored(0), Touch("r", (0,)), *_stored(1),
                               *_stored(2), Touch("r", (1,)), Touch("r", (1,)),
                               PrepareLoad("r", (0,)), PrepareStore("r", (3,))],
     "store_fails_only_when_full"),
    # O5: ARC's failed completion of a ready key drops it, with no event.
    ("O5 arc failed store drops a ready key", [_013("arc"), *_stored(0),
                                               CompleteStore("r", (0,), success=False)],
     "target accepted it"),
    # O6: a refused load leaves the keys before the bad one pinned (an AssertionError).
    ("O6 lru refused load pins", [_013("lru"), *_stored(0), PrepareStore("r", (1,)),
                                  PrepareLoad("r", (0, 1))], "AssertionError"),
]

FINDINGS_033: list[tuple[str, list[model.Command], str]] = [
    # O7: reset_cache drops every key and announces nothing.
    ("O7 lru reset announces nothing", [_033("lru"), *_stored(0), TakeEvents(), Reset()],
     "events_replay_to_ready"),
    ("O7 arc reset announces nothing", [_033("arc"), *_stored(0), TakeEvents(), Reset()],
     "events_replay_to_ready"),
    # O8: a completion from before a reset marks a re-stored key ready (the connector drops it).
    ("O8 late completion", [_033("lru"), PrepareStore("r", (0,)), Reset(),
                            PrepareStore("s", (0,)), CompleteStore("r", (0,), generation=0)],
     "view differs"),
    # O6 in 0.33.
    ("O6 refused load pins", [_033("lru"), *_stored(0), PrepareStore("r", (1,)),
                              PrepareLoad("r", (0, 1))], "AssertionError"),
    # O10: ARC's on_request_finished promotes a reused key to T2 though it has since been
    # evicted and is being stored again (pending): found by the explorer.
    ("O10 arc promotes a pending key", [
        NewOffload(1, "arc", Profile.V0_33), *_stored(0), PrepareStore("b", (0,)),
        PrepareStore("r", (1,)), CompleteStore("r", (1,)), PrepareStore("r", (0,)),
        RequestFinished("b")], "pending_keys_stay_in_t1"),
    # O9: a second completion of a store is accepted silently.
    ("O9 complete twice", [_033("lru"), *_stored(0), CompleteStore("r", (0,))],
     "target accepted it"),
]


def _show(error: BaseException | None) -> str:
    return "conforms" if error is None else f"{type(error).__name__}: {error}"


@needs_013
@pytest.mark.parametrize(("name", "program", "said"), FINDINGS_013,
                         ids=[f[0] for f in FINDINGS_013])
def test_vllm_013_finding(name: str, program: list[model.Command], said: str) -> None:
    error = _run(program)
    assert error is not None and said in _show(error), _show(error)


@needs_033
@pytest.mark.parametrize(("name", "program", "said"), FINDINGS_033,
                         ids=[f[0] for f in FINDINGS_033])
def test_vllm_033_finding(name: str, program: list[model.Command], said: str) -> None:
    error = _run(program)
    assert error is not None and said in _show(error), _show(error)


@pytest.mark.parametrize(("name", "program", "said"), FINDINGS_013 + FINDINGS_033,
                         ids=[f[0] for f in FINDINGS_013 + FINDINGS_033])
def test_impl_conforms_where_vllm_does_not(name: str, program: list[model.Command],
                                           said: str) -> None:
    """impl has vLLM 0.13's API only: the 0.33 programs run under the 0.13 profile without
    the reset (impl has none)."""
    first = program[0]
    assert isinstance(first, NewOffload)
    under_013: list[model.Command] = [NewOffload(first.capacity, first.policy, Profile.V0_13)]
    under_013 += [c for c in program[1:] if not isinstance(c, Reset)]
    assert len(under_013) > 2
    assert _run(under_013, "impl") is None


def test_the_spec_keeps_a_refused_store_all_or_nothing() -> None:
    """The O3 program on the spec: the store is refused (None) and nothing moves."""
    state, _ = model.step(None, NewOffload(2, "arc"))
    for command in [*_stored(0, 1), PrepareLoad("r", (1,))]:
        state, _ = model.step(state, command)
    after, output = model.step(state, PrepareStore("r", (2, 3)))
    assert output is None and after.refs == state.refs and after.t1 == state.t1


def test_store_violations_names_each_broken_rule() -> None:
    before, _ = model.step(None, NewOffload(2, "lru"))
    for command in _stored(0, 1):
        before, _ = model.step(before, command)
    store = PrepareStore("r", (0, 2))
    assert model.store_violations(before, store, ((2,), (0,)), before) == [
        "store_is_all_or_nothing", "store_keeps_offered_keys"]
    pinned, _ = model.step(before, PrepareLoad("r", (1,)))
    assert "store_evicts_only_idle_keys" in model.store_violations(
        pinned, PrepareStore("r", (2,)), ((2,), (1,)), pinned)
    assert "store_fails_only_when_full" in model.store_violations(
        before, PrepareStore("r", (2,)), None, before)
    assert "store_evicts_only_what_it_needs" in model.store_violations(
        before, PrepareStore("r", (2,)), ((2,), (0, 1)), before)


def test_complete_load_refuses_an_unpin_below_zero() -> None:
    state, _ = model.step(None, NewOffload(2, "lru"))
    for command in _stored(0):
        state, _ = model.step(state, command)
    with pytest.raises(model.NotPinned, match="key 0"):
        model.step(state, CompleteLoad("r", (0,)))
