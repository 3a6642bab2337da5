"""Hostile input to KV events, the block-residency metrics, cache stats and ``kvspec plan``.

* Events (``kvspec.impl.kv_events``): the structs check nothing when built, as msgspec's and
  vLLM's do (docs/hostile-input.md says why): those calls are accepted, and what the pool
  builds is shown to decode with the typed decoder. ``KVEventAggregator`` is a subject drawn
  with events counted from several workers; its snapshot is the worker count and every
  event's count in first-seen order. Its other methods (``get_common_events``,
  ``get_all_events``, ``clear_events``, ``reset_workers``, ``get_number_of_workers``) take
  no argument.
* Metrics (``kvspec.impl.kv_cache_metrics``): a collector with a seeded random source and a
  fake clock, after allocations, accesses and evictions; the snapshot holds every tracked
  block's times, the undrained eviction events and the random source's state (a refused call
  must not draw: the draw decides which later block is sampled).
* Stats (``kvspec.impl.stats``): ``PrefixCacheStats`` after some records, and the
  constructors of both classes.
* Plan (``kvspec.models.plan`` and the ``kvspec plan`` command): bad layouts, counts, sizes
  and memory strings to ``plan_memory`` and ``parse_memory``; the command must answer a bad
  value with one line on stderr naming it and exit status 2 (``cli_call``).
"""

from __future__ import annotations

import contextlib
import io
import random
from dataclasses import astuple, dataclass
from typing import Any

import msgspec
import numpy as np
from hypothesis import given, strategies as st

from kvspec import cli
from kvspec.impl.block_pool import BlockPool
from kvspec.impl.kv_cache_metrics import BlockMetricsState, KVCacheMetricsCollector
from kvspec.impl.kv_cache_utils import KVCacheBlock
from kvspec.impl.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    KVEventAggregator,
    KVEventBatch,
)
from kvspec.impl.stats import KVCacheEvictionEvent, PrefixCacheStats
from kvspec.models.layout import ModelLayout, get_layout
from kvspec.models.plan import parse_memory, plan_memory
from tests.hostile import BadCall, check
from tests.hostile.values import (
    Bad,
    HalfwayError,
    Opaque,
    bad_count,
    bad_positive,
    halfway,
    not_an_int,
    not_iterable,
)

STRUCTS_ACCEPT = ("msgspec Structs check field types when decoded, not when built, and vLLM's "
                  "callers build events with other types (docs/hostile-input.md)")


def _call(describe: str, run: Any, bad: Bad | None = None, **kwargs: Any) -> BadCall:
    if bad is None:
        return BadCall(describe, run, **kwargs)
    return BadCall(describe, run, bad.value, bad.forms, **kwargs)


def _numpy_count(bad: Bad) -> str:
    """The acceptance reason when ``bad`` is a positive numpy integer (impl's one integer rule,
    docs/hostile-input.md), else ''."""
    value = bad.value
    if isinstance(value, np.integer) and not isinstance(value, np.bool_) and int(value) > 0:
        return "a numpy integer in range: impl's integer arguments take numpy's, converted"
    return ""


def _operation(call: BadCall, operation: str) -> BadCall:
    return BadCall(call.describe, call.run, call.bad, call.named, call.propagates,
                   call.accepted, operation)


def _nothing(_: object) -> object:
    """The snapshot of a call with no subject (a constructor, a pure function)."""
    return None


# ---------------------------------------------------------------------- event structs


def _bad_field() -> st.SearchStrategy[Bad]:
    return st.sampled_from([Bad(None, "None"), Bad("GPU", "'GPU'"), Bad(2.5, "2.5"),
                            Bad([1.5], "[1.5]"), Bad(Opaque(), "Opaque()"),
                            Bad((1, 2), "(1, 2)")])


