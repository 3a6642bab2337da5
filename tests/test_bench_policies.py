"""The policy benchmark's traces and rows are sane (speed is never asserted)."""

from __future__ import annotations

from benchmarks import bench_policies


def test_every_policy_serves_both_quick_traces() -> None:
    rows = bench_policies.run(quick=True)
    kvspec_rows = [r for r in rows if r["implementation"] == "kvspec"]
    assert {(r["trace"], r["policy"]) for r in kvspec_rows} == {
        (t, p) for t in ("agent", "chat") for p in bench_policies.POLICIES}
    for row in rows:
        assert 0.0 <= row["token_hit_rate"] <= 1.0
        assert row["blocks_per_s"] > 0
