"""vLLM 0.33's KV-cache events (impl/kv_events_033.py): the map-encoded family
(``BlockStoredV033``, ``BlockRemovedV033``, ``AllBlocksClearedV033``, ``KVEventBatchV033``)
and the table of both releases' families (``event_classes(profile)``).

The bytes are checked against spec/events.py's statement of each profile (a Hypothesis
property), against 0.13's decoder (neither release reads the other's events), and, when
``.venv-vllm-0.33.0`` exists, against vLLM 0.33's own decoder and encoder (a subprocess
running vLLM's interpreter). vLLM 0.13's family and the aggregator: tests/test_kv_events.py.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import event, given, strategies as st

from kvspec.impl import kv_events_033
from kvspec.impl.kv_events import (
    MEDIUM_GPU,
    BlockStored,
    InvalidEventsError,
    KVCacheEvent,
    KVEventAggregator,
    KVEventBatch,
)
from kvspec.spec import events as spec_events
from kvspec.spec.pool import Profile

REPO_ROOT = Path(__file__).resolve().parent.parent
ENCODER = msgspec.msgpack.Encoder()  # what vLLM's ZMQ publisher encodes with
BATCH_DECODER = msgspec.msgpack.Decoder(KVEventBatch)  # vLLM 0.13's
VLLM_033_PYTHON = REPO_ROOT / ".venv-vllm-0.33.0" / "bin" / "python"
DECODER_033 = msgspec.msgpack.Decoder(kv_events_033.KVEventBatchV033)

HASHES = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=8))
TEXT = st.none() | st.sampled_from(["GPU", "CPU", "LOCAL", "a", "é" * 20])
KEYS = st.none() | st.tuples(st.sampled_from(["lora-a", "salt"])) | st.tuples(
    st.tuples(st.text(max_size=3), st.integers(-4, 4)), st.binary(max_size=4))


@st.composite
def wire_events(draw: st.DrawFn) -> spec_events.WireEvent:
    kind = draw(st.integers(0, 2))
    if kind == 2:
        return spec_events.WireCleared()
    hashes = tuple(draw(st.lists(HASHES, min_size=1, max_size=3)))
    optional = draw(st.booleans())
    if kind == 1:
        return spec_events.WireRemoved(
            hashes, draw(TEXT), draw(st.none() | st.integers(0, 70000)) if optional else None,
            draw(TEXT) if optional else None, draw(TEXT) if optional else None)
    size = draw(st.integers(1, 3))
    return spec_events.WireStored(
        hashes, draw(st.none() | HASHES),
        tuple(draw(st.lists(st.integers(-(2**40), 2**63 - 1), min_size=size * len(hashes),
                            max_size=size * len(hashes)))),
        size, draw(st.none() | st.integers(0, 2**20)), draw(TEXT), draw(TEXT),
        tuple(draw(KEYS) for _ in hashes) if optional and draw(st.booleans()) else None,
        draw(st.none() | st.integers(0, 3)) if optional else None,
        draw(TEXT) if optional else None, draw(st.none() | st.integers(1, 4096)) if optional
        else None, draw(TEXT) if optional else None, draw(TEXT) if optional else None,
        draw(TEXT) if optional else None,
        tuple(tuple(draw(st.lists(st.integers(0, 300), min_size=1, max_size=2))) for _ in hashes)
        if optional and draw(st.booleans()) else None)


def impl_event(event: spec_events.WireEvent, profile: Profile) -> Any:
    """impl's event of the profile's family for a spec wire event."""
    classes = kv_events_033.event_classes(profile.value)
    if isinstance(event, spec_events.WireCleared):
        return classes.AllBlocksCleared()
    names = [name for name, _ in (spec_events.stored_fields(profile)
                                  if isinstance(event, spec_events.WireStored)
                                  else spec_events.removed_fields(profile))]
    values = {n: spec_events._plain(getattr(event, n)) for n in names}
    if values.get("extra_keys") is not None:  # a list of per-block tuples, as vLLM types it
        values["extra_keys"] = [None if k is None else tuple(k) for k in values["extra_keys"]]
    cls = classes.BlockStored if isinstance(event, spec_events.WireStored) else (
        classes.BlockRemoved)
    return cls(**values)


@given(events=st.lists(wire_events(), max_size=4), ts=st.floats(allow_nan=False),
       rank=st.none() | st.integers(0, 7), profile=st.sampled_from(list(Profile)))
def test_impl_bytes_are_the_specs_per_profile(events: list[spec_events.WireEvent], ts: float,
                                              rank: int | None, profile: Profile) -> None:
    """impl's event classes of a profile write the bytes spec.events states for it, and the
    spec reads them back (less the fields the profile lacks)."""
    classes = kv_events_033.event_classes(profile.value)
    batch = classes.KVEventBatch(ts, [impl_event(e, profile) for e in events], rank)
    data = ENCODER.encode(batch)
    assert data == spec_events.encode_batch(ts, events, rank, profile)
    decoded = spec_events.decode_batch(data, lambda raw: spec_events.decode_event(raw, profile))
    assert decoded[1] == tuple(spec_events.decode_event(
        spec_events.unpack(spec_events.pack(spec_events.wire_value(e, profile))), profile)
        for e in events)
    assert all(spec_events.decodes_back(e, profile) for e in events)
    event("map" if spec_events.encoding(profile) is spec_events.Encoding.MAP else "array")


def test_neither_releases_decoder_reads_the_others_events() -> None:
    """0.13's decoder refuses a map, 0.33's an array (vLLM #42892 broke array consumers); a
    consumer that reads the shape reads both."""
    stored_033 = kv_events_033.BlockStoredV033([1], None, [1], 1, None, MEDIUM_GPU, None,
                                           group_idx=0)
    new = ENCODER.encode(kv_events_033.KVEventBatchV033(0.0, [stored_033]))
    old = ENCODER.encode(KVEventBatch(0.0, [BlockStored([1], None, [1], 1, None, MEDIUM_GPU)]))
    with pytest.raises(msgspec.ValidationError, match="Expected `array`, got `object`"):
        BATCH_DECODER.decode(new)
    with pytest.raises(msgspec.ValidationError, match="Expected `object`, got `array`"):
        DECODER_033.decode(old)
    with pytest.raises(spec_events.WireError, match="Expected `array`"):
        spec_events.decode_batch(new, spec_events.read_event_array_only)
    with pytest.raises(spec_events.WireError, match="Expected `object`"):
        spec_events.decode_batch(old, lambda raw: spec_events.decode_event(raw, Profile.V0_33))
    read_new = spec_events.decode_batch(new)[1][0]
    read_old = spec_events.decode_batch(old)[1][0]
    assert spec_events.to_pool_event(read_new) == spec_events.to_pool_event(read_old)
    assert isinstance(read_new, spec_events.WireStored) and read_new.group_idx == 0


def test_a_0_33_map_without_lora_name_is_refused() -> None:
    raw = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
           "token_ids": [1], "block_size": 1, "lora_id": None, "medium": "GPU"}
    data = spec_events.pack([0.0, [raw], None])
    with pytest.raises(msgspec.ValidationError, match="lora_name"):
        DECODER_033.decode(data)
    with pytest.raises(spec_events.WireError, match="lora_name"):
        spec_events.decode_batch(data)


def test_optional_fields_are_left_out_until_set() -> None:
    bare = kv_events_033.BlockRemovedV033([7], MEDIUM_GPU)
    assert spec_events.unpack(ENCODER.encode(bare)) == {
        "type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}
    assert spec_events.optional_fields_default_to_none(Profile.V0_33)
    assert [n for n, required in spec_events.stored_fields(Profile.V0_33) if required] == [
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name"]
    assert kv_events_033.BlockStoredV033.__struct_fields__ == tuple(
        n for n, _ in spec_events.stored_fields(Profile.V0_33))
    assert kv_events_033.BlockRemovedV033.__struct_fields__ == tuple(
        n for n, _ in spec_events.removed_fields(Profile.V0_33))


def test_decoded_0_33_events_with_multimodal_keys_stay_countable() -> None:
    """Decoding turns a multimodal event key's tuple into a list; impl's events still hash, so
    the aggregator counts them (vLLM 0.33's raise TypeError: docs/findings.md, E1)."""
    keys: list[tuple[Any, ...] | None] = [(("img", 0), "lora-a")]
    sent = kv_events_033.BlockStoredV033([1], None, [1], 1, None, MEDIUM_GPU, "lora-a",
                                     extra_keys=keys)
    batch = kv_events_033.KVEventBatchV033(0.0, [sent])
    [received] = DECODER_033.decode(ENCODER.encode(batch)).events
    assert received != sent  # msgspec decodes the inner tuple as a list, as in vLLM
    assert hash(received) == hash(sent)
    aggregator = KVEventAggregator(1)
    aggregator.add_events([received])
    assert aggregator.get_common_events() == [received]


def test_event_classes_refuse_an_unknown_profile() -> None:
    assert kv_events_033.event_classes("kvspec") is kv_events_033.EVENT_CLASSES["vllm-0.13"]
    with pytest.raises(InvalidEventsError, match=r"'vllm-0\.99'"):
        kv_events_033.event_classes("vllm-0.99")


@pytest.mark.parametrize("profile", [None, 33, b"vllm-0.33", ["vllm-0.33"], "VLLM-0.33"])
def test_event_classes_refuse_a_profile_that_is_not_one_by_name(profile: Any) -> None:
    """Not a profile's name (an unhashable list included): the typed refusal naming it."""
    with pytest.raises(InvalidEventsError, match=re.escape(repr(profile))):
        kv_events_033.event_classes(profile)


def test_each_profile_gets_its_releases_family() -> None:
    """vllm-0.33: the map-encoded family of this module, each a KVCacheEvent (the aggregator
    counts them) with vLLM's class name as its tag; vllm-0.13: kv_events' arrays."""
    family = kv_events_033.event_classes("vllm-0.33")
    assert family == (kv_events_033.BlockStoredV033, kv_events_033.BlockRemovedV033,
                      kv_events_033.AllBlocksClearedV033, kv_events_033.KVEventBatchV033)
    for cls in family[:3]:
        assert issubclass(cls, kv_events_033.KVCacheEventV033)
        assert issubclass(cls, KVCacheEvent)
        config = cls.__struct_config__
        assert (config.array_like, config.omit_defaults, config.tag_field) == (
            False, True, "type")
        assert config.tag == cls.__name__.removesuffix("V033")
    assert kv_events_033.event_classes("vllm-0.13").BlockStored is BlockStored
    assert spec_events.unpack(ENCODER.encode(kv_events_033.AllBlocksClearedV033())) == {
        "type": "AllBlocksCleared"}


def test_0_33_events_are_frozen_slotted_picklable_values() -> None:
    """Equal fields, equal events with equal hashes (extra keys and lookahead tokens
    included); frozen, slotted, and unchanged by pickling, as 0.13's."""
    def stored(lora_name: str | None) -> kv_events_033.BlockStoredV033:
        return kv_events_033.BlockStoredV033(
            [1, b"\x02"], None, [1, 2, 3, 4], 2, None, MEDIUM_GPU, lora_name,
            extra_keys=[None, ("salt",)], group_idx=1, session_id="s",
            lookahead_token_ids=[[3], [5]])

    events: list[KVCacheEvent] = [
        stored("a"), kv_events_033.BlockRemovedV033([1], MEDIUM_GPU, group_idx=0),
        kv_events_033.AllBlocksClearedV033()]
    for item in events:
        assert not hasattr(item, "__dict__")
        assert pickle.loads(pickle.dumps(item)) == item
    assert stored("a") == stored("a") and hash(stored("a")) == hash(stored("a"))
    assert stored("a") != stored("b") and len({stored("a"), stored("a"), stored(None)}) == 2
    with pytest.raises(AttributeError):
        stored("a").group_idx = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):
        kv_events_033.BlockRemovedV033([1], MEDIUM_GPU).medium = None  # type: ignore[misc]


# Runs under vLLM 0.33's interpreter: reads the batches' spec-written bytes with vLLM 0.33's
# decoder, re-encodes them with its encoder, and prints the bytes, one hex line per batch;
# then checks the decoded-event hashing fact behind finding E1.
VLLM_033_EVENTS = """
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, KVEventAggregator
decoder, encoder = msgspec.msgpack.Decoder(KVEventBatch), msgspec.msgpack.Encoder()
for line in sys.stdin.read().split():
    print("bytes", encoder.encode(decoder.decode(bytes.fromhex(line))).hex())
from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import to_event_extra_keys
keys = to_event_extra_keys([(("mm", "img", 0), ("lora", "a", "/p"))])
sent = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=1,
                   lora_id=None, medium="GPU", lora_name="a", extra_keys=keys)
got = decoder.decode(encoder.encode(KVEventBatch(ts=0.0, events=[sent]))).events[0]
try:
    KVEventAggregator(1).add_events([got])
    print("aggregated")
except TypeError as error:
    print("refused", error)
"""


@pytest.mark.slow
def test_events_are_byte_compatible_with_vllm_0_33_when_installed() -> None:
    """vLLM 0.33 decodes the spec's (and impl's) 0.33 bytes and writes them back unchanged."""
    if not VLLM_033_PYTHON.exists():
        pytest.skip("no .venv-vllm-0.33.0 (make vllm-env VLLM=0.33.0 builds it)")
    batches = [wire_events_sample(seed) for seed in range(40)]
    ours = [spec_events.encode_batch(ts, events, rank, Profile.V0_33)
            for ts, events, rank in batches]
    for (ts, events, rank), data in zip(batches, ours, strict=True):
        impl_batch = kv_events_033.KVEventBatchV033(
            ts, [impl_event(e, Profile.V0_33) for e in events], rank)
        assert ENCODER.encode(impl_batch) == data
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run([str(VLLM_033_PYTHON), "-c", VLLM_033_EVENTS],
                          input="\n".join(d.hex() for d in ours), env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    theirs = [bytes.fromhex(line.removeprefix("bytes ")) for line in lines
              if line.startswith("bytes ")]
    assert theirs == ours
    assert any(line.startswith("refused unhashable type") for line in lines)  # finding E1


def wire_events_sample(seed: int) -> tuple[float, list[spec_events.WireEvent], int | None]:
    """A seeded batch of wire events with every optional field's shapes."""
    rng = random.Random(seed)
    events: list[spec_events.WireEvent] = []
    for _ in range(rng.randrange(5)):
        choices: list[int | bytes] = [rng.randrange(2**64), rng.randbytes(8)]
        hashes = tuple(rng.choice(choices) for _ in range(rng.randrange(1, 3)))
        kind = rng.randrange(3)
        if kind == 0:
            events.append(spec_events.WireStored(
                hashes, rng.choice([None, rng.randrange(2**64)]),
                tuple(rng.randrange(2**31) for _ in range(2 * len(hashes))), 2,
                rng.choice([None, 3]), "GPU", rng.choice([None, "lora-a"]),
                rng.choice([None, tuple(rng.choice([None, ("lora-a",), (("img", -1), "s")])
                                        for _ in hashes)]),
                rng.choice([None, 0, 1]), rng.choice([None, "full_attention"]),
                rng.choice([None, 128]), rng.choice([None, "LOCAL"]),
                rng.choice([None, "tier-1"]), rng.choice([None, "session-9"]),
                rng.choice([None, tuple((rng.randrange(100),) for _ in hashes)])))
        elif kind == 1:
            events.append(spec_events.WireRemoved(hashes, "GPU", rng.choice([None, 2]),
                                                  rng.choice([None, "REMOTE"]), None))
        else:
            events.append(spec_events.WireCleared())
    return rng.uniform(0, 2e9), events, rng.choice([None, 1])