_STRUCT_FIELDS: dict[str, tuple[type[msgspec.Struct], dict[str, Any]]] = {
    "BlockStored": (BlockStored, {"block_hashes": [1], "parent_block_hash": None,
                                  "token_ids": [1, 2], "block_size": 2, "lora_id": None,
                                  "medium": MEDIUM_GPU}),
    "BlockRemoved": (BlockRemoved, {"block_hashes": [1], "medium": MEDIUM_GPU}),
    "EventBatch": (EventBatch, {"ts": 1.0, "events": [], "data_parallel_rank": None}),
    "KVEventBatch": (KVEventBatch, {"ts": 1.0, "events": [], "data_parallel_rank": None}),
}


@given(st.data())
def test_event_structs_accept_any_field_as_documented(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(_STRUCT_FIELDS)))
    struct, fields = _STRUCT_FIELDS[name]
    field = data.draw(st.sampled_from(sorted(fields)))
    bad = data.draw(_bad_field().filter(lambda b: not _fits(field, b.value)))
    args = {**fields, field: bad.value}
    check(None, _nothing, _operation(_call(f"{name}({field}={bad.label})",
                                           lambda _: struct(**args), bad,
                                           accepted=STRUCTS_ACCEPT), name))


@given(st.data())
def test_malformed_events_are_refused_where_they_are_decoded(data: st.DataObject) -> None:
    """The acceptance above ends at the wire: an event built with a bad field does not decode
    with vLLM's typed decoder, so a consumer never reads it as a well-formed event."""
    name = data.draw(st.sampled_from(["BlockStored", "BlockRemoved"]))
    struct, fields = _STRUCT_FIELDS[name]
    field = data.draw(st.sampled_from(sorted(fields)))
    bad = data.draw(_bad_field().filter(lambda b: not _fits(field, b.value)))
    event = struct(**{**fields, field: bad.value})
    try:
        wire = msgspec.msgpack.encode(KVEventBatch(1.0, [event]))  # type: ignore[list-item]
    except TypeError:
        return  # not even encodable (an Opaque): nothing reaches a consumer
    try:
        msgspec.msgpack.Decoder(KVEventBatch).decode(wire)
    except msgspec.ValidationError:
        return
    raise AssertionError(f"{name}({field}={bad.label}) decodes as a well-formed event")


def _fits(field: str, value: object) -> bool:
    """Whether ``value`` is a value of the field after all (msgpack has no tuples)."""
    optional = ("parent_block_hash", "lora_id", "medium", "data_parallel_rank")
    if field in optional and value is None:
        return True
    if field == "medium" and isinstance(value, str):
        return True
    return field in ("block_hashes", "token_ids", "events") and value == (1, 2)


@dataclass
class _Request:
    block_hashes: list[bytes]
    all_token_ids: list[int]
    lora_request: Any = None


@given(num_blocks=st.integers(2, 12), bound=st.sampled_from([None, 1, 4]),
       program=st.lists(st.tuples(st.sampled_from(["admit", "finish", "evict", "reset", "take"]),
                                  st.integers(0, 2**16)), max_size=30))
def test_what_the_pool_builds_always_decodes(num_blocks: int, bound: int | None,
                                             program: list[tuple[str, int]]) -> None:
    """Every event the pool emits, collapse snapshots included, survives vLLM's wire: encoded
    in a batch and decoded with the typed decoder, it comes back equal."""
    pool = BlockPool(num_blocks, True, 2, True, max_pending_kv_events=bound)
    held: list[list[KVCacheBlock]] = []
    events: list[KVCacheEvent] = []
    for action, seed in program:
        if action == "admit" and pool.get_num_free_blocks():
            size = 1 + seed % min(3, pool.get_num_free_blocks())
            blocks = pool.get_new_blocks(size)
            family = seed % 3
            hashes = [bytes([family, i]) * 16 for i in range(size)]
            pool.cache_full_blocks(_Request(hashes, list(range(2 * size))), blocks, 0, size, 2,
                                   seed % 2)
            held.append(blocks)
        elif action == "finish" and held:
            pool.free_blocks(reversed(held.pop(seed % len(held))))
        elif action == "evict":
            pool.evict_blocks({seed % num_blocks})
        elif action == "reset":
            pool.reset_prefix_cache()
        elif action == "take":
            events += pool.take_events()
    events += pool.take_events()
    wire = msgspec.msgpack.encode(KVEventBatch(1.0, events))  # type: ignore[arg-type]
    assert msgspec.msgpack.Decoder(KVEventBatch).decode(wire).events == events


