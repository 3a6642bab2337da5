"""The attention layer (conformance/attention_manager_machine.py): each attention type's
single-type manager called directly, against the spec, on impl (this interpreter) and on
vLLM 0.13 (its environment, when built: skipped otherwise)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvspec.conformance import attention_manager_machine as machine

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_013 = REPO_ROOT / ".venv-vllm-0.13.0" / "bin" / "python"


TestImplAttentionManagersConformToSpec = machine.machine_for(machine.adapter_for("impl")).TestCase


def test_the_two_planted_cases_of_issue_19() -> None:
    """The two bugs the coordinators mask, as the spec states them."""
    from kvspec.spec import manager as model, pool as P
    from kvspec.spec.manager import GroupSpec, Kind

    full = GroupSpec(Kind.FULL, 1)
    pool = P.new_pool(8, True, False)
    hashes = [bytes([i]) * 32 for i in range(2)]
    pool, taken = P.get_new_blocks(pool, 4)  # 1, 2 in group 0; 3, 4 in group 1
    pool = P.cache_full_blocks(pool, taken[:1], hashes, 0, 1, 0, token_ids=(0,), block_size=1)
    pool = P.cache_full_blocks(pool, taken[2:], hashes, 0, 2, 1, token_ids=(0, 1),
                               block_size=1)
    assert model.type_cache_hit(pool, full, [0, 1], hashes, 2, 1, False) == ((1,), (3,))
    window = GroupSpec(Kind.SLIDING_WINDOW, 2, sliding_window=4)
    assert model.skipped_blocks_to_free((0, 0, 0, 4, 5, 6), window, 11) == (3,)


def test_attention_layer_on_vllm_013() -> None:
    """vLLM 0.13's managers conform but for the known findings B1 and M2 (docs/findings.md),
    which the run steps around; `kvspec audit --layer attention` reports them."""
    if not VLLM_013.exists():
        pytest.skip("no .venv-vllm-0.13.0 (make vllm-env VLLM=0.13.0 builds it)")
    script = (
        "from hypothesis import settings\n"
        "from hypothesis.stateful import run_state_machine_as_test\n"
        "from kvspec.conformance import attention_manager_machine as m\n"
        "machine = m.machine_for(m.adapter_for('vllm'), frozenset({'B1', 'M2'}))\n"
        "run_state_machine_as_test(machine, settings=settings("
        "max_examples=300, stateful_step_count=25, deadline=None, derandomize=True))\n")
    run = subprocess.run([str(VLLM_013), "-c", script], capture_output=True, text=True,
                         cwd=REPO_ROOT, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
