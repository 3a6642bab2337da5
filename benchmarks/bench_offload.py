"""The KV offloading managers: kvspec's impl/kv_offload/ against vLLM's, side by side.

kvspec's ``LRUOffloadingManager`` and ``ARCOffloadingManager`` (vLLM 0.13's API) and, when
``import vllm`` works in this interpreter, vLLM's own managers, on identical keys in one
process, alternating, best of several repetitions:

* vLLM 0.13 (``.venv-vllm-0.13.0``): ``vllm.v1.kv_offload.{lru,arc}_manager``; both sides get
  a fresh vLLM ``CPUBackend`` (ctypes blocks), so the backend costs the same on both;
* vLLM 0.33 (``.venv-vllm-0.33.0``): ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager``
  (``cache_policy="lru"|"arc"``), which has its own chunk pool and a per-key ``lookup`` and
  takes a ``ReqContext`` per call; kvspec gets this module's minimal list backend and the
  same keys (``make_offload_key(hash, 0)``).

Every manager has events on and its events are drained after each call batch. Keys are
32-byte hashes (36 under 0.33), in batches of 64 (one request's worth). Per size n, a manager
of capacity n runs: ``store`` (prepare_store + complete_store of n keys into the empty cache),
``lookup`` (all n, full hits), ``load`` (prepare_load + complete_load), ``touch`` (one pass;
ARC moves T1 to T2), then ``evict`` (storing fresh keys into the full cache, 64 evictions a
batch). Figures are keys per second; ``ratio`` = kvspec / vLLM. Two single-call cases time
one ``prepare_store`` of 5,000 new keys into a full ARC cache of 10,000 ready keys: with no
key pinned, and with the 5,000 least recent pinned by loads, where vLLM 0.13 rescans the
pinned keys for every victim (quadratic; vLLM #50992). They report milliseconds per call.

Run: ``PYTHONPATH=. .venv-vllm-0.13.0/bin/python -m benchmarks.bench_offload [--quick]`` (or
``.venv-vllm-0.33.0``), or ``python -m benchmarks.run --only offload``.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvspec.impl.kv_offload import ARCOffloadingManager, LRUOffloadingManager

BATCH = 64
BLOCK_SIZE = 16


class ListBlock:
    """A block of the list backend: what vLLM's ``CPUBlockStatus`` holds."""

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = -1


class ListSpec:
    """Where blocks are: their ids (vLLM's ``CPULoadStoreSpec`` holds a NumPy array)."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids

    @staticmethod
    def medium() -> str:
        return "CPU"


class ListBackend:
    """vLLM 0.13's ``CPUBackend`` logic with plain Python blocks (no vLLM needed)."""

    def __init__(self, num_blocks: int) -> None:
        self.block_size = BLOCK_SIZE
        self.medium = "CPU"
        self.num_blocks = num_blocks
        self.num_allocated = 0
        self.free_list: list[int] = []

    def get_num_free_blocks(self) -> int:
        return len(self.free_list) + self.num_blocks - self.num_allocated

    def allocate_blocks(self, block_hashes: list[Any]) -> list[ListBlock]:
        fresh = min(len(block_hashes), self.num_blocks - self.num_allocated)
        blocks = [ListBlock(i) for i in range(self.num_allocated, self.num_allocated + fresh)]
        self.num_allocated += fresh
        pop = self.free_list.pop
        blocks.extend(ListBlock(pop()) for _ in range(len(block_hashes) - fresh))
        return blocks

    def free(self, block: ListBlock) -> None:
        self.free_list.append(block.block_id)

    def get_load_store_spec(self, block_hashes: Iterable[Any],
                            blocks: Iterable[ListBlock]) -> ListSpec:
        return ListSpec([block.block_id for block in blocks])


@dataclass
class Side:
    """One implementation under test: a name and a factory of uniform drivers."""

    name: str
    make: Callable[[str, int], Driver]


