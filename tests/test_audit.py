"""`kvspec audit`: exit statuses, the JSON result, counterexamples, the mutation score.

Each audit here runs the pool machine for a number of examples from a fixed seed
(``--examples``), so that it covers the same programs on a loaded machine as on an idle one:
a conforming target a few examples, a planted bug until the audit finds it (it stops there),
with a cap on the examples. ``--budget`` is only a hard cap, far above what that takes. The
checks are on verdicts and shapes, never on timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvspec.cli import main
from kvspec.conformance import audit as audit_module
from kvspec.conformance.audit import (
    EXAMPLES_PER_BATCH,
    AuditBoundError,
    run_audit,
    run_layer,
)
from kvspec.conformance.layers import LAYERS
from kvspec.conformance.mutation_scores import mutation_score
from kvspec.conformance.pool_machine import BAD_CALLS
from kvspec.conformance.vllm_targets import vllm_version
from kvspec.spec import pool_invariants
from kvspec.spec.pool import Profile

BUGGY = "tests.planted_bug_pool:ReversedAllocationPool"
SPINNING = "tests.planted_bug_pool:NegativeCountSpinsPool"


# The audits' hard cap: each takes seconds, even on a loaded machine.
CAP_SECONDS = "600"
CONFORMING = "20"  # examples of a target that conforms, or whose bug is a bad call's
UNTIL_FOUND = "1000"  # a cap: seed 1 finds each planted bug in its first 10 examples, and a
# failure in an ordinary rule ends the audit


def audit(tmp_path: Path, *extra: str, examples: str = CONFORMING) -> tuple[int, dict[str, Any]]:
    result_file = tmp_path / "audit.json"
    status = main(["audit", "--layer", "pool", "--examples", examples, "--budget", CAP_SECONDS,
                   "--seed", "1", "--no-progress", "--json", str(result_file),
                   "--counterexamples", str(tmp_path / "counterexamples"), *extra])
    data = json.loads(result_file.read_text()) if result_file.exists() else {}
    return status, data


def test_impl_conforms_and_the_json_lists_every_rule_and_invariant(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, data = audit(tmp_path, "--target", "impl", "--profile", "vllm-0.13")
    assert status == 0
    assert data["kvspec_audit"] == 1
    assert (data["target"], data["profile"], data["verdict"]) == ("impl", "vllm-0.13",
                                                                  "conforms")
    assert data["examples_per_layer"] == 20
    [layer] = data["layers"]
    assert layer["layer"] == "pool" and layer["status"] == "audited" and layer["conforms"]
    assert layer["examples"] >= 20 and layer["steps"] > 0 and layer["notes"] == []
    rules = {row["name"] for row in layer["rules"]}
    assert {"build", "admit_request", "finish_request", "evict_blocks", *BAD_CALLS} <= rules
    invariants = {row["name"] for row in layer["invariants"]}
    assert {f"invariant_{p.__name__}" for p in pool_invariants.ALL} <= invariants
    assert {"matches_spec_state", "matches_spec_counts",
            "invariant_allocated_blocks_are_fresh"} <= invariants
    for row in layer["rules"] + layer["situations"] + layer["invariants"]:
        assert set(row) == {"name", "steps", "verdict"}
        assert row["verdict"] in ("ok", "not reached")
    assert layer["failures"] == []
    report = capsys.readouterr().out
    assert "verdict: impl conforms to vllm-0.13" in report
    assert "invariant_free_iff_unreferenced" in report
    assert "20 examples per layer within a budget 600 s" in report


def test_a_planted_bug_fails_with_a_runnable_counterexample(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report_file = tmp_path / "report.txt"
    status, data = audit(tmp_path, "--target", BUGGY, "--report", str(report_file),
                         examples=UNTIL_FOUND)
    assert status == 1
    assert data["verdict"] == "does not conform" and not data["conforms"]
    [layer] = data["layers"]
    failure = layer["failures"][0]
    assert set(failure) == {"kind", "check", "situation", "error", "message", "rule", "program",
                            "counterexample", "known"}
    assert failure["program"][0].startswith("pool = ReversedAllocationPool(")
    assert "GetNewBlocks" in failure["message"]
    report = report_file.read_text()
    assert report == capsys.readouterr().out
    assert "FAILURE 1" in report
    # The table marks the rule where the failure happened.
    [row] = [r for r in layer["rules"] if r["name"] == failure["rule"]]
    assert row["verdict"] == "FAIL"

    # The written counterexample is plain calls on the pool's own API, and fails the same
    # way under plain pytest run from another directory.
    path = Path(failure["counterexample"])
    assert path.exists() and path.name.startswith("test_")
    text = path.read_text()
    assert "pool.get_new_blocks(" in text and "kvspec.conformance.audit" not in text
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(path)], cwd=elsewhere, capture_output=True, text=True,
                         check=False)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed" in run.stdout


def test_a_target_that_never_returns_is_a_discrepancy_with_its_program(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A negative count spins the free queue's stale-entry loop: the audit reports the step
    that did not return, with its shrunk program, instead of hanging."""
    # A step deadline of 1 s, where the pool's steps take milliseconds: a loaded machine's
    # slow steps are far inside it; the spinning one never returns.
    # The hang is a bad call's: the audit excludes it and goes on, so the examples are few.
    status, data = audit(tmp_path, "--target", SPINNING, "--step-deadline", "1")
    assert status == 1 and data["step_deadline_seconds"] == 1.0
    [layer] = data["layers"]
    [failure] = [f for f in layer["failures"] if f["error"] == "TargetDidNotReturn"]
    assert (failure["kind"], failure["check"], failure["situation"]) == (
        "rule", "bad_alloc_negative", "bad_alloc_negative")
    assert failure["message"].startswith("target did not return within")
    assert "interrupted in take_until_none_missing" in failure["message"]
    assert failure["program"][0].startswith("pool = NegativeCountSpinsPool(")
    assert failure["program"][-1] == "pool.get_new_blocks(-1)"
    assert "step deadline 1 s" in capsys.readouterr().out

    # The counterexample fails under its own deadline instead of hanging.
    path = Path(failure["counterexample"])
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(path)], cwd=tmp_path, capture_output=True, text=True,
                         check=False, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "did not return within 1 s" in run.stdout


