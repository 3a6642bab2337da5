"""One step of vLLM 0.33's real Scheduler: vLLM's BlockPool vs kvspec's, and the pool's share.

Under vLLM 0.33 the plugin replaces one module, ``vllm.v1.core.block_pool``: kvspec's
``BlockPool`` (``vllm_api="0.33"``) serves under vLLM 0.33's own ``KVCacheManager``,
coordinators and single-type managers (docs/plugin.md). So the comparison is one ``Scheduler``
class, one manager stack and one request block hasher (vLLM's ``get_request_block_hasher``,
which the plugin leaves in place under 0.33), with only the pool class differing.

How each side gets its pool, in one process: in vLLM 0.33 the one place a pool is built is
``KVCacheCoordinator.__init__`` (``vllm/v1/core/kv_cache_coordinator.py``), through the
module-level name ``BlockPool`` it imported from ``vllm.v1.core.block_pool``; every manager
and the ``KVCacheManager`` then share that object (``single_type_kv_cache_manager.py`` and
``kv_cache_utils.py`` import the name for annotations only). ``pool_class`` binds, while the
``Scheduler`` is built, every ``vllm.*`` module attribute that is vLLM's ``BlockPool`` to the
side's class, as the plugin's ``install()`` rebinds them (for good), and restores them after;
the built scheduler is checked to hold a pool of the side's class (``vllm_api`` "0.33" for
kvspec's) shared by all its managers. Before the first kvspec pool is built,
``host_types.bind_vllm()`` and ``block_pool.set_default_pool_api("0.33")`` do what
``install()`` does for the pool.

Two cases (``CASES``):

- full attention, one group of 16-token blocks, in steady state at 64 and 256 running
  requests, as benchmarks/bench_scheduler.py's 0.13 case (same prompts, outputs and pools:
  shared 512-token prefixes, evictions every step, no preemption);
- hybrid: a full-attention group and a Mamba group (``mamba_cache_mode="align"``), both of
  256-token blocks, hashed every 16 tokens (``prefix_match_unit``/``hash_block_size`` 16), so
  vLLM enables fine-grained (partial) prefix-cache hits: every step, ``cache_blocks`` of the
  full-attention manager registers each running request's prompt tail inside its block with
  ``BlockPool.cache_partial_block`` (``FullAttentionManager._cache_partial_tail_block``), the
  path vLLM PR #51333 measured at about 2.2 ms of a 23 ms engine step (29% of the
  scheduler-phase CPU) at roughly 900 running requests on a B200. Run at 896 running.

A step is ``schedule()`` then ``update_from_output()``; the simulated model's output is built
between the two, outside the clock (benchmarks/scheduler_loop.py's ``SimulatedModel``). Before
each step new requests are queued so that the running batch stays full. Prefix caching on, KV
events off, ``log_stats`` on, block hashing with vLLM's ``sha256``. Each pass freezes the heap
once the scheduler is built, as vLLM's engine core does (``freeze_gc_heap``).

Alternating the sides, ``repeats`` passes each of the plain step (nothing wrapped) and the
wrapped step; every pass is checked against vLLM's first plain pass (which also gives the hit
rate, the preemptions, the pool's use and the running batch): both sides schedule the same
tokens, see the same prefix-cache hits and hand out the same block ids at every step. In the
wrapped step ``TimedPool`` stands between vLLM's managers and scheduler and the pool, and
times every pool method they call (attribute reads pass through untimed). Both sides make the
same calls (checked). The time recorded per call includes the timer's floor (measured on a
method that does nothing), in both sides alike; ``pool_us_net_of_timer_floor`` takes it out.

Each time is ``best_of`` the passes: per step the least time any pass took, summed, per
measured step. Ratios are vLLM time / kvspec time (higher is better for kvspec). kvspec is
timed as this process imports it: compiled (mypyc) or pure Python (``KVSPEC_PURE_PYTHON=1``);
the first output line says which.

Run: ``PYTHONPATH=. .venv-vllm-0.33.0/bin/python -m benchmarks.bench_scheduler_033 [--quick]``,
or as the ``scheduler033`` section of ``python -m benchmarks.run --vllm-python
.venv-vllm-0.33.0/bin/python``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_scheduler import best_of
from benchmarks.scheduler_loop import (
    VOCAB,
    SimulatedModel,
    register_stand_in_model,
    write_model_config,
)

perf_counter = time.perf_counter
HASH_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Case:
    """One steady state: the KV-cache layout, the running batch, the pool, and the run."""

    name: str
    running: int
    num_gpu_blocks: int
    warmup_steps: int
    measured_steps: int
    hybrid: bool = False
    max_tokens: tuple[int, int] = (32, 256)
    seed: int = 0

    @property
    def block_size(self) -> int:
        """The groups' block size: 16 for full attention alone, 256 for the hybrid."""
        return 256 if self.hybrid else HASH_BLOCK_SIZE


