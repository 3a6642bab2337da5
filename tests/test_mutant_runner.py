"""The mutant runner's own parts (tests/mutants/__main__.py), without running the catalogue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import Phase, settings

from kvspec.conformance.profiles import MUTANTS_PROFILE
from tests.mutants import Mutant, catalogue
from tests.mutants.__main__ import (
    Verdict,
    checker_env,
    judge,
    merge_results,
    parse_args,
    read_results,
    save_results,
    schedule,
)


def _mutant(name: str, killed_by: str = "") -> Mutant:
    return Mutant(name, "a test mutant", lambda: None, ("tests/test_x.py",), killed_by)


@pytest.mark.parametrize("caller", [
    {},
    {"CI": "true"},
    {"CI": "true", "KVSPEC_PROFILE": "nightly"},
    {"KVSPEC_PROFILE": "dev"},
    {"KVSPEC_PROFILE": "ci-mutants", "CI": "false"},
])
def test_every_checker_runs_under_the_mutants_profile_whatever_the_caller_says(
        caller: dict[str, str]) -> None:
    env = checker_env({"PATH": "/bin", **caller}, "some_mutant", MUTANTS_PROFILE)
    assert env["KVSPEC_PROFILE"] == "mutants"
    assert env["KVSPEC_MUTANT"] == "some_mutant"
    assert env["KVSPEC_PURE_PYTHON"] == "1"
    assert env["PATH"] == "/bin"


def test_the_default_profile_is_mutants_and_profile_overrides_it() -> None:
    assert parse_args([]).profile == MUTANTS_PROFILE
    assert parse_args(["--profile", "nightly", "a"]).profile == "nightly"
    assert parse_args(["--jobs", "3"]).jobs == 3
    with pytest.raises(SystemExit):
        parse_args(["--jobs", "0"])


def test_the_mutants_profile_is_fixed_derandomized_and_does_not_shrink() -> None:
    profile = settings.get_profile(MUTANTS_PROFILE)
    assert profile.derandomize
    assert profile.database is None
    assert Phase.shrink not in profile.phases
    assert profile.max_examples >= settings.get_profile("ci").max_examples
    alias = settings.get_profile("ci-mutants")  # the old name still works
    assert (alias.derandomize, alias.database, alias.phases, alias.max_examples) == (
        profile.derandomize, profile.database, profile.phases, profile.max_examples)


def test_the_verdict_needs_exit_1_and_the_named_check() -> None:
    assert judge(_mutant("m"), 1, "1 failed") == (True, "")
    assert judge(_mutant("m"), 0, "all passed") == (False, "pytest exit 0")
    assert judge(_mutant("m"), 2, "collection error") == (False, "pytest exit 2")
    assert judge(_mutant("m", "free_iff"), 1, "... free_iff_unreferenced ...") == (True,
                                                                                  "free_iff")
    assert judge(_mutant("m", "free_iff"), 1, "some other failure") == (
        False, "failed, but not by free_iff")


def test_merging_keeps_unrun_mutants_replaces_rerun_ones_and_drops_retired_ones() -> None:
    previous: list[dict[str, object]] = [
        {"name": "b", "killed": True, "seconds": 1.0},
        {"name": "a", "killed": False, "seconds": 9.0},
        {"name": "retired", "killed": True, "seconds": 2.0},
        {"no name": True},
    ]
    results: dict[str, dict[str, object]] = {"a": {"name": "a", "killed": True, "seconds": 3.0},
                                             "c": {"name": "c", "killed": True, "seconds": 4.0}}
    merged = merge_results(previous, results, ["a", "b", "c"])
    assert merged == [{"name": "a", "killed": True, "seconds": 3.0},
                      {"name": "b", "killed": True, "seconds": 1.0},
                      {"name": "c", "killed": True, "seconds": 4.0}]


def test_saved_results_keep_the_format_kvspec_audit_reads(tmp_path: Path) -> None:
    path = tmp_path / "build" / "mutants.json"
    first, second = catalogue()[:2]
    path.parent.mkdir()
    path.write_text(json.dumps({"profile": "ci", "finished": "then", "mutants": [
        {"name": first.name, "checker": list(first.checker), "killed": False, "seconds": 5.0,
         "caught_by": "pytest exit 0"},
        {"name": "no_longer_in_the_catalogue", "checker": [], "killed": True}]}))
    verdict = Verdict(second.name, True, 1.234, "x")
    save_results({second.name: verdict.entry(second.checker)}, MUTANTS_PROFILE, path)
    data = json.loads(path.read_text())
    assert data["profile"] == MUTANTS_PROFILE and data["finished"]
    assert [e["name"] for e in data["mutants"]] == sorted([first.name, second.name])
    entry = next(e for e in data["mutants"] if e["name"] == second.name)
    assert entry == {"name": second.name, "checker": list(second.checker), "killed": True,
                     "seconds": 1.23, "caught_by": "x"}
    assert read_results(path) == data["mutants"]
    assert read_results(tmp_path / "missing.json") == []


def test_the_slowest_known_checkers_start_first() -> None:
    a, b, c, new = (_mutant(n) for n in ("a", "b", "c", "new"))
    order = schedule([a, b, c, new], {"a": 1.0, "b": 7.0, "c": 3.0})
    assert [m.name for m in order] == ["new", "b", "c", "a"]


def test_the_printed_program_does_not_count_as_the_check_that_caught_a_mutant() -> None:
    from tests.mutants import Mutant
    from tests.mutants.__main__ import judge

    mutant = Mutant("m", "d", lambda: None, ("tests/test_pool_machine.py",),
                    "free_iff_unreferenced")
    program = ("E   AssertionError: free order: target (1,), spec (2,)\n"
               "E   state = PoolConformance()\n"
               "E   state.invariant_free_iff_unreferenced()\n"
               "E   held_0 = state.admit_request(family=0)\n")
    assert judge(mutant, 1, program) == (False, "failed, but not by free_iff_unreferenced")
    said = "E   AssertionError: invariant free_iff_unreferenced violated by the target\n"
    assert judge(mutant, 1, said + program)[0]