# ---------------------------------------------------------------------- aggregator


def _stored(i: int) -> BlockStored:
    return BlockStored([i], None, [i, i], 2, None, MEDIUM_GPU)


_EVENTS: list[KVCacheEvent] = [_stored(1), _stored(2), BlockRemoved([1], MEDIUM_GPU),
                               AllBlocksCleared()]


@st.composite
def aggregators(draw: st.DrawFn) -> KVEventAggregator:
    aggregator = KVEventAggregator(draw(st.integers(1, 4)))
    for _ in range(draw(st.integers(0, 3))):
        aggregator.add_events(draw(st.lists(st.sampled_from(_EVENTS), max_size=4)))
    if draw(st.booleans()):
        aggregator.increment_workers(draw(st.integers(1, 2)))
    return aggregator


def aggregator_snapshot(aggregator: KVEventAggregator) -> object:
    counts = aggregator._event_counter
    return aggregator.get_number_of_workers(), tuple(counts.items())


@st.composite
def aggregator_bad_calls(draw: st.DrawFn, aggregator: KVEventAggregator) -> BadCall:
    operation = draw(st.sampled_from(["add_events", "increment_workers"]))
    if operation == "increment_workers":
        bad = draw(bad_positive())
        return _operation(_call(f"aggregator.increment_workers({bad.label})",
                                lambda a: a.increment_workers(bad.value), bad,
                                accepted=_numpy_count(bad)), operation)
    good = draw(st.lists(st.sampled_from(_EVENTS), max_size=3))
    kind = draw(st.sampled_from(["not a list", "not an event", "unhashable event"]))
    if kind == "not a list":
        bad = draw(st.sampled_from([
            Bad(None, "None"), Bad(tuple(good), "a tuple of events", (repr(tuple(good)),)),
            Bad(_EVENTS[0], "an event, not a list", (repr(_EVENTS[0]),)),
            Bad(Opaque(), "Opaque()")]))
        return _operation(_call(f"aggregator.add_events({bad.label})",
                                lambda a: a.add_events(bad.value), bad), operation)
    if kind == "not an event":
        bad = draw(st.sampled_from([Bad(None, "None"), Bad(3, "3"), Bad(Opaque(), "Opaque()"),
                                    Bad({"type": "BlockRemoved"}, "a dict")]))
    else:
        unhashable = BlockStored(None, None, None, 2, None, MEDIUM_GPU)  # type: ignore[arg-type]
        bad = Bad(unhashable, "BlockStored(block_hashes=None, ...)", (repr(unhashable),))
    position = draw(st.integers(0, len(good)))
    listed = [*good[:position], bad.value, *good[position:]]
    return _operation(_call(f"aggregator.add_events([<{len(good)} events> with {bad.label}])",
                            lambda a: a.add_events(listed), bad), operation)


@given(st.data())
def test_aggregator_refuses_bad_calls_and_changes_nothing(data: st.DataObject) -> None:
    subject = data.draw(aggregators())
    check(subject, aggregator_snapshot, data.draw(aggregator_bad_calls(subject)))


@given(bad=bad_positive())
def test_aggregator_constructor_refuses_bad_worker_counts(bad: Bad) -> None:
    check(None, _nothing, _operation(_call(f"KVEventAggregator({bad.label})",
                                           lambda _: KVEventAggregator(bad.value), bad,
                                           accepted=_numpy_count(bad)),
                                     "KVEventAggregator"))


