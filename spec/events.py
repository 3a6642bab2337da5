"""KV-cache events on the wire, per profile (vLLM's vllm/distributed/kv_events.py), and the
report modes (vllm/v1/core/kv_cache_manager.py, block_pool.py).

What a publisher sends is ``msgpack(KVEventBatch)``: ``[ts, [event, ...], data_parallel_rank]``
(the batch is an array in both releases; an unset rank goes out as nil). How each *event* is
written is the profile's choice (``encoding``):

* ``Encoding.ARRAY`` (vllm-0.13): ``[tag, field, ...]``, every field of the schema in order.
* ``Encoding.MAP`` (vllm-0.33, vLLM PR #42892): ``{"type": tag, name: value, ...}``; the
  required fields always, an optional field only when it is set (msgspec's ``omit_defaults``:
  every optional field defaults to None).

The schemas (``stored_fields``, ``removed_fields``) are the profile's too: 0.33's BlockStored
adds a required ``lora_name`` and eight optional fields, its BlockRemoved three optional ones.
Neither release's decoder reads the other's events: 0.13's refuses a map ("Expected `array`,
got `object`"), 0.33's refuses an array, and 0.33's refuses a map without ``lora_name``
(``decode_event``). A consumer that reads both looks at the shape (``read_event``); one that
assumes arrays (``read_event_array_only``) breaks on every 0.33 event, as several did.

``pack`` and ``unpack`` are the part of msgpack msgspec writes (smallest integer, string, bin,
array and map forms; floats as float64), so the spec states the bytes themselves:
``encode_batch`` gives exactly the bytes vLLM's ``msgspec.msgpack.encode`` gives for the same
batch (tests/test_kv_events.py compares them with both releases).

Report modes (a request's ``kv_cache_report_mode``, read from its sampling params' extra args):

* ``INCREMENTAL`` (the default, and any value other than ``"full"``): one BlockStored when a
  physical copy of a key is cached and one BlockRemoved when it goes, so the stream's stores
  less its removes are exactly the copies in the cache (``copies_accounted``: vLLM's own
  contract test, one store and one remove per physical copy).
* ``FULL`` (vLLM PR #45261): a prefix-cache hit also sends a BlockStored for the reused blocks
  (``emit_cached_block_events``), with no remove to match. Stores less removes then only bound
  the copies from above: a router that counts never misses a resident key, but may keep one
  that is gone, and the stream cannot tell a re-report from a new copy (vLLM #51699 proposes an
  ``origin`` field for that).
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any, cast

from kvspec.spec.pool import Cleared, Event, Profile, Removed, Stored

# --- Encodings, schemas and report modes: the profile's parameters ----------------------------


class Encoding(Enum):
    """How an event is written: a positional array or a map of names (module docstring)."""

    ARRAY = "array"  # vllm-0.13
    MAP = "map"  # vllm-0.33


def encoding(profile: Profile) -> Encoding:
    """The release's event encoding: 0.33 dropped ``array_like`` (#42892)."""
    return Encoding.ARRAY if profile is Profile.V0_13 else Encoding.MAP


TAG_FIELD = "type"  # msgspec's tag field in a map-encoded event
MEDIUM_GPU = "GPU"

# (name, required) in declaration order: what each release's class declares.
_STORED_0_13 = (("block_hashes", True), ("parent_block_hash", True), ("token_ids", True),
                ("block_size", True), ("lora_id", True), ("medium", True))
_STORED_0_33 = _STORED_0_13 + (
    ("lora_name", True), ("extra_keys", False), ("group_idx", False),
    ("kv_cache_spec_kind", False), ("kv_cache_spec_sliding_window", False),
    ("locality", False), ("ownership", False), ("session_id", False),
    ("lookahead_token_ids", False))
_REMOVED_0_13 = (("block_hashes", True), ("medium", True))
_REMOVED_0_33 = _REMOVED_0_13 + (("group_idx", False), ("locality", False), ("ownership", False))


def stored_fields(profile: Profile) -> tuple[tuple[str, bool], ...]:
    """BlockStored's fields under the profile, as (name, required), in declaration order."""
    return _STORED_0_13 if profile is Profile.V0_13 else _STORED_0_33


def removed_fields(profile: Profile) -> tuple[tuple[str, bool], ...]:
    """BlockRemoved's fields under the profile, as (name, required), in declaration order."""
    return _REMOVED_0_13 if profile is Profile.V0_13 else _REMOVED_0_33


