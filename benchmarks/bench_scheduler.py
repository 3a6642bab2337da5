"""The speed users feel: one step of vLLM's real Scheduler (0.13 or 0.33) with vLLM's KV-cache
code and with kvspec's, and the share of that step spent in the code kvspec replaces.

What kvspec's plugin replaces differs by release (docs/plugin.md), and so does what is
compared and timed (``TARGETS``):

- vLLM 0.13 (section s of docs/benchmarks.md): the KV-cache manager. vLLM's side is the
  ``Scheduler`` as built, with vLLM's ``KVCacheManager``, requests hashed by vLLM's
  ``get_request_block_hasher``; kvspec's side is the same ``Scheduler`` whose
  ``kv_cache_manager`` is then replaced by ``kvspec.impl.kv_cache_manager.KVCacheManager``
  built with the arguments vLLM's constructor passes (the object the plugin's rebinding makes
  that constructor build), requests hashed by kvspec's ``get_request_block_hasher``;
  ``host_types.bind_vllm()`` first, as the plugin does. The KV share is the time inside the
  manager's calls (``TimedManager``: ``get_computed_blocks``, ``allocate_slots``, ``free``,
  ``get_blocks``, ``get_num_common_prefix_blocks``, ``take_events``,
  ``make_prefix_cache_stats``, ``usage``, and any other), ``get_block_ids`` on the
  ``KVCacheBlocks`` it returns, and the request's block hasher (run inside the step as output
  tokens are appended; a prompt's hashing when the request is made is not part of a step).
- vLLM 0.33 (section s33): the block pool alone, ``vllm.v1.core.block_pool``; vLLM 0.33's own
  ``KVCacheManager``, coordinators, single-type managers and request block hasher serve both
  sides. In vLLM 0.33 the one place a pool is built is ``KVCacheCoordinator.__init__``
  (``vllm/v1/core/kv_cache_coordinator.py``), through the module-level name ``BlockPool`` it
  imported from ``vllm.v1.core.block_pool``; every manager and the ``KVCacheManager`` then
  share that object. ``pool_class`` binds, while the ``Scheduler`` is built, every ``vllm.*``
  module attribute that is vLLM's ``BlockPool`` to the side's class, as the plugin's
  ``install()`` rebinds them (for good), and restores them after; the built scheduler is
  checked to hold a pool of the side's class (``vllm_api`` "0.33" for kvspec's) shared by all
  its managers. Before the first kvspec pool is built, ``host_types.bind_vllm()`` and
  ``block_pool.set_default_pool_api("0.33")`` do what ``install()`` does for the pool. The
  pool share is the time inside every pool method vLLM's managers and scheduler call
  (``TimedPool``; attribute reads pass through untimed).

The cases (``CASES``): full attention, one group of 16-token blocks, in steady state at 64 and
256 running requests (both releases): prompts are one of 32 popular 512-token prefixes (Zipf)
plus 16..256 tokens of their own; each request then samples 32..256 tokens (each from its own
seeded stream, so both sides see the same tokens); the pool (1,800 and 5,600 blocks) is small
enough that blocks are evicted every step and large enough that nothing is preempted. Under
vLLM 0.33 also a hybrid: a full-attention group and a Mamba group
(``mamba_cache_mode="align"``), both of 256-token blocks, hashed every 16 tokens
(``prefix_match_unit``/``hash_block_size`` 16), so vLLM enables fine-grained (partial)
prefix-cache hits: every step, ``cache_blocks`` of the full-attention manager registers each
running request's prompt tail inside its block with ``BlockPool.cache_partial_block``
(``FullAttentionManager._cache_partial_tail_block``), the path vLLM PR #51333 measured at about
2.2 ms of a 23 ms engine step (29% of the scheduler-phase CPU) at roughly 900 running requests
on a B200. Run at 896 running. Before each step new requests are queued so that the running
batch stays full. Prefix caching on, KV events off (but in the check pass), ``log_stats`` on
(vLLM's serving defaults), block hashing with vLLM's ``sha256`` (what vLLM's engine core hands
the hasher). Like vLLM's engine core (``freeze_gc_heap``), each pass freezes the heap once the
scheduler is built, so collections skip the pool's blocks.

A step is what vLLM's engine core does each iteration: ``schedule()`` then
``update_from_output()`` (the simulated model's outputs, benchmarks/scheduler_loop.py's
``SimulatedModel``, are built between the two, outside the clock). Both sides run in one
process, on identical requests and outputs. A first pass of each side, with KV events on,
gives the case's character (hit rate, evictions and preemptions, the pool's use, the running
batch) and checks that both sides schedule the same tokens, see the same prefix-cache hits
and hand out the same block ids at every step; every timed pass is checked the same way.
Then, alternating the sides, ``Case.repeats`` passes each of:

- the plain step: its wall time, nothing wrapped;
- the wrapped step, for the share: the release's wrapper times each call into the replaced
  code. Both sides make the same calls (checked). The time recorded per call includes the
  timer's floor (``timer_floor_ns_per_call``, measured on a method that does nothing); it is
  in both sides alike, which pulls the ratio towards 1, and ``..._us_net_of_timer_floor``
  takes it out. The wrapper's whole cost shows as the wrapped step minus the plain one.

Each time is ``best_of`` the passes: per step the least time any pass took, summed, per
measured step. Ratios are vLLM time / kvspec time (higher is better for kvspec). kvspec is
timed as this process imports it: compiled (mypyc) or pure Python (``KVSPEC_PURE_PYTHON=1``);
the first output line says which.

Run: ``PYTHONPATH=. .venv-vllm-0.13.0/bin/python -m benchmarks.bench_scheduler [--quick]``
(or ``.venv-vllm-0.33.0``: the release is the interpreter's), or as the ``scheduler`` (0.13)
and ``scheduler033`` (0.33) sections of ``python -m benchmarks.run``.
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

from benchmarks.scheduler_loop import (
    BLOCK_SIZE,
    VOCAB,
    RequestStream,
    SimulatedModel,
    Workload,
    build_scheduler,
    make_request,
    vllm_release,
)

perf_counter = time.perf_counter
HYBRID_BLOCK_SIZE = 256


@dataclass(frozen=True)
class Case:
    """One steady state: the KV-cache layout, the running batch, the pool, and the run."""

    name: str
    running: int
    num_gpu_blocks: int
    warmup_steps: int
    measured_steps: int
    repeats: int  # passes of each side (a --quick run makes 2)
    seed: int  # of the requests and the model's tokens
    hybrid: bool = False
    max_tokens: tuple[int, int] = (32, 256)

    @property
    def block_size(self) -> int:
        """The groups' block size: 16 for full attention alone, 256 for the hybrid."""
        return HYBRID_BLOCK_SIZE if self.hybrid else BLOCK_SIZE

    def workload(self, kv_events: bool = False) -> Workload:
        """The scheduler's shape (and, under vLLM 0.13, the request stream's)."""
        return Workload(
            f"steady-{self.running}", seed=self.seed, steps=0,
            num_gpu_blocks=self.num_gpu_blocks, max_num_seqs=self.running,
            max_num_batched_tokens=8192, block_size=self.block_size,
            hash_block_size=BLOCK_SIZE, mamba=self.hybrid, max_model_len=2048,
            num_prefixes=32, prefix_tokens=(512, 512), suffix_tokens=(16, 256),
            max_tokens=self.max_tokens, repeat_prompt_rate=0.0, eos_rate=0.0,
            kv_events=kv_events, log_stats=True)


