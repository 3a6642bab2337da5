"""vLLM 0.33's real Scheduler over many steps: with kvspec's ``BlockPool`` in place through the
plugin, every step's scheduler output is vLLM's own.

Under vLLM 0.33 ``kvspec.vllm_plugin.install()`` replaces ``vllm.v1.core.block_pool`` only:
vLLM 0.33's ``KVCacheManager``, coordinators and single-type managers run over kvspec's pool
(``vllm_api`` "0.33"). Each workload of tests/vllm_loop_033.py (chunked prefill with resets
and cache salts; preemption under a tight pool; priority scheduling with forced resets; a
full-attention + Mamba hybrid in ``mamba_cache_mode="align"`` with prefix caching, 64-token
blocks hashed every 16 tokens, with a roomy and a tight pool; aborts everywhere, KV events on;
each shape under three seeds: 15 workloads) runs twice, in two processes: once with vLLM's
own pool, once after ``install()``. Per step the traces hold the block ids of new and cached
requests, their computed tokens, the scheduled tokens, the preempted and finished ids, the
common-prefix block counts, the blocks to zero and the block copies (Mamba copy-on-write),
the KV events, the KV-cache usage, the prefix-cache stats (and hits by source), eviction
samples, the outputs with their prefill stats, the whole block table of every running
request, the free-block count, and every ``BlockPool.cache_partial_block`` call (request,
block, tokens, group, returned hash). Every step of every workload is compared, with no
cut-off and nothing tolerated. The hybrid workloads must reach ``cache_partial_block`` (the
calls are counted on each side). The last test prints the counts.

Run in the vLLM 0.33 environment (skipped without vLLM 0.33)::

    .venv-vllm-0.33.0/bin/python -m pytest tests/test_vllm_scheduler_loop_033.py
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
if not importlib.metadata.version("vllm").startswith("0.33."):
    pytest.skip("needs vLLM 0.33 (tests/test_vllm_scheduler_loop.py is 0.13's)",
                allow_module_level=True)

from tests.vllm_loop_033 import (
    ALL_WORKLOADS,
    comparison_counts,
    first_difference,
    summary,
)

REPO_ROOT = Path(__file__).resolve().parent.parent

Traces = dict[str, dict[str, Any]]


def _run_side(side: str, out: Path) -> dict[str, Any]:
    """Every workload's trace with one side's pool, from a fresh interpreter."""
    env = dict(os.environ, PYTHONHASHSEED="0", VLLM_TARGET_DEVICE="cpu",
               VLLM_LOGGING_LEVEL="ERROR")
    env.pop("VLLM_USE_KVSPEC", None)  # the vLLM side must keep vLLM's pool
    done = subprocess.run([sys.executable, "-m", "tests.vllm_loop_033", "--side", side,
                           "--out", str(out)],
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


def test_each_side_runs_its_own_pool(traces: dict[str, Traces]) -> None:
    for name in ALL_WORKLOADS:
        assert traces["vllm"][name]["pool"] == "vllm.v1.core.block_pool"
        assert traces["kvspec"][name]["pool"] == "kvspec.impl.block_pool"
        assert traces["vllm"][name]["kvspec_build"] is None
        assert traces["kvspec"][name]["kvspec_build"] in ("compiled", "pure-Python")
        # 0.33's manager layer stays vLLM's on both sides.
        for side in ("vllm", "kvspec"):
            assert traces[side][name]["manager"] == "vllm.v1.core.kv_cache_manager"


@pytest.mark.parametrize("name", list(ALL_WORKLOADS))
def test_every_step_is_vllms(traces: dict[str, Traces], name: str) -> None:
    ours, theirs = traces["vllm"][name]["steps"], traces["kvspec"][name]["steps"]
    assert len(ours) == len(theirs) == ALL_WORKLOADS[name].steps
    difference = first_difference(ours, theirs)
    if difference is not None:
        pytest.fail(f"{name}: {difference[1]}")
    assert traces["vllm"][name]["partial_calls"] == traces["kvspec"][name]["partial_calls"]


def test_hybrid_workloads_cache_partial_blocks(traces: dict[str, Traces]) -> None:
    """Every Mamba workload calls ``BlockPool.cache_partial_block``, on each side, and some
    of those calls register a partial entry (return a hash); in each Mamba shape requests
    are scheduled from a prefix-cache hit that ends inside a block (a partial entry hit)."""
    sub_block_hits: dict[str, int] = {}
    for name, workload in ALL_WORKLOADS.items():
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
    for shape, counts in totals.items():
        for key in ("prefix-cache hit tokens", "aborts", "BlockStored", "BlockRemoved",
                    "finished by EOS or length", "successful resets", "AllBlocksCleared"):
            assert counts[key] > 0, (shape, key, counts)
    assert totals["chunked"]["chunked prefills"] > 0
    for shape in ("preempt", "priority", "mamba-preempt"):
        assert totals[shape]["preemptions"] > 0 and totals[shape]["resumptions"] > 0, shape
    assert totals["mamba"]["preemptions"] == 0  # the roomy pool
    for shape in ("mamba", "mamba-preempt"):
        assert totals[shape]["partial caches"] > 0, shape
        assert totals[shape]["block copies"] > 0, shape  # Mamba copy-on-write


def test_print_counts(traces: dict[str, Traces], capsys: pytest.CaptureFixture[str]) -> None:
    """Print what was compared, past pytest's capture, so that ``make vllm-loop`` shows it
    (the last test of the file: pytest runs them in order)."""
    header = (f"{'workload':<18} {'steps':>6} {'events':>7} {'tables':>7} "
              f"{'partial':>8} {'differences':>11}")
    builds = sorted({str(trace["kvspec_build"]) for trace in traces["kvspec"].values()})
    lines = ["", "vLLM 0.33's scheduler and managers, vLLM's BlockPool against kvspec's "
             f"({', '.join(builds)} build), every step compared:", header]
    totals = dict.fromkeys(("steps", "events", "tables", "partial", "differences"), 0)
    for name in ALL_WORKLOADS:
        counts = comparison_counts(traces["vllm"][name]["steps"],
                                   traces["kvspec"][name]["steps"])
        counts["partial"] = traces["vllm"][name]["partial_calls"]
        counts["differences"] += (traces["vllm"][name]["partial_calls"]
                                  != traces["kvspec"][name]["partial_calls"])
        for key in totals:
            totals[key] += counts[key]
        lines.append(f"{name:<18} {counts['steps']:>6} {counts['events']:>7} "
                     f"{counts['tables']:>7} {counts['partial']:>8} "
                     f"{counts['differences']:>11}")
    lines.append(f"{f'all {len(ALL_WORKLOADS)} workloads':<18} {totals['steps']:>6} "
                 f"{totals['events']:>7} {totals['tables']:>7} {totals['partial']:>8} "
                 f"{totals['differences']:>11}")
    lines.append("(partial: BlockPool.cache_partial_block calls, equal on both sides)")
    with capsys.disabled():
        print("\n".join(lines))
    assert totals["steps"] == sum(w.steps for w in ALL_WORKLOADS.values())
    assert totals["differences"] == 0
