"""KV-cache planning mutants: bugs in the sizing arithmetic vLLM's engine core calls at
start-up (impl/kv_cache_sizing.py, through impl/kv_cache_planning.py and models/plan.py),
each killed by
tests/test_kv_cache_planning.py's hand-worked vLLM cases."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvspec.impl import kv_cache_sizing
from kvspec.models import plan
from tests.mutants import Mutant, replace

PLANNING = "tests/test_kv_cache_planning.py"


def group_size_slack_too_wide() -> None:
    """A bucket under 1.5x the smallest sets the group size (vLLM 0.13: under 1.25x): four
    full-attention and five sliding-window layers get groups of 5, not 4."""
    replace(kv_cache_sizing, "_GROUP_SIZE_SLACK", 1.5)


def consecutive_group_cuts() -> None:
    """A bucket is cut into groups of consecutive layers instead of every k-th layer."""
    def split_into_groups(named_specs: Sequence[tuple[str, Any]]) -> list[Any]:
        buckets: dict[Any, list[str]] = {}
        for name, spec in named_specs:
            buckets.setdefault(spec, []).append(name)
        if not buckets:
            return []
        sizes = [len(names) for names in buckets.values()]
        group_size = min(sizes)
        if max(sizes) < group_size * kv_cache_sizing._GROUP_SIZE_SLACK:
            group_size = max(sizes)
        return [(spec, [names[i:i + group_size] for i in range(0, len(names), group_size)])
                for spec, names in buckets.items()]
    replace(plan, "split_into_groups", split_into_groups)


def _mutant(name: str, plant: Any, checker: str = PLANNING) -> Mutant:
    description = " ".join((plant.__doc__ or "").split())
    return Mutant(name, description, plant, (checker,))


MUTANTS: list[Mutant] = [
    _mutant("planning_group_size_slack_too_wide", group_size_slack_too_wide),
    # Named by the test that kills it: the comparison with vLLM 0.13 before it starts vLLM's
    # Python (where .venv-vllm-0.13.0 is built), some 8 s of every run.
    _mutant("planning_consecutive_group_cuts", consecutive_group_cuts,
            f"{PLANNING}::test_planning_a_shipped_model_gives_the_plan_commands_config"),
]
