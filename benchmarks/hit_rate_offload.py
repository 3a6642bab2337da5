"""Token hit rate of a CPU offload tier behind bench_policies' small GPU pool.

The ``agent`` and ``chat`` traces of ``benchmarks/bench_policies.py`` (``make_trace``, seed 0)
are served by its own loop (``serve``: one request per scheduler step, the oldest of
``MAX_RUNNING`` freed first) through kvspec's ``KVCacheManager`` with the ``lru`` policy
(vLLM 0.13's) and its default pool (agent 1200 blocks, chat 700; a quarter with ``--quick``),
block size 16. Each request's prefix is looked up on the GPU first, then in a CPU tier driven
the way vLLM 0.13's ``OffloadingConnector`` drives its ``OffloadingManager`` (scheduler side,
offloaded block size = GPU block size), with every transfer done at the end of the step
that issued it:

1. ``get_num_new_matched_tokens``: ``touch`` every full block's hash of the request, then
   ``lookup`` the hashes after the GPU hit; the leading run found (at least one block) is
   loaded (the connector reports it as asynchronous);
2. ``update_state_after_alloc``: ``prepare_load`` of those blocks; the load step ends with
   ``complete_load``;
3. ``build_connector_meta`` (the step that computes the rest of the prompt):
   ``prepare_store`` of the full blocks after the loaded ones (from block 0 when nothing was
   loaded); None skips the store; else, when it stored anything, ``touch`` of every full
   block up to there; the step ends with ``complete_store``.

The GPU side is unchanged by the tier (the same blocks are allocated and cached: what the
CPU serves is allocated as the GPU misses are), so every row of a trace has the same GPU
hits. ``from GPU`` / ``from CPU`` = prompt tokens found on the GPU / loaded from the CPU tier
(the connector's count: it may include the prompt's last full block, which a GPU hit never
does), over all prompt tokens; ``recovered`` = CPU tokens / (prompt tokens - GPU tokens).
CPU tier sizes: ``CPU_FACTORS`` times the GPU pool's blocks.

The managers are a parameter (``--manager``): kvspec's (``kvspec.impl.kv_offload``) when
importable, else vLLM 0.13's (``vllm.v1.kv_offload``). vLLM 0.13's ARC manager raises
KeyError when the connector touches a key whose store is pending (``touch`` pops it from T1,
then ``move_to_end`` of the popped key); that run is reported as the crash, not as numbers.

Run: ``python -m benchmarks.hit_rate_offload [--quick] [--manager kvspec|vllm]``; with
vLLM's managers: ``PYTHONPATH=. .venv-vllm-0.13.0/bin/python -m benchmarks.hit_rate_offload
--manager vllm``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_policies

BLOCK_SIZE = bench_policies.BLOCK_SIZE
GPU_POLICY = "lru"
CPU_FACTORS = (2, 4, 8)
TIER_POLICIES = ("lru", "arc")
MANAGER_MODULES = {
    "kvspec": ("kvspec.impl.kv_offload.lru_manager", "kvspec.impl.kv_offload.arc_manager"),
    "vllm": ("vllm.v1.kv_offload.lru_manager", "vllm.v1.kv_offload.arc_manager"),
}
VLLM_ARC_CRASH = "vLLM 0.13 ARC: KeyError at touch of a pending key"


@dataclass(frozen=True)
class Managers:
    """Which implementation's offloading managers, and their two classes."""

    implementation: str
    classes: dict[str, Callable[..., Any]]  # "lru" / "arc" -> class(backend, enable_events)


def manager_classes(which: str | None = None) -> Managers | None:
    """The ``which`` managers (kvspec's first, then vLLM's, when None); None if none import."""
    for name in (which,) if which else ("kvspec", "vllm"):
        try:
            lru, arc = (importlib.import_module(m) for m in MANAGER_MODULES[name])
        except ImportError:
            continue
        return Managers(name, {"lru": lru.LRUOffloadingManager,
                               "arc": arc.ARCOffloadingManager})
    return None


class _Slot:
    """A CPU block as the managers see it: vLLM's ``BlockStatus`` (ref_cnt -1: pending)."""

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = -1

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


class CPUSlots:
    """A tiny CPU backend (vLLM's ``Backend`` methods, duck-typed): ``num_blocks`` slots."""

    medium = "CPU"

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))

    def get_num_free_blocks(self) -> int:
        return len(self._free)

    def allocate_blocks(self, block_hashes: list[Any]) -> list[_Slot]:
        assert len(block_hashes) <= len(self._free), "allocate past the free count"
        return [_Slot(self._free.pop()) for _ in block_hashes]

    def free(self, block: _Slot) -> None:
        self._free.append(block.block_id)

    def get_load_store_spec(self, block_hashes: Any, blocks: Any) -> list[int]:
        return [block.block_id for block in blocks]