class ReportMode(Enum):
    """When a request's blocks are reported (module docstring)."""

    INCREMENTAL = "incremental"
    FULL = "full"


def report_mode(value: object) -> ReportMode:
    """The mode a request's ``kv_cache_report_mode`` selects: vLLM compares it with
    ``"full"`` and treats everything else, a misspelling included, as incremental.

    post: (__return__ is ReportMode.FULL) == (value == "full")
    """
    return ReportMode.FULL if value == "full" else ReportMode.INCREMENTAL


def reports_reused_blocks(mode: ReportMode) -> bool:
    """Whether a prefix-cache hit sends a BlockStored for the blocks it reuses."""
    return mode is ReportMode.FULL


# --- Wire events --------------------------------------------------------------------------------

Hash = int | bytes


@dataclass(frozen=True)
class WireStored:
    """A BlockStored with every field either release declares (unset optional ones None)."""

    block_hashes: tuple[Hash, ...]
    parent_block_hash: Hash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class WireRemoved:
    block_hashes: tuple[Hash, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True)
class WireCleared:
    pass


WireEvent = WireStored | WireRemoved | WireCleared


def _schema(event: WireEvent, profile: Profile) -> tuple[tuple[str, bool], ...]:
    if isinstance(event, WireStored):
        return stored_fields(profile)
    if isinstance(event, WireRemoved):
        return removed_fields(profile)
    return ()


def _written_only_when_required_or_set(
    pairs: tuple[tuple[str, Any], ...], event: WireEvent, profile: Profile
) -> bool:
    """Every required field is written; an optional one exactly when it is set (map), every
    field (array); nothing outside the profile's schema."""
    schema = _schema(event, profile)
    array = encoding(profile) is Encoding.ARRAY
    expected = tuple(name for name, required in schema
                     if array or required or getattr(event, name) is not None)
    return tuple(name for name, _ in pairs) == expected


def wire_fields(event: WireEvent, profile: Profile) -> tuple[tuple[str, Any], ...]:
    """The (name, value) pairs the profile's encoder writes for ``event``, in order. Fields the
    profile's schema lacks are not written (0.13 has no ``group_idx``).

    post: _written_only_when_required_or_set(__return__, event, profile)
    """
    array = encoding(profile) is Encoding.ARRAY
    return tuple((name, _plain(getattr(event, name))) for name, required in _schema(event, profile)
                 if array or required or getattr(event, name) is not None)


def _plain(value: Any) -> Any:
    """Tuples as lists, as msgpack writes them (both are arrays)."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _tag(event: WireEvent) -> str:
    if isinstance(event, WireStored):
        return "BlockStored"
    if isinstance(event, WireRemoved):
        return "BlockRemoved"
    return "AllBlocksCleared"


@dataclass(frozen=True)
class StructMap:
    """A map-encoded struct: its entries in order, and how many it could have (the tag and
    every declared field). msgspec sizes the map header for that many, so a BlockStored
    (16 possible entries) always gets a 3-byte map16 header, even when it writes 10."""

    entries: tuple[tuple[str, Any], ...]
    width: int


def wire_value(event: WireEvent, profile: Profile) -> list[Any] | StructMap:
    """The event as the profile writes it: ``[tag, *values]`` or ``{"type": tag, **fields}``."""
    pairs = wire_fields(event, profile)
    if encoding(profile) is Encoding.ARRAY:
        return [_tag(event), *(value for _, value in pairs)]
    return StructMap(((TAG_FIELD, _tag(event)), *pairs), 1 + len(_schema(event, profile)))


def wire_batch(ts: float, events: Sequence[WireEvent], data_parallel_rank: int | None,
               profile: Profile) -> list[Any]:
    """A KVEventBatch as written: an array in both releases, its rank nil when unset."""
    return [float(ts), [wire_value(e, profile) for e in events], data_parallel_rank]


def encode_batch(ts: float, events: Sequence[WireEvent], data_parallel_rank: int | None,
                 profile: Profile) -> bytes:
    """The bytes of a KVEventBatch, as vLLM's encoder writes them under the profile."""
    return pack(wire_batch(ts, events, data_parallel_rank, profile))


# --- Reading events back ------------------------------------------------------------------------


class WireError(ValueError):
    """Bytes or a decoded value that is not an event of the expected shape."""


_CLASSES: dict[str, type[WireStored] | type[WireRemoved] | type[WireCleared]] = {
    "BlockStored": WireStored, "BlockRemoved": WireRemoved, "AllBlocksCleared": WireCleared}