# ---------------------------------------------------------------------- metrics


class FakeClock:
    """A clock that moves one millisecond per reading."""

    def __init__(self) -> None:
        self.now_ns = 0

    def __call__(self) -> int:
        self.now_ns += 1_000_000
        return self.now_ns


@dataclass(frozen=True)
class StandIn:
    """Something with a ``block_id`` that a caller might pass for a block."""

    block_id: Any


@dataclass
class CollectorSubject:
    collector: KVCacheMetricsCollector
    rng: random.Random

    def __repr__(self) -> str:
        return (f"CollectorSubject(rate={self.collector.sample_rate}, "
                f"tracked={sorted(self.collector.block_metrics)})")


@st.composite
def collectors(draw: st.DrawFn) -> CollectorSubject:
    rng = random.Random(draw(st.integers(0, 2**16)))
    collector = KVCacheMetricsCollector(draw(st.sampled_from([1.0, 0.5])), rng=rng,
                                        clock=FakeClock())
    for _ in range(draw(st.integers(0, 8))):
        block = KVCacheBlock(draw(st.integers(0, 7)))
        action = draw(st.sampled_from(["allocate", "allocate", "access", "evict"]))
        getattr(collector, f"on_block_{action}{'ed' if action != 'allocate' else 'd'}")(block)
    return CollectorSubject(collector, rng)


def collector_snapshot(subject: CollectorSubject) -> object:
    collector = subject.collector
    tracked = tuple((block_id, state.birth_time_ns, state.last_access_ns,
                     tuple(state.access_history))
                    for block_id, state in sorted(collector.block_metrics.items()))
    return tracked, tuple(collector._eviction_events), subject.rng.getstate()


def _bad_block() -> st.SearchStrategy[Bad]:
    return st.sampled_from([
        Bad(None, "None"), Bad(3, "3"), Bad(Opaque(), "Opaque()"),
        *(Bad(StandIn(value), f"StandIn(block_id={value!r})", (repr(StandIn(value)),))
          for value in (None, "1", 1.0, -1, True, [1]))])


def _bad_block_id() -> st.SearchStrategy[Bad]:
    return st.one_of(not_an_int(), st.integers(-(2**65), -1).map(lambda v: Bad(v, repr(v))))


@st.composite
def collector_bad_calls(draw: st.DrawFn, subject: CollectorSubject) -> BadCall:
    operation = draw(st.sampled_from(["on_block_allocated", "on_block_accessed",
                                      "on_block_evicted", "on_block_id_evicted",
                                      "on_blocks_allocated", "on_blocks_accessed"]))
    if operation == "on_block_id_evicted":
        bad = draw(_bad_block_id())
        call = _call(f"collector.on_block_id_evicted({bad.label})",
                     lambda s: s.collector.on_block_id_evicted(bad.value), bad)
    elif operation.startswith("on_block_"):
        bad = draw(_bad_block())
        call = _call(f"collector.{operation}({bad.label})",
                     lambda s: getattr(s.collector, operation)(bad.value), bad)
    else:
        good = draw(st.lists(st.integers(0, 7), max_size=3))
        kind = draw(st.sampled_from(["not iterable", "bad id", "halfway"]))
        if kind == "halfway":
            call = _call(f"collector.{operation}(<iterator of {good}, then fails>)",
                         lambda s: getattr(s.collector, operation)(halfway(good)),
                         propagates=HalfwayError)
        elif kind == "not iterable":
            bad = draw(not_iterable())
            call = _call(f"collector.{operation}({bad.label})",
                         lambda s: getattr(s.collector, operation)(bad.value), bad)
        else:
            bad = draw(_bad_block_id())
            listed = [*good, bad.value]
            call = _call(f"collector.{operation}([<{len(good)} ids>, {bad.label}])",
                         lambda s: getattr(s.collector, operation)(listed), bad)
    return _operation(call, operation)


