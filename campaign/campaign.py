"""``kvspec campaign``: the audits as a campaign of many workers over one shared Redis.

The work is cut into *shards*: one layer of one target under one profile (and eviction
policy), from one seed, for a share of the budget (`plan`). Each shard is a job on an RQ
queue in the campaign's Redis, so workers on this machine and on any other that reaches
the server take them (``kvspec campaign worker --database redis://...``); RQ hands a job to
one worker at a time, retries a crashed one (`Retry`) and keeps what still fails in its
failed-job registry. This module runs no queue of its own.

A shard is `run_audit` with the shared example database (`redis_db`): it replays every
failure saved for its machine before generating anything, and saves each failure the moment
Hypothesis finds it (through a spool on the worker's disk, so an unreachable or restarting
server loses nothing). What it reaches (steps per rule and invariant, `hypothesis.event`
labels) and what it finds go to the campaign's records in the same Redis (`CampaignStore`);
the controller (`run_campaign`) shows progress, merges them into one `CampaignData` and writes
the terminal table and the HTML page (`report`).

On one machine with no ``--database``, the controller starts a real Redis server of its own
(`redis_db.LocalRedisServer`, its data in ``.kvspec/redis``), and stops it at the end after
exporting the examples to ``.kvspec/examples``, which ``kvspec audit`` (so ``make audit``)
replays.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvspec.campaign.redis_db import (
    LocalRedisServer,
    RedisUnavailable,
    SpooledDatabase,
    environment_database,
    export,
    redis_client,
    shared_database,
)
from kvspec.conformance.example_db import EXPORTED, STATE_DIR

QUEUE = "kvspec-campaign"
PREFIX = "kvspec:campaign"
FAILURES = "kvspec:failures"  # every failure any campaign found, by `failure_id`
PROFILES = ("vllm-0.13", "vllm-0.33")
# The eviction policies a campaign audits beside the default order, on the pool and manager.
POLICIES = ("lru-lifo-unhashed", "priority", "pinned")
POLICY_LAYERS = ("pool", "manager")
# How long a shard's job may run past its budget before RQ kills it (shrinking, start-up).
JOB_SLACK_SECONDS = 120
# What a shard costs beyond its budget: the work horse's fork, the layer's build, the first
# batch's start (measured about 1 s on a 2-core machine).
SHARD_OVERHEAD = 1.0
RETRIES = 2
# How long the controller waits for its local workers to listen (start-up: Python, torch, the
# machines, `audit.warm_up`) before it queues the shards anyway: the budget counts from then.
WORKERS_START_SECONDS = 180.0
# Set in the environment of the workers a controller starts: its process id (`work`).
CONTROLLER_VARIABLE = "KVSPEC_CAMPAIGN_CONTROLLER"


def missing_package() -> str | None:
    """The name of the package a campaign needs that is not installed (redis, rq), or None."""
    import importlib.util

    return next((name for name in ("redis", "rq") if importlib.util.find_spec(name) is None),
                None)


def _redis_errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


@dataclass(frozen=True)
class Shard:
    """One job: what to audit, from which seed, for how long, and where to report."""

    campaign: str
    job: str
    layer: str
    target: str
    profile: str
    policy: str | None
    seed: int
    budget: float
    database: str  # the campaign's Redis URL

    @property
    def label(self) -> str:
        return layer_label(self.layer, self.policy)


def layer_label(layer: str, policy: str | None) -> str:
    """A shard's layer as the report shows it: a policy's shard is ``pool/priority``."""
    return layer if not policy else f"{layer}/{policy}"


def failure_id(target: str, profile: str, label: str, failure: Any) -> str:
    """A failure's identity across shards, workers and campaigns."""
    return "|".join([target, profile, label, failure.kind, failure.check, failure.situation,
                     failure.error])


