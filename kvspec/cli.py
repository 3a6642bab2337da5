"""The ``kvspec`` command: ``kvspec audit`` (conformance audit), ``kvspec plan``, ``kvspec
campaign`` (audits over many workers, conformance/campaign_cli.py) and ``kvspec events``
(a KV-event stream's oracle, conformance/events_check.py).

``kvspec audit --target impl|vllm|package.module:Class --profile vllm-0.13|vllm-0.33`` runs
the conformance machines of conformance against the target for a time budget, shows a
progress bar on stderr, then prints a table of every rule, situation and invariant with the
steps it checked and its verdict, the mutation score of each machine, and every failure with
its shrunk program, which it also writes out as a runnable pytest file.

Exit status: 0 when the target conforms, 1 when it does not, 2 on a usage or set-up error
(bad arguments, or a target that cannot be imported, is not a class, or cannot be built: one
line on stderr, never a conformance failure). With ``--baseline FILE`` (a previous ``--json``
result) the discrepancies FILE lists count as known: the status is 0 unless a new one appears.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from kvspec.conformance.arguments import positive_seconds, whole_number

EXIT_CONFORMS, EXIT_DOES_NOT_CONFORM, EXIT_USAGE = 0, 1, 2
DEFAULT_BUDGET = 30.0

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
    parser.add_argument("--budget", type=positive_seconds("budget"), default=DEFAULT_BUDGET,
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
    from kvspec.conformance.audit import run_audit
    from kvspec.conformance.baseline import BaselineError, apply_baseline, read_baseline
    from kvspec.conformance.counterexamples import write_counterexamples
    from kvspec.conformance.deadline import configured_seconds
    from kvspec.conformance.profiles import load_profile
    from kvspec.conformance.report import render_report, write_json
    from kvspec.spec.pool import Profile

    load_profile()
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
        from kvspec.conformance.example_db import DatabaseError, open_database

        try:
            database = open_database(database_spec, writer=False,
                                     local=Path(".kvspec/local-examples"),
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


def build_parser() -> argparse.ArgumentParser:
    from kvspec.conformance.campaign_cli import add_campaign_parser
    from kvspec.conformance.events_check import add_events_parser
    from kvspec.models.cli import add_plan_parser

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