class Driver:
    """vLLM 0.13's calls on a manager (0.33's are adapted by a subclass)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def lookup(self, keys: list[Any]) -> int:
        hits: int = self.manager.lookup(keys)
        return hits

    def prepare_load(self, keys: list[Any]) -> None:
        self.manager.prepare_load(keys)

    def complete_load(self, keys: list[Any]) -> None:
        self.manager.complete_load(keys)

    def touch(self, keys: list[Any]) -> None:
        self.manager.touch(keys)

    def store(self, keys: list[Any]) -> int:
        """prepare_store + complete_store of the keys; the number evicted."""
        out = self.manager.prepare_store(keys)
        if out is None:
            raise AssertionError("the benchmark's store did not fit")
        self.manager.complete_store(out.block_hashes_to_store)
        for _ in self.manager.take_events():
            pass
        return len(out.block_hashes_evicted)


class Driver033(Driver):
    """vLLM 0.33's ``CPUOffloadingManager``: one ReqContext per batch, lookup per key."""

    def __init__(self, manager: Any, context: Callable[[], Any], hit: Any) -> None:
        super().__init__(manager)
        self.context = context
        self.hit = hit

    def lookup(self, keys: list[Any]) -> int:
        lookup, ctx, hit = self.manager.lookup, self.context(), self.hit
        hits = 0
        for key in keys:
            if lookup(key, ctx) is not hit:
                break
            hits += 1
        return hits

    def prepare_load(self, keys: list[Any]) -> None:
        self.manager.prepare_load(keys, self.context())

    def complete_load(self, keys: list[Any]) -> None:
        self.manager.complete_load(keys, self.context())

    def touch(self, keys: list[Any]) -> None:
        self.manager.touch(keys, self.context())

    def store(self, keys: list[Any]) -> int:
        ctx = self.context()
        out = self.manager.prepare_store(keys, ctx)
        if out is None:
            raise AssertionError("the benchmark's store did not fit")
        self.manager.complete_store(out.keys_to_store, ctx)
        for _ in self.manager.take_events():
            pass
        return len(out.evicted_keys)