@given(st.data())
def test_metrics_collector_refuses_bad_calls_and_changes_nothing(data: st.DataObject) -> None:
    subject = data.draw(collectors())
    check(subject, collector_snapshot, data.draw(collector_bad_calls(subject)))


@given(st.data())
def test_metrics_constructors_refuse_bad_arguments(data: st.DataObject) -> None:
    which = data.draw(st.sampled_from(["sample_rate", "rng", "clock", "BlockMetricsState"]))
    not_callable = st.sampled_from([Bad(3, "3"), Bad("now", "'now'"), Bad(Opaque(), "Opaque()")])
    if which == "BlockMetricsState":
        bad = data.draw(not_callable)
        call = _call(f"BlockMetricsState(clock={bad.label})",
                     lambda _: BlockMetricsState(bad.value), bad)
    else:
        if which == "sample_rate":
            bad = data.draw(st.one_of(not_an_int(), st.sampled_from(
                [Bad(0, "0"), Bad(-0.5, "-0.5"), Bad(1.5, "1.5"), Bad(0.0, "0.0")])))
        elif which == "rng":
            bad = data.draw(st.one_of(not_callable, st.just(Bad(random.random, "random.random",
                                                                ("<built-in method random",)))))
        else:
            bad = data.draw(st.one_of(not_callable, st.just(Bad(None, "None"))))
        args = {which: bad.value}
        call = _call(f"KVCacheMetricsCollector({which}={bad.label})",
                     lambda _: KVCacheMetricsCollector(**args), bad)
    check(None, _nothing, _operation(call, which))


# ---------------------------------------------------------------------- stats


@st.composite
def prefix_stats(draw: st.DrawFn) -> PrefixCacheStats:
    stats = PrefixCacheStats()
    for _ in range(draw(st.integers(0, 3))):
        tokens = draw(st.integers(0, 100))
        stats.record(tokens, draw(st.integers(0, tokens)), draw(st.booleans()))
    return stats


@given(st.data())
def test_prefix_cache_stats_record_refuses_and_changes_nothing(data: st.DataObject) -> None:
    stats = data.draw(prefix_stats())
    args: dict[str, Any] = {"num_tokens": 10, "num_hits": 4, "preempted": False}
    which = data.draw(st.sampled_from(["num_tokens", "num_hits", "preempted", "hits > tokens"]))
    if which == "preempted":
        bad = data.draw(st.sampled_from([Bad(None, "None"), Bad(1, "1"), Bad("yes", "'yes'")]))
        args["preempted"] = bad.value
    elif which == "hits > tokens":
        bad = Bad(11, "11")
        args["num_hits"] = 11
    else:
        bad = data.draw(bad_count())
        args[which] = bad.value
        args["preempted"] = data.draw(st.booleans())
    check(stats, astuple, _operation(_call(f"stats.record(<{which}: {bad.label}>)",
                                           lambda s: s.record(**args), bad), "record"))