def plan(campaign: str, target: str, database: str, budget: float, workers: int,
         layers: list[str], profiles: list[str], policies: list[str], seed: int,
         shard_budget: float | None = None,
         first: Callable[[str, str, str], bool] | None = None) -> list[Shard]:
    """The shards of a campaign: every (layer, profile) and every (policy layer, profile,
    policy), then more rounds of them from new seeds while the budget lasts. Each shard gets
    ``shard_budget`` seconds (default: the budget shared out so that one round fits, at most
    60 s). ``workers`` run the shards in waves, one shard each at a time, and each shard costs
    `SHARD_OVERHEAD` beyond its own budget: 3 shards on 2 workers are 2 waves, not 1.5.
    Shards for which ``first(label, profile)`` is true (a failure is known) go first, so that
    a later campaign replays known failures before anything else."""
    kinds: list[tuple[str, str, str | None]] = [
        (layer, profile, None) for profile in profiles for layer in layers]
    kinds += [(layer, profile, policy) for profile in profiles for policy in policies
              for layer in POLICY_LAYERS if layer in layers]
    seconds = 0.9 * budget  # the rest: shrinking, the last shard's end
    waves = -(-len(kinds) // workers) if workers else 0  # 0: only remote workers, unknown
    each = shard_budget or max(2.0, min(60.0, (seconds / waves if waves else 0.0)
                                        - SHARD_OVERHEAD))
    shards_that_fit = int(seconds // (each + SHARD_OVERHEAD)) * workers
    rounds = max(1, shards_that_fit // len(kinds))
    shards = []
    for round_ in range(rounds):
        for index, (layer, profile, policy) in enumerate(kinds):
            number = round_ * len(kinds) + index
            shards.append(Shard(campaign, f"{campaign}-{number:04d}", layer, target, profile,
                                policy, seed + 1000 * number, each, database))
    if first is not None:
        shards.sort(key=lambda s: not first(s.target, s.profile, s.label))
    return shards


# -- the records in Redis --------------------------------------------------------------------

class CampaignStore:
    """A campaign's records in its Redis, as JSON: its settings, each shard's state and
    result, the failures found (this campaign's and every campaign's), notable events."""

    def __init__(self, url: str, campaign: str) -> None:
        self.client = redis_client(url)
        self.campaign = campaign
        self.key = f"{PREFIX}:{campaign}"

    def ping(self) -> bool:
        return bool(self.client.ping())

    def start(self, meta: dict[str, Any]) -> None:
        self.client.set(f"{self.key}:meta", json.dumps(meta))
        self.client.rpush(f"{PREFIX}s", self.campaign)

    def meta(self) -> dict[str, Any]:
        raw = self.client.get(f"{self.key}:meta")
        return {} if raw is None else dict(json.loads(raw))

    def update_shard(self, job: str, **values: Any) -> None:
        """Merge values into a shard's record (a WATCH-free read-modify-write is enough: a
        shard's record is written by the one worker running it, and by the controller only
        for shards no worker holds)."""
        raw = self.client.hget(f"{self.key}:shards", job)
        record = {} if raw is None else json.loads(raw)
        record.update(values)
        self.client.hset(f"{self.key}:shards", job, json.dumps(record))

    def shards(self) -> dict[str, dict[str, Any]]:
        return {k.decode(): json.loads(v)
                for k, v in self.client.hgetall(f"{self.key}:shards").items()}

    def add_attempt(self, job: str, attempt: dict[str, Any]) -> None:
        """Each run of a shard (a retry adds one): which worker, from when to when."""
        self.client.rpush(f"{self.key}:attempts:{job}", json.dumps(attempt))

    def attempts(self, job: str) -> list[dict[str, Any]]:
        return [json.loads(a) for a in self.client.lrange(f"{self.key}:attempts:{job}", 0, -1)]

    def set_result(self, job: str, result: dict[str, Any]) -> None:
        self.client.hset(f"{self.key}:results", job, json.dumps(result))

    def results(self) -> dict[str, dict[str, Any]]:
        return {k.decode(): json.loads(v)
                for k, v in self.client.hgetall(f"{self.key}:results").items()}

    def add_failure(self, record: dict[str, Any]) -> None:
        """Record a failure for this campaign and in the all-campaigns registry (the first
        finder is kept; ``runs`` counts the shards that reported it)."""
        fid = record["id"]
        for key in (f"{self.key}:failures", FAILURES):
            raw = self.client.hget(key, fid)
            if raw is None:
                kept = dict(record, runs=1)
            else:
                kept = json.loads(raw)
                kept["runs"] = int(kept.get("runs", 1)) + 1
                kept["replayed"] = bool(kept.get("replayed")) and bool(record.get("replayed"))
            self.client.hset(key, fid, json.dumps(kept))

    def failures(self) -> list[dict[str, Any]]:
        return [json.loads(v) for v in self.client.hvals(f"{self.key}:failures")]

    def known_failures(self) -> list[dict[str, Any]]:
        return [json.loads(v) for v in self.client.hvals(FAILURES)]

    def add_event(self, kind: str, text: str, t: float) -> None:
        self.client.rpush(f"{self.key}:events", json.dumps({"t": t, "kind": kind,
                                                            "text": text}))

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(v) for v in self.client.lrange(f"{self.key}:events", 0, -1)]


# -- a shard, in a worker --------------------------------------------------------------------

def local_worker_name(pid: int) -> str:
    """The RQ name of the worker process ``pid`` on this machine (its controller waits for
    it by this name, `_listening`)."""
    return f"kvspec-{socket.gethostname()}-{pid}"


def worker_name() -> str:
    """The worker running this shard, as ``host:pid`` of the RQ worker (the shard itself runs
    in the work horse RQ forks from it for each job)."""
    return f"{socket.gethostname()}:{os.getppid()}"


def run_shard(values: dict[str, Any]) -> dict[str, Any]:
    """The RQ job: audit one shard against the shared example database and record what it
    reached and found. Returns the shard's result (also stored in `CampaignStore`)."""
    from kvspec.conformance.audit import run_audit
    from kvspec.conformance.profiles import load_profile
    from kvspec.spec.pool import Profile

    shard = Shard(**values)
    store = CampaignStore(shard.database, shard.campaign)
    meta = store.meta()
    started = time.time()
    if meta.get("deadline") and started > float(meta["deadline"]):
        # A job left from a campaign that has ended (its controller gone): nothing to do.
        store.update_shard(shard.job, status="skipped", worker=worker_name())
        return {"status": "skipped"}
    load_profile(environment_database())
    campaign_start = float(meta.get("started", started))
    unreachable: list[str] = []

    def note_unreachable(error: BaseException) -> None:
        if not unreachable:
            print(f"kvspec campaign: Redis at {shard.database} unreachable ({error}); "
                  "examples kept in the spool until it answers", file=sys.stderr)
        unreachable.append(str(error))

    spool = STATE_DIR / "spool" / socket.gethostname()
    database = SpooledDatabase(shared_database(shard.database), spool, note_unreachable)
    database.flush()  # what a worker killed while Redis was down left behind
    attempt = {"worker": worker_name(), "pid": os.getpid(), "started": started}
    with contextlib.suppress(*_redis_errors()):
        store.update_shard(shard.job, status="started", worker=worker_name(), pid=os.getpid(),
                           started=started)
        store.add_attempt(shard.job, attempt)
    last = [0.0]

    def progress(layer: str, recorder: Any, seconds: float, failures: int) -> None:
        now = time.time()
        if now - last[0] < 1.0:
            return
        last[0] = now
        with contextlib.suppress(*_redis_errors()):  # progress is best effort
            store.update_shard(shard.job, examples=recorder.examples, steps=recorder.steps,
                               failures=failures, updated=now)

    def found(failure: Any) -> None:
        record = {
            "id": failure_id(shard.target, shard.profile, shard.label, failure),
            "layer": shard.label, "target": shard.target, "profile": shard.profile,
            "policy": shard.policy, "kind": failure.kind, "check": failure.check,
            "situation": failure.situation, "error": failure.error,
            "message": failure.message, "program": [str(call) for call in failure.program],
            "found_at": time.time() - campaign_start, "worker": worker_name(),
            "replayed": failure.replayed, "campaign": shard.campaign, "job": shard.job,
        }
        # The example itself is already in the database (Hypothesis saved it when found);
        # this record is what the report shows. Kept locally if Redis is away.
        _retrying(lambda: store.add_failure(record), 30.0, note_unreachable)

    audit = run_audit(shard.target, Profile(shard.profile), shard.budget, layer=shard.layer,
                      seed_base=shard.seed, progress=progress, policy=shard.policy,
                      database=database, on_failure=found)
    events: Counter[str] = Counter()
    for layer in audit.audited:
        events.update(layer.events)
    database.flush()
    finished = time.time()
    rows = [{"kind": row.kind, "name": row.name, "steps": row.steps, "verdict": row.verdict}
            for layer in audit.audited for row in layer.rows]
    result = {
        "status": "finished" if audit.audited else "skipped",
        "reason": "; ".join(layer.reason for layer in audit.layers if layer.reason),
        "examples": sum(layer.examples for layer in audit.layers),
        "steps": sum(layer.steps for layer in audit.layers),
        "replayed": sum(layer.replayed for layer in audit.layers),
        "failures": len(audit.failures), "rows": rows, "events": dict(events),
        "worker": worker_name(), "started": started, "finished": finished,
        "spooled": len(database.pending),
    }
    _retrying(lambda: store.set_result(shard.job, result), 30.0, note_unreachable)
    _retrying(lambda: store.update_shard(
        shard.job, status=result["status"], examples=result["examples"],
        steps=result["steps"], failures=result["failures"], replayed=result["replayed"],
        finished=finished), 30.0, note_unreachable)
    return result


def _retrying(write: Callable[[], None], seconds: float,
              on_error: Callable[[BaseException], None]) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            write()
            return
        except _redis_errors() as error:
            on_error(error)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def work(url: str, burst: bool, name: str | None = None) -> int:
    """``kvspec campaign worker``: an RQ worker on the campaign queue. The audit machinery is
    imported here, once, so that each job's forked work horse starts at once.

    A worker that a controller started (`CONTROLLER_VARIABLE` names the controller's process)
    listens until the controller stops it, and stops by itself (RQ's warm shutdown: its
    current shard ends first) if the controller is gone."""
    import importlib

    from rq import Queue, Worker

    # Preloaded for the work horses: each job's fork starts with the machines imported.
    for module in ("audit", "layers", "free_queue_machine", "hash_map_machine", "pool_machine",
                   "manager_machine", "attention_manager_machine", "block_table_machine",
                   "offload_machine"):
        importlib.import_module(f"kvspec.conformance.{module}")
    from kvspec.conformance.audit import warm_up

    warm_up()
    connection = redis_client(url, timeout=30.0)
    try:
        connection.ping()
    except _redis_errors() as error:
        print(f"kvspec campaign worker: error: no Redis answers at {url} ({error})",
              file=sys.stderr)
        return 2
    name = name or local_worker_name(os.getpid())
    controller = os.environ.get(CONTROLLER_VARIABLE)
    if controller:
        _stop_when_gone(int(controller))
    worker = Worker([Queue(QUEUE, connection=connection)], connection=connection, name=name)
    worker.work(burst=burst, logging_level="WARNING", with_scheduler=False)
    return 0


def _stop_when_gone(controller: int) -> None:
    """SIGTERM this worker (RQ's warm shutdown) once its parent is no longer ``controller``:
    a controller killed outright leaves no worker listening for ever."""
    import threading

    def watch() -> None:
        while os.getppid() == controller:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="kvspec-controller-watch", daemon=True).start()


# -- the controller --------------------------------------------------------------------------

@dataclass
class CampaignOptions:
    target: str = "impl"
    budget: float = 60.0
    workers: int = 2
    database: str | None = None  # a Redis URL; None: start a server of our own
    layers: list[str] = field(default_factory=list)  # empty: every layer
    profiles: list[str] = field(default_factory=lambda: list(PROFILES))
    policies: list[str] = field(default_factory=lambda: list(POLICIES))
    shard_budget: float | None = None
    seed: int | None = None
    report: Path | None = None  # where the report's files go
    redis_grace: float = 30.0  # how long the campaign waits for an unreachable Redis
    progress: bool = True


@dataclass
class CampaignOutcome:
    data: dict[str, Any]
    exit_code: int
    report_dir: Path
    message: str = ""


class _Progress:
    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = stream.isatty()
        self.last_line = ""
        self.last_print = 0.0

    def show(self, line: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + line[:119].ljust(119))
            self.stream.flush()
        elif time.monotonic() - self.last_print >= 10.0 or line.startswith("done"):
            # A log (CI) gets a line every 10 s rather than a line per second.
            self.stream.write(line + "\n")
            self.stream.flush()
            self.last_print = time.monotonic()

    def say(self, text: str) -> None:
        if self.tty and self.enabled:
            self.stream.write("\r" + " " * 119 + "\r")
        self.stream.write(f"kvspec campaign: {text}\n")
        self.stream.flush()


def _spawn_worker(url: str, index: int, logs: Path) -> subprocess.Popen[bytes]:
    """A local worker. Not ``--burst``: it starts before the shards are queued (`_listening`)
    and listens until the controller stops it (`_stop_workers`), or stops by itself when the
    controller is gone (`CONTROLLER_VARIABLE`)."""
    log = open(logs / f"worker-{index}.log", "ab")  # noqa: SIM115 (the child's)
    process = subprocess.Popen(
        [sys.executable, "-m", "kvspec.cli", "campaign", "worker", "--database", url],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=dict(os.environ, **{CONTROLLER_VARIABLE: str(os.getpid())}),
        start_new_session=True)  # its own group: stopping it stops its work horse too
    log.close()
    return process


def _listening(queue: Any, workers: list[subprocess.Popen[bytes]]) -> bool:
    """Whether every local worker still running listens on the queue (RQ registered it)."""
    from rq import Worker

    prefix = Worker.redis_worker_namespace_prefix
    names = {key.removeprefix(prefix) for key in Worker.all_keys(queue=queue)}
    return all(process.poll() is not None or local_worker_name(process.pid) in names
               for process in workers)


def _stop_workers(workers: list[subprocess.Popen[bytes]], timeout: float = 10.0) -> None:
    for process in workers:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)  # RQ's warm shutdown, then the horse
    deadline = time.monotonic() + timeout
    for process in workers:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def run_campaign(options: CampaignOptions, out: TextIO = sys.stderr) -> CampaignOutcome:
    """Run a campaign (see the module's docstring) and write its report; never hangs on a
    lost server: after ``redis_grace`` seconds without an answer it stops its workers and
    ends with exit status 2, keeping what was recorded."""
    from kvspec.conformance.layers import LAYER_NAMES

    campaign = time.strftime("%Y%m%d-%H%M%S") + f"-{random.randrange(16**4):04x}"
    report_dir = options.report or Path("build") / "campaign" / campaign
    report_dir.mkdir(parents=True, exist_ok=True)
    logs = report_dir / "logs"
    logs.mkdir(exist_ok=True)
    say = _Progress(out, options.progress)
    server: LocalRedisServer | None = None
    if options.database is None:
        server = LocalRedisServer(STATE_DIR / "redis")
        url = server.start()
        say.say(f"started redis-server at {url} (data in {server.directory})")
        shown_database = f"{url} (started by kvspec; data in {server.directory})"
    else:
        url = shown_database = options.database
    try:
        return _run(options, campaign, url, shown_database, report_dir, logs, say,
                    server, layers=options.layers or list(LAYER_NAMES))
    finally:
        if server is not None:
            server.stop()
            say.say(f"stopped redis-server at {url}")