CASES = (
    Case("full attention", 64, 1800, 300, 200),
    Case("full attention", 256, 5600, 300, 100),
    Case("hybrid attention + Mamba (align)", 896, 2400, 150, 30, hybrid=True,
         max_tokens=(32, 160)),
)
QUICK_CASES = (
    Case("full attention", 64, 1800, 250, 60),
    Case("full attention", 256, 5600, 200, 20),
    Case("hybrid attention + Mamba (align)", 896, 2400, 80, 8, hybrid=True,
         max_tokens=(32, 160)),
)


# -- building vLLM 0.33's scheduler ----------------------------------------------------------


@contextlib.contextmanager
def pool_class(cls: Any) -> Iterator[None]:
    """While inside, every ``vllm.*`` module attribute that is vLLM's ``BlockPool`` is ``cls``
    (the names the plugin's ``install()`` rebinds); restored on the way out."""
    from vllm.v1.core import block_pool

    theirs = block_pool.BlockPool
    bound: list[tuple[dict[str, Any], str]] = []
    if cls is not theirs:
        for name, module in list(sys.modules.items()):
            namespace = getattr(module, "__dict__", None)
            if not name.startswith("vllm.") or not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                if value is theirs:
                    namespace[attr] = cls
                    bound.append((namespace, attr))
    try:
        yield
    finally:
        for namespace, attr in bound:
            namespace[attr] = theirs


def build_scheduler(case: Case, folder: Path, pool_cls: Any) -> Any:
    """vLLM 0.33's ``Scheduler`` for ``case`` (built on the CPU from a local ``config.json``,
    nothing downloaded; benchmarks/scheduler_loop.py), its pool an instance of ``pool_cls``."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        ModelConfig,
        ObservabilityConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    register_stand_in_model()
    write_model_config(folder)
    block_size = case.block_size
    model_config = ModelConfig(model=str(folder), skip_tokenizer_init=True, max_model_len=2048,
                               dtype="float16", seed=0)
    scheduler_config = SchedulerConfig(
        max_num_seqs=case.running, max_num_batched_tokens=8192, max_model_len=2048,
        enable_chunked_prefill=True, policy="fcfs", is_encoder_decoder=False)
    hybrid: dict[str, Any] = {}
    if case.hybrid:
        hybrid = {"mamba_cache_mode": "align", "mamba_block_size": block_size,
                  "prefix_match_unit": HASH_BLOCK_SIZE}
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True, **hybrid)
    cache_config.num_gpu_blocks = case.num_gpu_blocks
    vllm_config = VllmConfig(
        model_config=model_config, cache_config=cache_config,
        scheduler_config=scheduler_config, device_config=DeviceConfig("cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=False, publisher="null"),
        observability_config=ObservabilityConfig())
    groups = [KVCacheGroupSpec(["model.layers.0.attn"], FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float16))]
    if case.hybrid:
        groups.append(KVCacheGroupSpec(["model.layers.1.mixer"], MambaSpec(
            block_size=block_size, shapes=((4, 8),), dtypes=(torch.float16,),
            mamba_cache_mode="align")))
    kv_cache_config = KVCacheConfig(num_blocks=case.num_gpu_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=groups)
    with pool_class(pool_cls):
        scheduler = Scheduler(
            vllm_config=vllm_config, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size, hash_block_size=HASH_BLOCK_SIZE, log_stats=True)
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    holders = [manager.coordinator, *manager.coordinator.single_type_managers]
    if type(pool) is not pool_cls or any(h.block_pool is not pool for h in holders):
        raise RuntimeError(f"the scheduler's pool is {type(pool)}, not {pool_cls}, or not "
                           "shared by all its managers")
    if getattr(pool, "vllm_api", "0.33") != "0.33":
        raise RuntimeError(f"kvspec's pool serves vLLM {pool.vllm_api}'s API, not 0.33's")
    if case.hybrid and not manager.coordinator.enable_partial_hash_hits:
        raise RuntimeError("the hybrid case did not enable vLLM's partial hash hits")
    return scheduler


@dataclass
class Side:
    name: str
    pool_cls: Any


def sides() -> list[Side]:
    """vLLM's pool and kvspec's, set up as the plugin sets kvspec's up under vLLM 0.33."""
    from vllm.v1.core import block_pool as vllm_block_pool

    from kvspec.impl import block_pool, host_types

    host_types.bind_vllm()
    block_pool.set_default_pool_api("0.33")
    return [Side("vllm", vllm_block_pool.BlockPool), Side("kvspec", block_pool.BlockPool)]