def test_a_baseline_turns_known_discrepancies_into_a_pass(tmp_path: Path) -> None:
    first_status, first = audit(tmp_path, "--target", BUGGY, examples=UNTIL_FOUND)
    assert first_status == 1
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(first))
    status, data = audit(tmp_path, "--target", BUGGY, "--baseline", str(baseline),
                         examples=UNTIL_FOUND)
    assert status == 0
    assert data["baseline"] == str(baseline) and data["new_failures"] == 0
    assert all(f["known"] for f in data["layers"][0]["failures"])
    assert data["verdict"] == "does not conform"

    baseline.write_text("{}")
    assert audit(tmp_path, "--target", BUGGY, "--baseline", str(baseline))[0] == 2


def test_contract_scope_leaves_out_bad_calls(tmp_path: Path) -> None:
    status, data = audit(tmp_path, "--target", "impl", "--scope", "contract")
    assert status == 0
    [layer] = data["layers"]
    assert set(BAD_CALLS) <= set(layer["out_of_contract_skipped"])
    verdicts = {row["name"]: row for row in layer["rules"]}
    assert all(verdicts[kind]["verdict"] == "excluded" for kind in BAD_CALLS)
    assert all(verdicts[kind]["steps"] == 0 for kind in BAD_CALLS)


@pytest.mark.parametrize("argv, message", [
    (["--target", "no_such_package.pool:BlockPool"], "cannot import module"),
    (["--target", "kvspec.impl.block_pool:NoSuchClass"], "has no class"),
    (["--target", "impl_pool"], "unknown target"),
    (["--target", "impl", "--profile", "vllm-9.9"], "invalid choice"),
    (["--target", "impl", "--budget", "-3"], "budget must be positive"),
    (["--target", "impl", "--layer", "everything"], "invalid choice"),
    (["--target", "impl", "--step-deadline", "-1"], "step deadline must be a finite number"),
    (["--target", "impl", "--step-deadline", "soon"], "step deadline must be a number"),
    (["--target", "impl", "--examples", "0"], "examples must be >= 1, got '0'"),
    (["--target", "impl", "--examples", "ten"], "examples must be a whole number, got 'ten'"),
])
def test_usage_errors_exit_2(argv: list[str], message: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--no-progress", *argv]) == 2
    assert message in capsys.readouterr().err


def test_an_examples_bound_covers_the_same_programs_however_fast_the_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same seed and examples bound run the same programs on a machine slowed down (a
    progress hook that sleeps at every example) as on this one: the same examples, steps and
    steps per rule, in batches whose sizes do not follow the measured speed."""
    def slowed(layer: str, recorder: Any, seconds: float, failures: int) -> None:
        time.sleep(0.005)

    monkeypatch.setattr(audit_module, "EXAMPLES_PER_BATCH", 10)  # small batches, quick
    examples = 25  # three batches: 10, 10 and 5
    runs = [run_audit("impl", Profile.V0_13, 600.0, layer="pool", seed_base=7,
                      examples=examples, progress=progress)
            for progress in (None, slowed)]
    [fast], [slow] = (audit.layers for audit in runs)
    assert fast.conforms and slow.conforms
    assert examples <= fast.examples == slow.examples and fast.steps == slow.steps
    assert [(r.name, r.steps) for r in fast.rows] == [(r.name, r.steps) for r in slow.rows]
    assert runs[0].examples == examples and fast.notes == []


def test_the_budget_still_caps_an_examples_bound() -> None:
    """A million examples (hours on any machine) within a budget of 0.5 s: the audit stops after
    its first batch, and says how far it got."""
    result = run_layer(LAYERS["pool"], "impl", Profile.V0_13, 0.5, seed_base=1,
                       examples=1_000_000)
    assert result.conforms and result.examples < 1_000_000
    assert result.notes[-1].startswith("the budget ran out after ")
    assert result.notes[-1].endswith(" of the 1000000 examples asked for")
    assert int(result.notes[-1].split()[5]) >= EXAMPLES_PER_BATCH


@pytest.mark.parametrize("bound", [0, -1, 2.5, True, "10"])
def test_a_bad_examples_bound_is_refused(bound: Any) -> None:
    with pytest.raises(AuditBoundError, match="examples bound must be a whole number >= 1"):
        run_audit("impl", Profile.V0_13, 1.0, layer="pool", seed_base=1, examples=bound)
    with pytest.raises(AuditBoundError, match=repr(bound).replace(".", r"\.")):
        run_layer(LAYERS["pool"], "impl", Profile.V0_13, 1.0, seed_base=1, examples=bound)


@pytest.mark.skipif(vllm_version() is not None, reason="vLLM is importable here")
def test_vllm_target_without_vllm_says_which_env_to_build(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--target", "vllm", "--no-progress", "--budget", "1"]) == 2
    err = capsys.readouterr().err
    assert "vLLM is not importable" in err and "make vllm-env VLLM=0.13.0" in err


def test_no_subcommand_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["audit", "--help"]) == 0
    assert "--profile" in capsys.readouterr().out


def test_mutation_score_comes_from_the_cached_catalogue_run(tmp_path: Path) -> None:
    assert mutation_score("tests/test_pool_machine.py", cache=tmp_path / "absent.json") is None
    cache = tmp_path / "mutants.json"
    cache.write_text(json.dumps({"profile": "ci", "finished": "2025-01-01T00:00:00", "mutants": [
        {"name": "a", "checker": ["tests/test_pool_machine.py"], "killed": True},
        {"name": "b", "checker": ["tests/test_pool_machine.py"], "killed": False},
        {"name": "c", "checker": ["tests/test_manager_machine.py"], "killed": True},
    ]}))
    score = mutation_score("tests/test_pool_machine.py", cache=cache)
    assert score is not None
    assert (score["killed"], score["total"], score["survivors"]) == (1, 2, ["b"])


def test_mutation_scores_are_found_by_configuration_not_the_package_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """build/mutants.json under the current directory, else KVSPEC_MUTANTS where it is set
    (``kvspec audit --mutants FILE`` passes a file of its own)."""
    entries = {"mutants": [{"name": "a", "checker": ["tests/test_pool_machine.py"],
                            "killed": True}]}
    monkeypatch.delenv("KVSPEC_MUTANTS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert mutation_score("tests/test_pool_machine.py") is None
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "mutants.json").write_text(json.dumps(entries))
    score = mutation_score("tests/test_pool_machine.py")
    assert score is not None and score["source"] == str(tmp_path / "build" / "mutants.json")
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(entries))
    monkeypatch.setenv("KVSPEC_MUTANTS", str(elsewhere))
    score = mutation_score("tests/test_pool_machine.py")
    assert score is not None and score["source"] == str(elsewhere)
