"""Mutation scores: how many catalogue mutants each layer's machine kills.

``python -m tests.mutants`` writes its verdicts to ``build/mutants.json`` (one entry per
mutant, with the checker that ran it). Where the audit reads them is configuration, never the
package's own path (which points into site-packages once installed): the ``path`` given
(``kvspec audit --mutants FILE``), else the ``KVSPEC_MUTANTS`` environment variable, else
``build/mutants.json`` under the current directory (the repository root, where ``make audit``
and ``make mutants`` run).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ENVIRONMENT_VARIABLE = "KVSPEC_MUTANTS"
DEFAULT_PATH = Path("build") / "mutants.json"  # under the current directory


def mutants_path(path: Path | str | None = None) -> Path:
    """Where the mutation scores are read from: ``path``, else ``$KVSPEC_MUTANTS``, else
    `DEFAULT_PATH` under the current directory."""
    if path is not None:
        return Path(path)
    configured = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    return Path(configured) if configured else Path.cwd() / DEFAULT_PATH


def mutation_score(checker: str, cache: Path | None = None) -> dict[str, Any] | None:
    """How many catalogue mutants the machine in ``checker`` kills, from the cached results.

    ``python -m tests.mutants`` writes the cache; None when it has not been run.
    """
    path = mutants_path(cache)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    entries = [m for m in data.get("mutants", []) if checker in m.get("checker", [])]
    if not entries:
        return None
    killed = sum(1 for m in entries if m.get("killed"))
    return {
        "killed": killed, "total": len(entries),
        "survivors": [m.get("name", "?") for m in entries if not m.get("killed")],
        "measured": data.get("finished", "unknown"), "profile": data.get("profile", "unknown"),
        "source": str(path),
    }
