"""CrossHair finds no input on which spec/attention_rules.py and impl's rules differ.

``crosshair diffbehavior`` runs both functions on symbolic inputs (negative and zero sizes
included) and reports any input where results or exception types differ. Each pair runs in a
subprocess with a wall-clock cap; a CrossHair that cannot run here skips the test.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# CrossHair's limits are CPU seconds, which a loaded machine stretches in wall time (48 s
# with the cores shared among a dozen processes): the subprocess's timeout only stops a hang.
HANG_CAP = 600

RULES = (
    "blocks_needed",
    "num_blocks_to_allocate",
    "sliding_window_skipped_tokens",
    "chunked_local_skipped_tokens",
    "mamba_skipped_tokens",
    "skipped_blocks",
    "sliding_window_blocks_for_hit",
    "full_attention_hit_blocks",
    "sliding_window_hit",
    "chunked_local_hit",
    "mamba_hit_blocks",
)


@pytest.mark.skipif(importlib.util.find_spec("crosshair") is None,
                    reason="crosshair-tool is not installed")
@pytest.mark.parametrize("rule", RULES)
def test_spec_and_impl_rules_agree(rule: str) -> None:
    command = [
        sys.executable, "-m", "crosshair", "diffbehavior",
        "--exception_equivalence", "SAME_TYPE", "--per_condition_timeout", "3",
        f"kvspec.spec.attention_rules.{rule}", f"kvspec.impl.single_type_kv_cache_manager.{rule}",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=HANG_CAP,
                            check=False)
    assert result.returncode == 0 and "No differences found" in result.stdout, (
        f"crosshair diffbehavior {rule}:\n{result.stdout}\n{result.stderr}")
