"""vLLM's real Scheduler over many steps: with kvspec's KV-cache code in place through the
plugin, every step's scheduler output is vLLM's own, under vLLM 0.13 and under 0.33.

The release is the one this interpreter imports (``make vllm-loop VLLM=0.13.0`` or
``VLLM=0.33.0`` runs it in that release's environment). Each of the release's 15 workloads of
tests/vllm_loop.py (five shapes, each under three seeds) runs twice, in two processes: once
with vLLM's own KV-cache code, once after ``kvspec.vllm_plugin.install()``, which puts
kvspec's ``KVCacheManager`` in place under vLLM 0.13, and kvspec's ``BlockPool`` alone, under
vLLM 0.33's own managers and coordinators (``vllm_api`` "0.33"), under 0.33.

- vLLM 0.13's shapes: chunked prefill, preemption under memory pressure, priority scheduling
  with LoRA and cache salts, aborts, prefix-cache resets, and a full plus sliding-window
  hybrid with a roomy and a tight pool, KV events on.
- vLLM 0.33's shapes: chunked prefill with resets and cache salts; preemption under a tight
  pool; priority scheduling with forced resets; a full-attention + Mamba hybrid in
  ``mamba_cache_mode="align"`` with prefix caching, 64-token blocks hashed every 16 tokens,
  with a roomy and a tight pool; aborts everywhere, KV events on.

Per step the traces hold the block ids of new and cached requests, their computed tokens, the
scheduled tokens, the preempted and finished ids, the common-prefix block counts, the KV
events, the KV-cache usage, the prefix-cache stats, eviction samples, the outputs and the
whole block table of every running request; under 0.13 also (with a sliding-window group) the
refused allocations that freed blocks; under 0.33 also the blocks to zero and the block copies
(Mamba copy-on-write), the hits by source, the outputs' prefill stats, the free-block count
and every ``BlockPool.cache_partial_block`` call (request, block, tokens, group, returned
hash). Every step of every workload is compared, with no cut-off and no emulation. Under 0.33
nothing is tolerated, and the Mamba workloads must reach ``cache_partial_block`` (the calls
are counted on each side). Under 0.13 the steps must be equal but for one difference, a vLLM
bug (docs/findings.md, M2):

- vLLM 0.13's refused ``allocate_slots`` leaves an empty ``req_to_blocks`` entry, which
  ``get_num_common_prefix_blocks`` counts as a request, so vLLM reports 0 common-prefix blocks
  in every group while a refused request waits; kvspec leaves no entry. Tolerated only at
  steps where vLLM's tables hold an empty entry and its count is 0.

(D7, a refused allocation that frees the blocks that left the sliding window, is no
difference: kvspec's vllm-0.13 profile frees them as vLLM does.) The last test prints the
counts: per workload the steps, KV events and block-table rows compared, the steps explained
by M2 (0.13) or the ``cache_partial_block`` calls (0.33), the steps that differed otherwise,
and their totals.

Run in a vLLM environment (skipped without vLLM)::

    .venv-vllm-0.13.0/bin/python -m pytest tests/test_vllm_scheduler_loop.py
    .venv-vllm-0.33.0/bin/python -m pytest tests/test_vllm_scheduler_loop.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from benchmarks.scheduler_loop import UnsupportedRelease
from tests.vllm_loop import (
    LOOP_WORKLOADS,
    Explained,
    StepRecord,
    comparison_counts,
    first_difference,
    summary,
    vllm_release,
)

try:
    RELEASE = vllm_release()
except UnsupportedRelease as error:
    pytest.skip(str(error), allow_module_level=True)
WORKLOADS = LOOP_WORKLOADS[RELEASE]
REPO_ROOT = Path(__file__).resolve().parent.parent

Traces = dict[str, dict[str, Any]]


def _run_side(side: str, out: Path) -> dict[str, Any]:
    """Every workload's trace with one side's KV-cache code, from a fresh interpreter."""
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_TARGET_DEVICE="cpu",
               VLLM_LOGGING_LEVEL="ERROR")
    env.pop("VLLM_USE_KVSPEC", None)  # the vLLM side must keep vLLM's code
    done = subprocess.run([sys.executable, "-m", "tests.vllm_loop", "--side", side,
                           "--release", RELEASE, "--out", str(out)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise AssertionError(f"the {side} side failed ({done.returncode}):\n"
                             f"{done.stderr[-4000:]}")
    traces: dict[str, Any] = json.loads(out.read_text())
    return traces


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Traces]:
    folder = tmp_path_factory.mktemp("traces")
    with ThreadPoolExecutor(2) as pool:  # the two sides run side by side
        futures = {side: pool.submit(_run_side, side, folder / f"{side}.json")
                   for side in ("vllm", "kvspec")}
        return {side: future.result() for side, future in futures.items()}


def m2_explained(vllm_step: StepRecord, kvspec_step: StepRecord) -> set[str]:
    """The keys M2 accounts for at this step (see the module docstring)."""
    if (vllm_step.get("empty_table_entries", 0) > 0
            and kvspec_step.get("empty_table_entries", 0) == 0
            and not any(vllm_step.get("num_common_prefix_blocks", ()))):
        return {"empty_table_entries", "num_common_prefix_blocks"}
    return set()


# The differences each release's comparison tolerates: M2 under 0.13 (a vLLM 0.13 bug in the
# manager kvspec replaces there); none under 0.33, where the managers are vLLM's on both sides.
EXPLAINED: dict[str, Explained | None] = {"0.13": m2_explained, "0.33": None}


def test_each_side_runs_its_own_kv_cache_code(traces: dict[str, Traces]) -> None:
    for name in WORKLOADS:
        ours, theirs = traces["vllm"][name], traces["kvspec"][name]
        assert ours["kvspec_build"] is None
        if RELEASE == "0.13":
            assert ours["manager"] == "vllm.v1.core.kv_cache_manager"
            assert theirs["manager"] == "kvspec.impl.kv_cache_manager"
            continue
        assert ours["pool"] == "vllm.v1.core.block_pool"
        # BlockPool(...) inside a vLLM 0.33 process builds 0.33's pool, BlockPool033.
        assert theirs["pool"] == "kvspec.impl.block_pool_033"
        assert theirs["kvspec_build"] in ("compiled", "pure-Python")
        # 0.33's manager layer stays vLLM's on both sides.
        for side in ("vllm", "kvspec"):
            assert traces[side][name]["manager"] == "vllm.v1.core.kv_cache_manager"


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_step_is_vllms(traces: dict[str, Traces], name: str) -> None:
    ours, theirs = traces["vllm"][name]["steps"], traces["kvspec"][name]["steps"]
    assert len(ours) == len(theirs) == WORKLOADS[name].steps
    difference = first_difference(ours, theirs, EXPLAINED[RELEASE])
    if difference is not None:
        pytest.fail(f"{name}: {difference[1]}")
    assert traces["vllm"][name]["partial_calls"] == traces["kvspec"][name]["partial_calls"]


@pytest.mark.skipif(RELEASE != "0.33", reason="partial prefix-cache entries are vLLM 0.33's")
def test_hybrid_workloads_cache_partial_blocks(traces: dict[str, Traces]) -> None:
    """Every Mamba workload calls ``BlockPool.cache_partial_block``, on each side, and some
    of those calls register a partial entry (return a hash); in each Mamba shape requests
    are scheduled from a prefix-cache hit that ends inside a block (a partial entry hit)."""
    sub_block_hits: dict[str, int] = {}
    for name, workload in WORKLOADS.items():
        if workload.mamba:
            shape = name.rsplit("-", 1)[0]
            sub_block_hits[shape] = sub_block_hits.get(shape, 0) + sum(
                computed % workload.block_size != 0
                for step in traces["vllm"][name]["steps"]
                for _, _, computed in step.get("new", ()))
        for side in ("vllm", "kvspec"):
            calls = traces[side][name]["partial_calls"]
            if not workload.mamba:
                assert calls == 0, (side, name)
                continue
            assert calls > 0, (side, name)
            registered = sum(call[-1] is not None for step in traces[side][name]["steps"]
                             for call in step.get("partial_caches", ()))
            assert registered > 0, (side, name)
    assert sub_block_hits and all(hits > 0 for hits in sub_block_hits.values()), sub_block_hits


def test_workloads_exercise_what_they_claim(traces: dict[str, Traces]) -> None:
    """Every kind of event the test is about happens, in each shape."""
    totals: dict[str, dict[str, int]] = {}
    for name, trace in traces["vllm"].items():
        shape = name.rsplit("-", 1)[0]
        for key, value in summary(trace["steps"]).items():
            totals.setdefault(shape, {}).setdefault(key, 0)
            totals[shape][key] += value
    everywhere: tuple[str, ...] = ("prefix-cache hit tokens", "aborts", "BlockStored",
                                   "BlockRemoved", "finished by EOS or length")
    if RELEASE == "0.33":
        everywhere += ("successful resets", "AllBlocksCleared")
    for shape, counts in totals.items():
        for key in everywhere:
            assert counts[key] > 0, (shape, key, counts)
    assert totals["chunked"]["chunked prefills"] > 0
    if RELEASE == "0.13":
        assert totals["chunked"]["successful resets"] > 0
        assert totals["priority"]["successful resets"] > 0
        tight, roomy = "hybrid-preempt", "hybrid"
    else:
        tight, roomy = "mamba-preempt", "mamba"
    for shape in ("preempt", "priority", tight):
        assert totals[shape]["preemptions"] > 0 and totals[shape]["resumptions"] > 0, shape
    assert totals[roomy]["preemptions"] == 0  # the roomy pool
    if RELEASE == "0.13":
        # The tight hybrid pool reaches D7's case: refusals that free out-of-window blocks.
        refusals = sum(bool(step.get("refusals_that_freed"))
                       for name, trace in traces["vllm"].items() if name.startswith(tight)
                       for step in trace["steps"])
        assert refusals > 0
    else:
        for shape in (roomy, tight):
            assert totals[shape]["partial caches"] > 0, shape
            assert totals[shape]["block copies"] > 0, shape  # Mamba copy-on-write


def test_print_counts(traces: dict[str, Traces], capsys: pytest.CaptureFixture[str]) -> None:
    """Print what was compared, past pytest's capture, so that ``make vllm-loop`` shows it
    (the last test of the file: pytest runs them in order)."""
    # The fourth column: the steps M2 explains (0.13), or the cache_partial_block calls,
    # which must be equal on both sides (0.33).
    fourth = "M2 steps" if RELEASE == "0.13" else "partial"
    header = (f"{'workload':<18} {'steps':>6} {'events':>7} {'tables':>7} "
              f"{fourth:>8} {'differences':>11}")
    if RELEASE == "0.13":
        title = "vLLM's scheduler, vLLM's manager against kvspec's, every step compared:"
    else:
        builds = sorted({str(trace["kvspec_build"]) for trace in traces["kvspec"].values()})
        title = ("vLLM 0.33's scheduler and managers, vLLM's BlockPool against kvspec's "
                 f"({', '.join(builds)} build), every step compared:")
    lines = ["", title, header]
    totals = dict.fromkeys(("steps", "events", "tables", "fourth", "differences"), 0)
    for name in WORKLOADS:
        ours, theirs = traces["vllm"][name], traces["kvspec"][name]
        counts = comparison_counts(ours["steps"], theirs["steps"], EXPLAINED[RELEASE])
        if RELEASE == "0.13":
            counts["fourth"] = counts["explained"]
        else:
            counts["fourth"] = ours["partial_calls"]
            counts["differences"] += ours["partial_calls"] != theirs["partial_calls"]
        for key in totals:
            totals[key] += counts[key]
        lines.append(f"{name:<18} {counts['steps']:>6} {counts['events']:>7} "
                     f"{counts['tables']:>7} {counts['fourth']:>8} "
                     f"{counts['differences']:>11}")
    lines.append(f"{f'all {len(WORKLOADS)} workloads':<18} {totals['steps']:>6} "
                 f"{totals['events']:>7} {totals['tables']:>7} {totals['fourth']:>8} "
                 f"{totals['differences']:>11}")
    if RELEASE == "0.33":
        lines.append("(partial: BlockPool.cache_partial_block calls, equal on both sides)")
    with capsys.disabled():
        print("\n".join(lines))
    assert totals["steps"] == sum(w.steps for w in WORKLOADS.values())
    assert totals["differences"] == 0
