"""Prefix hashing: impl/hashing.py against known values, against spec/hashing.py, and isolation.

The reference hash used to evaluate the spec is written here from the definition (sha256 of a
highest-protocol pickle), independently of impl's. Tests of vLLM 0.13's bytes select the
untagged extra-key format (the ``untagged`` fixture); the spec-agreement tests draw the format.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import pytest
import xxhash as xxhash_module
from hypothesis import event, given, strategies as st

import kvspec.impl.hashing as hashing
from kvspec.impl.request import LoRARequest, MultiModalFeatureSpec, PlaceholderRange, Request
from kvspec.spec import hashing as spec_hashing
from kvspec.spec.pool import Profile

REPO_ROOT = Path(__file__).resolve().parent.parent
# CrossHair's limits are CPU seconds, which a loaded machine stretches in wall time (80 s
# with the cores shared among a dozen processes): the subprocess's timeout only stops a hang.
CROSSHAIR_HANG_CAP = 900


def reference_sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


@pytest.fixture(autouse=True)
def _restore_module_state() -> Iterator[None]:
    """Tests may reseed NONE_HASH, flip the int-hash flag or change the extra-key format: put
    all three back afterwards."""
    none_hash = hashing.NONE_HASH
    use_int = hashing.USE_INT_BLOCK_HASHES
    key_format = hashing.EXTRA_KEY_FORMAT
    yield
    hashing.NONE_HASH = none_hash
    hashing.USE_INT_BLOCK_HASHES = use_int
    hashing.set_extra_key_format(key_format)


@pytest.fixture
def untagged() -> None:
    """vLLM 0.13's extra keys (bare values): what its bytes are computed from."""
    hashing.set_extra_key_format(hashing.ExtraKeyFormat.UNTAGGED)


# The impl format and the spec format of the same name.
FORMATS = {hashing.ExtraKeyFormat.UNTAGGED: spec_hashing.KeyFormat.UNTAGGED,
           hashing.ExtraKeyFormat.TAGGED: spec_hashing.KeyFormat.TAGGED}


# --- hash functions and NONE_HASH ---------------------------------------------------------------


def test_hash_block_tokens_known_value() -> None:
    expected = reference_sha256((hashing.NONE_HASH, (1, 2, 3), None))
    assert hashing.hash_block_tokens(hashing.sha256, None, [1, 2, 3]) == expected


def test_hash_block_tokens_treats_empty_parent_as_none_hash() -> None:
    assert hashing.hash_block_tokens(hashing.sha256, hashing.BlockHash(b""), [7]) == (
        hashing.hash_block_tokens(hashing.sha256, None, [7])
    )


def test_hash_block_tokens_chains_parent_and_extra_keys() -> None:
    parent = hashing.BlockHash(b"p" * 32)
    expected = reference_sha256((parent, (5, 6), ("lora", "salt")))
    assert hashing.hash_block_tokens(hashing.sha256, parent, (5, 6), ("lora", "salt")) == expected


@pytest.mark.parametrize(
    ("name", "reference"),
    [
        ("sha256", reference_sha256),
        ("sha256_cbor", lambda v: hashlib.sha256(cbor2.dumps(v, canonical=True)).digest()),
        (
            "xxhash",
            lambda v: xxhash_module.xxh3_128_digest(pickle.dumps(v, pickle.HIGHEST_PROTOCOL)),
        ),
        ("xxhash_cbor", lambda v: xxhash_module.xxh3_128_digest(cbor2.dumps(v, canonical=True))),
    ],
)
def test_hash_functions_by_name(name: str, reference: Any) -> None:
    fn = hashing.get_hash_fn_by_name(name)
    payload = (b"\x01" * 32, (1, 300, 70000, 2**40), ("x",))
    assert fn(payload) == reference(payload)
    assert len(fn(payload)) == (32 if name.startswith("sha256") else 16)
    parent = hashing.BlockHash(b"\x02" * 16)
    assert hashing.hash_block_tokens(fn, parent, [9, 8]) == reference((parent, (9, 8), None))


@pytest.mark.parametrize("name", ["md5", "", "SHA256", None, 3])
def test_unknown_hash_function_name_is_refused(name: Any) -> None:
    with pytest.raises(hashing.UnknownHashFunctionError, match=repr(name)):
        hashing.get_hash_fn_by_name(name)
    assert issubclass(hashing.UnknownHashFunctionError, ValueError)


def test_none_hash_with_python_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    hashing.init_none_hash(hashing.sha256)
    assert reference_sha256("42") == hashing.NONE_HASH
    hashing.init_none_hash(hashing.xxhash)
    assert xxhash_module.xxh3_128_digest(pickle.dumps("42", 5)) == hashing.NONE_HASH


def test_none_hash_without_python_hash_seed_is_random(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    hashing.init_none_hash(hashing.sha256)
    first = hashing.NONE_HASH
    hashing.init_none_hash(hashing.sha256)
    assert isinstance(first, bytes) and len(first) == 32
    assert first != hashing.NONE_HASH


def test_chains_read_the_current_none_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    hashing.init_none_hash(hashing.sha256)
    request = Request("r", [1, 2], block_hasher=hashing.get_request_block_hasher(2, hashing.sha256))
    assert request.block_hashes == [reference_sha256((reference_sha256("7"), (1, 2), None))]


# --- group-id keys and external hashes ----------------------------------------------------------


def test_group_id_key_known_bytes() -> None:
    key = hashing.make_block_hash_with_group_id(hashing.BlockHash(b"abc"), 258)
    assert key == b"abc\x00\x00\x01\x02"
    assert hashing.get_block_hash(key) == b"abc"
    assert hashing.get_group_id(key) == 258


@given(block_hash=st.binary(max_size=40), group_id=st.integers(0, 2**32 - 1))
def test_group_id_key_round_trip_matches_spec(block_hash: bytes, group_id: int) -> None:
    key = hashing.make_block_hash_with_group_id(hashing.BlockHash(block_hash), group_id)
    assert key == spec_hashing.key_with_group(block_hash, group_id)
    assert hashing.get_block_hash(key) == block_hash
    assert hashing.get_group_id(key) == group_id
    event("small group id" if group_id < 256 else "large group id")


@pytest.mark.parametrize("group_id", [-1, 2**32, 2**40, 1.0, "0", None, True])
def test_bad_group_id_is_refused(group_id: Any) -> None:
    with pytest.raises(hashing.InvalidGroupIdError, match=repr(group_id)[:8]):
        hashing.make_block_hash_with_group_id(hashing.BlockHash(b"h"), group_id)


@pytest.mark.parametrize("block_hash", ["abc", None, 5, bytearray(b"ab")])
def test_non_bytes_hash_is_refused(block_hash: Any) -> None:
    with pytest.raises(hashing.InvalidBlockHashError):
        hashing.make_block_hash_with_group_id(block_hash, 0)


@pytest.mark.parametrize("key", [b"", b"abc", "abcdef"])
def test_short_or_non_bytes_key_is_refused(key: Any) -> None:
    with pytest.raises(hashing.InvalidBlockHashError):
        hashing.get_group_id(key)
    with pytest.raises(hashing.InvalidBlockHashError):
        hashing.get_block_hash(key)


@given(block_hash=st.binary(min_size=1, max_size=40))
def test_external_hash_matches_spec(block_hash: bytes) -> None:
    hashing.USE_INT_BLOCK_HASHES = True
    converted = hashing.maybe_convert_block_hash(hashing.BlockHash(block_hash))
    assert converted == spec_hashing.external_hash(block_hash, True)
    assert converted == int.from_bytes(block_hash, "big") & (2**64 - 1)
    hashing.USE_INT_BLOCK_HASHES = False
    assert hashing.maybe_convert_block_hash(hashing.BlockHash(block_hash)) == block_hash


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("1", True), ("0", False),
                                                  ("false", False), ("true", True)])