class OffloadTier:
    """The scheduler side of vLLM 0.13's ``OffloadingConnector`` (offloaded block = GPU
    block), transfers completing at the end of their step; counts what it served."""

    def __init__(self, manager: Any, block_size: int = BLOCK_SIZE) -> None:
        self.manager = manager
        self.block_size = block_size
        self._matched: dict[str, tuple[int, int]] = {}  # request id -> (GPU, CPU) tokens
        self.gpu_tokens = self.cpu_tokens = 0
        self.stored_blocks = self.stores_refused = self.requests = 0

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        size = self.block_size
        num_blocks = request.num_tokens // size
        hashes = request.block_hashes
        assert len(hashes) == num_blocks
        self.manager.touch(hashes)
        ext = 0
        if num_blocks * size - num_computed_tokens >= size:
            start = num_computed_tokens // size
            hits = self.manager.lookup(hashes[start:])
            if hits:
                ext = size * (start + hits) - num_computed_tokens
                if ext < size:
                    ext = 0
        self._matched[request.request_id] = (num_computed_tokens, ext)
        return ext

    def scheduled(self, request: Any) -> None:
        """The request got its GPU slots: load what the CPU holds, then store the rest."""
        gpu, ext = self._matched.pop(request.request_id)
        size, manager, hashes = self.block_size, self.manager, request.block_hashes
        self.requests += 1
        self.gpu_tokens += gpu
        self.cpu_tokens += ext
        next_stored = 0
        if ext:  # update_state_after_alloc; the load step ends
            loaded = hashes[gpu // size:(gpu + ext) // size]
            manager.prepare_load(loaded)
            manager.complete_load(loaded)
            next_stored = (gpu + ext) // size
        num_blocks = request.num_tokens // size  # build_connector_meta of the compute step
        if num_blocks <= next_stored:
            return
        output = manager.prepare_store(hashes[next_stored:num_blocks])
        if output is None:
            self.stores_refused += 1
            return
        stored = list(output.block_hashes_to_store)
        if not stored:
            return
        manager.touch(hashes[:num_blocks])
        manager.complete_store(stored)  # the compute step ends
        self.stored_blocks += len(stored)


class _TieredManager:
    """bench_policies' ``serve`` loop sees a KVCacheManager; the tier rides on its calls."""

    def __init__(self, gpu: Any, tier: OffloadTier) -> None:
        self._gpu = gpu
        self._tier = tier

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gpu, name)

    def get_computed_blocks(self, request: Any) -> tuple[Any, int]:
        hits, num_hit = self._gpu.get_computed_blocks(request)
        self._tier.get_num_new_matched_tokens(request, num_hit)
        return hits, num_hit

    def allocate_slots(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        new = self._gpu.allocate_slots(request, *args, **kwargs)
        if new is not None:
            self._tier.scheduled(request)
        return new


def serve_trace(trace: bench_policies.Trace,
                tier: OffloadTier | None = None) -> tuple[int, int, int]:
    """Serve the trace through bench_policies' loop: GPU hit, CPU hit, prompt tokens."""
    gpu = bench_policies.impl_manager(trace.num_blocks, GPU_POLICY)
    requests = bench_policies.impl_requests(trace, GPU_POLICY)
    manager = gpu if tier is None else _TieredManager(gpu, tier)
    _, _, hit_tokens, prompt_tokens = bench_policies.serve(manager, requests, trace)
    if tier is None:
        return hit_tokens, 0, prompt_tokens
    assert tier.gpu_tokens == hit_tokens and tier.requests == len(requests)
    return hit_tokens, tier.cpu_tokens, prompt_tokens


def prefix_ceiling(trace: bench_policies.Trace) -> int:
    """Prompt tokens an unbounded cache would serve: each request's leading full blocks
    that some earlier request computed (the bound that no tier size can pass)."""
    seen: set[Any] = set()
    hits = 0
    for request in bench_policies.impl_requests(trace, GPU_POLICY):
        hashes = request.block_hashes
        run = 0
        while run < len(hashes) and hashes[run] in seen:
            run += 1
        hits += run * BLOCK_SIZE
        seen.update(hashes)
    return hits


def _row(name: str, tier: str, cpu_blocks: int | None, gpu_hits: int, cpu_hits: int,
         tokens: int, error: str | None = None) -> dict[str, Any]:
    misses = tokens - gpu_hits
    return {
        "trace": name, "tier": tier, "cpu_blocks": cpu_blocks, "error": error,
        "gpu_tokens": gpu_hits, "cpu_tokens": None if error else cpu_hits,
        "gpu_hit_rate": round(gpu_hits / tokens, 4),
        "cpu_hit_rate": None if error else round(cpu_hits / tokens, 4),
        "total_hit_rate": None if error else round((gpu_hits + cpu_hits) / tokens, 4),
        "recovered": None if error or tier == "none" else round(cpu_hits / misses, 4),
    }


def run(quick: bool = False, traces: tuple[str, ...] = ("agent", "chat"),
        managers: Managers | None = None,
        factors: tuple[int, ...] = CPU_FACTORS,
        policies: tuple[str, ...] = TIER_POLICIES) -> list[dict[str, Any]]:
    """One row per trace for the GPU pool alone, then per CPU tier size and policy."""
    managers = managers or manager_classes()
    if managers is None:
        raise RuntimeError("no offloading managers: neither kvspec's nor vLLM's import")
    rows: list[dict[str, Any]] = []
    for name in traces:
        trace = bench_policies.make_trace(name, quick)
        gpu_hits, _, tokens = serve_trace(trace)
        rows.append(_row(name, "none", None, gpu_hits, 0, tokens))
        for factor in factors:
            cpu_blocks = factor * trace.num_blocks
            for policy in policies:
                tier = OffloadTier(managers.classes[policy](CPUSlots(BLOCK_SIZE, cpu_blocks),
                                                           False))
                try:
                    hits = serve_trace(trace, tier)
                except KeyError:
                    if (managers.implementation, policy) != ("vllm", "arc"):
                        raise
                    rows.append(_row(name, policy, cpu_blocks, gpu_hits, 0, tokens,
                                     f"{VLLM_ARC_CRASH} (request index {tier.requests - 1})"))
                    continue
                if hits[0] != gpu_hits:
                    raise AssertionError(f"{name}: the tier changed the GPU hits: "
                                         f"{hits[0]} != {gpu_hits}")
                rows.append(_row(name, policy, cpu_blocks, *hits))
        ceiling = prefix_ceiling(trace)
        for row in rows:
            row.setdefault("ceiling_hit_rate", round(ceiling / tokens, 4))
            row.setdefault("requests", len(trace.requests))
            row.setdefault("gpu_blocks", trace.num_blocks)
            row.setdefault("prompt_tokens", tokens)
    for row in rows:
        row["managers"] = managers.implementation
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = ["| trace | GPU blocks | CPU tier | CPU blocks | from GPU | from CPU | total | "
             "recovered |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tier = "none" if r["tier"] == "none" else f"{r['tier'].upper()} ({r['managers']})"
        cpu = "-" if r["cpu_blocks"] is None else (
            f"{r['cpu_blocks']} ({r['cpu_blocks'] // r['gpu_blocks']}x)")
        if r["error"]:
            lines.append(f"| {r['trace']} | {r['gpu_blocks']} | {tier} | {cpu} | "
                         f"{r['gpu_hit_rate']:.3f} | {r['error']} | | |")
            continue
        recovered = "-" if r["recovered"] is None else f"{r['recovered']:.3f}"
        lines.append(f"| {r['trace']} | {r['gpu_blocks']} | {tier} | {cpu} | "
                     f"{r['gpu_hit_rate']:.3f} | {r['cpu_hit_rate']:.3f} | "
                     f"{r['total_hit_rate']:.3f} | {recovered} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="quarter-size traces")
    parser.add_argument("--trace", choices=["agent", "chat", "all"], default="all")
    parser.add_argument("--manager", choices=sorted(MANAGER_MODULES), default=None,
                        help="whose offloading managers (default: kvspec's, else vLLM's)")
    args = parser.parse_args(argv)
    managers = manager_classes(args.manager)
    if managers is None:
        print(f"no offloading managers importable ({args.manager or 'kvspec, vllm'})",
              file=sys.stderr)
        return 2
    traces = ("agent", "chat") if args.trace == "all" else (args.trace,)
    rows = run(args.quick, traces, managers)
    print(table(rows))
    for name in traces:
        r = next(r for r in rows if r["trace"] == name)
        print(f"{name}: {r['requests']} requests, {r['prompt_tokens']} prompt tokens, "
              f"GPU pool {r['gpu_blocks']} blocks; an unbounded cache would hit "
              f"{r['ceiling_hit_rate']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