class RequestStream:
    """The requests of a case, in arrival order, as vLLM 0.33's ``Request``: one of 32
    popular 512-token prefixes (Zipf) plus 16..256 tokens of their own, ``max_tokens`` from
    the case's range (benchmarks/bench_scheduler.py's prompts)."""

    def __init__(self, case: Case, block_hasher: Callable[[Any], list[Any]]) -> None:
        self.case = case
        self.block_hasher = block_hasher
        self.rng = random.Random(f"{case.seed}:{case.running}:prompts")
        self.prefixes = [self._tokens(512) for _ in range(32)]
        self.popularity = [1.0 / (rank + 1) for rank in range(32)]
        self.count = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, VOCAB) for _ in range(n)]

    def next_request(self, arrival_time: float) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        rng = self.rng
        prefix = rng.choices(self.prefixes, weights=self.popularity)[0]
        prompt = prefix + self._tokens(rng.randint(16, 256))
        max_tokens = rng.randint(*self.case.max_tokens)
        request_id = f"r{self.count}"
        self.count += 1
        return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), None,
                       arrival_time=arrival_time, block_hasher=self.block_hasher)


def request_block_hasher() -> Callable[[Any], list[Any]]:
    """vLLM 0.33's request block hasher (both sides: the plugin leaves it in place), seeded as
    vLLM's engine core seeds it."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    hasher: Callable[[Any], list[Any]] = kv_cache_utils.get_request_block_hasher(
        HASH_BLOCK_SIZE, sha256)
    return hasher


# -- timing the pool -----------------------------------------------------------------------


class Clock:
    """Seconds and calls recorded inside the pool's methods, per method."""

    def __init__(self) -> None:
        self.by_method: dict[str, list[float]] = {}  # name -> [seconds, calls]

    def add(self, name: str, seconds: float) -> None:
        entry = self.by_method.get(name)
        if entry is None:
            entry = self.by_method[name] = [0.0, 0]
        entry[0] += seconds
        entry[1] += 1


class TimedPool:
    """Stands between vLLM's managers and scheduler and their pool: every method they call on
    it is timed into the clock; other attributes are read through, untimed."""

    def __init__(self, pool: Any, clock: Clock) -> None:
        self._inner = pool
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not callable(value):
            return value
        add = self._clock.add

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = perf_counter()
            result = value(*args, **kwargs)
            add(name, perf_counter() - start)
            return result
        self.__dict__[name] = timed  # later calls skip __getattr__
        return timed


