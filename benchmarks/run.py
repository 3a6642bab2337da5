"""Run every benchmark side by side with vLLM and print the ratios.

    python -m benchmarks.run [--quick] [--vllm-python PATH] [--only pool,checker,...]
    python -m benchmarks.run --only soak       # opt-in: impl/ alone, minutes (bench_soak.py)
    python -m benchmarks.run --only scheduler033 --vllm-python .venv-vllm-0.33.0/bin/python
    python -m benchmarks.run --only offload --quick  # opt-in: the offloading managers

vLLM is timed in the same process as impl/ when it is importable; ``--vllm-python`` re-runs
this module under that interpreter (for example ``.venv-vllm-0.13.0/bin/python``, built by
``make vllm-env``), which has the repository on its path. Without vLLM, impl/ alone is timed.
impl/ is timed as this process imports it: compiled when ``make compile`` has built it,
pure Python with ``KVSPEC_PURE_PYTHON=1``; the first line says which.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import bench_pool

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm-0.13.0" / "bin" / "python"


def _vllm_block_pool() -> Any | None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        module = importlib.import_module("vllm.v1.core.block_pool")
    except ImportError:
        return None
    return module.BlockPool


def _row(workload: str, unit: str, ours: float, theirs: float | None,
         higher_is_better: bool = True) -> dict[str, Any]:
    ratio = None
    if theirs:
        ratio = ours / theirs if higher_is_better else theirs / ours
    return {"workload": workload, "unit": unit, "impl": ours, "vllm": theirs,
            "speedup": ratio}


def pool_rows(quick: bool) -> list[dict[str, Any]]:
    from kvspec.impl.block_pool import BlockPool

    vllm_pool = _vllm_block_pool()
    runs = 2 if quick else 5
    rows = []

    def both(measure: Callable[[Any], float], higher: bool = True) -> tuple[float, float | None]:
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(runs):  # alternate, so drift hits both alike
            ours.append(measure(BlockPool))
            if vllm_pool is not None:
                theirs.append(measure(vllm_pool))
        pick = max if higher else min
        return pick(ours), (pick(theirs) if theirs else None)

    for n in (100_000, 1_000_000):
        def construct(cls: Any, n: int = n) -> float:
            return bench_pool.construct_seconds(cls, n)
        ours_s, theirs_s = both(construct, False)
        rows.append(_row(f"a. construct {n:,} blocks", "ms", ours_s * 1e3,
                         None if theirs_s is None else theirs_s * 1e3, False))
    ours_b, theirs_b = both(
        lambda cls: -bench_pool.construct_bytes_per_block(cls, 1_000_000), True)
    rows.append(_row("a. bytes per block (1M)", "B", -ours_b,
                     None if theirs_b is None else -theirs_b, False))
    requests = 40_000 if quick else 150_000
    for caching in (False, True):
        def alloc_free(cls: Any, caching: bool = caching) -> float:
            return bench_pool.alloc_free_blocks_per_second(cls, caching, num_requests=requests)
        ours_r, theirs_r = both(alloc_free)
        rows.append(_row(f"b. alloc+free, caching {'on' if caching else 'off'}", "M blocks/s",
                         ours_r / 1e6, None if theirs_r is None else theirs_r / 1e6))
    workload = bench_pool.PrefixWorkload.make(num_requests=3_000 if quick else 10_000)
    hit_rates: dict[str, float] = {}

    def c2(cls: Any) -> float:
        rate, hit_rate = bench_pool.prefix_blocks_per_second(cls, workload)
        hit_rates["vllm" if cls is vllm_pool else "impl"] = hit_rate
        return rate

    ours_c, theirs_c = both(c2)
    rows.append(_row(f"c2. prefix workload (hit rate {hit_rates['impl']:.3f})", "M blocks/s",
                     ours_c / 1e6, None if theirs_c is None else theirs_c / 1e6))
    if "vllm" in hit_rates and abs(hit_rates["vllm"] - hit_rates["impl"]) > 1e-12:
        raise AssertionError(f"hit rates differ: {hit_rates}: the pools behave differently")
    return rows


def checker_rows(quick: bool) -> list[dict[str, Any]]:
    from benchmarks import bench_checker

    steps = bench_checker.steps_per_second(examples=10 if quick else 40)
    return [_row("checker: machine steps/s (16 blocks)", "steps/s", steps, None)]


def _module_rows(name: str, quick: bool) -> list[dict[str, Any]]:
    try:
        module = importlib.import_module(f"benchmarks.{name}")
    except ImportError as error:
        print(f"(skipping {name}: {error})", file=sys.stderr)
        return []
    rows: list[dict[str, Any]] = module.run(quick=quick)
    if rows and "impl" not in rows[0]:  # one row per implementation: join them
        by_side = {row["implementation"]: row for row in rows}
        ours = by_side["kvspec"]
        theirs = by_side.get("vllm")
        return [_row(f"{ours['workload']} (hit rate {ours['token_hit_rate']})", "M blocks/s",
                     ours["blocks_per_s"] / 1e6,
                     None if theirs is None else theirs["blocks_per_s"] / 1e6)]
    return rows


def _scheduler_rows(release: str, quick: bool) -> list[dict[str, Any]]:
    """benchmarks/bench_scheduler.py's rows for one vLLM release (none where this interpreter
    imports another)."""
    from benchmarks import bench_scheduler

    return bench_scheduler.run(quick=quick, release=release)


SECTIONS: dict[str, Callable[[bool], list[dict[str, Any]]]] = {
    "pool": pool_rows,
    "checker": checker_rows,
    "manager": lambda quick: _module_rows("bench_manager", quick),
    "block_table": lambda quick: _module_rows("bench_block_table", quick),
    # vLLM 0.13's own Scheduler stepping with each manager: the step and its KV-cache share.
    "scheduler": lambda quick: _scheduler_rows("0.13", quick),
    # vLLM 0.33's Scheduler with vLLM's BlockPool vs kvspec's (--vllm-python of a 0.33 env).
    "scheduler033": lambda quick: _scheduler_rows("0.33", quick),
    # Memory and speed over ~10M block operations on a 1M-block pool, impl/ alone.
    "soak": lambda quick: _module_rows("bench_soak", quick),
    # The KV offloading managers (impl/kv_offload/) against vLLM 0.13's or 0.33's.
    "offload": lambda quick: _module_rows("bench_offload", quick),
}
# Run only when --only names them: the soak takes minutes (benchmarks/bench_soak.py),
# scheduler033 needs a vLLM 0.33 interpreter (benchmarks/bench_scheduler.py), and the
# offloading managers' full run (1M keys) takes minutes (benchmarks/bench_offload.py).
OPT_IN = frozenset({"soak", "scheduler033", "offload"})


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer and smaller runs")
    parser.add_argument("--vllm-python", help="an interpreter that can import vLLM")
    parser.add_argument("--only", default=",".join(n for n in SECTIONS if n not in OPT_IN),
                        help=f"comma-separated sections of {', '.join(SECTIONS)} (default: "
                        f"all but {', '.join(sorted(OPT_IN))})")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    vllm_python = args.vllm_python or (str(DEFAULT_VLLM_PYTHON)
                                       if DEFAULT_VLLM_PYTHON.exists() else None)
    if vllm_python and _vllm_block_pool() is None and not os.environ.get("KVSPEC_FORWARDED"):
        forwarded = list(argv if argv is not None else sys.argv[1:])
        env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu",
                   KVSPEC_FORWARDED="1")
        return subprocess.call([vllm_python, "-m", "benchmarks.run", *forwarded,
                                "--vllm-python", vllm_python], env=env, cwd=ROOT)
    version = None
    if _vllm_block_pool() is not None:
        import vllm

        version = getattr(vllm, "__version__", "?")
    from kvspec import impl

    build = "compiled with mypyc" if impl.COMPILED else "pure Python"
    print(f"python {sys.version.split()[0]}; impl/ {build}; "
          f"vLLM side by side: {version or 'not importable'}")
    rows: list[dict[str, Any]] = []
    for name in args.only.split(","):
        section = SECTIONS[name.strip()](args.quick)
        for row in section:
            print(f"  {row['workload']:<44} {row.get('unit', ''):>11}  impl {_fmt(row['impl']):>10}"
                  f"  vllm {_fmt(row.get('vllm')):>10}  speedup {_fmt(row.get('speedup'))}",
                  flush=True)
        rows.extend(section)
    if args.json:
        Path(args.json).write_text(json.dumps({"vllm": version, "impl": build, "rows": rows},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
