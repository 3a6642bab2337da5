"""Baselines: a previous audit result (``--json``) whose discrepancies count as known.

An audit with ``--baseline FILE`` passes when it finds no discrepancy beyond FILE's: a failure
is known when its layer, kind, check, situation and error type are listed there.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvspec.conformance.audit import AuditResult


class BaselineError(ValueError):
    """A --baseline file that cannot be read as a kvspec audit result."""


BaselineKey = tuple[str, str, str, str, str]  # layer, kind, check, situation, error


def read_baseline(path: Path) -> frozenset[BaselineKey]:
    """The discrepancies a previous result (written by --json) lists."""
    try:
        data = json.loads(path.read_text())
        return frozenset((layer["layer"], f["kind"], f["check"], f["situation"], f["error"])
                         for layer in data["layers"] for f in layer["failures"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise BaselineError(f"cannot read baseline {str(path)!r} as a kvspec audit result: "
                            f"{error}") from error


def apply_baseline(audit: AuditResult, known: frozenset[BaselineKey], name: str) -> None:
    """Mark the failures listed in known (the baseline called name) as known."""
    audit.baseline = name
    for layer in audit.audited:
        for failure in layer.failures:
            failure.known = (layer.layer, *failure.key) in known