FULL = "full attention"
HYBRID = "hybrid attention + Mamba (align)"
# Each release's cases as docs/benchmarks.md measured them (sections s and s33: their seeds
# pick their prompts). vLLM 0.33's steps take longer on this machine, so fewer steps and
# passes; the hybrid (partial prefix-cache entries) is vLLM 0.33's alone.
CASES: dict[str, tuple[Case, ...]] = {
    "0.13": (Case(FULL, 64, 1800, 400, 200, repeats=5, seed=64),
             Case(FULL, 256, 5600, 500, 150, repeats=5, seed=256)),
    "0.33": (Case(FULL, 64, 1800, 300, 200, repeats=3, seed=0),
             Case(FULL, 256, 5600, 300, 100, repeats=3, seed=0),
             Case(HYBRID, 896, 2400, 150, 30, repeats=2, seed=0, hybrid=True,
                  max_tokens=(32, 160))),
}
QUICK_CASES: dict[str, tuple[Case, ...]] = {
    "0.13": (Case(FULL, 64, 1800, 400, 60, repeats=2, seed=64),
             Case(FULL, 256, 5600, 500, 40, repeats=2, seed=256)),
    "0.33": (Case(FULL, 64, 1800, 250, 60, repeats=2, seed=0),
             Case(FULL, 256, 5600, 200, 20, repeats=2, seed=0),
             Case(HYBRID, 896, 2400, 80, 8, repeats=2, seed=0, hybrid=True,
                  max_tokens=(32, 160))),
}