@given(st.data())
def test_stats_constructors_refuse_bad_fields(data: st.DataObject) -> None:
    if data.draw(st.booleans()):
        field = data.draw(st.sampled_from(["reset", "requests", "queries", "hits",
                                           "preempted_requests", "preempted_queries",
                                           "preempted_hits"]))
        bad = data.draw(st.sampled_from([Bad(None, "None"), Bad(1, "1")]) if field == "reset"
                        else bad_count())
        kwargs = {field: bad.value}
        call = _call(f"PrefixCacheStats({field}={bad.label})",
                     lambda _: PrefixCacheStats(**kwargs), bad)
        operation = "PrefixCacheStats"
    else:
        field = data.draw(st.sampled_from(["lifetime_seconds", "idle_seconds",
                                           "reuse_gaps_seconds", "a reuse gap"]))
        seconds = st.sampled_from([Bad(None, "None"), Bad("1", "'1'"), Bad(-1.0, "-1.0"),
                                   Bad(float("nan"), "nan", ("nan",)), Bad(True, "True"),
                                   Bad(float("inf"), "inf", ("inf",))])
        values: dict[str, Any] = {"lifetime_seconds": 2.0, "idle_seconds": 1.0,
                                  "reuse_gaps_seconds": (0.5,)}
        if field == "reuse_gaps_seconds":
            bad = data.draw(st.sampled_from([Bad([0.5], "[0.5]"), Bad(None, "None")]))
            values[field] = bad.value
        elif field == "a reuse gap":
            bad = data.draw(seconds)
            values["reuse_gaps_seconds"] = (0.5, bad.value)
        else:
            bad = data.draw(seconds)
            values[field] = bad.value
        call = _call(f"KVCacheEvictionEvent(<{field}: {bad.label}>)",
                     lambda _: KVCacheEvictionEvent(**values), bad)
        operation = "KVCacheEvictionEvent"
    check(None, _nothing, _operation(call, operation))


# ---------------------------------------------------------------------- plan


_MODELS = ("Llama-3.1-8B", "Jamba-v0.1", "Gemma-3-27B", "Whisper-large-v3")


def _bad_plan_int() -> st.SearchStrategy[Bad]:
    """Not an int in [1, 2**63 - 1]."""
    return st.one_of(bad_positive(), st.sampled_from([2**63, 2**64, 10**400]).map(
        lambda v: Bad(v, f"{v}" if v < 2**65 else "10**400", (str(v)[:39],))))


@given(st.data())
def test_plan_memory_refuses_bad_arguments(data: st.DataObject) -> None:
    layout = get_layout(data.draw(st.sampled_from(_MODELS)))
    which = data.draw(st.sampled_from(["layout", "memory_bytes", "num_blocks", "block_size",
                                       "mamba_block_size", "max_model_len",
                                       "max_num_batched_tokens"]))
    args: dict[str, Any] = {"memory_bytes": 2**30}
    if which == "layout":
        bad = data.draw(st.sampled_from([Bad(None, "None"), Bad("Llama-3.1-8B",
                                                                "'Llama-3.1-8B'"),
                                         Bad(Opaque(), "Opaque()")]))
        call = _call(f"plan_memory({bad.label}, memory_bytes=2**30)",
                     lambda _: plan_memory(bad.value, memory_bytes=2**30), bad)
    else:
        optional = which in ("mamba_block_size", "max_model_len")  # None: the default
        bad = data.draw(_bad_plan_int().filter(lambda b: not optional or b.value is not None))
        if which == "num_blocks":
            args = {"num_blocks": bad.value}
        else:
            args[which] = bad.value
        call = _call(f"plan_memory(<{layout.name}>, {which}={bad.label})",
                     lambda lay: plan_memory(lay, **args), bad)
    check(layout, _layout_snapshot, _operation(call, f"plan_memory {which}"))


def _layout_snapshot(layout: ModelLayout) -> object:
    return layout  # frozen: equal means unchanged


def _bad_memory_text() -> st.SearchStrategy[Bad]:
    def text(value: str, label: str | None = None) -> Bad:
        shown = repr(value)
        form = shown if len(shown) <= 80 else shown[:40]
        return Bad(value, label or shown, (form,))
    return st.one_of(
        st.sampled_from([text(""), text("GiB"), text("-1GiB"), text("0"), text("0.0001B"),
                         text("1e9"), text("nan"), text("inf"), text("80 GiBs"), text("80PiB"),
                         text("1,024"), text("0x10"), text("١GiB"), text("1٫5GiB"),
                         text("\u20031GiB"), text("8388608TiB"), text("9" * 20),
                         text("9" * 5000, "'9' * 5000"), text("0." + "9" * 5000 + "GiB",
                                                             "'0.' + '9' * 5000 + 'GiB'")]),
        st.sampled_from([Bad(None, "None"), Bad(80, "80"), Bad(b"80GiB", "b'80GiB'"),
                         Bad(Opaque(), "Opaque()")]))