def wrap_pool(scheduler: Any, clock: Clock) -> None:
    """Put a ``TimedPool`` in place of the pool wherever vLLM's objects hold it."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    timed = TimedPool(pool, clock)
    for holder in (manager, manager.coordinator, *manager.coordinator.single_type_managers):
        if holder.block_pool is pool:
            holder.block_pool = timed
    for referrer in gc.get_referrers(pool):  # nothing of vLLM's still holds the pool itself
        owner = type(referrer).__module__
        if owner.startswith("vllm.") and type(referrer).__name__ != "KVCacheBlock":
            raise RuntimeError(f"{type(referrer)} still holds the unwrapped pool")


def timer_floor_seconds(calls: int = 40_000, rounds: int = 15) -> float:
    """Seconds the clock records per call of a pool method doing nothing (least of
    ``rounds``, short ones, so that another process's burst is dropped)."""

    class Nothing:
        def get_num_free_blocks(self) -> int:
            return 0

    best = float("inf")
    for _ in range(rounds):
        clock = Clock()
        wrapped = TimedPool(Nothing(), clock)
        for _ in range(calls):
            wrapped.get_num_free_blocks()
        best = min(best, sum(s for s, _ in clock.by_method.values()))
    return best / calls


# -- one pass -----------------------------------------------------------------------------


@dataclass
class Pass:
    """What one pass over a case measured: lists hold one entry per measured step."""

    step_seconds: list[float] = field(default_factory=list)
    pool_seconds: list[float] = field(default_factory=list)
    pool_seconds_by_method: dict[str, list[float]] = field(default_factory=dict)
    calls_by_method: dict[str, int] = field(default_factory=dict)  # over the measured steps
    hit_tokens: int = 0
    query_tokens: int = 0
    preemptions: int = 0
    max_usage: float = 0.0
    running: int = 0  # least running requests over the measured steps
    fingerprint: list[int] = field(default_factory=list)


def run_pass(side: Side, case: Case, folder: Path, timed: bool = False) -> Pass:
    """Warm ``case`` up to steady state, then measure its steps (pool wrapped when
    ``timed``)."""
    scheduler = build_scheduler(case, folder, side.pool_cls)
    clock = Clock()
    if timed:
        wrap_pool(scheduler, clock)
    stream = RequestStream(case, request_block_hasher())
    model = SimulatedModel(case.seed, 0.0)
    result = Pass(running=case.running)
    gc.collect()
    gc.freeze()
    try:
        _run_steps(scheduler, case, stream, model, clock, result)
    finally:
        gc.unfreeze()
    return result


def _block_ids(output: Any) -> str:
    """The block ids the step hands out (to new and to running requests), as text."""
    new = [(r.req_id, r.block_ids) for r in output.scheduled_new_reqs]
    cached = output.scheduled_cached_reqs
    return repr((new, cached.req_ids, cached.new_block_ids))


def _run_steps(scheduler: Any, case: Case, stream: RequestStream, model: SimulatedModel,
               clock: Clock, result: Pass) -> None:
    queue_depth = max(4, case.running // 16)
    by_method = clock.by_method
    measured = case.measured_steps
    for index in range(case.warmup_steps + measured):
        while len(scheduler.waiting) < queue_depth:  # arrivals keep the batch full
            scheduler.add_request(stream.next_request(float(index)))
        before = {name: entry[:] for name, entry in by_method.items()}
        start = perf_counter()
        output = scheduler.schedule()
        scheduled = perf_counter()
        model_output = model.output(scheduler, output)
        resumed = perf_counter()
        engine_outputs = scheduler.update_from_output(output, model_output)
        end = perf_counter()
        if index < case.warmup_steps:
            continue
        step = index - case.warmup_steps
        result.step_seconds.append((scheduled - start) + (end - resumed))
        for name, (seconds, calls) in by_method.items():
            seconds_before, calls_before = before.get(name, (0.0, 0))
            per_step = result.pool_seconds_by_method.setdefault(name, [0.0] * measured)
            per_step[step] = seconds - seconds_before
            result.calls_by_method[name] = (result.calls_by_method.get(name, 0)
                                            + int(calls - calls_before))
        result.pool_seconds.append(sum(
            per_step[step] for per_step in result.pool_seconds_by_method.values()))
        stats = next(iter(engine_outputs.values())).scheduler_stats
        result.hit_tokens += stats.prefix_cache_stats.hits
        result.query_tokens += stats.prefix_cache_stats.queries
        result.preemptions += len(output.preempted_req_ids or ())
        result.max_usage = max(result.max_usage, stats.kv_cache_usage)
        result.running = min(result.running, len(scheduler.running))
        result.fingerprint.append(hash((tuple(output.num_scheduled_tokens.items()),
                                        stats.prefix_cache_stats.hits, _block_ids(output))))


def _vllm_importable() -> bool:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm
        import vllm.v1.core.sched.scheduler
    except Exception:  # vLLM absent or half-installed
        return False
    return str(getattr(vllm, "__version__", "")).startswith("0.33.")


@dataclass
class Measurement:
    """Both sides on one case: microseconds per measured step (``best_of`` the passes) by side
    name, and the case's character."""

    case: Case
    hit_rate: float
    preemptions: int
    max_usage: float
    min_running: int
    step_us: dict[str, float] = field(default_factory=dict)  # nothing wrapped
    wrapped_step_us: dict[str, float] = field(default_factory=dict)
    pool_us: dict[str, float] = field(default_factory=dict)
    pool_us_by_method: dict[str, dict[str, float]] = field(default_factory=dict)
    calls_by_method: dict[str, float] = field(default_factory=dict)  # per step


def measure(case: Case, repeats: int) -> Measurement:
    """Both sides on ``case``: ``repeats`` passes each of the plain and the wrapped step,
    alternating the sides; every pass checked against vLLM's first plain one."""
    both = sides()
    steps = case.measured_steps
    with tempfile.TemporaryDirectory(prefix="kvspec-bench-") as tmp:
        folder = Path(tmp) / "model"
        plain: dict[str, list[Pass]] = {side.name: [] for side in both}
        wrapped: dict[str, list[Pass]] = {side.name: [] for side in both}
        for repeat in range(repeats):
            order = both if repeat % 2 == 0 else both[::-1]  # alternate, so drift hits both
            for side in order:
                plain[side.name].append(run_pass(side, case, folder))
            for side in order:
                wrapped[side.name].append(run_pass(side, case, folder, timed=True))
    check = plain["vllm"][0]
    for name, one in ((n, p) for n in plain for p in plain[n] + wrapped[n]):
        if one.fingerprint != check.fingerprint:
            raise AssertionError(f"{case.name}, {case.running} running: {name}'s pool "
                                 "scheduled other tokens, hits or block ids than vLLM's")
    calls = {name: [p.calls_by_method for p in passes] for name, passes in wrapped.items()}
    if any(c != calls["vllm"][0] for per_side in calls.values() for c in per_side):
        raise AssertionError(f"the managers called the two pools differently: {calls}")
    result = Measurement(case, check.hit_tokens / max(1, check.query_tokens),
                         check.preemptions, check.max_usage, check.running)
    result.calls_by_method = {name: n / steps for name, n in sorted(calls["vllm"][0].items())}
    for name in plain:
        result.step_us[name] = best_of([p.step_seconds for p in plain[name]]) / steps * 1e6
        result.wrapped_step_us[name] = best_of(
            [p.step_seconds for p in wrapped[name]]) / steps * 1e6
        result.pool_us[name] = best_of([p.pool_seconds for p in wrapped[name]]) / steps * 1e6
        result.pool_us_by_method[name] = {
            method: best_of([p.pool_seconds_by_method[method] for p in wrapped[name]])
            / steps * 1e6 for method in result.calls_by_method}
    return result


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Rows for benchmarks/run.py: the step and the pool's share of it per case (``impl``
    kvspec's pool, ``vllm`` vLLM's, microseconds per step; ``speedup`` vLLM / kvspec)."""
    if not _vllm_importable():
        print("(bench_scheduler_033: needs vLLM 0.33 importable, for its Scheduler)",
              file=sys.stderr)
        return []
    floor = timer_floor_seconds()
    rows: list[dict[str, Any]] = []
    for case in QUICK_CASES if quick else CASES:
        m = measure(case, repeats=2 if quick or case.hybrid else 3)
        calls = m.calls_by_method
        details = {
            "calls_per_step": round(sum(calls.values()), 1),
            "calls_per_step_by_method": {k: round(v, 1) for k, v in calls.items()},
            "timer_floor_ns_per_call": round(floor * 1e9, 1),
            "wrapped_step_us": {k: round(v, 1) for k, v in m.wrapped_step_us.items()},
            "pool_share_of_wrapped_step": {
                side: round(m.pool_us[side] / m.wrapped_step_us[side], 3) for side in m.pool_us},
            "pool_us_by_method": {side: {k: round(v, 1) for k, v in by.items()}
                                  for side, by in m.pool_us_by_method.items()},
            # The step ratio if the steps differed by the pool's time alone.
            "step_speedup_implied_by_pool": round(m.step_us["vllm"] / (
                m.step_us["vllm"] - m.pool_us["vllm"] + m.pool_us["kvspec"]), 3),
            "pool_us_net_of_timer_floor": {
                side: round(us - sum(calls.values()) * floor * 1e6, 1)
                for side, us in m.pool_us.items()},
        }
        character = {"case": case.name, "running": case.running,
                     "hit_rate": round(m.hit_rate, 3), "preemptions": m.preemptions,
                     "max_kv_cache_usage": round(m.max_usage, 3),
                     "min_running": m.min_running}
        for label, times, extra in (
            (f"s33. step, {case.name}, {case.running} running", m.step_us, {}),
            (f"s33. pool share, {case.name}, {case.running} running", m.pool_us, details),
        ):
            rows.append({"workload": label, "unit": "us/step", "impl": times["kvspec"],
                         "vllm": times["vllm"], "speedup": times["vllm"] / times["kvspec"],
                         **character, **extra})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    args = parser.parse_args(argv)
    from kvspec import impl

    print(f"kvspec impl/: {'compiled with mypyc' if impl.COMPILED else 'pure Python'}; "
          "microseconds per step, best of the passes", flush=True)
    rows = run(quick=args.quick)
    print(f"{'':66s} {'vLLM':>8s} {'kvspec':>8s}  vLLM/kvspec")
    for row in rows:
        print(f"{row['workload']:66s} {row['vllm']:8.1f} {row['impl']:8.1f}  "
              f"{row['speedup']:.2f}x")
        if "pool_us_by_method" not in row:
            print(f"    hit rate {row['hit_rate']}, preemptions {row['preemptions']}, "
                  f"KV-cache usage up to {row['max_kv_cache_usage']}, running at least "
                  f"{row['min_running']}")
            continue
        by = row["pool_us_by_method"]
        for name in sorted(by["vllm"], key=lambda n: -by["vllm"][n]):
            theirs, ours = by["vllm"][name], by["kvspec"].get(name, 0.0)
            calls = row["calls_per_step_by_method"][name]
            print(f"    {name + f' ({calls:g} calls/step)':62s} {theirs:8.1f} {ours:8.1f}  "
                  f"{theirs / ours if ours else float('nan'):.2f}x")
        share = row["pool_share_of_wrapped_step"]
        net = row["pool_us_net_of_timer_floor"]
        print(f"    {row['calls_per_step']} timed calls/step, "
              f"{row['timer_floor_ns_per_call']} ns/call of timer inside the pool time; "
              f"wrapped step {row['wrapped_step_us']}; pool share of it vLLM "
              f"{share['vllm']:.0%}, kvspec {share['kvspec']:.0%}")
        print(f"    pool time net of the timer floor: vLLM {net['vllm']:.1f}, kvspec "
              f"{net['kvspec']:.1f}: {net['vllm'] / net['kvspec']:.2f}x; the step ratio if "
              f"only the pool's time differed: {row['step_speedup_implied_by_pool']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