class SteadyStream:
    """vLLM 0.33's cases' requests, in arrival order: one of 32 popular 512-token prefixes
    (Zipf) plus 16..256 tokens of their own, ``max_tokens`` from the case's range.

    The same prompts as vLLM 0.13's cases, which draw through the loop's ``RequestStream``
    (``Case.workload``), but drawn from a stream of their own (seeded by the running batch;
    no draws for repeats, LoRA or salts): the figures of docs/benchmarks.md's section s33
    were measured on it."""

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
        rng = self.rng
        prefix = rng.choices(self.prefixes, weights=self.popularity)[0]
        prompt = prefix + self._tokens(rng.randint(16, 256))
        max_tokens = rng.randint(*self.case.max_tokens)
        request_id = f"r{self.count}"
        self.count += 1
        return make_request("0.33", request_id, prompt, max_tokens, arrival_time,
                            self.block_hasher)


# -- timing wrappers ---------------------------------------------------------------------------


class Clock:
    """Seconds and calls recorded inside the timed calls, per method."""

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


def wrap_manager(scheduler: Any, clock: Clock) -> None:
    """Put a ``TimedManager`` in place of the scheduler's KV-cache manager."""
    scheduler.kv_cache_manager = TimedManager(scheduler.kv_cache_manager, clock)


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


class _Nothing:
    """A method that does nothing, called through a wrapper for the wrapper's own cost."""

    def free(self, request: Any) -> None:
        return None


def wrapper_floor_seconds(wrap: Callable[[Any, Clock], Any], calls: int = 40_000,
                          rounds: int = 15) -> tuple[float, float]:
    """(seconds the clock records per call of a method doing nothing: the timer's floor,
    seconds a wrapped call of it costs more than a direct one: the wrapper's whole cost),
    each the least of ``rounds`` short rounds, so that another process's burst is dropped."""
    direct = _Nothing()
    best_direct = best_wrapped = best_floor = float("inf")
    for _ in range(rounds):
        clock = Clock()
        wrapped = wrap(_Nothing(), clock)
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


# -- the two sides, and what each release replaces -----------------------------------------------


@dataclass
class Side:
    """One side's scheduler (``build``: case, folder, KV events on?) and request hasher."""

    name: str
    build: Callable[[Case, Path, bool], Any]
    hasher: Callable[[], Callable[[Any], list[Any]]]


@dataclass(frozen=True)
class Target:
    """What kvspec's plugin replaces under a release, and so what this bench swaps and times
    (the module docstring says how): ``what`` names it, ``key`` heads the rows' keys
    (``{key}_us_by_method``, ...), ``label`` heads the rows' names (docs/benchmarks.md's
    section). ``sides`` builds vLLM's side and kvspec's; ``wrap`` puts ``wrapper`` in place in
    a pass's scheduler. ``times_hasher``: whether the request block hasher is timed with the
    share (vLLM 0.13's sides hash with their own code; under 0.33 both use vLLM's).
    ``stream`` makes a case's requests."""

    what: str
    key: str
    label: str
    sides: Callable[[], list[Side]]
    wrapper: Callable[[Any, Clock], Any]
    wrap: Callable[[Any, Clock], None]
    times_hasher: bool
    stream: Callable[[Case, Callable[[Any], list[Any]]], Any]