def _frozen(value: Any) -> Any:
    """Lists as tuples (a decoded array), so decoded events compare with built ones."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def _schema_of(tag: str, profile: Profile) -> tuple[tuple[str, bool], ...]:
    if tag == "BlockStored":
        return stored_fields(profile)
    if tag == "BlockRemoved":
        return removed_fields(profile)
    return ()


def decode_event(raw: Any, profile: Profile) -> WireEvent:
    """What the profile's decoder makes of one decoded event value: its own shape only (an
    array under vllm-0.13, a map under vllm-0.33), every required field present; unknown map
    keys are ignored and missing optional fields are None, as msgspec does."""
    expect = encoding(profile)
    if expect is Encoding.ARRAY and not isinstance(raw, list):
        raise WireError(f"Expected `array`, got {type(raw).__name__}: {raw!r}")
    if expect is Encoding.MAP and not isinstance(raw, dict):
        raise WireError(f"Expected `object`, got {type(raw).__name__}: {raw!r}")
    tag = raw[0] if isinstance(raw, list) and raw else (
        raw.get(TAG_FIELD) if isinstance(raw, dict) else None)
    if not isinstance(tag, str) or tag not in _CLASSES:
        raise WireError(f"not an event tag: {tag!r}")
    schema = _schema_of(tag, profile)
    if isinstance(raw, list):
        values = raw[1:]
        required = sum(1 for _, r in schema if r)
        if not required <= len(values) <= len(schema):
            raise WireError(f"{tag} needs {required} to {len(schema)} fields, got {values!r}")
        given = dict(zip((name for name, _ in schema), values, strict=False))
    else:
        given = {k: v for k, v in raw.items() if k in dict(schema)}
        missing = [name for name, r in schema if r and name not in given]
        if missing:
            raise WireError(f"{tag} is missing required field `{missing[0]}`: {raw!r}")
    return _CLASSES[tag](**{k: _frozen(v) for k, v in given.items()})


def read_event(raw: Any) -> WireEvent:
    """A consumer that reads both releases: an array is read as 0.13's, a map as 0.33's."""
    return decode_event(raw, Profile.V0_13 if isinstance(raw, list) else Profile.V0_33)


def read_event_array_only(raw: Any) -> WireEvent:
    """A consumer written against 0.13's arrays (kthena#1535, llm-d-kv-cache#661): every 0.33
    event is refused."""
    return decode_event(raw, Profile.V0_13)


def decode_batch(data: bytes, reader: Any = read_event) -> tuple[float, tuple[WireEvent, ...],
                                                                  int | None]:
    """(ts, events, data_parallel_rank) of a KVEventBatch's bytes, each event read by
    ``reader`` (``read_event``, ``read_event_array_only`` or a profile's ``decode_event``)."""
    batch = unpack(data)
    if not (isinstance(batch, list) and 2 <= len(batch) <= 3 and isinstance(batch[1], list)):
        raise WireError(f"not a KVEventBatch: {batch!r}")
    rank = batch[2] if len(batch) == 3 else None
    return batch[0], tuple(reader(e) for e in batch[1]), rank


def to_pool_event(event: WireEvent) -> Event:
    """The spec pool's view of a wire event (int hashes; what spec.pool emits)."""
    if isinstance(event, WireStored):
        return Stored(tuple(_int_hash(h) for h in event.block_hashes),
                      None if event.parent_block_hash is None
                      else _int_hash(event.parent_block_hash),
                      tuple(event.token_ids), event.block_size, event.lora_id)
    if isinstance(event, WireRemoved):
        return Removed(tuple(_int_hash(h) for h in event.block_hashes))
    return Cleared()


def _int_hash(block_hash: Hash) -> int:
    """An event hash as an int: bytes hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)
    by their low 64 bits, as the int form would have carried them."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash, "big") & (2**64 - 1)
    return block_hash


def from_pool_event(event: Event, group_idx: int | None = None) -> WireEvent:
    """A spec pool event as a wire event (what the pool knows of it; the request's fields,
    lora_name, extra keys, session, lookahead tokens, are the caller's to add)."""
    if isinstance(event, Stored):
        return WireStored(event.hashes, event.parent, event.token_ids, event.block_size,
                          event.lora_id, group_idx=group_idx)
    if isinstance(event, Removed):
        return WireRemoved(event.hashes, group_idx=group_idx)
    return WireCleared()


# --- Report modes: what the stream says about the cache -----------------------------------------


def stream_balance(events: Sequence[Event]) -> Counter[int]:
    """Per hash: BlockStored hashes less BlockRemoved hashes since the last AllBlocksCleared
    (zero entries kept out; negative ones kept, they are a broken stream)."""
    balance: Counter[int] = Counter()
    for event in events:
        if isinstance(event, Cleared):
            balance.clear()
        elif isinstance(event, Stored):
            balance.update(event.hashes)
        elif isinstance(event, Removed):
            balance.subtract(event.hashes)
    return Counter({h: n for h, n in balance.items() if n})


def copies_accounted(events: Sequence[Event], copies: Mapping[int, int],
                     mode: ReportMode) -> bool:
    """The stream against the cache's physical copies (hash -> how many blocks hold it).

    Incremental: stores less removes are exactly the copies (one store and one remove per
    copy). Full: at least the copies and never below zero (re-reports only add stores).

    post: __return__ or mode is ReportMode.INCREMENTAL or not copies_accounted(events, copies, ReportMode.INCREMENTAL)
    """  # noqa: E501 (a PEP 316 condition must fit on one line)
    balance = stream_balance(events)
    held = {h: n for h, n in copies.items() if n}
    if mode is ReportMode.INCREMENTAL:
        return dict(balance) == held
    return (all(n >= 0 for n in balance.values())
            and all(balance[h] >= n for h, n in held.items()))


# --- msgpack: the subset msgspec writes ---------------------------------------------------------


def _pack_int(n: int) -> bytes:
    if 0 <= n < 128:
        return bytes((n,))
    if -32 <= n < 0:
        return bytes((n & 0xFF,))
    for low, high, code, fmt in ((0, 2**8, 0xCC, ">B"), (0, 2**16, 0xCD, ">H"),
                                 (0, 2**32, 0xCE, ">I"), (0, 2**64, 0xCF, ">Q"),
                                 (-(2**7), 0, 0xD0, ">b"), (-(2**15), 0, 0xD1, ">h"),
                                 (-(2**31), 0, 0xD2, ">i"), (-(2**63), 0, 0xD3, ">q")):
        if low <= n < high:
            return bytes((code,)) + struct.pack(fmt, n)
    raise WireError(f"integer {n} does not fit msgpack's 64 bits")


def _pack_length(n: int, fix: int | None, fix_max: int, codes: tuple[int, int, int]) -> bytes:
    if fix is not None and n <= fix_max:
        return bytes((fix | n,))
    for code, fmt, limit in zip(codes, (">B", ">H", ">I"), (2**8, 2**16, 2**32), strict=True):
        if code and n < limit:
            return bytes((code,)) + struct.pack(fmt, n)
    raise WireError(f"length {n} does not fit msgpack")


def pack(value: Any) -> bytes:
    """msgpack of a value made of None, bool, int, float, str, bytes, lists/tuples and dicts,
    in msgspec's forms (the shortest for ints and lengths; floats as float64).

    raises: WireError
    post: unpack(__return__) == _plain_all(value) or value != value
    """
    if value is None:
        return b"\xc0"
    if value is True or value is False:
        return b"\xc3" if value else b"\xc2"
    if isinstance(value, int):
        return _pack_int(value)
    if isinstance(value, float):
        return b"\xcb" + struct.pack(">d", value)
    if isinstance(value, str):
        data = value.encode()
        return _pack_length(len(data), 0xA0, 31, (0xD9, 0xDA, 0xDB)) + data
    if isinstance(value, bytes):
        return _pack_length(len(value), None, -1, (0xC4, 0xC5, 0xC6)) + value
    if isinstance(value, list | tuple):
        return _pack_length(len(value), 0x90, 15, (0, 0xDC, 0xDD)) + b"".join(
            pack(v) for v in value)
    if isinstance(value, dict):
        return _pack_length(len(value), 0x80, 15, (0, 0xDE, 0xDF)) + b"".join(
            pack(k) + pack(v) for k, v in value.items())
    if isinstance(value, StructMap):
        count = len(value.entries)
        if value.width <= 15:
            header = bytes((0x80 | count,))
        else:
            header = b"\xde" + struct.pack(">H", count)  # no event has 2**16 fields
        return header + b"".join(pack(k) + pack(v) for k, v in value.entries)
    raise WireError(f"cannot write {type(value).__name__} {value!r} as msgpack")


def _plain_all(value: Any) -> Any:
    """A value as unpack gives it back: tuples as lists, all the way down."""
    if isinstance(value, list | tuple):
        return [_plain_all(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain_all(v) for k, v in value.items()}
    if isinstance(value, StructMap):
        return {k: _plain_all(v) for k, v in value.entries}
    return value


_FIXED = {0xC0: None, 0xC2: False, 0xC3: True}
_NUMBERS = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h",
            0xD2: ">i", 0xD3: ">q", 0xCA: ">f", 0xCB: ">d"}
_LENGTHS = {0xD9: (">B", "str"), 0xDA: (">H", "str"), 0xDB: (">I", "str"),
            0xC4: (">B", "bin"), 0xC5: (">H", "bin"), 0xC6: (">I", "bin"),
            0xDC: (">H", "array"), 0xDD: (">I", "array"), 0xDE: (">H", "map"),
            0xDF: (">I", "map")}


def _unpack_at(data: bytes, at: int) -> tuple[Any, int]:
    if at >= len(data):
        raise WireError("msgpack ends early")
    code = data[at]
    at += 1
    if code <= 0x7F or code >= 0xE0:
        return (code if code <= 0x7F else code - 0x100), at
    if code in _FIXED:
        return _FIXED[code], at
    if code in _NUMBERS:
        fmt = _NUMBERS[code]
        size = struct.calcsize(fmt)
        if at + size > len(data):
            raise WireError("msgpack ends early")
        return struct.unpack(fmt, data[at:at + size])[0], at + size
    if 0xA0 <= code <= 0xBF:
        kind, n = "str", code & 0x1F
    elif 0x90 <= code <= 0x9F:
        kind, n = "array", code & 0x0F
    elif 0x80 <= code <= 0x8F:
        kind, n = "map", code & 0x0F
    elif code in _LENGTHS:
        fmt, kind = _LENGTHS[code]
        size = struct.calcsize(fmt)
        if at + size > len(data):
            raise WireError("msgpack ends early")
        n = struct.unpack(fmt, data[at:at + size])[0]
        at += size
    else:
        raise WireError(f"msgpack type byte {code:#x} is not one msgspec writes here")
    if kind in ("str", "bin"):
        if at + n > len(data):
            raise WireError("msgpack ends early")
        chunk = data[at:at + n]
        return (chunk.decode() if kind == "str" else bytes(chunk)), at + n
    if kind == "array":
        items = []
        for _ in range(n):
            item, at = _unpack_at(data, at)
            items.append(item)
        return items, at
    mapping = {}
    for _ in range(n):
        key, at = _unpack_at(data, at)
        mapping[key], at = _unpack_at(data, at)
    return mapping, at


def unpack(data: bytes) -> Any:
    """The value of one msgpack document (arrays as lists, maps as dicts); trailing bytes or a
    type byte outside the subset above are refused."""
    value, end = _unpack_at(data, 0)
    if end != len(data):
        raise WireError(f"{len(data) - end} bytes after the msgpack value")
    return value


def split_documents(data: bytes) -> tuple[bytes, ...]:
    """The bytes of each msgpack document in ``data``, a concatenation of them (a file of
    bare KVEventBatch payloads); a document cut short or outside the subset above is refused.

    raises: WireError
    post: b"".join(__return__) == data
    """
    documents: list[bytes] = []
    at = 0
    while at < len(data):
        _, end = _unpack_at(data, at)
        documents.append(data[at:end])
        at = end
    return tuple(documents)


# --- Named invariants over wire events ----------------------------------------------------------


def optional_fields_default_to_none(profile: Profile) -> bool:
    """Every field the profile adds over 0.13 is optional with default None, except
    BlockStored's ``lora_name``: a consumer of the new release must not require any of them
    (the wire schema freezes the required fields)."""
    base = {name for name, _ in _STORED_0_13} | {name for name, _ in _REMOVED_0_13}
    names = {f.name: f.default for f in fields(WireStored) + fields(WireRemoved)}
    added = [(name, required) for name, required in stored_fields(profile)
             + removed_fields(profile) if name not in base]
    return all((not required and names[name] is None) or name == "lora_name"
               for name, required in added)


def decodes_back(event: WireEvent, profile: Profile) -> bool:
    """The profile's decoder reads the profile's encoding of an event back as the event, less
    the fields the profile's schema lacks."""
    raw = unpack(pack(wire_value(event, profile)))
    kept = {name for name, _ in _schema(event, profile)}
    # Every field outside 0.13's schema defaults to None (optional_fields_default_to_none).
    changes = {f.name: None for f in fields(event) if f.name not in kept}
    expected: WireEvent = replace(cast(Any, event), **changes)
    return decode_event(raw, profile) == expected
