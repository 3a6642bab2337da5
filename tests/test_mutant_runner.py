"""The mutant runner's own parts (tests/mutants/__main__.py and worker.py), with fake
catalogues: tiny checkers that pass, fail, hang or crash, run by real workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import Phase, settings

from kvspec.conformance.profiles import MUTANTS_PROFILE
from tests import vllm_033
from tests.mutants import Mutant, catalogue
from tests.mutants.__main__ import (
    Verdict,
    Worker,
    checker_env,
    judge,
    merge_results,
    parse_args,
    read_results,
    run_all,
    save_results,
    schedule,
    worker_env,
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


def test_a_worker_names_no_mutant_of_its_own() -> None:
    env = worker_env({"KVSPEC_MUTANT": "left_over", "CI": "true"}, MUTANTS_PROFILE)
    assert "KVSPEC_MUTANT" not in env
    assert (env["KVSPEC_PROFILE"], env["KVSPEC_PURE_PYTHON"]) == (MUTANTS_PROFILE, "1")


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


# --- the workers, on fake checkers -------------------------------------------------------

FAKE_CHECKERS = """
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def test_passes():
    pass


def test_fails_by_its_check():
    assert False, "check_alpha caught it"


def test_says_which_mutant_it_checks():
    assert False, f"checking {os.environ.get('KVSPEC_MUTANT')}"


def test_prints_then_fails():
    print("said on stdout")
    os.write(2, b"said on stderr\\n")
    assert False, "failed after printing"


def test_hangs_with_a_child():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (HERE / "sleeper.pid").write_text(str(sleeper.pid))
    time.sleep(600)


def test_crashes():
    os.kill(os.getpid(), signal.SIGSEGV)


def test_changes_the_worker_state():
    json.changed_by_a_sibling = True
    os.environ["CHANGED_BY_A_SIBLING"] = "1"
    assert False, "changed"


def test_sees_the_worker_state_unchanged():
    assert not hasattr(json, "changed_by_a_sibling")
    assert "CHANGED_BY_A_SIBLING" not in os.environ
    assert False, "state unchanged"