def _block_hasher(kv_cache_utils: Any, sha256: Any) -> Callable[[Any], list[Any]]:
    """A request block hasher of ``kv_cache_utils`` (vLLM's or kvspec's), seeded for sha256."""
    kv_cache_utils.init_none_hash(sha256)
    block_hasher: Callable[[Any], list[Any]] = kv_cache_utils.get_request_block_hasher(
        BLOCK_SIZE, sha256)
    return block_hasher


def _sides_013() -> list[Side]:
    """vLLM 0.13's manager and kvspec's, each with its own request block hasher."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as vllm_kv_cache_utils

    from kvspec.impl import host_types, kv_cache_utils
    from kvspec.impl.kv_cache_manager import KVCacheManager

    host_types.bind_vllm()

    def build_vllm(case: Case, folder: Path, kv_events: bool) -> Any:
        scheduler = build_scheduler(case.workload(kv_events), folder, "0.13")
        module = type(scheduler.kv_cache_manager).__module__
        if module != "vllm.v1.core.kv_cache_manager":  # VLLM_USE_KVSPEC=1 and the plugin ran
            raise RuntimeError(f"vLLM's side got the KV-cache manager of {module}")
        return scheduler

    def build_kvspec(case: Case, folder: Path, kv_events: bool) -> Any:
        scheduler = build_scheduler(case.workload(kv_events), folder, "0.13")
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

    return [Side("vllm", build_vllm, lambda: _block_hasher(vllm_kv_cache_utils, sha256)),
            Side("kvspec", build_kvspec, lambda: _block_hasher(kv_cache_utils, sha256))]


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


def _sides_033() -> list[Side]:
    """vLLM 0.33's pool and kvspec's, set up as the plugin sets kvspec's up under vLLM 0.33;
    vLLM's request block hasher on both sides (the plugin leaves it in place under 0.33)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import block_pool as vllm_block_pool, kv_cache_utils as vllm_kv_cache_utils

    from kvspec.impl import block_pool, host_types

    host_types.bind_vllm()
    block_pool.set_default_pool_api("0.33")

    def builder(pool_cls: Any) -> Callable[[Case, Path, bool], Any]:
        def build(case: Case, folder: Path, kv_events: bool) -> Any:
            with pool_class(pool_cls):
                scheduler = build_scheduler(case.workload(kv_events), folder, "0.33")
            manager = scheduler.kv_cache_manager
            pool = manager.block_pool
            holders = [manager.coordinator, *manager.coordinator.single_type_managers]
            if type(pool) is not pool_cls or any(h.block_pool is not pool for h in holders):
                raise RuntimeError(f"the scheduler's pool is {type(pool)}, not {pool_cls}, or "
                                   "not shared by all its managers")
            if getattr(pool, "vllm_api", "0.33") != "0.33":
                raise RuntimeError(f"kvspec's pool serves vLLM {pool.vllm_api}'s API, not 0.33's")
            if case.hybrid and not manager.coordinator.enable_partial_hash_hits:
                raise RuntimeError("the hybrid case did not enable vLLM's partial hash hits")
            return scheduler
        return build

    def hasher() -> Callable[[Any], list[Any]]:
        return _block_hasher(vllm_kv_cache_utils, sha256)

    return [Side("vllm", builder(vllm_block_pool.BlockPool), hasher),
            Side("kvspec", builder(block_pool.BlockPool), hasher)]


TARGETS: dict[str, Target] = {
    "0.13": Target("KV-cache manager", "kv", "s.", _sides_013, TimedManager, wrap_manager,
                   times_hasher=True,
                   stream=lambda case, hasher: RequestStream(case.workload(), hasher, "0.13")),
    "0.33": Target("pool", "pool", "s33.", _sides_033, TimedPool, wrap_pool,
                   times_hasher=False, stream=SteadyStream),
}


# -- one pass ------------------------------------------------------------------------------------