def _run(options: CampaignOptions, campaign: str, url: str, shown_database: str,
         report_dir: Path, logs: Path, say: _Progress, server: LocalRedisServer | None,
         layers: list[str]) -> CampaignOutcome:
    from rq import Queue, Retry
    from rq.registry import StartedJobRegistry

    store = CampaignStore(url, campaign)
    try:
        store.ping()
    except _redis_errors() as error:
        raise RedisUnavailable(f"no Redis answers at {url}: {error}") from None
    started = time.time()
    seed = options.seed if options.seed is not None else random.randrange(2**31)
    known = {(f["target"], f["profile"], f["layer"]) for f in store.known_failures()}
    shards = plan(campaign, options.target, url, options.budget, options.workers, layers,
                  options.profiles, options.policies, seed, options.shard_budget,
                  first=lambda target, profile, label: (target, profile, label) in known)
    events: list[dict[str, Any]] = []

    def event(kind: str, text: str) -> None:
        t = time.time() - started
        events.append({"t": t, "kind": kind, "text": text})
        with contextlib.suppress(*_redis_errors()):
            store.add_event(kind, text, t)
        say.say(text)

    connection = redis_client(url)
    queue = Queue(QUEUE, connection=connection)
    for shard in shards:
        store.update_shard(shard.job, status="queued", attempts=0, **{
            k: v for k, v in asdict(shard).items() if k not in ("campaign", "database", "job")})

    def start_work() -> float:
        """Queue the shards; the budget counts from now."""
        now = time.time()
        store.start({"campaign": campaign, "started": started, "budget": options.budget,
                     "deadline": now + options.budget + JOB_SLACK_SECONDS,
                     "target": options.target, "workers": options.workers,
                     "database": shown_database, "seed": seed})
        for shard in shards:
            queue.enqueue(run_shard, asdict(shard), job_id=shard.job,
                          job_timeout=int(shard.budget + JOB_SLACK_SECONDS),
                          retry=Retry(max=RETRIES), result_ttl=7 * 86400,
                          failure_ttl=30 * 86400, description=f"kvspec shard {shard.job}")
        return now

    if known:
        event("replay", f"{len(known)} known failure kind(s) in the database: their shards "
              "run first and replay them before generating")
    event("plan", f"{len(shards)} shards of {shards[0].budget:.1f} s each on "
          f"{options.workers} local worker(s); queue {QUEUE!r} at {url}")
    fits = int(options.budget * max(options.workers, 1) // (shards[0].budget + SHARD_OVERHEAD))
    if fits < len(shards):
        event("plan", f"the budget fits about {fits} of the {len(shards)} shards on "
              f"{options.workers} worker(s); the rest are reported as not run unless more "
              "workers join (raise --budget or --workers)")
    # The shards are queued once every local worker listens, and the budget counts from then:
    # a worker's start-up (slow on a loaded machine) is not the campaign's time, and a first
    # wave of shards goes to every local worker, not to the first one up.
    workers = [_spawn_worker(url, i, logs) for i in range(options.workers)]
    work_started: float | None = None
    deadline = started + WORKERS_START_SECONDS + options.budget
    timeline: list[dict[str, Any]] = []
    lost_since: float | None = None
    seen_attempts: dict[str, int] = {}
    exit_code, message = 0, ""
    job_ids = [shard.job for shard in shards]
    try:
        while True:
            now = time.time()
            try:
                records = store.shards()
                if lost_since is not None:
                    event("redis", f"Redis at {url} answers again after "
                          f"{now - lost_since:.0f} s")
                    lost_since = None
                if work_started is None and (_listening(queue, workers)
                                             or now - started > WORKERS_START_SECONDS):
                    work_started = start_work()
                    deadline = work_started + options.budget
                    if workers:
                        listening = sum(process.poll() is None for process in workers)
                        event("plan", f"{listening} local worker(s) listening after "
                              f"{work_started - started:.0f} s; shards queued, the budget "
                              "counts from now")
                StartedJobRegistry(QUEUE, connection=connection).cleanup()
            except _redis_errors() as error:
                if lost_since is None:
                    lost_since = now
                    event("redis", f"Redis at {url} unreachable ({error}); waiting up to "
                          f"{options.redis_grace:.0f} s")
                if now - lost_since > options.redis_grace:
                    exit_code = 2
                    message = (f"Redis at {url} unreachable for {options.redis_grace:.0f} s; "
                               "stopped the workers (examples found are kept in their "
                               "spools, .kvspec/spool, and pushed by the next run)")
                    event("redis", message)
                    break
                time.sleep(1.0)
                continue
            done = [j for j in job_ids if records.get(j, {}).get("status")
                    in ("finished", "skipped", "failed", "abandoned")]
            running = [j for j in job_ids if records.get(j, {}).get("status") == "started"]
            _check_jobs(queue, records, store, seen_attempts, event)
            point = {"t": now - started,
                     "examples": sum(int(r.get("examples", 0)) for r in records.values()),
                     "steps": sum(int(r.get("steps", 0)) for r in records.values()),
                     "failures": len(store.failures()),
                     "reached": 0}
            timeline.append(point)
            if work_started is None:  # waiting for the local workers to listen
                time.sleep(0.2)
                continue
            say.show(f"[{now - work_started:5.0f}s/{options.budget:.0f}s] shards {len(done)}/"
                     f"{len(job_ids)} done, {len(running)} running | {point['examples']:,} "
                     f"examples, {point['steps']:,} steps | failures {point['failures']}")
            if len(done) == len(job_ids):
                break
            alive = [p for p in workers if p.poll() is None]
            if now > deadline + 5:
                # Out of time: what is queued is not run; what runs ends at its budget.
                for job in queue.get_jobs():
                    if job.id in job_ids:
                        job.cancel()
                        store.update_shard(job.id, status="not run")
                        job_ids.remove(job.id)
                if now > deadline + JOB_SLACK_SECONDS or not running:
                    break
            elif len(alive) < options.workers and queue.count:
                for process in workers:
                    if process.poll() is not None and process.returncode != 0:
                        event("worker", f"a local worker exited with {process.returncode}; "
                              "started another")
                workers = alive + [_spawn_worker(url, len(workers) + i, logs)
                                   for i in range(options.workers - len(alive))]
            time.sleep(1.0)
    except KeyboardInterrupt:
        exit_code, message = 2, "interrupted"
        event("stop", "interrupted: stopping the workers")
    finally:
        _stop_workers(workers)
    say.show("done")
    unreadable: tuple[type[BaseException], ...] = (RedisUnavailable, *_redis_errors())
    try:
        data = merge(store, options, shown_database, timeline, events)
        exported = export(url, EXPORTED)
        event("export", f"{exported} example(s) exported to {EXPORTED} (kvspec audit "
              "replays them)")
    except unreadable as error:
        say.say(f"could not read the campaign's records from {url}: {error}")
        return CampaignOutcome({}, 2, report_dir, message or str(error))
    data["events"] = events
    _write_report(data, report_dir)
    if exit_code == 0 and data["failures"]:
        exit_code = 1
    return CampaignOutcome(data, exit_code, report_dir, message)


def _check_jobs(queue: Any, records: dict[str, dict[str, Any]], store: CampaignStore,
                seen_attempts: dict[str, int], event: Callable[[str, str], None]) -> None:
    """Report the shards RQ retried after a crash (a new attempt began) and mark those it
    gave up on (its failed-job registry)."""
    from rq.job import Job, JobStatus

    for job_id, record in records.items():
        if record.get("status") in ("finished", "skipped", "failed", "not run"):
            continue
        if record.get("status") == "queued" and job_id not in seen_attempts:
            continue  # not started yet: nothing to ask RQ
        attempts = store.attempts(job_id)
        if len(attempts) > seen_attempts.get(job_id, 1) and len(attempts) > 1:
            event("shard", f"shard {job_id} crashed on {attempts[-2]['worker']}; RQ runs it "
                  f"again (attempt {len(attempts)}) on {attempts[-1]['worker']}")
        seen_attempts[job_id] = len(attempts)
        try:
            job = Job.fetch(job_id, connection=queue.connection)
        except Exception:  # expired or deleted: nothing more to learn
            continue
        if job.get_status(refresh=False) == JobStatus.FAILED:
            store.update_shard(job_id, status="failed", attempts=len(attempts))
            event("shard", f"shard {job_id} failed {len(attempts)} time(s); RQ keeps it in "
                  "its failed-job registry")


def merge(store: CampaignStore, options: CampaignOptions, database: str,
          timeline: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[str, Any]:
    """The campaign's records merged into `report.CampaignData`."""
    meta = store.meta()
    records = store.shards()
    results = store.results()
    shards = []
    coverage: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for job, record in sorted(records.items()):
        result = results.get(job, {})
        label = layer_label(record["layer"], record.get("policy"))
        shards.append({
            "job": job, "layer": label, "target": record.get("target", options.target),
            "profile": record["profile"], "policy": record.get("policy"),
            "seed": int(record.get("seed", 0)), "worker": result.get(
                "worker", record.get("worker", "")),
            "status": record.get("status", "queued"),
            "attempts": max(len(store.attempts(job)), 1 if result else 0),
            "started": result.get("started", record.get("started")),
            "finished": result.get("finished", record.get("finished")),
            "examples": int(result.get("examples", record.get("examples", 0))),
            "steps": int(result.get("steps", record.get("steps", 0))),
            "replayed": int(result.get("replayed", 0)),
            "failures": int(result.get("failures", record.get("failures", 0)))})
        reached: list[tuple[str, str, int]] = [(row["kind"], row["name"], int(row["steps"]))
                                               for row in result.get("rows", [])]
        reached += [("event", name, int(count))
                    for name, count in result.get("events", {}).items()]
        for kind, name, count in reached:
            entry = coverage.setdefault((label, record["profile"], kind, name), {
                "layer": label, "profile": record["profile"], "kind": kind, "name": name,
                "count": 0, "shards": 0})
            entry["count"] += count
            entry["shards"] += 1 if count else 0
    started = float(meta.get("started", time.time()))
    # What was reached by each moment: the coverage of the shards finished by then (a shard
    # reports its coverage when it ends).
    reached_when: list[tuple[float, set[tuple[str, str, str, str]]]] = []
    for job, result in results.items():
        record = records.get(job, {})
        label = layer_label(record.get("layer", ""), record.get("policy"))
        names = {(label, record.get("profile", ""), row["kind"], row["name"])
                 for row in result.get("rows", []) if row["steps"]}
        names |= {(label, record.get("profile", ""), "event", name)
                  for name in result.get("events", {})}
        reached_when.append((float(result.get("finished", started)) - started, names))
    for point in timeline:
        seen: set[tuple[str, str, str, str]] = set()
        for t, names in reached_when:
            if t <= point["t"]:
                seen |= names
        point["reached"] = len(seen)
    return {
        "campaign": store.campaign, "started": started, "finished": time.time(),
        "budget": float(meta.get("budget", options.budget)), "workers": options.workers,
        "database": database, "target": options.target, "shards": shards,
        "coverage": sorted(coverage.values(), key=lambda e: (e["layer"], e["profile"],
                                                             e["kind"], e["name"])),
        "not_reached": [{k: e[k] for k in ("layer", "profile", "kind", "name")}
                        for e in coverage.values() if not e["count"] and e["kind"] != "event"],
        "failures": _numbered(store.failures()),
        "timeline": timeline, "events": events,
    }


def _numbered(failures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The failures in the order found, each with a short id for the report (F1, F2, ...);
    the full identity (`failure_id`) stays as ``key``."""
    ordered = sorted(failures, key=lambda f: f["found_at"])
    return [dict(f, key=f["id"], id=f"F{n}") for n, f in enumerate(ordered, 1)]


def _write_report(data: dict[str, Any], report_dir: Path) -> None:
    from kvspec.campaign import report

    (report_dir / "campaign.json").write_text(json.dumps(data, indent=1))
    report.write_html(data, report_dir / "report.html")  # type: ignore[arg-type]
    (report_dir / "report.txt").write_text(report.render_table(data))  # type: ignore[arg-type]