def test_kills_its_worker():
    os.kill(os.getppid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def checkers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fake_catalogue") / "test_fake_checkers.py"
    path.write_text(FAKE_CHECKERS)
    return path


@pytest.fixture(scope="module")
def workers() -> Iterator[list[Worker]]:
    env = worker_env(os.environ, MUTANTS_PROFILE)
    started = [Worker(env), Worker(env)]
    yield started
    for worker in started:
        worker.stop()


def fake(checkers: Path, test: str, killed_by: str = "", name: str = "") -> Mutant:
    """A mutant whose checker is one test of the fake catalogue (nothing is planted: the
    fake catalogue has no conftest that plants)."""
    return Mutant(name or f"fake_{test}", "a fake mutant", lambda: None,
                  (f"{checkers}::{test}",), killed_by)


def test_a_failing_check_kills_and_a_passing_one_does_not(
        checkers: Path, workers: list[Worker]) -> None:
    worker = workers[0]
    killed = worker.run(fake(checkers, "test_fails_by_its_check", "check_alpha"), 120)
    assert (killed.name, killed.killed, killed.detail) == (
        "fake_test_fails_by_its_check", True, "check_alpha")
    survivor = worker.run(fake(checkers, "test_passes"), 120)
    assert (survivor.killed, survivor.detail) == (False, "pytest exit 0")
    other = worker.run(fake(checkers, "test_fails_by_its_check", "check_beta"), 120)
    assert (other.killed, other.detail) == (False, "failed, but not by check_beta")


def test_each_checker_is_told_its_mutant_and_its_output_is_judged(
        checkers: Path, workers: list[Worker]) -> None:
    worker = workers[0]
    named = fake(checkers, "test_says_which_mutant_it_checks", "checking fake_named",
                 name="fake_named")
    assert worker.run(named, 120).killed
    for said in ("said on stdout", "said on stderr", "failed after printing"):
        assert worker.run(fake(checkers, "test_prints_then_fails", said), 120).killed, said


def test_a_checker_sees_none_of_what_an_earlier_one_changed(
        checkers: Path, workers: list[Worker]) -> None:
    worker = workers[0]
    assert worker.run(fake(checkers, "test_changes_the_worker_state", "changed"), 120).killed
    clean = worker.run(fake(checkers, "test_sees_the_worker_state_unchanged", "state unchanged"),
                       120)
    assert clean.killed, clean.detail


def test_a_checker_past_its_timeout_is_killed_with_what_it_started(
        checkers: Path, workers: list[Worker]) -> None:
    pid_file = checkers.with_name("sleeper.pid")
    # 20 s: ten times what the fake checker needs to reach its sleep on a loaded machine.
    verdict = workers[1].run(fake(checkers, "test_hangs_with_a_child"), 20)
    assert (verdict.killed, verdict.detail) == (False, "checker ran past 20 s")
    sleeper = int(pid_file.read_text())
    for _ in range(600):  # the sleeper is killed with its checker's process group
        if not _running(sleeper):
            break
        time.sleep(0.1)
    assert not _running(sleeper)
    # The worker goes on with the next checker.
    assert workers[1].run(fake(checkers, "test_fails_by_its_check", "check_alpha"), 120).killed


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_crashing_checker_does_not_kill(checkers: Path, workers: list[Worker]) -> None:
    verdict = workers[1].run(fake(checkers, "test_crashes"), 120)
    assert (verdict.killed, verdict.detail) == (False, "pytest exit -11")


def test_a_worker_that_dies_leaves_its_mutant_alive_and_is_replaced(
        checkers: Path, workers: list[Worker]) -> None:
    worker = workers[1]
    verdict = worker.run(fake(checkers, "test_kills_its_worker"), 120)
    assert not verdict.killed
    assert verdict.detail.startswith("mutant worker failed: it exited with status -9")
    assert worker.run(fake(checkers, "test_fails_by_its_check", "check_alpha"), 120).killed


def test_the_catalogue_runs_on_every_worker_and_reports_each_verdict(
        checkers: Path, workers: list[Worker]) -> None:
    mutants = [fake(checkers, "test_fails_by_its_check", "check_alpha", name=f"kill_{i}")
               for i in range(4)] + [fake(checkers, "test_passes", name="survivor")]
    reported: list[str] = []
    verdicts = run_all(mutants, workers, 120, lambda verdict: reported.append(verdict.name))
    assert sorted(reported) == sorted(verdicts) == sorted(m.name for m in mutants)
    assert [verdicts[m.name].killed for m in mutants] == [True] * 4 + [False]


def test_a_real_mutant_is_planted_by_conftest_and_caught_as_in_a_process_of_its_own(
        workers: list[Worker]) -> None:
    """The catalogue's own planting: conftest.py plants the mutant the checker is told, in
    the forked child. This one is caught by its named check only on the examples a process
    of its own runs: a worker that preloaded modules the checker does not import would have
    Hypothesis draw other values (from those modules' constants), and another check would
    catch it first."""
    mutant = next(m for m in catalogue() if m.name == "bt_move_row_swaps")
    assert mutant.killed_by == "slot mapping of every block"
    assert workers[0].run(mutant, 600).killed
    unknown = Mutant("no_such_mutant", "", lambda: None, mutant.checker)
    assert workers[0].run(unknown, 600).detail != "pytest exit 1"
    assert "KVSPEC_MUTANT" not in os.environ


def test_a_server_forks_checkers_for_its_clients_and_refuses_another_environment(
        checkers: Path, tmp_path: Path) -> None:
    """The server that forks the reruns under vLLM 0.33 (tests/vllm_033.py), here in this
    Python: stdout and stderr come back apart; a request from an environment other than the
    one it imported in, or to a socket nobody listens on, gets None (the rerun then runs in a
    process of its own)."""
    from tests.mutants.worker import ask

    path = str(tmp_path / "server.sock")
    env = worker_env(os.environ, MUTANTS_PROFILE)
    server = subprocess.Popen([sys.executable, "-m", "tests.mutants.worker", "--listen", path],
                              env=env, cwd=vllm_033.ROOT, stdin=subprocess.DEVNULL)
    try:
        for _ in range(6000):  # the socket is bound before the server imports anything
            if os.path.exists(path):
                break
            time.sleep(0.1)
        args = ["-x", "-q", "-s", f"{checkers}::test_prints_then_fails"]
        reply = ask(path, args, {**env, "KVSPEC_MUTANT": "m", "KVSPEC_DATABASE": "none"},
                    str(vllm_033.ROOT), 300)
        assert reply is not None
        assert reply["returncode"] == 1 and not reply["timed_out"]
        assert "said on stdout" in reply["stdout"] and "said on stdout" not in reply["stderr"]
        assert "said on stderr" in reply["stderr"]
        assert ask(path, args, {**env, "SOMETHING": "else"}, str(vllm_033.ROOT), 300) is None
    finally:
        server.terminate()
        server.wait()
    assert ask(str(tmp_path / "nobody.sock"), args, env, str(vllm_033.ROOT), 300) is None