@dataclass
class Pass:
    """What one pass over a case measured: lists hold one entry per measured step."""

    step_seconds: list[float] = field(default_factory=list)
    share_seconds: list[float] = field(default_factory=list)
    share_seconds_by_method: dict[str, list[float]] = field(default_factory=dict)
    calls_by_method: dict[str, int] = field(default_factory=dict)  # over the measured steps
    hit_tokens: int = 0
    query_tokens: int = 0
    preemptions: int = 0
    evictions: int = 0
    max_usage: float = 0.0
    running: int = 0  # least running requests over the measured steps
    fingerprint: list[int] = field(default_factory=list)


def run_pass(release: str, side: Side, case: Case, folder: Path, timed: bool = False,
             kv_events: bool = False) -> Pass:
    """Warm ``case`` up to steady state, then measure its steps (wrapped when ``timed``)."""
    target = TARGETS[release]
    scheduler = side.build(case, folder, kv_events)
    clock = Clock()
    hasher = side.hasher()
    if timed:
        if target.times_hasher:
            hasher = clock.timed_hasher(hasher)
        target.wrap(scheduler, clock)
    published: list[Any] = []
    if kv_events:
        scheduler.kv_event_publisher.publish = lambda batch: published.extend(batch.events)
    stream = target.stream(case, hasher)
    model = SimulatedModel(case.seed, 0.0)
    result = Pass(running=case.running)
    # As vLLM's engine core does once the scheduler is built (freeze_gc_heap): the start-up
    # heap (the pool's blocks among it) is left out of later collections.
    gc.collect()
    gc.freeze()
    try:
        _run_steps(scheduler, case, stream, model, clock, published, result)
    finally:
        gc.unfreeze()
    return result


def _block_ids(output: Any) -> str:
    """The block ids the step hands out (to new and to running requests), as text."""
    new = [(r.req_id, r.block_ids) for r in output.scheduled_new_reqs]
    cached = output.scheduled_cached_reqs
    return repr((new, cached.req_ids, cached.new_block_ids))


def _run_steps(scheduler: Any, case: Case, stream: Any, model: SimulatedModel,
               clock: Clock, published: list[Any], result: Pass) -> None:
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
            published.clear()
            continue
        step = index - case.warmup_steps
        result.step_seconds.append((scheduled - start) + (end - resumed))
        for name, (seconds, calls) in by_method.items():
            seconds_before, calls_before = before.get(name, (0.0, 0))
            per_step = result.share_seconds_by_method.setdefault(name, [0.0] * measured)
            per_step[step] = seconds - seconds_before
            result.calls_by_method[name] = (result.calls_by_method.get(name, 0)
                                            + int(calls - calls_before))
        result.share_seconds.append(sum(
            per_step[step] for per_step in result.share_seconds_by_method.values()))
        stats = next(iter(engine_outputs.values())).scheduler_stats
        result.hit_tokens += stats.prefix_cache_stats.hits
        result.query_tokens += stats.prefix_cache_stats.queries
        result.preemptions += len(output.preempted_req_ids or ())
        result.evictions += sum(type(e).__name__ == "BlockRemoved" for e in published)
        published.clear()
        result.max_usage = max(result.max_usage, stats.kv_cache_usage)
        result.running = min(result.running, len(scheduler.running))
        result.fingerprint.append(hash((tuple(output.num_scheduled_tokens.items()),
                                        stats.prefix_cache_stats.hits, _block_ids(output))))


def best_of(passes: list[list[float]]) -> float:
    """The sum over steps of each step's least time across the passes: a pause that hits one
    pass's step (another process, the OS) is dropped; what every pass pays at that step (the
    work, and the collections its allocations trigger) is kept."""
    return float(sum(min(times) for times in zip(*passes, strict=True)))


