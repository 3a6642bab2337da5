"""The benchmarks still run (not how fast: speed is measured by benchmarks/, never here).

A benchmark is not run by the test suite otherwise, so an API change that breaks one (a
machine rule's new arguments, a renamed keyword) would only show at the next measurement.
Each is run here on the smallest inputs it takes.
"""

from __future__ import annotations

from benchmarks import bench_checker, bench_offload, bench_soak


def test_the_checker_benchmark_drives_the_pool_machine() -> None:
    assert bench_checker.steps_per_second(examples=2, steps=10) > 0


def test_the_soaks_run_and_report_every_interval() -> None:
    for soak in (bench_soak.pool_soak(num_blocks=2_000, total_ops=20_000, intervals=2),
                 bench_soak.manager_soak(num_blocks=2_000, total_ops=20_000, intervals=2)):
        assert len(soak.intervals) == 2 and soak.ops >= 20_000
        assert all(interval.traced is not None for interval in soak.intervals)


def test_the_offload_benchmark_runs_every_phase() -> None:
    rows, _ = bench_offload.measure((500,), runs=1, big=(400, 200), max_fresh=200)
    assert len(rows) == 2 * len(bench_offload.PHASES) + 2
    assert all(row["impl"] > 0 for row in rows)