def test_int_block_hash_flag_is_read_from_the_environment(value: str | None,
                                                          expected: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"}
    if value is not None:
        env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = value
    out = subprocess.run(
        [sys.executable, "-c", "import impl.hashing as h; print(h.USE_INT_BLOCK_HASHES)"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True, timeout=300,
    )
    assert out.stdout.strip() == str(expected)


# --- extra keys ---------------------------------------------------------------------------------


def image(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(offset, length))


def test_extra_keys_order_lora_mm_salt_embeds(untagged: None) -> None:
    embeds = np.arange(8, dtype=np.float32).reshape(4, 2)
    request = Request(
        "r", [1, 2, 3, 4], lora_request=LoRARequest("adapter", 3), cache_salt="salt",
        mm_features=[image("img", 1, 2)], prompt_embeds=embeds,
    )
    keys, next_mm = hashing.generate_block_hash_extra_keys(request, 0, 2, 0)
    assert keys == ("adapter", "img", "salt", embeds[0:2].tobytes())
    assert next_mm == 0  # the image runs on past this block
    keys, next_mm = hashing.generate_block_hash_extra_keys(request, 2, 4, next_mm)
    assert keys == ("adapter", "img", embeds[2:4].tobytes())  # no salt after block 0
    assert next_mm == 1


def test_tagged_extra_keys_are_vllm_0_33s_tuples() -> None:
    """The default format: each key led by its kind, as vLLM 0.33 writes it (an mm key holds
    the feature's offset from the block start; embeddings are a sha256 digest)."""
    assert hashing.EXTRA_KEY_FORMAT is hashing.ExtraKeyFormat.TAGGED
    embeds = np.arange(8, dtype=np.float32).reshape(4, 2)
    request = Request(
        "r", [1, 2, 3, 4], lora_request=LoRARequest("adapter", 3, "/a"), cache_salt="salt",
        mm_features=[image("img", 1, 2)], prompt_embeds=embeds,
    )
    keys, next_mm = hashing.generate_block_hash_extra_keys(request, 0, 2, 0)
    assert keys == (("lora", "adapter", "/a"), ("mm", "img", 1), ("cache_salt", "salt"),
                    ("prompt_embeds", hashlib.sha256(embeds[0:2].tobytes()).digest()))
    keys, next_mm = hashing.generate_block_hash_extra_keys(request, 2, 4, next_mm)
    assert keys == (("lora", "adapter", "/a"), ("mm", "img", -1),
                    ("prompt_embeds", hashlib.sha256(embeds[2:4].tobytes()).digest()))


@pytest.mark.parametrize("value", ["x", None, 1, [hashing.ExtraKeyFormat.TAGGED], "TAGGED"])
def test_bad_extra_key_format_is_refused(value: Any) -> None:
    before = hashing.EXTRA_KEY_FORMAT
    with pytest.raises(hashing.InvalidExtraKeyFormatError, match=re.escape(repr(value))):
        hashing.set_extra_key_format(value)
    assert hashing.EXTRA_KEY_FORMAT is before
    assert hashing.set_extra_key_format("untagged") is before
    assert hashing.EXTRA_KEY_FORMAT is hashing.ExtraKeyFormat.UNTAGGED


def test_extra_keys_none_without_sources() -> None:
    request = Request("r", [1, 2, 3, 4], cache_salt="")
    assert hashing.need_extra_keys(request)  # a salt, even an empty one, counts (vLLM 0.13)
    assert hashing.generate_block_hash_extra_keys(request, 0, 4, 0) == (None, 0)
    assert not hashing.need_extra_keys(Request("q", [1]))


def test_prompt_embeds_of_a_torch_tensor_are_raw_bytes(untagged: None) -> None:
    torch = pytest.importorskip("torch")
    embeds = torch.arange(12, dtype=torch.bfloat16).reshape(6, 2)
    request = Request("r", None, prompt_embeds=embeds)
    assert request.all_token_ids == [0] * 6
    keys, _ = hashing.generate_block_hash_extra_keys(request, 2, 4, 0)
    assert keys is not None
    assert keys == (embeds[2:4].flatten().view(torch.uint8).numpy().tobytes(),)
    assert len(keys[0]) == 2 * 2 * 2


def test_mm_index_counting_back_past_the_first_feature_is_refused() -> None:
    request = Request("r", list(range(8)), mm_features=[image("a", 4, 2)])
    with pytest.raises(hashing.InvalidMultiModalIndexError, match="-2"):
        hashing.generate_block_hash_extra_keys(request, 4, 8, -2)


# --- spec agreement ----------------------------------------------------------------------------

TOKENS = st.one_of(st.integers(0, 255), st.integers(256, 2**31 - 1), st.integers(-(2**40), 2**40))


@st.composite
def feature_positions(draw: st.DrawFn, max_offset: int, max_length: int,
                      max_count: int = 3) -> list[tuple[int, int]]:
    """(offset, length) of up to ``max_count`` features in token order, none overlapping the
    next (a request refuses others), the first at most ``max_offset`` in."""
    positions: list[tuple[int, int]] = []
    end = 0
    for _ in range(draw(st.integers(0, max_count))):
        offset = draw(st.integers(end, max(end, max_offset)))
        length = draw(st.integers(0, max_length))
        positions.append((offset, length))
        end = offset + length
    return positions


@st.composite
def request_inputs(draw: st.DrawFn, embeds: bool = True) -> dict[str, Any]:
    block_size = draw(st.integers(1, 5))
    tokens = draw(st.lists(TOKENS, max_size=6 * block_size + 3))
    positions = draw(feature_positions(len(tokens) + 2, 2 * block_size + 1))
    use_embeds = embeds and draw(st.booleans())
    return {
        "format": draw(st.sampled_from(list(FORMATS))),
        "block_size": block_size,
        "tokens": tokens,
        "lora_name": draw(st.none() | st.sampled_from(["lora-a", "lora-b"])),
        "cache_salt": draw(st.none() | st.sampled_from(["", "salt-1", "salt-2"])),
        "features": [(f"mm{i}", o, n) for i, (o, n) in enumerate(positions)],
        "embeds": (
            np.arange(len(tokens) * 2, dtype=np.float32).reshape(len(tokens), 2) + 0.5
            if use_embeds else None
        ),
    }


def make_request(inputs: dict[str, Any], num_prompt_tokens: int | None = None) -> Request:
    hashing.set_extra_key_format(inputs["format"])
    tokens = inputs["tokens"]
    prompt = tokens if num_prompt_tokens is None else tokens[:num_prompt_tokens]
    lora_name = inputs["lora_name"]
    embeds = inputs["embeds"]
    return Request(
        "req",
        list(prompt),
        lora_request=None if lora_name is None else LoRARequest(lora_name, 1),
        cache_salt=inputs["cache_salt"],
        mm_features=[image(i, o, n) for i, o, n in inputs["features"]],
        prompt_embeds=None if embeds is None else embeds[: len(prompt)],
        block_hasher=hashing.get_request_block_hasher(inputs["block_size"], hashing.sha256),
    )


def spec_new_hashes(
    inputs: dict[str, Any], tokens: list[int], hashed: list[bytes], num_prompt_tokens: int
) -> list[bytes]:
    """What one hasher call adds, per the spec, to a request with ``tokens`` and ``hashed``."""
    block_size = inputs["block_size"]
    features = inputs["features"]
    embeds = inputs["embeds"]
    rows = None if embeds is None else tuple(row.tobytes() for row in embeds[:num_prompt_tokens])
    extras = spec_hashing.new_blocks_extra_keys(
        len(tokens), block_size, len(hashed), inputs["lora_name"],
        tuple(i for i, _, _ in features), tuple(o for _, o, _ in features),
        tuple(n for _, _, n in features), inputs["cache_salt"], rows,
        FORMATS[inputs["format"]], "",
    )
    return list(spec_hashing.chain_hashes(
        reference_sha256, hashing.NONE_HASH, tuple(tokens[len(hashed) * block_size :]),
        block_size, extras, hashed[-1] if hashed else None,
    ))


@given(inputs=request_inputs())
def test_request_hashes_agree_with_spec(inputs: dict[str, Any]) -> None:
    request = make_request(inputs)
    expected = spec_new_hashes(inputs, inputs["tokens"], [], len(inputs["tokens"]))
    assert request.block_hashes == expected
    event(f"full blocks: {min(len(expected), 4)}{'+' if len(expected) > 4 else ''}")
    event(f"format: {inputs['format'].value}")
    event(f"extra keys: {hashing.need_extra_keys(request) or inputs['embeds'] is not None}")


@given(inputs=request_inputs(), data=st.data())
def test_incremental_request_hashes_agree_with_spec(inputs: dict[str, Any],
                                                    data: st.DataObject) -> None:
    tokens = inputs["tokens"]
    num_prompt = data.draw(st.integers(0, len(tokens)))
    request = make_request(inputs, num_prompt)
    expected = spec_new_hashes(inputs, tokens[:num_prompt], [], num_prompt)
    assert request.block_hashes == expected
    position = num_prompt
    while position < len(tokens):
        step = data.draw(st.integers(1, len(tokens) - position))
        chunk = tokens[position : position + step]
        request.append_output_token_ids(chunk[0] if step == 1 else chunk)
        position += step
        expected += spec_new_hashes(inputs, tokens[:position], expected, num_prompt)
        assert request.block_hashes == expected
        assert len(request.block_hashes) == request.num_tokens // inputs["block_size"]


@given(inputs=request_inputs(embeds=False), data=st.data())
def test_incremental_hashing_equals_hashing_from_scratch(inputs: dict[str, Any],
                                                         data: st.DataObject) -> None:
    """Away from vLLM 0.13's multimodal quirk (features reaching the incremental blocks)."""
    tokens, block_size = inputs["tokens"], inputs["block_size"]
    num_prompt = data.draw(st.integers(0, len(tokens)))
    first_incremental_start = num_prompt // block_size * block_size
    inputs["features"] = [
        f for f in inputs["features"] if f[1] + f[2] < first_incremental_start
    ]
    incremental = make_request(inputs, num_prompt)
    for token in tokens[num_prompt:]:
        incremental.append_output_token_ids(token)
    assert incremental.block_hashes == make_request(inputs).block_hashes
    event(f"features kept: {len(inputs['features'])}")


def test_incremental_hashing_keeps_vllm_0_13_multimodal_quirk() -> None:
    """A feature ending exactly where an incremental call's first block starts is keyed into
    that block, though hashing the same tokens in one call leaves it out (vLLM 0.13)."""
    inputs: dict[str, Any] = {
        "format": hashing.ExtraKeyFormat.UNTAGGED, "block_size": 4, "tokens": list(range(8)),
        "lora_name": None, "cache_salt": None,
        "features": [("img", 0, 4)], "embeds": None,
    }
    incremental = make_request(inputs, 6)
    incremental.append_output_token_ids([6, 7])
    from_scratch = make_request(inputs)
    assert incremental.block_hashes[0] == from_scratch.block_hashes[0]
    assert incremental.block_hashes[1] != from_scratch.block_hashes[1]
    spec_incremental = spec_new_hashes(inputs, list(range(6)), [], 6)
    spec_incremental += spec_new_hashes(inputs, list(range(8)), spec_incremental, 6)
    assert incremental.block_hashes == spec_incremental
    assert from_scratch.block_hashes == spec_new_hashes(inputs, list(range(8)), [], 8)


@given(
    tokens=st.lists(TOKENS, max_size=20),
    block_size=st.integers(1, 4),
    extras=st.lists(st.none() | st.tuples(st.text(max_size=3)), min_size=20, max_size=20),
)
def test_hash_block_tokens_chain_matches_spec(tokens: list[int], block_size: int,
                                              extras: list[tuple[str] | None]) -> None:
    count = len(tokens) // block_size
    block_extras = tuple(extras[:count])
    parent: hashing.BlockHash | None = None
    chain = []
    for index in range(count):
        parent = hashing.hash_block_tokens(
            hashing.sha256, parent, tokens[index * block_size : (index + 1) * block_size],
            block_extras[index],
        )
        chain.append(parent)
    assert tuple(chain) == spec_hashing.chain_hashes(
        reference_sha256, hashing.NONE_HASH, tuple(tokens), block_size, block_extras
    )
    payloads = spec_hashing.chain_payloads(hashing.NONE_HASH, tuple(tokens), block_size,
                                           block_extras)
    assert len(payloads) == count


# --- isolation ---------------------------------------------------------------------------------


@given(
    tokens=st.lists(TOKENS, min_size=1, max_size=24),
    block_size=st.integers(1, 4),
    isolation=st.sampled_from(["salt", "lora", "salt-vs-none", "lora-vs-none"]),
)
def test_different_salt_or_lora_never_share_a_block_hash(
    tokens: list[int], block_size: int, isolation: str
) -> None:
    hasher = hashing.get_request_block_hasher(block_size, hashing.sha256)
    if isolation == "salt":
        a = Request("a", tokens, cache_salt="tenant-a", block_hasher=hasher)
        b = Request("b", tokens, cache_salt="tenant-b", block_hasher=hasher)
    elif isolation == "salt-vs-none":
        a = Request("a", tokens, cache_salt="tenant-a", block_hasher=hasher)
        b = Request("b", tokens, block_hasher=hasher)
    elif isolation == "lora":
        a = Request("a", tokens, lora_request=LoRARequest("x", 1), block_hasher=hasher)
        b = Request("b", tokens, lora_request=LoRARequest("y", 2), block_hasher=hasher)
    else:
        a = Request("a", tokens, lora_request=LoRARequest("x", 1), block_hasher=hasher)
        b = Request("b", tokens, block_hasher=hasher)
    a.append_output_token_ids(list(tokens))
    b.append_output_token_ids(list(tokens))
    assert set(a.block_hashes).isdisjoint(b.block_hashes)
    event(isolation)


def test_empty_salt_and_same_lora_name_do_share() -> None:
    """What isolation does not cover (vLLM 0.13): an empty salt is no salt, and LoRA adapters
    are told apart by name, not by id."""
    hasher = hashing.get_request_block_hasher(2, hashing.sha256)
    assert (Request("a", [1, 2], cache_salt="", block_hasher=hasher).block_hashes
            == Request("b", [1, 2], block_hasher=hasher).block_hashes)
    assert (Request("a", [1, 2], lora_request=LoRARequest("x", 1), block_hasher=hasher)
            .block_hashes
            == Request("b", [1, 2], lora_request=LoRARequest("x", 9), block_hasher=hasher)
            .block_hashes)


# --- the coarse view ---------------------------------------------------------------------------


def test_coarse_view_concatenates_fine_hashes() -> None:
    fine = [hashing.BlockHash(bytes([i]) * 2) for i in range(7)]
    view = hashing.BlockHashListWithBlockSize(fine, 16, 48)
    assert len(view) == 2
    assert view[0] == fine[0] + fine[1] + fine[2]
    assert view[-1] == view[1] == fine[3] + fine[4] + fine[5]
    assert view[0:2] == list(view) == list(spec_hashing.coarse_hashes(tuple(fine), 3))
    assert view[::-1] == [view[1], view[0]]
    fine.append(hashing.BlockHash(b"\x07\x07"))
    fine.append(hashing.BlockHash(b"\x08\x08"))
    assert len(view) == 3  # the view follows its list


@given(fine=st.lists(st.binary(min_size=1, max_size=3), max_size=12), scale=st.integers(1, 4))
def test_coarse_view_matches_spec(fine: list[bytes], scale: int) -> None:
    view = hashing.BlockHashListWithBlockSize([hashing.BlockHash(h) for h in fine], 2, 2 * scale)
    assert tuple(view) == spec_hashing.coarse_hashes(tuple(fine), scale)


def test_coarse_view_refuses_bad_sizes_and_indices() -> None:
    with pytest.raises(hashing.InvalidBlockSizeError, match="48"):
        hashing.BlockHashListWithBlockSize([], 32, 48)
    with pytest.raises(hashing.InvalidBlockSizeError):
        hashing.BlockHashListWithBlockSize([], 0, 16)
    view = hashing.BlockHashListWithBlockSize([hashing.BlockHash(b"a")] * 4, 16, 32)
    with pytest.raises(IndexError, match="2"):
        view[2]
    with pytest.raises(IndexError):
        view[-3]
    with pytest.raises(TypeError):
        view["0"]  # type: ignore[call-overload]


def test_request_block_hasher_refuses_bad_block_size() -> None:
    with pytest.raises(hashing.InvalidBlockSizeError, match="0"):
        hashing.get_request_block_hasher(0, hashing.sha256)


# --- CrossHair: spec vs impl on the pure parts ---------------------------------------------------
# diffbehavior explores both functions of a pair on the same symbolic inputs. It reads no
# preconditions, so each pair shares one admissibility guard; both raising counts as agreeing.


def spec_key_with_group(block_hash: bytes, group_id: int) -> bytes | None:
    if not 0 <= group_id < 2**32:
        return None
    return spec_hashing.key_with_group(block_hash, group_id)


def impl_key_with_group(block_hash: bytes, group_id: int) -> bytes | None:
    if not 0 <= group_id < 2**32:
        return None
    return hashing.make_block_hash_with_group_id(hashing.BlockHash(block_hash), group_id)


def _walk_admissible(offsets: tuple[int, ...], lengths: tuple[int, ...], start: int, end: int,
                     start_mm_idx: int) -> bool:
    return (
        len(offsets) == len(lengths) <= 3
        and all(o >= 0 for o in offsets) and all(n >= 0 for n in lengths)
        and all(offsets[i] + lengths[i] <= offsets[i + 1] for i in range(len(offsets) - 1))
        and 0 <= start < end
        and (not offsets or -len(offsets) <= start_mm_idx <= len(offsets))
    )


def spec_mm_walk(offsets: tuple[int, ...], lengths: tuple[int, ...], start: int, end: int,
                 start_mm_idx: int) -> tuple[tuple[int, ...], int] | None:
    if not _walk_admissible(offsets, lengths, start, end, start_mm_idx):
        return None
    return spec_hashing.mm_walk(offsets, lengths, start, end, start_mm_idx)


def impl_mm_walk(offsets: tuple[int, ...], lengths: tuple[int, ...], start: int, end: int,
                 start_mm_idx: int) -> tuple[tuple[int, ...], int] | None:
    if not _walk_admissible(offsets, lengths, start, end, start_mm_idx):
        return None
    features = [image(str(i), o, n) for i, (o, n) in enumerate(zip(offsets, lengths,
                                                                   strict=True))]
    request = Request("walk", [0], mm_features=features)
    keys, next_index = hashing.generate_block_hash_extra_keys(request, start, end, start_mm_idx)
    # The identifier, in either format (a tagged key is ("mm", identifier, offset - start)).
    return tuple(int(k[1] if isinstance(k, tuple) else k) for k in keys or ()), next_index


@given(
    positions=feature_positions(12, 6),
    start=st.integers(0, 14), width=st.integers(1, 5), start_mm_idx=st.integers(-3, 3),
)
def test_mm_walk_agrees_with_spec(positions: list[tuple[int, int]], start: int, width: int,
                                  start_mm_idx: int) -> None:
    offsets = tuple(o for o, _ in positions)
    lengths = tuple(n for _, n in positions)
    args = (offsets, lengths, start, start + width, start_mm_idx)
    assert spec_mm_walk(*args) == impl_mm_walk(*args)


@pytest.mark.parametrize(
    ("spec_fn", "impl_fn"),
    [("spec_key_with_group", "impl_key_with_group"), ("spec_mm_walk", "impl_mm_walk")],
)
def test_crosshair_finds_no_behaviour_difference(spec_fn: str, impl_fn: str) -> None:
    pytest.importorskip("crosshair")
    module = "tests.test_hashing"
    proc = subprocess.run(
        [sys.executable, "-m", "crosshair", "diffbehavior", "--exception_equivalence=ALL",
         "--per_condition_timeout=6", f"{module}.{spec_fn}", f"{module}.{impl_fn}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=CROSSHAIR_HANG_CAP, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- byte compatibility with vLLM 0.13 itself, when its environment is at hand ------------------

VLLM_PYTHON = REPO_ROOT / ".venv-vllm-0.13.0" / "bin" / "python"

# Runs under vLLM 0.13's interpreter: prints the block hashes of each case as hex, one JSON list.
VLLM_SIDE = """
import json, sys
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.request import Request
from vllm.sampling_params import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import get_hash_fn_by_name
out = []
for algo, bs, prompt, rest, lora, salt, feats in json.load(sys.stdin):
    fn = get_hash_fn_by_name(algo)
    ku.init_none_hash(fn)
    mm = [MultiModalFeatureSpec(data=None, modality="image", identifier=i,
                                mm_position=PlaceholderRange(offset=o, length=n))
          for i, o, n in feats]
    req = Request("r", prompt, SamplingParams(max_tokens=8), None, None, mm_features=mm or None,
                  lora_request=LoRARequest(lora, 1, "/p") if lora else None, cache_salt=salt,
                  block_hasher=ku.get_request_block_hasher(bs, fn))
    for token in rest:
        req.append_output_token_ids(token)
    out.append([h.hex() for h in req.block_hashes])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_block_hashes_match_vllm_0_13_when_installed(monkeypatch: pytest.MonkeyPatch,
                                                     untagged: None) -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip("no .venv-vllm-0.13.0 (make vllm-env VLLM=0.13.0 builds it)")
    rng = random.Random(13)
    cases: list[Any] = []
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        for _ in range(25):
            bs = rng.choice([1, 2, 4, 16])
            tokens = [rng.choice([rng.randint(0, 255), rng.randint(0, 2**31 - 1),
                                  rng.randint(2**31, 2**40)])
                      for _ in range(rng.randint(0, 5 * bs))]
            split = rng.randint(0, len(tokens))
            positions = []
            end = 0
            for _ in range(rng.randint(0, 2)):  # in token order, not overlapping
                offset = rng.randint(end, max(end, len(tokens)))
                positions.append((offset, rng.randint(0, 2 * bs)))
                end = sum(positions[-1])
            cases.append([algo, bs, tokens[:split], tokens[split:],
                          rng.choice([None, "lora-a"]), rng.choice([None, "", "salt"]),
                          [[f"mm{i}", o, n] for i, (o, n) in enumerate(positions)]])
    env = dict(os.environ, PYTHONHASHSEED="2024", VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_SIDE], input=json.dumps(cases),
                          env=env, capture_output=True, text=True, timeout=900, check=True)
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    monkeypatch.setenv("PYTHONHASHSEED", "2024")
    ours = []
    case: Any
    for case in cases:
        algo, bs, prompt, rest, lora, salt, feats = case
        fn = hashing.get_hash_fn_by_name(algo)
        hashing.init_none_hash(fn)
        request = Request("r", prompt, cache_salt=salt,
                          lora_request=LoRARequest(lora, 1, "/p") if lora else None,
                          mm_features=[image(i, o, n) for i, o, n in feats],
                          block_hasher=hashing.get_request_block_hasher(bs, fn))
        for token in rest:
            request.append_output_token_ids(token)
        ours.append([h.hex() for h in request.block_hashes])
    assert ours == theirs


# --- tagged keys: vLLM 0.33's, when its environment is at hand ------------------------------------

VLLM_033_PYTHON = REPO_ROOT / ".venv-vllm-0.33.0" / "bin" / "python"

# Runs under vLLM 0.33's interpreter: prints, per case, block 0's extra keys (repr) and the block
# hashes as hex, one JSON list.
VLLM_033_SIDE = """
import json, sys
import torch
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.request import Request
from vllm.sampling_params import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import get_hash_fn_by_name
out = []
for algo, bs, prompt, rest, lora, salt, feats, embeds in json.load(sys.stdin):
    fn = get_hash_fn_by_name(algo)
    ku.init_none_hash(fn)
    mm = [MultiModalFeatureSpec(data=None, modality="image", identifier=i,
                                mm_position=PlaceholderRange(offset=o, length=n))
          for i, o, n in feats]
    rows = (torch.arange(len(prompt) * 2, dtype=torch.float32).reshape(-1, 2) + 0.5
            if embeds else None)
    req = Request("r", prompt, SamplingParams(max_tokens=8), None, mm_features=mm or None,
                  lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None,
                  cache_salt=salt, prompt_embeds=rows,
                  block_hasher=ku.get_request_block_hasher(bs, fn))
    for token in rest:
        req.append_output_token_ids(token)
    keys = ku.generate_block_hash_extra_keys(req, 0, bs, 0)[0] if req.num_tokens >= bs else None
    out.append([repr(keys), [h.hex() for h in req.block_hashes]])
print(json.dumps(out))
"""


def tagged_cases(rng: random.Random) -> list[Any]:
    """Requests whose hashes vLLM 0.33 and impl's tagged format must agree on: away from the
    multimodal walk's boundary, which 0.33 changed too (a feature ending exactly where a block
    starts), and with features hashed in one call (0.33 finds a later call's first feature
    differently)."""
    cases: list[Any] = []
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        for _ in range(40):
            bs = rng.choice([1, 2, 4, 16])
            tokens = [rng.choice([rng.randint(0, 255), rng.randint(0, 2**31 - 1)])
                      for _ in range(rng.randint(0, 5 * bs))]
            positions = []
            end = 0
            for _ in range(rng.randint(0, 2)):
                offset = rng.randint(end, max(end, len(tokens)))
                length = rng.randint(1, 2 * bs)
                if (offset + length) % bs:  # a feature not ending on a block boundary
                    positions.append((offset, length))
                    end = offset + length
            split = len(tokens) if positions else rng.randint(0, len(tokens))
            cases.append([algo, bs, tokens[:split], tokens[split:],
                          rng.choice([None, ["lora-a", "/adapters/a"], ["x", "/adapters/x"]]),
                          rng.choice([None, "", "salt", "x"]),
                          [[f"mm{i}", o, n] for i, (o, n) in enumerate(positions)],
                          bool(split) and rng.random() < 0.3])
    return cases


@pytest.mark.slow
def test_tagged_keys_match_vllm_0_33_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """impl's tagged format is vLLM 0.33's: the same extra keys and block hashes."""
    if not VLLM_033_PYTHON.exists():
        pytest.skip("no .venv-vllm-0.33.0 (make vllm-env VLLM=0.33.0 builds it)")
    torch = pytest.importorskip("torch")
    cases = tagged_cases(random.Random(33))
    env = dict(os.environ, PYTHONHASHSEED="2033", VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run([str(VLLM_033_PYTHON), "-c", VLLM_033_SIDE], input=json.dumps(cases),
                          env=env, capture_output=True, text=True, timeout=900, check=True)
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    monkeypatch.setenv("PYTHONHASHSEED", "2033")
    hashing.set_extra_key_format(hashing.ExtraKeyFormat.TAGGED)
    ours = []
    case: Any
    for case in cases:
        algo, bs, prompt, rest, lora, salt, feats, embeds = case
        fn = hashing.get_hash_fn_by_name(algo)
        hashing.init_none_hash(fn)
        rows = (torch.arange(len(prompt) * 2, dtype=torch.float32).reshape(-1, 2) + 0.5
                if embeds else None)
        request = Request("r", prompt, cache_salt=salt, prompt_embeds=rows,
                          lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None,
                          mm_features=[image(i, o, n) for i, o, n in feats],
                          block_hasher=hashing.get_request_block_hasher(bs, fn))
        for token in rest:
            request.append_output_token_ids(token)
        keys = (hashing.generate_block_hash_extra_keys(request, 0, bs, 0)[0]
                if request.num_tokens >= bs else None)
        ours.append([repr(keys), [h.hex() for h in request.block_hashes]])
    assert ours == theirs
    assert sum(1 for keys, _ in ours if keys != "None") > len(cases) // 2  # most carry keys


# --- vLLM 0.33's hashing: the fixed-seed root, lookahead, the coarse view, event keys -------------


@pytest.fixture
def host_033() -> Iterator[None]:
    """impl as it is inside a vLLM 0.33 process (host_profile), put back afterwards."""
    from kvspec.impl import host_profile

    previous = host_profile.choose(host_profile.profile_for("0.33.0"))
    yield
    host_profile.choose(previous)


@pytest.mark.parametrize("name", ["sha256", "sha256_cbor"])
def test_0_33_root_is_the_fixed_seeds_hash_without_pythonhashseed(
        name: str, host_033: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    fn = hashing.get_hash_fn_by_name(name)
    hashing.init_none_hash(fn)
    first = hashing.NONE_HASH
    hashing.init_none_hash(fn)
    assert first == hashing.NONE_HASH == fn(spec_hashing.DEFAULT_NONE_HASH_SEED)
    assert hashing.get_none_hash_seed() == spec_hashing.none_hash_seed(
        Profile.V0_33, name, None) == "vllm-none-hash"


@pytest.mark.parametrize("name", ["xxhash", "xxhash_cbor"])
def test_0_33_root_stays_random_for_xxhash(name: str, host_033: None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    fn = hashing.get_hash_fn_by_name(name)
    hashing.init_none_hash(fn)
    first, seed = hashing.NONE_HASH, hashing.get_none_hash_seed()
    hashing.init_none_hash(fn)
    assert first != hashing.NONE_HASH and seed != hashing.get_none_hash_seed()
    assert seed is not None and first == fn(seed)  # hash_fn(random seed), as in vLLM 0.33
    assert spec_hashing.none_hash_seed(Profile.V0_33, name, None) is None


def test_pythonhashseed_wins_under_0_33(host_033: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "9")
    for name in spec_hashing.ALGORITHMS:
        hashing.init_none_hash(hashing.get_hash_fn_by_name(name))
        assert hashing.get_none_hash_seed() == "9"
        assert spec_hashing.none_hash_seed(Profile.V0_33, name, "9") == "9"
        assert spec_hashing.root_reproducible(Profile.V0_33, name, None)
        assert spec_hashing.root_reproducible(Profile.V0_13, name, None)


def test_0_13_root_has_no_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    hashing.init_none_hash(hashing.sha256)  # no vLLM in this process: kvspec's, 0.13's rule
    assert hashing.get_none_hash_seed() is None
    assert spec_hashing.none_hash_seed(Profile.V0_13, "sha256", None) is None


def spec_lookahead_hashes(tokens: list[int], block_size: int, lookahead: int,
                          lora: str | None, salt: str | None, rows: tuple[bytes, ...] | None,
                          none_hash: bytes) -> list[bytes]:
    """The spec's chain under lookahead, the hash function applied (no multimodal input)."""
    count = spec_hashing.num_lookahead_blocks(len(tokens), block_size, lookahead)
    window_keys = []
    for i in range(count):
        start = i * block_size
        end = start + block_size + lookahead
        embeds = None if rows is None else b"".join(rows[start:end])
        window_keys.append(spec_hashing.block_extra_keys(
            lora, (), salt, embeds, start, spec_hashing.KeyFormat.TAGGED, "/adapters/" + (
                lora or "")))
    extras = tuple(spec_hashing.lookahead_extra_keys(window_keys[i], tuple(
        tokens[(i + 1) * block_size:(i + 1) * block_size + lookahead])) for i in range(count))
    return list(spec_hashing.chain_hashes(reference_sha256, none_hash,
                                          tuple(tokens[:count * block_size]), block_size,
                                          extras))


@given(tokens=st.lists(st.integers(0, 2**31 - 1), max_size=20), block_size=st.integers(1, 4),
       lookahead=st.integers(1, 3), lora=st.none() | st.just("lora-a"),
       salt=st.none() | st.sampled_from(["", "s"]), embeds=st.booleans(),
       appended=st.integers(0, 5))
def test_lookahead_hashes_agree_with_spec(tokens: list[int], block_size: int, lookahead: int,
                                          lora: str | None, salt: str | None, embeds: bool,
                                          appended: int) -> None:
    hashing.set_extra_key_format(hashing.ExtraKeyFormat.TAGGED)
    prompt = tokens[:len(tokens) - appended] if appended < len(tokens) else tokens
    rows = (np.arange(len(prompt) * 2, dtype=np.float32).reshape(len(prompt), 2) + 0.5
            if embeds and prompt else None)
    request = Request("r", list(prompt), cache_salt=salt, prompt_embeds=rows,
                      lora_request=None if lora is None else LoRARequest(
                          lora, 1, "/adapters/" + lora),
                      block_hasher=hashing.get_request_block_hasher(
                          block_size, hashing.sha256, lookahead))
    for token in tokens[len(prompt):]:
        request.append_output_token_ids(token)
    spec_rows = None if rows is None else tuple(row.tobytes() for row in rows)
    assert request.block_hashes == spec_lookahead_hashes(
        tokens, block_size, lookahead, lora, salt, spec_rows, hashing.NONE_HASH)


def test_lookahead_waits_for_its_tokens_and_zero_is_the_plain_hasher() -> None:
    plain = Request("r", [1, 2, 3, 4, 5],
                    block_hasher=hashing.get_request_block_hasher(2, hashing.sha256))
    ahead = Request("r", [1, 2, 3, 4, 5],
                    block_hasher=hashing.get_request_block_hasher(2, hashing.sha256, 2))
    assert len(plain.block_hashes) == 2 and len(ahead.block_hashes) == 1
    assert ahead.block_hashes[0] == reference_sha256((hashing.NONE_HASH, (1, 2), (None, 3, 4)))
    ahead.append_output_token_ids(6)
    assert len(ahead.block_hashes) == 2
    zero = Request("r", [1, 2, 3, 4, 5],
                   block_hasher=hashing.lookahead_request_block_hasher(2, hashing.sha256, 0))
    assert zero.block_hashes == plain.block_hashes


@pytest.mark.parametrize("value", [-1, 2**31, "2", None, 1.0])
def test_bad_lookahead_is_refused(value: Any) -> None:
    with pytest.raises(hashing.InvalidBlockSizeError, match="num_hash_lookahead_tokens"):
        hashing.lookahead_request_block_hasher(2, hashing.sha256, value)


@given(fine=st.lists(st.binary(min_size=1, max_size=3), max_size=12), scale=st.integers(1, 4))
def test_0_33_coarse_view_is_the_boundary_hash(fine: list[bytes], scale: int) -> None:
    view = hashing.BlockHashListWithBlockSizeV033(
        [hashing.BlockHash(h) for h in fine], 2, 2 * scale)
    expected = spec_hashing.coarse_hashes_for(Profile.V0_33, tuple(fine), scale)
    assert list(view) == list(expected) == view[:]
    assert spec_hashing._boundary_hashes(expected, tuple(fine), scale)


def test_hash_block_size_of_the_groups() -> None:
    assert spec_hashing.hash_block_size((16,), None) == 16
    assert spec_hashing.hash_block_size((16, 64), None) == 16
    assert spec_hashing.hash_block_size((32, 64), 8) == 8
    with pytest.raises(spec_hashing.BadHashUnit, match="one KV-cache group"):
        spec_hashing.hash_block_size((16,), 8)
    with pytest.raises(spec_hashing.BadHashUnit, match="does not divide"):
        spec_hashing.hash_block_size((16, 64), 32)


# Runs under vLLM 0.33's interpreter with PYTHONHASHSEED unset: the root hashes, lookahead chains
# (no multimodal input), coarse views and event extra keys, one JSON object.
VLLM_033_HASHING = """
import json, sys
import torch
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.request import Request
from vllm.sampling_params import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
cases = json.load(sys.stdin)
roots = {}
for algo in ("sha256", "sha256_cbor"):
    ku.init_none_hash(get_hash_fn_by_name(algo))
    roots[algo] = [ku.NONE_HASH.hex(), ku.get_none_hash_seed()]
fn = get_hash_fn_by_name("sha256")
ku.init_none_hash(fn)
chains = []
for bs, look, prompt, rest, lora, salt, embeds in cases["lookahead"]:
    rows = (torch.arange(len(prompt) * 2, dtype=torch.float32).reshape(-1, 2) + 0.5
            if embeds else None)
    req = Request("r", prompt, SamplingParams(max_tokens=8), None,
                  lora_request=LoRARequest(lora, 1, "/adapters/" + lora) if lora else None,
                  cache_salt=salt, prompt_embeds=rows,
                  block_hasher=ku.get_request_block_hasher(bs, fn, look))
    for token in rest:
        req.append_output_token_ids(token)
    chains.append([h.hex() for h in req.block_hashes])
coarse = [[h.hex() for h in ku.BlockHashListWithBlockSize([bytes.fromhex(x) for x in fine],
                                                          2, 2 * scale)]
          for fine, scale in cases["coarse"]]
def tagged(k):
    return tuple(tuple(x) for x in k)
events = [repr(ku.to_event_extra_keys([None if k is None else tagged(k) for k in keys]))
          for keys in cases["event_keys"]]
print(json.dumps({"roots": roots, "chains": chains, "coarse": coarse, "events": events}))
"""


@pytest.mark.slow
def test_0_33_hashing_matches_vllm_0_33_when_installed(host_033: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixed-seed roots, lookahead chains, coarse views and event extra keys are vLLM
    0.33's, from both impl and the spec."""
    if not VLLM_033_PYTHON.exists():
        pytest.skip("no .venv-vllm-0.33.0 (make vllm-env VLLM=0.33.0 builds it)")
    torch = pytest.importorskip("torch")
    rng = random.Random(3300)
    lookahead: list[Any] = []
    for _ in range(60):
        bs, look = rng.choice([1, 2, 4]), rng.choice([1, 2, 3])
        tokens = [rng.randint(0, 2**31 - 1) for _ in range(rng.randint(0, 4 * bs + look))]
        split = rng.randint(1, len(tokens)) if tokens else 0
        lookahead.append([bs, look, tokens[:split], tokens[split:],
                          rng.choice([None, "lora-a"]), rng.choice([None, "", "salt"]),
                          split > 0 and rng.random() < 0.3])
    coarse: list[Any] = [[[rng.randbytes(rng.randint(1, 4)).hex()
                           for _ in range(rng.randint(0, 9))], rng.randint(1, 3)]
                          for _ in range(20)]
    event_keys: list[Any] = [[None, [["lora", "a", "/p"], ["mm", "img", -2], ["cache_salt", "s"],
                               ["prompt_embeds", "d"]]], [[["mm", "x", 0]]], []]
    cases = {"lookahead": lookahead, "coarse": coarse, "event_keys": event_keys}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    proc = subprocess.run([str(VLLM_033_PYTHON), "-c", VLLM_033_HASHING],
                          input=json.dumps(cases), env=env, capture_output=True, text=True,
                          timeout=900, check=True)
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    for algo, (root, seed) in theirs["roots"].items():
        fn = hashing.get_hash_fn_by_name(algo)
        hashing.init_none_hash(fn)
        assert [hashing.NONE_HASH.hex(), hashing.get_none_hash_seed()] == [root, seed]
        assert spec_hashing.none_hash(fn, spec_hashing.none_hash_seed(
            Profile.V0_33, algo, None) or "").hex() == root
    hashing.init_none_hash(hashing.sha256)
    hashing.set_extra_key_format(hashing.ExtraKeyFormat.TAGGED)
    case: Any
    for case, chain in zip(lookahead, theirs["chains"], strict=True):
        bs, look, prompt, rest, lora, salt, embeds = case
        rows = (torch.arange(len(prompt) * 2, dtype=torch.float32).reshape(-1, 2) + 0.5
                if embeds else None)
        request = Request("r", prompt, cache_salt=salt, prompt_embeds=rows,
                          lora_request=LoRARequest(lora, 1, "/adapters/" + lora) if lora
                          else None,
                          block_hasher=hashing.get_request_block_hasher(bs, hashing.sha256, look))
        for token in rest:
            request.append_output_token_ids(token)
        assert [h.hex() for h in request.block_hashes] == chain
        spec_rows = None if rows is None else tuple(bytes(hashing.tensor_data(r)) for r in rows)
        assert [h.hex() for h in spec_lookahead_hashes(
            prompt + rest, bs, look, lora, salt, spec_rows, hashing.NONE_HASH)] == chain
    assert sum(1 for chain in theirs["chains"] if chain) > len(lookahead) // 2
    for (fine, scale), expected in zip(coarse, theirs["coarse"], strict=True):
        fine_bytes = [hashing.BlockHash(bytes.fromhex(h)) for h in fine]
        view = hashing.BlockHashListWithBlockSizeV033(fine_bytes, 2, 2 * scale)
        assert [h.hex() for h in view] == expected
        assert [h.hex() for h in spec_hashing.coarse_hashes_for(
            Profile.V0_33, tuple(fine_bytes), scale)] == expected
    for keys, expected in zip(event_keys, theirs["events"], strict=True):
        tagged = [None if k is None else tuple(tuple(x) for x in k) for k in keys]
        ours = [spec_hashing.event_extra_keys(k) for k in tagged] or None
        assert repr(ours) == expected


# --- the request block hasher's fast paths (docs/benchmarks.md, "The request block hasher") ------


class _Counted:
    """A hash function that counts its calls: SHA-256 of the pickle, or other bytes."""

    def __init__(self, genuine: bool = True, module: str = __name__) -> None:
        self.calls = 0
        self.genuine = genuine
        self.__module__ = module

    def __call__(self, value: Any) -> bytes:
        self.calls += 1
        digest = reference_sha256(value)
        return digest if self.genuine else digest[::-1]


def _hashes(block_size: int, fn: Any, tokens: list[int], extra: list[int]) -> list[bytes]:
    request = Request("r", tokens, block_hasher=hashing.get_request_block_hasher(block_size, fn))
    for token in extra:
        request.append_output_token_ids(token)
    return list(request.block_hashes)


def test_request_hasher_calls_any_other_hash_function_once_per_block() -> None:
    """Only sha256 of the pickle (impl's, or vLLM's own) is computed inline; any other
    function, one that hashes the same bytes included, is called for every block."""
    spy = _Counted()
    assert _hashes(2, spy, [1, 2, 3, 4, 5], [6, 7]) == _hashes(
        2, hashing.sha256, [1, 2, 3, 4, 5], [6, 7])
    assert spy.calls == 3


@pytest.mark.parametrize("genuine", [True, False])
def test_request_hasher_inlines_vllms_sha256_only_when_it_is_sha256(
        monkeypatch: pytest.MonkeyPatch, genuine: bool) -> None:
    """vLLM's ``vllm.utils.hashing.sha256`` (the attribute of that module, with that module
    name, not a wrapper) is inlined once it gives SHA-256 of the pickle on a probe: same bytes,
    one call (the probe). A function there that hashes otherwise is called per block."""
    theirs = _Counted(genuine, module="vllm.utils.hashing")
    fake = type(sys)("vllm.utils.hashing")
    fake.sha256 = theirs  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.utils.hashing", fake)
    ours = _hashes(2, theirs, [1, 2, 3, 4, 5], [6, 7])
    if genuine:
        assert ours == _hashes(2, hashing.sha256, [1, 2, 3, 4, 5], [6, 7])
        assert theirs.calls == 1
    else:
        assert theirs.calls == 1 + 3
    wrapper = _Counted(module="vllm.utils.hashing")
    wrapper.__wrapped__ = theirs  # type: ignore[attr-defined]
    fake.sha256 = wrapper  # type: ignore[attr-defined]
    _hashes(2, wrapper, [1, 2, 3, 4, 5], [6, 7])
    assert wrapper.calls == 3


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 6, 33])
def test_request_hasher_one_block_and_many_blocks_agree_with_hash_block_tokens(
        tokens: int) -> None:
    """The one-block case (a decode step's) and the many-block case (a prompt's) cut the same
    blocks as hash_block_tokens chained block by block, for impl's sha256 and another."""
    ids = list(range(100, 100 + tokens))
    for fn in (hashing.sha256, _Counted()):
        parent: hashing.BlockHash | None = None
        expected = []
        for start in range(0, tokens - tokens % 4, 4):
            parent = hashing.hash_block_tokens(fn, parent, ids[start:start + 4])
            expected.append(parent)
        assert _hashes(4, fn, ids[:1], ids[1:]) == expected  # one token at a time
        assert _hashes(4, fn, ids, []) == expected  # all at once
