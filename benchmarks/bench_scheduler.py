"""The speed users feel: one step of vLLM 0.13's real Scheduler, vLLM's KV-cache manager vs
kvspec's, and the KV-cache share of that step.

A step is what vLLM's engine core does each iteration: ``schedule()`` then
``update_from_output()`` (the simulated model's outputs are built between the two, outside the
clock). The scheduler is benchmarks/scheduler_loop.py's (built on the CPU from a local Llama
``config.json``, nothing downloaded), in steady state at 64 and 256 running requests: before
each step new requests are queued so that the running batch stays full; prompts are one of 32
popular 512-token prefixes (Zipf) plus 16..256 tokens of their own; each request then samples
32..256 tokens (each from its own seeded stream, so both sides see the same tokens). The pool
(1,800 and 5,600 blocks of 16 tokens) is small enough that blocks are evicted every step and
large enough that nothing is preempted. Prefix caching on, KV events off, ``log_stats`` on
(vLLM's serving defaults), block hashing with vLLM's ``sha256`` (what vLLM's engine core
hands the hasher). Like vLLM's engine core (``freeze_gc_heap``), each pass freezes the heap
once the scheduler is built, so collections skip the pool's blocks.

Both sides run in one process, on identical requests and outputs:

- vLLM: ``Scheduler`` as built, with vLLM's ``KVCacheManager``, requests hashed by vLLM's
  ``get_request_block_hasher``;
- kvspec: the same ``Scheduler`` whose ``kv_cache_manager`` is then replaced by
  ``kvspec.impl.kv_cache_manager.KVCacheManager`` built with the arguments vLLM's constructor
  passes (the object the plugin's rebinding makes that constructor build), requests hashed by
  kvspec's ``get_request_block_hasher``; ``host_types.bind_vllm()`` first, as the plugin does.

A first pass of each side, with KV events on, gives the hit rate and evictions per step and
checks that both sides schedule the same tokens and see the same hits at every step; every
timed pass is checked the same way. Then, alternating the sides, ``repeats`` passes each of:

- the plain step: its wall time, nothing wrapped;
- the wrapped step, for the KV-cache share: ``TimedManager`` stands between the scheduler and
  the manager and times each call the scheduler makes (``get_computed_blocks``,
  ``allocate_slots``, ``free``, ``get_blocks``, ``get_num_common_prefix_blocks``,
  ``take_events``, ``make_prefix_cache_stats``, ``usage``, and any other) and
  ``get_block_ids`` on the ``KVCacheBlocks`` it returns; the request's block hasher (run
  inside the step as output tokens are appended; a prompt's hashing when the request is made
  is not part of a step) is timed the same way. Both sides make the same calls (checked). The
  time recorded per call includes the timer's floor (``timer_floor_ns_per_call``, measured on
  a method that does nothing); it is in both sides alike, which pulls the ratio towards 1, and
  ``kv_us_net_of_timer_floor`` takes it out. The wrapper's whole cost shows as the wrapped
  step minus the plain one.

Each time is ``best_of`` the passes: per step the least time any pass took, summed, per
measured step. Ratios are vLLM time / kvspec time (higher is better for kvspec). kvspec is
timed as this process imports it: compiled (mypyc) or pure Python; the first output line says
which.

Run: ``PYTHONPATH=. .venv-vllm-0.13.0/bin/python -m benchmarks.bench_scheduler [--quick]``, or
as the ``scheduler`` section of ``python -m benchmarks.run``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.scheduler_loop import (
    BLOCK_SIZE,
    RequestStream,
    SimulatedModel,
    Workload,
    build_scheduler,
)

perf_counter = time.perf_counter


@dataclass(frozen=True)
class Shape:
    """One steady state: the running batch, the pool, and how long to run and measure."""

    running: int
    num_gpu_blocks: int
    warmup_steps: int
    measured_steps: int

    def workload(self, kv_events: bool = False) -> Workload:
        return Workload(
            f"steady-{self.running}", seed=self.running, steps=0,
            num_gpu_blocks=self.num_gpu_blocks, max_num_seqs=self.running,
            max_num_batched_tokens=8192, max_model_len=2048, num_prefixes=32,
            prefix_tokens=(512, 512), suffix_tokens=(16, 256), max_tokens=(32, 256),
            repeat_prompt_rate=0.0, eos_rate=0.0, kv_events=kv_events, log_stats=True)


SHAPES = (Shape(64, 1800, 400, 200), Shape(256, 5600, 500, 150))
QUICK_SHAPES = (Shape(64, 1800, 400, 60), Shape(256, 5600, 500, 40))


# -- timing wrappers ---------------------------------------------------------------------------


class Clock:
    """Seconds and calls recorded inside the KV-cache manager's calls and the block hasher,
    per method."""

    HASHER = "block hasher"

    def __init__(self) -> None:
        self.by_method: dict[str, list[float]] = {}  # name -> [seconds, calls]

    def add(self, name: str, seconds: float) -> None:
        entry = self.by_method.get(name)
        if entry is None:
            entry = self.by_method[name] = [0.0, 0]
        entry[0] += seconds
        entry[1] += 1

    @property
    def seconds(self) -> float:
        return sum(seconds for seconds, _ in self.by_method.values())

    def timed_hasher(self, hasher: Callable[[Any], list[Any]]) -> Callable[[Any], list[Any]]:
        add = self.add

        def request_block_hasher(request: Any) -> list[Any]:
            start = perf_counter()
            hashes = hasher(request)
            add(Clock.HASHER, perf_counter() - start)
            return hashes
        return request_block_hasher


class TimedBlocks:
    """A ``KVCacheBlocks`` whose ``get_block_ids`` is timed into the clock."""

    def __init__(self, blocks: Any, clock: Clock) -> None:
        self.inner = blocks
        self.clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_block_ids(self, allow_none: bool = False) -> Any:
        start = perf_counter()
        ids = self.inner.get_block_ids(allow_none=allow_none)
        self.clock.add("KVCacheBlocks.get_block_ids", perf_counter() - start)
        return ids


def _unwrap(blocks: Any) -> Any:
    return blocks.inner if isinstance(blocks, TimedBlocks) else blocks


class TimedManager:
    """Stands between the scheduler and its KV-cache manager: every call the scheduler makes
    is timed into the clock; the ``KVCacheBlocks`` returned are ``TimedBlocks``."""

    def __init__(self, manager: Any, clock: Clock) -> None:
        self.inner = manager
        self.clock = clock

    def __getattr__(self, name: str) -> Any:
        """Attributes (``empty_kv_cache_blocks``, ...) as they are; methods not named below
        timed like those."""
        value = getattr(self.inner, name)
        if not callable(value):
            return value
        return lambda *args, **kwargs: self._time(name, value, *args, **kwargs)

    def _time(self, name: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = perf_counter()
        result = method(*args, **kwargs)
        self.clock.add(name, perf_counter() - start)
        return result

    def get_computed_blocks(self, request: Any) -> tuple[Any, int]:
        blocks, num_tokens = self._time("get_computed_blocks", self.inner.get_computed_blocks,
                                        request)
        return TimedBlocks(blocks, self.clock), num_tokens

    def allocate_slots(self, request: Any, num_new_tokens: int,
                       num_new_computed_tokens: int = 0, new_computed_blocks: Any = None,
                       num_lookahead_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0) -> Any:
        blocks = self._time("allocate_slots", self.inner.allocate_slots, request,
                            num_new_tokens, num_new_computed_tokens,
                            _unwrap(new_computed_blocks), num_lookahead_tokens,
                            delay_cache_blocks, num_encoder_tokens)
        return None if blocks is None else TimedBlocks(blocks, self.clock)

    def get_blocks(self, request_id: str) -> Any:
        return TimedBlocks(self._time("get_blocks", self.inner.get_blocks, request_id),
                           self.clock)

    def free(self, request: Any) -> None:
        self._time("free", self.inner.free, request)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> Any:
        return self._time("get_num_common_prefix_blocks",
                          self.inner.get_num_common_prefix_blocks, running_request_id)

    def take_events(self) -> Any:
        return self._time("take_events", self.inner.take_events)

    def make_prefix_cache_stats(self) -> Any:
        return self._time("make_prefix_cache_stats", self.inner.make_prefix_cache_stats)

    @property
    def usage(self) -> float:
        start = perf_counter()
        usage: float = self.inner.usage
        self.clock.add("usage", perf_counter() - start)
        return usage


def wrapper_floor_seconds(calls: int = 200_000) -> tuple[float, float]:
    """(seconds the clock records per call of a method doing nothing: the timer's floor,
    seconds a wrapped call of it costs more than a direct one: the wrapper's whole cost)."""

    class Nothing:
        def free(self, request: Any) -> None:
            return None

    direct = Nothing()
    best_direct = best_wrapped = best_floor = float("inf")
    for _ in range(3):
        clock = Clock()
        wrapped = TimedManager(Nothing(), clock)
        start = perf_counter()
        for _ in range(calls):
            direct.free(None)
        best_direct = min(best_direct, perf_counter() - start)
        start = perf_counter()
        for _ in range(calls):
            wrapped.free(None)
        best_wrapped = min(best_wrapped, perf_counter() - start)
        best_floor = min(best_floor, clock.seconds)
    return best_floor / calls, (best_wrapped - best_direct) / calls


# -- the two sides -------------------------------------------------------------------------------


@dataclass
class Side:
    name: str
    build: Callable[[Workload, Path], Any]  # a Scheduler
    hasher: Callable[[], Callable[[Any], list[Any]]]


def _vllm_side() -> Side:
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    def build(workload: Workload, folder: Path) -> Any:
        scheduler = build_scheduler(workload, folder)
        module = type(scheduler.kv_cache_manager).__module__
        if module != "vllm.v1.core.kv_cache_manager":  # VLLM_USE_KVSPEC=1 and the plugin ran
            raise RuntimeError(f"vLLM's side got the KV-cache manager of {module}")
        return scheduler

    return Side("vllm", build, lambda: _block_hasher(kv_cache_utils, sha256))


def _block_hasher(kv_cache_utils: Any, sha256: Any) -> Callable[[Any], list[Any]]:
    """A side's own request block hasher (its kv_cache_utils), seeded for sha256."""
    kv_cache_utils.init_none_hash(sha256)
    block_hasher: Callable[[Any], list[Any]] = kv_cache_utils.get_request_block_hasher(
        BLOCK_SIZE, sha256)
    return block_hasher


def _kvspec_side() -> Side:
    from vllm.utils.hashing import sha256

    from kvspec.impl import host_types, kv_cache_utils
    from kvspec.impl.kv_cache_manager import KVCacheManager

    host_types.bind_vllm()

    def build(workload: Workload, folder: Path) -> Any:
        scheduler = build_scheduler(workload, folder)
        # The arguments vLLM 0.13's Scheduler.__init__ passes its KVCacheManager.
        scheduler.kv_cache_manager = KVCacheManager(
            kv_cache_config=scheduler.kv_cache_config,
            max_model_len=scheduler.max_model_len,
            enable_caching=scheduler.cache_config.enable_prefix_caching,
            use_eagle=scheduler.use_eagle,
            log_stats=scheduler.log_stats,
            enable_kv_cache_events=scheduler.enable_kv_cache_events,
            dcp_world_size=scheduler.dcp_world_size,
            pcp_world_size=scheduler.pcp_world_size,
            hash_block_size=scheduler.block_size,
            metrics_collector=scheduler.kv_metrics_collector,
        )
        return scheduler

    return Side("kvspec", build, lambda: _block_hasher(kv_cache_utils, sha256))


# -- one pass ------------------------------------------------------------------------------------


@dataclass
class Pass:
    """What one pass over a shape measured: lists hold one entry per measured step."""

    step_seconds: list[float] = field(default_factory=list)
    kv_seconds: list[float] = field(default_factory=list)
    kv_seconds_by_method: dict[str, list[float]] = field(default_factory=dict)
    calls_by_method: dict[str, int] = field(default_factory=dict)  # over the measured steps
    hit_tokens: int = 0
    query_tokens: int = 0
    preemptions: int = 0
    evictions: int = 0
    fingerprint: list[int] = field(default_factory=list)


def run_pass(side: Side, shape: Shape, folder: Path, timed: bool = False,
             kv_events: bool = False) -> Pass:
    """Warm ``shape`` up to steady state, then measure its steps (wrapped when ``timed``)."""
    workload = shape.workload(kv_events)
    scheduler = side.build(workload, folder)
    clock = Clock()
    hasher = side.hasher()
    if timed:
        hasher = clock.timed_hasher(hasher)
        scheduler.kv_cache_manager = TimedManager(scheduler.kv_cache_manager, clock)
    published: list[Any] = []
    if kv_events:
        scheduler.kv_event_publisher.publish = lambda batch: published.extend(batch.events)
    stream = RequestStream(workload, hasher)
    model = SimulatedModel(workload.seed, workload.eos_rate)
    result = Pass()
    # As vLLM's engine core does once the scheduler is built (freeze_gc_heap): the start-up
    # heap (the pool's blocks among it) is left out of later collections.
    gc.collect()
    gc.freeze()
    try:
        _run_steps(scheduler, shape, stream, model, clock, published, result)
    finally:
        gc.unfreeze()
    return result


def _run_steps(scheduler: Any, shape: Shape, stream: RequestStream, model: SimulatedModel,
               clock: Clock, published: list[Any], result: Pass) -> None:
    queue_depth = max(4, shape.running // 16)
    by_method = clock.by_method
    for index in range(shape.warmup_steps + shape.measured_steps):
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
        if index < shape.warmup_steps:
            published.clear()
            continue
        result.step_seconds.append((scheduled - start) + (end - resumed))
        measured = index - shape.warmup_steps
        for name, (seconds, calls) in by_method.items():
            seconds_before, calls_before = before.get(name, (0.0, 0))
            per_step = result.kv_seconds_by_method.setdefault(
                name, [0.0] * shape.measured_steps)
            per_step[measured] = seconds - seconds_before
            result.calls_by_method[name] = (result.calls_by_method.get(name, 0)
                                            + int(calls - calls_before))
        result.kv_seconds.append(sum(
            per_step[measured] for per_step in result.kv_seconds_by_method.values()))
        stats = next(iter(engine_outputs.values())).scheduler_stats
        result.hit_tokens += stats.prefix_cache_stats.hits
        result.query_tokens += stats.prefix_cache_stats.queries
        result.preemptions += len(output.preempted_req_ids or ())
        result.evictions += sum(type(e).__name__ == "BlockRemoved" for e in published)
        published.clear()
        result.fingerprint.append(hash((tuple(output.num_scheduled_tokens.items()),
                                        stats.prefix_cache_stats.hits)))


def best_of(passes: list[list[float]]) -> float:
    """The sum over steps of each step's least time across the passes: a pause that hits one
    pass's step (another process, the OS) is dropped; what every pass pays at that step (the
    work, and the collections its allocations trigger) is kept."""
    return float(sum(min(times) for times in zip(*passes, strict=True)))


def _vllm_importable() -> bool:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
    except Exception:  # vLLM absent or half-installed
        return False
    return True


@dataclass
class Measurement:
    """Both sides on one shape: microseconds per measured step (``best_of`` the passes) by
    side name, and the workload's character."""

    shape: Shape
    hit_rate: float
    evictions_per_step: float
    preemptions: int
    step_us: dict[str, float] = field(default_factory=dict)  # nothing wrapped
    wrapped_step_us: dict[str, float] = field(default_factory=dict)
    kv_us: dict[str, float] = field(default_factory=dict)
    kv_us_by_method: dict[str, dict[str, float]] = field(default_factory=dict)
    calls_by_method: dict[str, float] = field(default_factory=dict)  # per step


def measure(shape: Shape, repeats: int) -> Measurement:
    """Both sides on ``shape``, ``repeats`` passes each of the plain and the wrapped step,
    alternating. A first pass of each side with KV events on gives the workload's character
    and checks that both sides schedule the same steps; every later pass is checked too."""
    sides = [_vllm_side(), _kvspec_side()]
    steps = shape.measured_steps
    with tempfile.TemporaryDirectory(prefix="kvspec-bench-") as tmp:
        folder = Path(tmp) / "model"
        checks = {side.name: run_pass(side, shape, folder, kv_events=True) for side in sides}
        check = checks["vllm"]
        plain: dict[str, list[Pass]] = {side.name: [] for side in sides}
        wrapped: dict[str, list[Pass]] = {side.name: [] for side in sides}
        for _ in range(repeats):
            for side in sides:  # alternate, so drift hits both alike
                plain[side.name].append(run_pass(side, shape, folder))
                wrapped[side.name].append(run_pass(side, shape, folder, timed=True))
    for name, one in [*checks.items(), *((n, p) for n in plain for p in plain[n] + wrapped[n])]:
        if one.fingerprint != check.fingerprint:
            raise AssertionError(f"running {shape.running}: {name}'s manager scheduled "
                                 "other steps than vLLM's")
    calls = {name: [p.calls_by_method for p in passes] for name, passes in wrapped.items()}
    if any(c != calls["vllm"][0] for per_side in calls.values() for c in per_side):
        raise AssertionError(f"the scheduler called the two managers differently: {calls}")
    result = Measurement(shape, check.hit_tokens / max(1, check.query_tokens),
                         check.evictions / steps, check.preemptions)
    result.calls_by_method = {name: n / steps for name, n in sorted(calls["vllm"][0].items())}
    for name in plain:
        result.step_us[name] = best_of([p.step_seconds for p in plain[name]]) / steps * 1e6
        result.wrapped_step_us[name] = best_of(
            [p.step_seconds for p in wrapped[name]]) / steps * 1e6
        result.kv_us[name] = best_of([p.kv_seconds for p in wrapped[name]]) / steps * 1e6
        result.kv_us_by_method[name] = {
            method: best_of([p.kv_seconds_by_method[method] for p in wrapped[name]])
            / steps * 1e6 for method in result.calls_by_method}
    return result


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Rows for benchmarks/run.py: the step and its KV-cache share at 64 and 256 running
    (``impl`` kvspec, ``vllm`` vLLM, microseconds per step; ``speedup`` vLLM / kvspec)."""
    if not _vllm_importable():
        print("(bench_scheduler: vLLM is not importable here; it needs vLLM's Scheduler)",
              file=sys.stderr)
        return []
    floor, wrapper = wrapper_floor_seconds()
    rows: list[dict[str, Any]] = []
    for shape in QUICK_SHAPES if quick else SHAPES:
        m = measure(shape, repeats=2 if quick else 5)
        calls = m.calls_by_method
        details = {
            "calls_per_step": round(sum(calls.values()), 1),
            "calls_per_step_by_method": {k: round(v, 1) for k, v in calls.items()},
            "timer_floor_ns_per_call": round(floor * 1e9, 1),
            "wrapper_ns_per_call": round(wrapper * 1e9, 1),
            "wrapped_step_us": {k: round(v, 1) for k, v in m.wrapped_step_us.items()},
            "kv_share_of_wrapped_step": {
                side: round(m.kv_us[side] / m.wrapped_step_us[side], 3) for side in m.kv_us},
            "kv_us_by_method": {side: {k: round(v, 1) for k, v in by.items()}
                                for side, by in m.kv_us_by_method.items()},
            "kv_us_net_of_timer_floor": {
                side: round(us - sum(calls.values()) * floor * 1e6, 1)
                for side, us in m.kv_us.items()},
        }
        character = {"running": shape.running, "hit_rate": round(m.hit_rate, 3),
                     "evictions_per_step": round(m.evictions_per_step, 1),
                     "preemptions": m.preemptions}
        for label, times, extra in (
            (f"s. step, {shape.running} running (hits {m.hit_rate:.2f})", m.step_us, {}),
            (f"s. KV share, {shape.running} running ({m.evictions_per_step:.0f} evict/step)",
             m.kv_us, details),
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
          "microseconds per step, best of the passes")
    rows = run(quick=args.quick)
    print(f"{'':62s} {'vLLM':>8s} {'kvspec':>8s}  vLLM/kvspec")
    for row in rows:
        print(f"{row['workload']:62s} {row['vllm']:8.1f} {row['impl']:8.1f}  "
              f"{row['speedup']:.2f}x")
        if "kv_us_by_method" not in row:
            continue
        by = row["kv_us_by_method"]
        for name in by["vllm"]:
            theirs, ours = by["vllm"][name], by["kvspec"].get(name, 0.0)
            calls = row["calls_per_step_by_method"][name]
            print(f"    {name + f' ({calls:g} calls/step)':58s} {theirs:8.1f} {ours:8.1f}  "
                  f"{theirs / ours if ours else float('nan'):.2f}x")
        share = row["kv_share_of_wrapped_step"]
        print(f"    {row['calls_per_step']} timed calls/step, "
              f"{row['timer_floor_ns_per_call']} ns/call of timer inside "
              f"the KV time, {row['wrapper_ns_per_call']} ns/call of wrapper in all; "
              f"wrapped step {row['wrapped_step_us']}; KV share of it vLLM "
              f"{share['vllm']:.0%}, kvspec {share['kvspec']:.0%}; "
              f"preemptions {row['preemptions']}")
        net = row["kv_us_net_of_timer_floor"]
        print(f"    KV-cache share net of the timer floor: vLLM {net['vllm']:.1f}, kvspec "
              f"{net['kvspec']:.1f}: {net['vllm'] / net['kvspec']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