def _importable_release() -> str | None:
    """The release of the vLLM this interpreter imports, or None if vLLM's scheduler does not
    import (absent or half-installed) or the release is not one this bench knows."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401

        return vllm_release()
    except Exception:  # vLLM absent or half-installed, or a release unknown here
        return None


@dataclass
class Measurement:
    """Both sides on one case: microseconds per measured step (``best_of`` the passes) by side
    name, and the case's character."""

    case: Case
    hit_rate: float
    evictions_per_step: float
    preemptions: int
    max_usage: float
    min_running: int
    step_us: dict[str, float] = field(default_factory=dict)  # nothing wrapped
    wrapped_step_us: dict[str, float] = field(default_factory=dict)
    share_us: dict[str, float] = field(default_factory=dict)
    share_us_by_method: dict[str, dict[str, float]] = field(default_factory=dict)
    calls_by_method: dict[str, float] = field(default_factory=dict)  # per step


def measure(release: str, case: Case, repeats: int) -> Measurement:
    """Both sides on ``case``: a check pass each with KV events on, then ``repeats`` passes
    each of the plain and the wrapped step, alternating the sides; every pass checked against
    vLLM's check pass."""
    sides = TARGETS[release].sides()
    steps = case.measured_steps
    with tempfile.TemporaryDirectory(prefix="kvspec-bench-") as tmp:
        folder = Path(tmp) / "model"
        checks = {side.name: run_pass(release, side, case, folder, kv_events=True)
                  for side in sides}
        plain: dict[str, list[Pass]] = {side.name: [] for side in sides}
        wrapped: dict[str, list[Pass]] = {side.name: [] for side in sides}
        for repeat in range(repeats):
            order = sides if repeat % 2 == 0 else sides[::-1]  # alternate, so drift hits both
            for side in order:
                plain[side.name].append(run_pass(release, side, case, folder))
            for side in order:
                wrapped[side.name].append(run_pass(release, side, case, folder, timed=True))
    check = checks["vllm"]
    for name, one in [*checks.items(), *((n, p) for n in plain for p in plain[n] + wrapped[n])]:
        if one.fingerprint != check.fingerprint:
            raise AssertionError(f"{case.name}, {case.running} running: {name}'s "
                                 f"{TARGETS[release].what} scheduled other tokens, hits or "
                                 "block ids than vLLM's")
    calls = {name: [p.calls_by_method for p in passes] for name, passes in wrapped.items()}
    if any(c != calls["vllm"][0] for per_side in calls.values() for c in per_side):
        raise AssertionError(f"the two {TARGETS[release].what}s were called differently: "
                             f"{calls}")
    result = Measurement(case, check.hit_tokens / max(1, check.query_tokens),
                         check.evictions / steps, check.preemptions, check.max_usage,
                         check.running)
    result.calls_by_method = {name: n / steps for name, n in sorted(calls["vllm"][0].items())}
    for name in plain:
        result.step_us[name] = best_of([p.step_seconds for p in plain[name]]) / steps * 1e6
        result.wrapped_step_us[name] = best_of(
            [p.step_seconds for p in wrapped[name]]) / steps * 1e6
        result.share_us[name] = best_of([p.share_seconds for p in wrapped[name]]) / steps * 1e6
        result.share_us_by_method[name] = {
            method: best_of([p.share_seconds_by_method[method] for p in wrapped[name]])
            / steps * 1e6 for method in result.calls_by_method}
    return result


def _row_names(release: str, m: Measurement) -> tuple[str, str]:
    """The two rows' names: the step, and the share (docs/benchmarks.md's sections s and s33
    name them so; vLLM 0.13's have one case, its running batch names it)."""
    case, label, share = m.case, TARGETS[release].label, TARGETS[release].key
    if release == "0.13":
        return (f"{label} step, {case.running} running (hits {m.hit_rate:.2f})",
                f"{label} KV share, {case.running} running ({m.evictions_per_step:.0f} "
                "evict/step)")
    return (f"{label} step, {case.name}, {case.running} running",
            f"{label} {share} share, {case.name}, {case.running} running")