def sides() -> tuple[list[Side], str | None, Callable[[bytes], Any]]:
    """kvspec and, when importable, vLLM; the vLLM version; how a hash becomes a key."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    ours = {"lru": LRUOffloadingManager, "arc": ARCOffloadingManager}
    try:
        import vllm
    except ImportError:
        return ([Side("kvspec", lambda policy, n: Driver(
            ours[policy](ListBackend(n), enable_events=True)))], None, lambda h: h)
    version = str(getattr(vllm, "__version__", "?"))
    try:
        from vllm.v1.kv_offload.arc_manager import ARCOffloadingManager as VllmARC
        from vllm.v1.kv_offload.backends.cpu import CPUBackend
        from vllm.v1.kv_offload.lru_manager import LRUOffloadingManager as VllmLRU
    except ImportError:
        pass
    else:  # vLLM 0.13's layout: both sides on vLLM's CPUBackend
        theirs = {"lru": VllmLRU, "arc": VllmARC}

        def backend(n: int) -> Any:
            return CPUBackend(block_size=BLOCK_SIZE, num_blocks=n)

        return ([Side("kvspec", lambda policy, n: Driver(
                    ours[policy](backend(n), enable_events=True))),
                 Side("vllm", lambda policy, n: Driver(
                     theirs[policy](backend(n), enable_events=True)))],
                version, lambda h: h)
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    counter = iter(range(1 << 62))

    def context() -> Any:
        return ReqContext(req_id=f"bench-{next(counter)}")

    return ([Side("kvspec", lambda policy, n: Driver(
                ours[policy](ListBackend(n), enable_events=True))),
             Side("vllm", lambda policy, n: Driver033(
                 CPUOffloadingManager(num_chunks=n, cache_policy=policy, enable_events=True),
                 context, LookupResult.HIT))],
            version, lambda h: make_offload_key(h, 0))


def make_keys(count: int, to_key: Callable[[bytes], Any], seed: int) -> list[Any]:
    rng = random.Random(seed)
    return [to_key(rng.randbytes(32)) for _ in range(count)]


def batches(keys: list[Any]) -> list[list[Any]]:
    return [keys[i:i + BATCH] for i in range(0, len(keys), BATCH)]


def timed(step: Callable[[list[Any]], Any], groups: list[list[Any]]) -> float:
    """Seconds for ``step`` over every group."""
    start = time.perf_counter()
    for group in groups:
        step(group)
    return time.perf_counter() - start


def one_size(driver: Driver, keys: list[Any], fresh: list[Any]) -> dict[str, float]:
    """Seconds per phase on one manager of capacity len(keys)."""
    groups = batches(keys)
    out: dict[str, float] = {"store": timed(driver.store, groups)}
    hits = 0

    def lookup(group: list[Any]) -> None:
        nonlocal hits
        hits += driver.lookup(group)

    out["lookup"] = timed(lookup, groups)
    if hits != len(keys):
        raise AssertionError(f"{hits} lookup hits of {len(keys)}")

    def load(group: list[Any]) -> None:
        driver.prepare_load(group)
        driver.complete_load(group)

    out["load"] = timed(load, groups)
    out["touch"] = timed(driver.touch, groups)
    evicted = 0

    def evict(group: list[Any]) -> None:
        nonlocal evicted
        evicted += driver.store(group)

    out["evict"] = timed(evict, batches(fresh))
    if evicted != len(fresh):
        raise AssertionError(f"{evicted} evictions for {len(fresh)} fresh keys")
    return out


def one_big_store(driver: Driver, keys: list[Any], fresh: list[Any], pin: bool) -> float:
    """Seconds for one prepare_store of ``fresh`` into a full cache of ``keys``."""
    for group in batches(keys):
        driver.store(group)
    if pin:
        driver.prepare_load(keys[:len(fresh)])
    manager = driver.manager
    start = time.perf_counter()
    if isinstance(driver, Driver033):
        out = manager.prepare_store(fresh, driver.context())
        evicted = len(out.evicted_keys)
    else:
        out = manager.prepare_store(fresh)
        evicted = len(out.block_hashes_evicted)
    elapsed = time.perf_counter() - start
    if evicted != len(fresh):
        raise AssertionError(f"{evicted} evictions for {len(fresh)} fresh keys")
    return elapsed


PHASES = ("store", "lookup", "load", "touch", "evict")


def measure(sizes: Iterable[int], runs: int, big: tuple[int, int] = (10_000, 5_000),
            max_fresh: int = 100_000) -> tuple[list[dict[str, Any]], str | None]:
    """Rows of ``{workload, unit, impl, vllm, speedup}`` (run.py's shape), and vLLM's version.

    ``max_fresh`` bounds the keys the evict phase stores into the full cache."""
    all_sides, version, to_key = sides()
    rows: list[dict[str, Any]] = []
    for n in sizes:
        keys = make_keys(n, to_key, seed=n)
        fresh = make_keys(min(n, max_fresh), to_key, seed=n + 1)
        for policy in ("lru", "arc"):
            best: dict[str, dict[str, float]] = {}
            for _ in range(runs):
                for side in all_sides:  # alternate, so drift hits both alike
                    driver = side.make(policy, n)
                    gc.collect()
                    phases = one_size(driver, keys, fresh)
                    del driver
                    mine = best.setdefault(side.name, {})
                    for phase, value in phases.items():
                        mine[phase] = min(mine.get(phase, float("inf")), value)
            for phase in PHASES:
                count = len(fresh) if phase == "evict" else n
                ours = count / best["kvspec"][phase]
                theirs = count / best["vllm"][phase] if "vllm" in best else None
                rows.append({"workload": f"{policy.upper()} {phase}, {n:,} keys",
                             "unit": "M keys/s", "impl": ours / 1e6,
                             "vllm": None if theirs is None else theirs / 1e6,
                             "speedup": None if theirs is None else ours / theirs})
    capacity, count = big
    keys = make_keys(capacity, to_key, seed=1)
    fresh = make_keys(count, to_key, seed=2)
    for pin in (False, True):
        seconds: dict[str, float] = {}
        for _ in range(runs):
            for side in all_sides:
                driver = side.make("arc", capacity)
                gc.collect()
                value = one_big_store(driver, keys, fresh, pin)
                seconds[side.name] = min(seconds.get(side.name, float("inf")), value)
        what = f"{count:,} least recent pinned" if pin else "none pinned"
        theirs_ms = seconds["vllm"] * 1e3 if "vllm" in seconds else None
        rows.append({"workload": f"ARC one store evicting {count:,} of {capacity:,} "
                                 f"({what})", "unit": "ms/call",
                     "impl": seconds["kvspec"] * 1e3, "vllm": theirs_ms,
                     "speedup": None if theirs_ms is None
                     else theirs_ms / (seconds["kvspec"] * 1e3)})
    return rows, version


def measure_mode(quick: bool) -> tuple[list[dict[str, Any]], str | None]:
    """Quick: 10k and 100k keys, one run, 20k evictions. Full: also 1M, best of 3."""
    if quick:
        return measure((10_000, 100_000), runs=1, max_fresh=20_000)
    return measure((10_000, 100_000, 1_000_000), runs=3)


def run(quick: bool = False) -> list[dict[str, Any]]:
    """benchmarks/run.py's entry."""
    return measure_mode(quick)[0]


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="10k and 100k keys, one run (a smoke run: noisy figures)")
    args = parser.parse_args(argv)
    rows, version = measure_mode(args.quick)
    print(f"python {sys.version.split()[0]}; kvspec impl/kv_offload (pure Python); "
          f"vLLM side by side: {version or 'not importable'}")
    print(f"  {'workload':<56} {'unit':>9} {'kvspec':>9} {'vLLM':>9} {'ratio':>8}")
    for row in rows:
        print(f"  {row['workload']:<56} {row['unit']:>9} {_fmt(row['impl']):>9} "
              f"{_fmt(row['vllm']):>9} {_fmt(row['speedup']):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