@given(bad=_bad_memory_text())
def test_parse_memory_refuses_bad_sizes(bad: Bad) -> None:
    check(None, _nothing, _operation(_call(f"parse_memory({bad.label})",
                                           lambda _: parse_memory(bad.value), bad),
                                     "parse_memory"))


class CommandRefused(ValueError):
    """``kvspec plan`` exited with status 2 and one line, ``kvspec plan: error: ...``, on
    stderr (its text is this error's message), and nothing on stdout: a refusal as the
    promise wants it from a command."""


def cli_call(argv: list[str]) -> None:
    """Run ``kvspec plan`` in this process; raise ``CommandRefused`` for a proper refusal,
    an ``AssertionError`` (untyped) for any other way of failing, return on success."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(["plan", *argv])
        except SystemExit as exit_:  # argparse's own usage errors
            status = exit_.code if isinstance(exit_.code, int) else 1
    lines = err.getvalue().splitlines()
    if status == 0:
        return
    if (status == 2 and len(lines) == 1 and lines[0].startswith("kvspec plan: error: ")
            and not out.getvalue()):
        raise CommandRefused(lines[0])
    raise AssertionError(f"kvspec plan exited {status} with stderr {err.getvalue()!r}")


@st.composite
def cli_bad_invocations(draw: st.DrawFn) -> BadCall:
    model = draw(st.sampled_from(_MODELS))
    which = draw(st.sampled_from(["model", "--memory", "--num-blocks", "--block-size",
                                  "--max-model-len", "--max-num-batched-tokens"]))
    budget = ["--memory", "1GiB"]
    if which == "model":
        name = draw(st.sampled_from(["", "gpt-zero", "Llama-3.1-8B/../x", "llama 3", "\n",
                                     "x" * 300]))
        argv = [name, *budget]
        bad = Bad(name, repr(name), (repr(name)[:40],))
    elif which == "--memory":
        bad = draw(_bad_memory_text().filter(lambda b: isinstance(b.value, str)
                                             and not b.value.startswith("-")))
        argv = [model, "--memory", bad.value]
    else:
        text = draw(st.sampled_from(["0", "-3", "abc", "1.5", "1e3", "", "١٢", "0x10",
                                     str(2**63), "9" * 400]))
        shown = repr(text)
        # Named as typed, or as the number it reads as (a range error names the int).
        bad = Bad(text, shown if len(shown) < 80 else f"'9' * {len(text)}", (shown[:40], text))
        argv = ([model, which, text] if which == "--num-blocks"
                else [model, *budget, f"{which}={text}"])
    return _operation(_call(f"kvspec plan {' '.join(map(repr, argv))[:120]}",
                            lambda _: cli_call(argv), bad), f"kvspec plan {which}")


@given(call=cli_bad_invocations())
def test_plan_command_refuses_bad_values_in_one_line(call: BadCall) -> None:
    check(None, _nothing, call)


def test_plan_command_still_plans() -> None:
    """What the checks let through: a plan, exit status 0."""
    cli_call(["Llama-3.1-8B", "--memory", "80GiB"])
    cli_call(["Qwen3-8B", "--num-blocks", "+11", "--block-size", " 16 "])
    cli_call(["Qwen3-8B", "--memory", "8388607TiB", "--max-model-len", str(2**63 - 1)])


# ---------------------------------------------------------------------- the pool's bound


@given(bad=bad_positive().filter(lambda b: b.value is not None))
def test_pool_refuses_a_bad_event_bound(bad: Bad) -> None:
    check(None, _nothing, _operation(
        _call(f"BlockPool(4, True, 2, True, max_pending_kv_events={bad.label})",
              lambda _: BlockPool(4, True, 2, True, max_pending_kv_events=bad.value), bad),
        "BlockPool max_pending_kv_events"))