def run(quick: bool = False, release: str | None = None) -> list[dict[str, Any]]:
    """Rows for benchmarks/run.py: the step and the share of it spent in what the plugin
    replaces, per case (``impl`` kvspec, ``vllm`` vLLM, microseconds per step; ``speedup``
    vLLM / kvspec), for ``release`` (default: this interpreter's)."""
    found = _importable_release()
    if found is None or release not in (None, found):
        print(f"(bench_scheduler: needs vLLM {release or '0.13 or 0.33'} importable, for its "
              f"Scheduler; found {found or 'none'})", file=sys.stderr)
        return []
    target = TARGETS[found]
    floor, wrapper = wrapper_floor_seconds(target.wrapper)
    key = target.key
    rows: list[dict[str, Any]] = []
    for case in (QUICK_CASES if quick else CASES)[found]:
        m = measure(found, case, repeats=2 if quick else case.repeats)
        calls = m.calls_by_method
        details = {
            "calls_per_step": round(sum(calls.values()), 1),
            "calls_per_step_by_method": {k: round(v, 1) for k, v in calls.items()},
            "timer_floor_ns_per_call": round(floor * 1e9, 1),
            "wrapper_ns_per_call": round(wrapper * 1e9, 1),
            "wrapped_step_us": {k: round(v, 1) for k, v in m.wrapped_step_us.items()},
            f"{key}_share_of_wrapped_step": {
                side: round(m.share_us[side] / m.wrapped_step_us[side], 3)
                for side in m.share_us},
            f"{key}_us_by_method": {side: {k: round(v, 1) for k, v in by.items()}
                                    for side, by in m.share_us_by_method.items()},
            # The step ratio if the steps differed by the share's time alone.
            f"step_speedup_implied_by_{key}": round(m.step_us["vllm"] / (
                m.step_us["vllm"] - m.share_us["vllm"] + m.share_us["kvspec"]), 3),
            f"{key}_us_net_of_timer_floor": {
                side: round(us - sum(calls.values()) * floor * 1e6, 1)
                for side, us in m.share_us.items()},
        }
        character = {"case": case.name, "running": case.running,
                     "hit_rate": round(m.hit_rate, 3),
                     "evictions_per_step": round(m.evictions_per_step, 1),
                     "preemptions": m.preemptions, "max_kv_cache_usage": round(m.max_usage, 3),
                     "min_running": m.min_running}
        step_row, share_row = _row_names(found, m)
        for label, times, extra in ((step_row, m.step_us, {}),
                                    (share_row, m.share_us, details)):
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
    if not rows:
        return 1
    key = TARGETS[vllm_release()].key
    print(f"{'':66s} {'vLLM':>8s} {'kvspec':>8s}  vLLM/kvspec")
    for row in rows:
        print(f"{row['workload']:66s} {row['vllm']:8.1f} {row['impl']:8.1f}  "
              f"{row['speedup']:.2f}x")
        by = row.get(f"{key}_us_by_method")
        if by is None:
            print(f"    hit rate {row['hit_rate']}, {row['evictions_per_step']} evictions/step, "
                  f"preemptions {row['preemptions']}, KV-cache usage up to "
                  f"{row['max_kv_cache_usage']}, running at least {row['min_running']}")
            continue
        for name in sorted(by["vllm"], key=lambda n: -by["vllm"][n]):
            theirs, ours = by["vllm"][name], by["kvspec"].get(name, 0.0)
            calls = row["calls_per_step_by_method"][name]
            print(f"    {name + f' ({calls:g} calls/step)':62s} {theirs:8.1f} {ours:8.1f}  "
                  f"{theirs / ours if ours else float('nan'):.2f}x")
        share = row[f"{key}_share_of_wrapped_step"]
        net = row[f"{key}_us_net_of_timer_floor"]
        print(f"    {row['calls_per_step']} timed calls/step, "
              f"{row['timer_floor_ns_per_call']} ns/call of timer inside the timed time, "
              f"{row['wrapper_ns_per_call']} ns/call of wrapper in all; wrapped step "
              f"{row['wrapped_step_us']}; share of it vLLM {share['vllm']:.0%}, kvspec "
              f"{share['kvspec']:.0%}")
        print(f"    time net of the timer floor: vLLM {net['vllm']:.1f}, kvspec "
              f"{net['kvspec']:.1f}: {net['vllm'] / net['kvspec']:.2f}x; the step ratio if "
              f"only this time differed: {row[f'step_speedup_implied_by_{key}']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
