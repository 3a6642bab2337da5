"""Hostile input to prefix hashing (impl/hashing.py) and to requests (impl/request.py).

Hashing's observable state is small: the chain seed ``NONE_HASH`` (and its re-export in
``kv_cache_utils``), the KV-event hash flag and the extra-key format. Its functions are pure
otherwise, so a bad call must leave those as they were and give a typed error naming the value.
The request block hasher is checked against duck-typed requests (``FakeRequest``: vLLM's
``Request`` is one), which it must read without changing, and against impl's own ``Request``.

Request subjects are drawn in interesting states: with and without a block hasher (sha256 or
CBOR, either key format), a LoRA adapter, a salt, multimodal features, prompt embeddings, some
output tokens. The snapshot is every field a caller can read, the block hashes included.

The first tests are the defects the suite found, one line each; the generated ones follow.
Names of impl added by the fixes are read when a call runs, not at import, so this file also
runs against the code before the fixes and shows each defect.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast, overload

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvspec.impl import hashing
from kvspec.impl.request import (
    ConstantList,
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    Request,
    RequestStatus,
)
from tests.hostile import ALLOWED, BadCall, check, judge
from tests.hostile.values import (
    Bad,
    HalfwayError,
    Opaque,
    bad_int,
    bad_positive,
    not_an_int,
    not_bytes,
)

# ---------------------------------------------------------------------- shared pieces


def hashing_state(_: object = None) -> object:
    """Everything of hashing's module state a caller can observe."""
    utils = sys.modules.get("kvspec.impl.kv_cache_utils")
    return (hashing.NONE_HASH, None if utils is None else utils.NONE_HASH,
            hashing.USE_INT_BLOCK_HASHES, getattr(hashing, "EXTRA_KEY_FORMAT", None))


@pytest.fixture(autouse=True)
def _restore_hashing_state() -> Iterator[None]:
    """A test that got a bad call through may have changed the module state: put it back."""
    none_hash, use_int = hashing.NONE_HASH, hashing.USE_INT_BLOCK_HASHES
    key_format = getattr(hashing, "EXTRA_KEY_FORMAT", None)
    yield
    hashing.NONE_HASH, hashing.USE_INT_BLOCK_HASHES = none_hash, use_int
    utils = sys.modules.get("kvspec.impl.kv_cache_utils")
    if utils is not None:
        vars(utils)["NONE_HASH"] = none_hash
    if key_format is not None:
        hashing.set_extra_key_format(key_format)


Draw = Callable[[st.SearchStrategy[Any]], Any]


def draw_key_format(draw: Draw) -> None:
    """Hash in either extra-key format from now on (code without the switch has one)."""
    setter = getattr(hashing, "set_extra_key_format", None)
    if setter is not None:
        setter(draw(st.sampled_from(list(hashing.ExtraKeyFormat))))


def _call(describe: str, run: Callable[[Any], object], bad: Bad | None = None,
          **kwargs: Any) -> BadCall:
    if bad is None:
        return BadCall(describe, run, **kwargs)
    return BadCall(describe, run, bad.value, bad.forms, **kwargs)


def _b(value: Any, label: str | None = None, *named: str) -> Bad:
    return Bad(value, label if label is not None else repr(value), tuple(named))


def _numpy_integer(bad: Bad, valid: Callable[[int], bool] = lambda _: True) -> str:
    """The acceptance reason when ``bad`` is a numpy integer whose value ``valid`` takes (impl's
    one integer rule, docs/hostile-input.md), else ''."""
    value = bad.value
    if isinstance(value, np.integer) and not isinstance(value, np.bool_) and valid(int(value)):
        return "a numpy integer in range: impl's integer arguments take numpy's, converted"
    return ""


def returns(value: Any) -> Callable[[Any], Any]:
    """A hash function that returns ``value`` whatever it is given."""
    def hash_fn(payload: Any) -> Any:
        return value
    hash_fn.__qualname__ = f"returns({value!r})"
    return hash_fn


# Why each acceptance is one (docs/hostile-input.md has the same rows).
BOOL_TOKENS = ("bool is an int to Python; True and False pickle and encode distinctly from 1 "
               "and 0, so no block is shared by mistake, and telling them apart would cost a "
               "Python-level pass per token on the hashing path")
INT_HASHES = ("an int hash (Python's builtin hash): vLLM 0.13's own tests build requests with "
              "it as the block hasher's hash function; the prefix cache keys bytes only")
NO_NEW_BLOCK = ("a malformed block hash or token list in a request that completes no new block: "
                "the hasher returns [] from num_tokens and the number of hashes alone (most "
                "calls, one per decode step), reading neither")
UNSEEDED = ("init_none_hash without PYTHONHASHSEED: the seed is random bytes and the hash "
            "function is not called, as in vLLM 0.13")
ANY_INT_TOKEN = ("a token id of any int value: the hash is defined for every int and impl does "
                 "not know the vocabulary (vLLM hashes them alike)")


# Token lists that are not lists of ints, and what naming them looks like.
BAD_TOKEN_LISTS = [
    _b("abc"), _b([1.5], None, "1.5"), _b([1, None], None, "None"), _b(["a"], None, "'a'"),
    _b(b"ab"), _b(bytearray(b"ab"), "bytearray(b'ab')"), _b(memoryview(b"ab"), "memoryview",
                                                            "<memory"),
    _b({1, 2}), _b(5), _b(None), _b(Opaque()), _b([np.int64(2)], "[np.int64(2)]", "2"),
    _b(np.array([1, 2]), "np.array([1, 2])", "array([1, 2])"), _b([1, b"x"], None, "b'x'"),
    _b([[1]], None, "[1]"), _b([1 + 0j], None, "(1+0j)"),
]


def _generator() -> Iterator[int]:
    """A generator: pickle and CBOR refuse it."""
    yield from ()


def _not_encodable() -> list[Bad]:
    lock = threading.Lock()
    return [_b(_generator(), "a generator", "generator"), _b(lock, "a lock", "lock"),
            _b(lambda: 0, "a lambda", "lambda")]


# ---------------------------------------------------------------------- the defects it found


# The same names, typed Any: these calls pass what the signatures refuse, on purpose.
loose: Any = hashing
LooseRequest: Any = Request
LooseLoRA: Any = LoRARequest
LoosePlaceholder: Any = PlaceholderRange
LooseFeature: Any = MultiModalFeatureSpec
LooseStatus: Any = RequestStatus


def _regression(describe: str, run: Callable[[Any], object], bad: object, *named: str,
                snapshot: Callable[[Any], object] = hashing_state,
                subject: Callable[[], object] = lambda: None) -> Any:
    return pytest.param(describe, run, bad, named, snapshot, subject, id=describe)


def _plain_request() -> Request:
    return Request("r", [1, 2, 3], block_hasher=hashing.get_request_block_hasher(2, hashing.sha256))


def request_snapshot(request: Request) -> object:
    """Every field of a request a caller can read, and hashing's state."""
    embeds = request.prompt_embeds
    return (
        request.request_id, None if request.prompt_token_ids is None
        else tuple(request.prompt_token_ids), tuple(request.all_token_ids),
        tuple(request.output_token_ids), tuple(request.block_hashes), request.num_tokens,
        request.num_output_tokens, request.num_prompt_tokens, request.num_tokens_with_spec,
        request.num_computed_tokens, request.num_cached_tokens, request.num_preemptions,
        request.status, tuple(request.spec_token_ids), tuple(request.mm_features),
        request.num_encoder_inputs, request.lora_request, request.cache_salt,
        None if embeds is None else np.asarray(embeds).tobytes(), request.max_tokens,
        request.skip_reading_prefix_cache, request.priority, request.client_index,
        request.eos_token_id, request.arrival_time, hashing_state(),
    )


def _feature(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(offset, length))


@pytest.mark.parametrize(("describe", "run", "bad", "named", "snapshot", "subject"), [
    _regression("hash_block_tokens(sha256, None, 'abc')",
                lambda _: loose.hash_block_tokens(loose.sha256, None, "abc"), "abc"),
    _regression("hash_block_tokens(sha256, None, [1.5])",
                lambda _: loose.hash_block_tokens(loose.sha256, None, [1.5]), [1.5], "1.5"),
    _regression("hash_block_tokens(sha256, 'parent', [1])",
                lambda _: loose.hash_block_tokens(loose.sha256, "parent", [1]), "parent"),
    _regression("hash_block_tokens(sha256, None, [1], ['key'])",
                lambda _: loose.hash_block_tokens(loose.sha256, None, [1], ["key"]), ["key"]),
    _regression("hash_block_tokens(sha256, None, [1], (1.5,))",
                lambda _: loose.hash_block_tokens(loose.sha256, None, [1], (1.5,)), 1.5),
    _regression("hash_block_tokens(None, None, [1])",
                lambda _: loose.hash_block_tokens(None, None, [1]), None),
    _regression("hash_block_tokens(<returns None>, None, [1])",
                lambda _: loose.hash_block_tokens(returns(None), None, [1]), None,
                "returns(None)"),
    _regression("sha256(<a generator>)",
                lambda _: loose.sha256(_generator()), None, "generator"),
    _regression("init_none_hash(None)", lambda _: loose.init_none_hash(None), None),
    _regression("maybe_convert_block_hash([1, 2])",
                lambda _: loose.maybe_convert_block_hash([1, 2]), [1, 2]),
    _regression("tensor_data([1.0])", lambda _: loose.tensor_data([1.0]), [1.0]),
    _regression("need_extra_keys(None)", lambda _: loose.need_extra_keys(None), None),
    _regression("get_request_block_hasher(2, None)",
                lambda _: loose.get_request_block_hasher(2, None), None),
    _regression("request_block_hasher(None)",
                lambda _: loose.get_request_block_hasher(2, loose.sha256)(None), None),
    _regression("generate_block_hash_extra_keys(<request>, 0, '4', 0)",
                lambda _: loose.generate_block_hash_extra_keys(_plain_request(), 0, "4", 0),
                "4"),
    _regression("BlockHashListWithBlockSize([b'a'], 1, 1)['0']",
                lambda _: loose.BlockHashListWithBlockSize([b"a"], 1, 1)["0"], "0"),
    _regression("BlockHashListWithBlockSize([None], 1, 1)[0]",
                lambda _: loose.BlockHashListWithBlockSize([None], 1, 1)[0], None),
    _regression("Request('r', [1], cache_salt=5)",
                lambda _: LooseRequest("r", [1], cache_salt=5), 5),
    _regression("Request('r', [1], lora_request=<no lora_name>)",
                lambda _: LooseRequest("r", [1], lora_request=Opaque()), Opaque()),
    _regression("Request('r', [1, 2], prompt_embeds=[[0.5]])",
                lambda _: LooseRequest("r", [1, 2], prompt_embeds=[[0.5]]), [[0.5]]),
    _regression("Request('r', [1, 2], prompt_embeds=<3 rows>)",
                lambda _: LooseRequest("r", [1, 2], prompt_embeds=np.zeros((3, 2))), 3),
    _regression("Request('r', <8 tokens>, mm_features=<overlapping>)",
                lambda _: LooseRequest("r", list(range(8)), mm_features=[
                    _feature("a", 0, 6), _feature("b", 2, 2)]), "b", "'b'"),
    _regression("Request('r', [1], block_hasher=lambda r: None)",
                lambda _: LooseRequest("r", [1], block_hasher=lambda r: None), None),
    _regression("Request('r', [1], sampling_params=<max_tokens='9'>)",
                lambda _: LooseRequest("r", [1], sampling_params=FakeParams(max_tokens="9")), "9"),
    _regression("LoRARequest('x', 0)", lambda _: LooseLoRA("x", 0), 0),
    _regression("LoRARequest(None, 1)", lambda _: LooseLoRA(None, 1), None),
    _regression("PlaceholderRange(-1, 2)", lambda _: LoosePlaceholder(-1, 2), -1),
    _regression("MultiModalFeatureSpec(None, 'image', None, PlaceholderRange(0, 1))",
                lambda _: LooseFeature(None, "image", None, PlaceholderRange(0, 1)),
                None),
    _regression("LoRARequest('x', 1).lora_name = 'y'",
                lambda lora: setattr(lora, "lora_name", "y"), "y",
                snapshot=lambda lora: (lora.lora_name, lora.lora_int_id, lora.lora_path),
                subject=lambda: LoRARequest("x", 1)),
    _regression("RequestStatus.is_finished('x')",
                lambda _: LooseStatus.is_finished("x"), "x"),
    _regression("request.num_tokens = 5", lambda r: setattr(r, "num_tokens", 5), 5,
                snapshot=request_snapshot, subject=_plain_request),
    _regression("request.get_num_encoder_embeds('0')",
                lambda r: r.get_num_encoder_embeds("0"), "0",
                snapshot=request_snapshot, subject=_plain_request),
    _regression("request.append_output_token_ids(4) with a hasher that fails",
                lambda r: r.append_output_token_ids(4), None, "halfway",
                snapshot=request_snapshot, subject=lambda: _failing_hasher_request()),
])
def test_found_defect_is_refused(describe: str, run: Callable[[Any], object], bad: object,
                                 named: tuple[str, ...], snapshot: Callable[[Any], object],
                                 subject: Callable[[], object]) -> None:
    propagates = HalfwayError if "fails" in describe else None
    verdict, detail = judge(subject(), snapshot,
                            BadCall(describe, run, bad, named, propagates=propagates))
    assert verdict in ALLOWED, f"{describe}\n  {verdict.value}\n  {detail}"


def _failing_hasher_request() -> Request:
    """A request whose block hasher fails on its second call (a hash function that breaks)."""
    calls: list[int] = []

    def block_hasher(request: Any) -> list[Any]:
        calls.append(1)
        if len(calls) > 1:
            raise HalfwayError("the block hasher failed halfway")
        return []
    return Request("r", [1, 2, 3], block_hasher=block_hasher)


@dataclass
class FakeParams:
    """Sampling or pooling params: only what a request reads of them."""

    max_tokens: Any = 8
    skip_reading_prefix_cache: Any = None


# ---------------------------------------------------------------------- hashing functions


@st.composite
def hashing_bad_calls(draw: st.DrawFn) -> BadCall:
    operation = draw(st.sampled_from(sorted(_HASHING_CALLS)))
    call: BadCall = draw(_HASHING_CALLS[operation]())
    return BadCall(call.describe, call.run, call.bad, call.named, call.propagates, call.accepted,
                   operation)


_BAD_HASH_FNS = [_b(None), _b(3), _b("sha256"), _b(Opaque()),
                 _b(returns(None), "<returns None>", "returns(None)"),
                 _b(returns("h"), "<returns 'h'>", "returns('h')"),
                 _b(returns(1.5), "<returns 1.5>", "returns(1.5)")]


@st.composite
def _hash_block_tokens(draw: st.DrawFn) -> BadCall:
    args: dict[str, Any] = {"hash_function": hashing.sha256, "parent_block_hash": None,
                            "curr_block_token_ids": [1, 2], "extra_keys": None}
    which = draw(st.sampled_from(["hash_function", "parent", "tokens", "extra_keys",
                                  "accepted"]))
    accepted = ""
    if which == "hash_function":
        bad = draw(st.sampled_from(_BAD_HASH_FNS))
        args["hash_function"] = bad.value
    elif which == "parent":
        bad = draw(st.sampled_from([_b("abc"), _b(2.5), _b([1]), _b(Opaque()),
                                    _b(bytearray(b"p"), "bytearray(b'p')"), _b(True)]))
        args["parent_block_hash"] = bad.value
    elif which == "tokens":
        bad = draw(st.sampled_from(BAD_TOKEN_LISTS))
        args["curr_block_token_ids"] = bad.value
    elif which == "extra_keys":
        bad = draw(st.sampled_from([
            _b(["key"]), _b("key"), _b((1.5,), None, "1.5"), _b((None,), None, "None"),
            _b(({},), None, "{}"), _b((Opaque(),), None, "Opaque()"),
            _b((("lora", 1.5),), None, "1.5"), _b((True,), None, "True"), _b(5),
            _b(({"a"},), None, "{'a'}"),
        ]))
        args["extra_keys"] = bad.value
    else:
        bad, accepted = draw(st.sampled_from([
            (_b([True, False]), BOOL_TOKENS), (_b([-1, 2**70]), ANY_INT_TOKEN),
            (_b(7), INT_HASHES),
        ]))
        if bad.value == 7:
            args["parent_block_hash"] = 7
            args["hash_function"] = hash
        else:
            args["curr_block_token_ids"] = bad.value
    return _call(f"hash_block_tokens(<{which}: {bad.label}>)",
                 lambda _: hashing.hash_block_tokens(**args), bad, accepted=accepted)


@st.composite
def _hash_functions(draw: st.DrawFn) -> BadCall:
    name = draw(st.sampled_from(["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]))
    candidates = _not_encodable()
    if name.endswith("cbor"):
        candidates += [_b(Opaque())]
    bad = draw(st.sampled_from(candidates))
    return _call(f"{name}({bad.label})", lambda _: getattr(hashing, name)(bad.value), bad)


@st.composite
def _get_hash_fn_by_name(draw: st.DrawFn) -> BadCall:
    bad = draw(st.sampled_from([_b(None), _b(3), _b("md5"), _b(""), _b("SHA256"),
                                _b(b"sha256"), _b(["sha256"]), _b(Opaque())]))
    return _call(f"get_hash_fn_by_name({bad.label})",
                 lambda _: hashing.get_hash_fn_by_name(bad.value), bad)


@st.composite
def _init_none_hash(draw: st.DrawFn) -> BadCall:
    seeded = draw(st.booleans())
    bad = draw(st.sampled_from(_BAD_HASH_FNS))
    # Without a seed the chain seed is random bytes: a callable is not called, so not checked.
    accepted = "" if seeded or not callable(bad.value) else UNSEEDED

    def run(_: object) -> None:
        saved = os.environ.get("PYTHONHASHSEED")
        if seeded:
            os.environ["PYTHONHASHSEED"] = "13"
        else:
            os.environ.pop("PYTHONHASHSEED", None)
        try:
            hashing.init_none_hash(bad.value)
        finally:
            if saved is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = saved
    return _call(f"init_none_hash({bad.label}) {'with' if seeded else 'without'} PYTHONHASHSEED",
                 run, bad, accepted=accepted)


@st.composite
def _group_id_keys(draw: st.DrawFn) -> BadCall:
    which = draw(st.sampled_from(["make hash", "make group", "get_block_hash", "get_group_id",
                                  "maybe_convert_block_hash"]))
    if which == "make hash":
        bad = draw(not_bytes())
        return _call(f"make_block_hash_with_group_id({bad.label}, 0)",
                     lambda _: hashing.make_block_hash_with_group_id(bad.value, 0), bad)
    if which == "make group":
        bad = draw(bad_int(0, 2**32 - 1))
        return _call(f"make_block_hash_with_group_id(b'h', {bad.label})",
                     lambda _: hashing.make_block_hash_with_group_id(
                         hashing.BlockHash(b"h"), bad.value), bad,
                     accepted=_numpy_integer(bad, lambda v: 0 <= v < 2**32))
    if which == "maybe_convert_block_hash":
        bad = draw(not_bytes())
        as_int = draw(st.booleans())

        def convert(_: object) -> object:
            saved = hashing.USE_INT_BLOCK_HASHES
            hashing.USE_INT_BLOCK_HASHES = as_int
            try:
                return hashing.maybe_convert_block_hash(bad.value)
            finally:
                hashing.USE_INT_BLOCK_HASHES = saved
        return _call(f"maybe_convert_block_hash({bad.label}) (int hashes: {as_int})", convert,
                     bad)
    bad = draw(st.one_of(not_bytes(), st.sampled_from([_b(b""), _b(b"abc")])))
    return _call(f"{which}({bad.label})", lambda _: getattr(hashing, which)(bad.value), bad)


@st.composite
def _set_extra_key_format(draw: st.DrawFn) -> BadCall:
    bad = draw(st.sampled_from([_b(None), _b("x"), _b("TAGGED"), _b(1), _b(True),
                                _b(["tagged"]), _b(Opaque())]))
    return _call(f"set_extra_key_format({bad.label})",
                 lambda _: hashing.set_extra_key_format(bad.value), bad)


@st.composite
def _tensor_data(draw: st.DrawFn) -> BadCall:
    bad = draw(st.sampled_from([_b(None), _b([1.0]), _b(np.zeros(2), "np.zeros(2)", "0."),
                                _b(Opaque()), _b(b"ab")]))
    return _call(f"tensor_data({bad.label})", lambda _: hashing.tensor_data(bad.value), bad)


@st.composite
def _get_request_block_hasher(draw: st.DrawFn) -> BadCall:
    if draw(st.booleans()):
        bad = draw(bad_positive(hashing.MAX_BLOCK_SIZE))
        return _call(f"get_request_block_hasher({bad.label}, sha256)",
                     lambda _: hashing.get_request_block_hasher(bad.value, hashing.sha256), bad,
                     accepted=_numpy_integer(bad, lambda v: 0 < v <= hashing.MAX_BLOCK_SIZE))
    bad = draw(st.sampled_from(_BAD_HASH_FNS[:4]))
    return _call(f"get_request_block_hasher(2, {bad.label})",
                 lambda _: hashing.get_request_block_hasher(2, bad.value), bad)


_HASHING_CALLS: dict[str, Any] = {
    "hash_block_tokens": _hash_block_tokens,
    "sha256/sha256_cbor/xxhash/xxhash_cbor": _hash_functions,
    "get_hash_fn_by_name": _get_hash_fn_by_name,
    "init_none_hash": _init_none_hash,
    "group-id keys": _group_id_keys,
    "set_extra_key_format": _set_extra_key_format,
    "tensor_data": _tensor_data,
    "get_request_block_hasher": _get_request_block_hasher,
}


@given(st.data())
def test_hashing_functions_refuse_bad_calls_and_change_nothing(data: st.DataObject) -> None:
    check(None, hashing_state, data.draw(hashing_bad_calls()))


# ---------------------------------------------------------------------- duck-typed requests


class VllmTokenList(Sequence[int]):
    """vLLM's ``ConstantList``: a read-only Sequence over a list (not a list), whose slices are
    lists, and whose ``len`` is Python-level."""

    def __init__(self, items: list[int]) -> None:
        self._items = items

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class FakeRequest:
    """What the hashing functions read of a request, as plain fields a test can break."""

    all_token_ids: Any
    num_tokens: Any
    block_hashes: Any = field(default_factory=list)
    lora_request: Any = None
    mm_features: Any = field(default_factory=list)
    cache_salt: Any = None
    prompt_embeds: Any = None
    request_id: str = "fake"

    def __repr__(self) -> str:
        return f"FakeRequest({self.request_id!r})"


def fake_snapshot(request: object) -> object:
    if not isinstance(request, FakeRequest):
        return hashing_state()
    fields = vars(request)
    return (tuple((k, repr(v)) for k, v in fields.items()), hashing_state())


@st.composite
def fake_requests(draw: st.DrawFn) -> FakeRequest:
    """A well-formed duck-typed request: vLLM-style token list (a Sequence) or a list, LoRA,
    salt and features drawn."""
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=2, max_size=10))
    token_list: Any = VllmTokenList(tokens) if draw(st.booleans()) else list(tokens)
    request = FakeRequest(token_list, len(tokens))
    if draw(st.booleans()):
        request.lora_request = LoRARequest("adapter", 1, "/adapters/a")
    if draw(st.booleans()):
        request.cache_salt = draw(st.sampled_from(["", "salt"]))
    if draw(st.booleans()):
        request.mm_features = [_feature("img", 0, 1), _feature("img2", 1, 1)]
    return request


# How each duck-typed request is broken: (label, field, bad value, forms of naming it).
def _broken_fields(request: FakeRequest) -> list[tuple[str, str, Any, tuple[str, ...]]]:
    n = request.num_tokens
    return [
        ("block_hashes None", "block_hashes", None, ("None",)),
        ("block_hashes a tuple", "block_hashes", (), ("()",)),
        ("num_tokens a float", "num_tokens", float(n), (repr(float(n)),)),
        ("num_tokens a str", "num_tokens", str(n), (repr(str(n)),)),
        ("num_tokens past the tokens", "num_tokens", n + 4, (str(n + 4),)),
        ("tokens with a float", "all_token_ids", [1.5] * n, ("1.5",)),
        ("tokens a str", "all_token_ids", "x" * n, (repr("x" * n),)),
        ("tokens a numpy array", "all_token_ids", np.arange(n), ("array(",)),
        ("tokens None", "all_token_ids", None, ("None",)),
        ("tokens bytes", "all_token_ids", bytes(n), (repr(bytes(n)),)),
        ("a block hash that is a str", "block_hashes", ["abc"], ("'abc'",)),
        ("lora_request without lora_name", "lora_request", Opaque(), ("Opaque()",)),
        ("lora_name an int", "lora_request", _NamedLora(5), ("lora_name=5",)),
        ("cache_salt an int", "cache_salt", 5, ("5",)),
        ("cache_salt bytes", "cache_salt", b"s", ("b's'",)),
        ("mm_features unsorted", "mm_features", [_feature("b", 2, 1), _feature("a", 0, 1)],
         ("'a'",)),
        ("mm_features overlapping", "mm_features", [_feature("a", 0, 6), _feature("b", 2, 2)],
         ("'b'",)),
        ("mm_features not a list", "mm_features", "features", ("'features'",)),
        ("a feature with no identifier", "mm_features", [_RawFeature(None, 0, 1)],
         ("identifier=None",)),
        ("a feature at a negative offset", "mm_features", [_RawFeature("a", -1, 1)],
         ("offset=-1",)),
        ("a feature with a float length", "mm_features", [_RawFeature("a", 0, 1.5)],
         ("length=1.5",)),
        ("prompt_embeds a list", "prompt_embeds", [[0.5]] * n, ("[[0.5]",)),
        ("prompt_embeds of objects", "prompt_embeds", np.array([object()] * n, dtype=object),
         ("array(",)),
    ]


@dataclass(frozen=True)
class _NamedLora:
    lora_name: Any
    lora_path: str = "/p"


@dataclass(frozen=True)
class _Position:
    offset: Any
    length: Any


@dataclass(frozen=True)
class _RawFeature:
    """A multimodal feature built without MultiModalFeatureSpec's checks (vLLM's has none)."""

    identifier: Any
    offset: Any
    length: Any

    @property
    def mm_position(self) -> _Position:
        return _Position(self.offset, self.length)


def _extra_key_fields(label: str) -> bool:
    return any(f in label for f in ("lora", "salt", "mm_features", "feature", "embeds"))


@st.composite
def hasher_bad_calls(draw: st.DrawFn, request: FakeRequest) -> BadCall:
    """A bad request for the block hasher, ``generate_block_hash_extra_keys`` or
    ``need_extra_keys``, or a bad hash function behind the hasher."""
    operation = draw(st.sampled_from(["request_block_hasher", "generate_block_hash_extra_keys",
                                      "need_extra_keys"]))
    block_size = draw(st.integers(1, 2))
    kind = draw(st.sampled_from(["not a request", "broken field", "hash function", "arguments"]))
    if kind == "not a request":
        bad = draw(st.sampled_from([_b(None), _b(Opaque()), _b(3), _b("request")]))
        target: Any = bad.value
        label = bad.label
    elif kind == "broken field" or operation == "need_extra_keys":
        broken = _broken_fields(request)
        if operation != "request_block_hasher":  # the others read only the extra-key sources
            broken = [b for b in broken if _extra_key_fields(b[0])]
        label, name, value, forms = draw(st.sampled_from(broken))
        setattr(request, name, value)
        bad = Bad(value, label, forms)
        target = request
        if (label == "a block hash that is a str" and operation == "request_block_hasher"
                and 2 * block_size > request.num_tokens):
            hasher = hashing.get_request_block_hasher(block_size, hashing.sha256)
            return _call(f"request_block_hasher(<{label}>), no new block", lambda _: hasher(target),
                         bad, operation=operation, accepted=NO_NEW_BLOCK)
    elif kind == "hash function" and operation == "request_block_hasher":
        bad = draw(st.sampled_from(_BAD_HASH_FNS[4:]))
        hasher = hashing.get_request_block_hasher(block_size, bad.value)
        return _call(f"get_request_block_hasher({block_size}, {bad.label})(<request>)",
                     lambda r: hasher(r), bad, operation=operation)
    else:
        return draw(_extra_keys_arguments(request))
    if operation == "request_block_hasher":
        hasher = hashing.get_request_block_hasher(block_size, hashing.sha256)
        return _call(f"request_block_hasher(<{label}>)", lambda _: hasher(target), bad,
                     operation=operation)
    if operation == "need_extra_keys":
        return _call(f"need_extra_keys(<{label}>)", lambda _: hashing.need_extra_keys(target),
                     bad, operation=operation)
    return _call(f"generate_block_hash_extra_keys(<{label}>, 0, 1, 0)",
                 lambda _: hashing.generate_block_hash_extra_keys(target, 0, 1, 0), bad,
                 operation=operation)


@st.composite
def _extra_keys_arguments(draw: st.DrawFn, request: FakeRequest) -> BadCall:
    which = draw(st.sampled_from(["start", "end", "range", "mm index"]))
    args: list[Any] = [request, 0, 2, 0]
    accepted = ""
    if which in ("start", "end"):
        bad = draw(not_an_int())
        args[1 if which == "start" else 2] = bad.value
        accepted = _numpy_integer(bad, lambda v: 0 <= v < 2 if which == "start" else v > 0)
    elif which == "range":
        start, end = draw(st.sampled_from([(-1, 1), (2, 2), (3, 1), (-5, -2)]))
        args[1:3] = [start, end]
        bad = Bad((start, end), f"[{start}, {end})", (f"[{start}, {end})",))
    else:
        request.mm_features = [_feature("img", 0, 1), _feature("img2", 1, 1)]
        bad = draw(st.one_of(not_an_int(), st.sampled_from([_b(3), _b(-3), _b(2**70)])))
        args[3] = bad.value
    return _call(f"generate_block_hash_extra_keys(<request>, {args[1]!r}, {args[2]!r}, "
                 f"{args[3]!r})", lambda _: hashing.generate_block_hash_extra_keys(*args), bad,
                 operation="generate_block_hash_extra_keys", accepted=accepted)


@given(st.data())
def test_hashing_refuses_bad_requests_and_changes_nothing(data: st.DataObject) -> None:
    draw_key_format(data.draw)
    request = data.draw(fake_requests())
    check(request, fake_snapshot, data.draw(hasher_bad_calls(request)))


@given(request=fake_requests(), block_size=st.integers(1, 3))
def test_hasher_reads_vllm_style_requests(request: FakeRequest, block_size: int) -> None:
    """Acceptance: vLLM's requests (a token list that is a Sequence, not a list; plain ints)
    hash as impl's do, in both formats."""
    for key_format in hashing.ExtraKeyFormat:
        hashing.set_extra_key_format(key_format)
        hasher = hashing.get_request_block_hasher(block_size, hashing.sha256)
        ours = Request("r", list(request.all_token_ids), lora_request=request.lora_request,
                       cache_salt=request.cache_salt, mm_features=request.mm_features,
                       block_hasher=hasher)
        assert hasher(cast(Any, request)) == ours.block_hashes


# ---------------------------------------------------------------------- impl's Request


@st.composite
def requests(draw: st.DrawFn) -> Request:
    """A request after a random run of valid calls."""
    draw_key_format(draw)
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), max_size=10))
    kwargs: dict[str, Any] = {}
    if draw(st.booleans()):
        block_size = draw(st.integers(1, 4))
        fn = draw(st.sampled_from([hashing.sha256, hashing.sha256_cbor]))
        kwargs["block_hasher"] = hashing.get_request_block_hasher(block_size, fn)
    if draw(st.booleans()):
        kwargs["lora_request"] = LoRARequest(draw(st.sampled_from(["a", "b"])), 1, "/p")
    if draw(st.booleans()):
        kwargs["cache_salt"] = draw(st.sampled_from(["", "a", "salt"]))
    with_features, with_embeds = draw(st.booleans()), draw(st.booleans())
    if tokens and with_features:
        kwargs["mm_features"] = [_feature("img", 0, min(2, len(tokens)))]
    prompt: list[int] | None = tokens
    if tokens and with_embeds:
        kwargs["prompt_embeds"] = np.arange(len(tokens) * 2, dtype=np.float32).reshape(-1, 2)
        if draw(st.booleans()):
            prompt = None
    if draw(st.booleans()):
        kwargs["sampling_params"] = FakeParams(max_tokens=draw(st.integers(1, 9)))
    request = Request("req", prompt, **kwargs)
    for chunk in draw(st.lists(st.lists(st.integers(0, 100), min_size=1, max_size=3),
                               max_size=3)):
        request.append_output_token_ids(chunk if len(chunk) > 1 else chunk[0])
    if draw(st.booleans()):
        request.status = draw(st.sampled_from(list(RequestStatus)))
    return request


def _hasher_that(behaviour: str) -> Callable[[Any], Any]:
    def block_hasher(request: Any) -> Any:
        if behaviour == "fails":
            raise HalfwayError("the block hasher failed halfway")
        return {"returns None": None, "returns [None]": [None], "returns 'abc'": "abc",
                "returns a tuple": (b"h",)}[behaviour]
    return block_hasher


@st.composite
def request_bad_calls(draw: st.DrawFn, request: Request) -> BadCall:
    operation = draw(st.sampled_from(sorted(_REQUEST_CALLS)))
    call: BadCall = draw(_REQUEST_CALLS[operation](request))
    return BadCall(call.describe, call.run, call.bad, call.named, call.propagates, call.accepted,
                   operation)


@st.composite
def _append(draw: st.DrawFn, request: Request) -> BadCall:
    kind = draw(st.sampled_from(["bad tokens", "bad tokens", "hasher", "accepted"]))
    if kind == "hasher":
        behaviour = draw(st.sampled_from(["fails", "returns None", "returns [None]",
                                          "returns 'abc'", "returns a tuple"]))
        request._block_hasher = _hasher_that(behaviour)  # the subject's set-up
        tokens = draw(st.lists(st.integers(0, 9), min_size=1, max_size=3))
        return _call(f"request.append_output_token_ids({tokens}) with a block hasher that "
                     f"{behaviour}",
                     lambda r: r.append_output_token_ids(tokens),
                     named=(behaviour.split(" ", 1)[-1].replace("a tuple", "(b'h',)"),),
                     propagates=HalfwayError if behaviour == "fails" else None)
    if kind == "accepted":
        bad, reason = draw(st.sampled_from([(_b([True]), BOOL_TOKENS),
                                            (_b([-3, 2**70]), ANY_INT_TOKEN)]))
        return _call(f"request.append_output_token_ids({bad.label})",
                     lambda r: r.append_output_token_ids(bad.value), bad, accepted=reason)
    bad = draw(st.sampled_from([b for b in BAD_TOKEN_LISTS if type(b.value) is not int] + [
        _b(3.0), _b(True), _b(np.int64(3), "np.int64(3)", "3"),
        _b((x for x in [1]), "a generator", "generator"),
        _b(request.all_token_ids, "its own token list", "["),
    ]))
    if bad.label == "its own token list":
        return _call("request.append_output_token_ids(request.all_token_ids)",
                     lambda r: r.append_output_token_ids(r.all_token_ids),
                     accepted="a list of ints, even the request's own: the tokens are read "
                              "before the list grows")
    return _call(f"request.append_output_token_ids({bad.label})",
                 lambda r: r.append_output_token_ids(bad.value), bad)


@st.composite
def _get_num_encoder_embeds(draw: st.DrawFn, request: Request) -> BadCall:
    count = len(request.mm_features)
    bad = draw(bad_int(0, count - 1) if count else st.one_of(not_an_int(),
                                                              st.integers(-3, 3).map(_b)))
    return _call(f"request.get_num_encoder_embeds({bad.label})",
                 lambda r: r.get_num_encoder_embeds(bad.value), bad,
                 accepted=_numpy_integer(bad, lambda v: 0 <= v < count))


@st.composite
def _computed_fields(draw: st.DrawFn, request: Request) -> BadCall:
    name = draw(st.sampled_from(["num_tokens", "num_tokens_with_spec", "num_output_tokens",
                                 "num_encoder_inputs", "has_encoder_inputs"]))
    bad = draw(st.sampled_from([_b(0), _b(99), _b(None), _b(True)]))
    return _call(f"request.{name} = {bad.label}", lambda r: setattr(r, name, bad.value), bad)


@st.composite
def _token_lists(draw: st.DrawFn, request: Request) -> BadCall:
    """The request's own token lists refuse every mutation (they change only through it)."""
    which = draw(st.sampled_from(["all_token_ids", "output_token_ids"]))
    mutation = draw(st.sampled_from([
        ("append(7)", lambda t: t.append(7)), ("extend([7])", lambda t: t.extend([7])),
        ("insert(0, 7)", lambda t: t.insert(0, 7)), ("pop()", lambda t: t.pop()),
        ("remove(7)", lambda t: t.remove(7)), ("clear()", lambda t: t.clear()),
        ("sort()", lambda t: t.sort()), ("reverse()", lambda t: t.reverse()),
        ("[0] = 7", lambda t: t.__setitem__(0, 7)), ("del [0]", lambda t: t.__delitem__(0)),
        ("+= [7]", lambda t: t.__iadd__([7])), ("*= 2", lambda t: t.__imul__(2)),
    ]))
    text, mutate = mutation
    return _call(f"request.{which}.{text}", lambda r: mutate(getattr(r, which)),
                 named=("read-only",))


@st.composite
def _status(draw: st.DrawFn, request: Request) -> BadCall:
    bad = draw(st.sampled_from([_b(None), _b("RUNNING"), _b(3), _b(Opaque())]))
    return _call(f"RequestStatus.is_finished({bad.label})",
                 lambda r: RequestStatus.is_finished(bad.value), bad)


_REQUEST_CALLS: dict[str, Any] = {
    "append_output_token_ids": _append,
    "get_num_encoder_embeds": _get_num_encoder_embeds,
    "computed fields": _computed_fields,
    "token lists": _token_lists,
    "RequestStatus.is_finished": _status,
}


@given(st.data())
def test_request_refuses_bad_calls_and_changes_nothing(data: st.DataObject) -> None:
    request = data.draw(requests())
    check(request, request_snapshot, data.draw(request_bad_calls(request)))


# ---------------------------------------------------------------------- constructors


def _constructor_bad(draw: Draw, which: str) -> tuple[Bad, dict[str, Any], str]:
    """A bad value for one Request argument, the arguments around it, and an acceptance
    reason when the value is accepted on purpose."""
    kwargs: dict[str, Any] = {"request_id": "r", "prompt_token_ids": [1, 2, 3]}
    accepted = ""
    if which == "request_id":
        bad = draw(st.sampled_from([_b(None), _b(5), _b(b"r"), _b(Opaque())]))
    elif which == "prompt_token_ids":
        bad = draw(st.sampled_from([b for b in BAD_TOKEN_LISTS if b.value is not None]
                                   + [_b(None, "None (and no prompt_embeds)", "'r'")]))
    elif which == "prompt_embeds":
        bad = draw(st.sampled_from([
            _b([[0.5]] * 3, "a list of rows", "[[0.5]"), _b("abc"), _b(Opaque()),
            _b(np.zeros((4, 2)), "4 rows for 3 tokens", "4"),
            _b(np.array([object()] * 3, dtype=object), "an object array", "array("),
            _b(np.float32(1.0), "a numpy scalar", "1.0"),
        ]))
    elif which == "mm_features":
        bad = draw(st.sampled_from([
            _b("features"), _b([Opaque()], "[Opaque()]", "Opaque()"),
            _b([_feature("b", 2, 1), _feature("a", 0, 1)], "unsorted", "'a'"),
            _b([_feature("a", 0, 3), _feature("b", 1, 1)], "overlapping", "'b'"),
            _b([_RawFeature("a", -1, 1)], "a negative offset", "offset=-1"),
            _b([_RawFeature(3, 0, 1)], "an int identifier", "identifier=3"),
        ]))
    elif which == "lora_request":
        bad = draw(st.sampled_from([_b(Opaque()), _b("adapter"), _b(_NamedLora(5), None,
                                                                    "lora_name=5")]))
    elif which == "cache_salt":
        bad = draw(st.sampled_from([_b(5), _b(b"salt"), _b(["salt"]), _b(Opaque())]))
    elif which in ("eos_token_id", "priority"):
        bad = draw(not_an_int().filter(lambda b: b.value is not None))
        accepted = _numpy_integer(bad)
    elif which == "client_index":
        bad = draw(bad_int(0))
        accepted = _numpy_integer(bad, lambda v: v >= 0)
    elif which == "arrival_time":
        bad = draw(st.sampled_from([_b("now"), _b(float("nan"), "nan", "nan"), _b([1.0]),
                                    _b(True)]))
    elif which == "trace_headers":
        bad = draw(st.sampled_from([_b("headers"), _b([("a", "b")]), _b(3)]))
    elif which in ("sampling_params", "pooling_params"):
        bad_field = draw(st.sampled_from(["max_tokens", "skip_reading_prefix_cache"]))
        value = draw(st.sampled_from([0, "9", 1.5] if bad_field == "max_tokens" else
                                     ["yes", 1, 0.0]))
        bad = Bad(FakeParams(**{bad_field: value}), f"<{bad_field}={value!r}>", (repr(value),))
    else:  # block_hasher
        bad = draw(st.sampled_from([
            _b(3), _b("sha256"),
            _b(_hasher_that("returns None"), "<returns None>", "None"),
            _b(_hasher_that("returns [None]"), "<returns [None]>", "[None]"),
            _b(_hasher_that("returns a tuple"), "<returns a tuple>", "(b'h',)"),
            _b(_hasher_that("fails"), "<fails>", "halfway"),
        ]))
    kwargs[which] = bad.value
    if which == "prompt_token_ids" and bad.value is None:
        kwargs["prompt_embeds"] = None
    return bad, kwargs, accepted


@given(st.data())
def test_request_constructor_refuses_bad_arguments(data: st.DataObject) -> None:
    which = data.draw(st.sampled_from([
        "request_id", "prompt_token_ids", "prompt_embeds", "mm_features", "lora_request",
        "cache_salt", "eos_token_id", "priority", "client_index", "arrival_time",
        "trace_headers", "sampling_params", "pooling_params", "block_hasher"]))
    bad, kwargs, accepted = _constructor_bad(data.draw, which)
    fails = bad.label == "<fails>"
    check(None, hashing_state, _call(f"Request({which}={bad.label})",
                                     lambda _: Request(**kwargs), bad, accepted=accepted,
                                     propagates=HalfwayError if fails else None,
                                     operation=which))


@given(st.data())
def test_request_constructor_accepts_what_vllm_callers_pass(data: st.DataObject) -> None:
    """The acceptances of docs/hostile-input.md: each is a value vLLM's callers pass."""
    bad, reason = data.draw(st.sampled_from([
        (_b([True, 2]), BOOL_TOKENS), (_b([-1, 2**70]), ANY_INT_TOKEN),
        (_b([], "an empty prompt"), "vLLM's own tests build requests with an empty prompt "
                                     "(test_allocate_with_lookahead); its engine refuses one "
                                     "before the scheduler"),
        (_b([_feature("img", 2, 9)], "a feature past the prompt"),
         "a feature reaching past the prompt: the walk keys it into the blocks it overlaps, "
         "generated tokens included, as vLLM 0.13 does (spec.hashing models it)"),
    ]))
    kwargs: dict[str, Any] = {"request_id": "r", "prompt_token_ids": [1, 2, 3, 4]}
    if bad.label == "a feature past the prompt":
        kwargs["mm_features"] = bad.value
    else:
        kwargs["prompt_token_ids"] = bad.value
    check(None, hashing_state, _call(f"Request(<{bad.label}>)", lambda _: Request(**kwargs),
                                     bad, accepted=reason))


@given(st.data())
def test_value_classes_refuse_bad_fields(data: st.DataObject) -> None:
    which = data.draw(st.sampled_from(["LoRARequest", "PlaceholderRange",
                                       "MultiModalFeatureSpec", "assignment"]))
    if which == "LoRARequest":
        field_name = data.draw(st.sampled_from(["lora_name", "lora_int_id", "lora_path"]))
        args: dict[str, Any] = {"lora_name": "a", "lora_int_id": 1, "lora_path": "/p"}
        bad = data.draw(bad_positive() if field_name == "lora_int_id" else
                        st.sampled_from([_b(None), _b(5), _b(b"a"), _b(Opaque())]))
        args[field_name] = bad.value
        call = _call(f"LoRARequest({field_name}={bad.label})", lambda _: LoRARequest(**args), bad)
    elif which == "PlaceholderRange":
        field_name = data.draw(st.sampled_from(["offset", "length"]))
        bad = data.draw(bad_int(0))
        position = {"offset": 0, "length": 1, field_name: bad.value}
        call = _call(f"PlaceholderRange({field_name}={bad.label})",
                     lambda _: PlaceholderRange(**position), bad)
    elif which == "MultiModalFeatureSpec":
        field_name = data.draw(st.sampled_from(["modality", "identifier", "mm_position"]))
        fields: dict[str, Any] = {"data": None, "modality": "image", "identifier": "i",
                                  "mm_position": PlaceholderRange(0, 1)}
        bad = data.draw(st.sampled_from([_b(None), _b(5), _b(Opaque()), _b((0, 1))]))
        fields[field_name] = bad.value
        call = _call(f"MultiModalFeatureSpec({field_name}={bad.label})",
                     lambda _: MultiModalFeatureSpec(**fields), bad)
    else:
        value: Any = data.draw(st.sampled_from([LoRARequest("a", 1), PlaceholderRange(0, 1),
                                                _feature("i", 0, 1)]))
        field_name = data.draw(st.sampled_from(sorted(type(value).__dataclass_fields__)))
        deleting = data.draw(st.booleans())
        run: Callable[[Any], object] = ((lambda v: delattr(v, field_name)) if deleting
                                        else (lambda v: setattr(v, field_name, "x")))
        call = _call(f"{type(value).__name__}.{field_name} {'deleted' if deleting else '= x'}",
                     run, named=(field_name,))
        check(value, repr, call)
        return
    check(None, hashing_state, call)


# ---------------------------------------------------------------------- the coarse view


@dataclass
class ViewSubject:
    fine: list[Any]
    view: Any


@st.composite
def views(draw: st.DrawFn) -> ViewSubject:
    hash_size = draw(st.integers(1, 3))
    scale = draw(st.integers(1, 3))
    fine: list[Any] = [bytes([i]) * 4 for i in range(draw(st.integers(0, 8)))]
    return ViewSubject(fine, hashing.BlockHashListWithBlockSize(fine, hash_size,
                                                                hash_size * scale))


@st.composite
def view_bad_calls(draw: st.DrawFn, subject: ViewSubject) -> BadCall:
    length = len(subject.view)
    which = draw(st.sampled_from(["index", "index", "slice", "constructor", "bad fine hash"]))
    if which == "index":
        bad = draw(st.one_of(bad_int(-length, length - 1), st.sampled_from([_b("0"), _b(None),
                                                                            _b(1.0)])))
        return _call(f"view[{bad.label}]", lambda s: s.view[bad.value], bad, operation="[]")
    if which == "slice":
        bad = draw(st.sampled_from([_b("a"), _b(1.5), _b(Opaque())]))
        return _call(f"view[{bad.label}:]", lambda s: s.view[bad.value:], bad, operation="[:]")
    if which == "bad fine hash":
        bad = draw(not_bytes())
        subject.fine.insert(0, bad.value)  # the caller's list, changed after the view was made
        if not len(subject.view):  # shorter than one coarse block: index 0 is out of range
            return _call("view[0] over a list shorter than the scale", lambda s: s.view[0],
                         named=("index 0",), operation="[] over a bad fine hash")
        return _call(f"view[0] over [{bad.label}, ...]", lambda s: s.view[0], bad,
                     operation="[] over a bad fine hash")
    arg = draw(st.sampled_from(["block_hashes", "hash_block_size", "target_block_size",
                                "not a multiple"]))
    args: list[Any] = [subject.fine, 2, 4]
    accepted = ""
    if arg == "block_hashes":
        bad = draw(st.sampled_from([_b(None), _b((b"a",)), _b(b"ab"), _b(Opaque())]))
        args[0] = bad.value
    elif arg == "not a multiple":
        args[1:] = [4, 6]
        bad = _b(6)
    else:
        bad = draw(bad_positive(hashing.MAX_BLOCK_SIZE))
        args[1 if arg == "hash_block_size" else 2] = bad.value
        sizes = [int(v) if isinstance(v, np.integer) else v for v in args[1:]]
        accepted = _numpy_integer(bad, lambda v: 0 < v <= hashing.MAX_BLOCK_SIZE
                                  and sizes[1] % sizes[0] == 0)
    return _call(f"BlockHashListWithBlockSize(<{arg}: {bad.label}>)",
                 lambda _: hashing.BlockHashListWithBlockSize(*args), bad, operation="constructor",
                 accepted=accepted)


@given(st.data())
def test_coarse_view_refuses_bad_calls_and_changes_nothing(data: st.DataObject) -> None:
    subject = data.draw(views())
    check(subject, lambda s: tuple(s.fine), data.draw(view_bad_calls(subject)))


@pytest.mark.parametrize("size", [2**31, 2**32, 2**64, np.uint64(2**63)])
def test_block_sizes_past_the_bound_are_refused(size: Any) -> None:
    """A block size past ``MAX_BLOCK_SIZE`` (2**31 - 1: no KV-cache block of vLLM's worker is
    longer) is refused by the request block hasher and the coarse view, naming it."""
    bad = _b(size, repr(size), str(int(size)))
    calls = [
        _call(f"get_request_block_hasher({size!r}, sha256)",
              lambda _: hashing.get_request_block_hasher(size, hashing.sha256), bad),
        _call(f"BlockHashListWithBlockSize([], 1, {size!r})",
              lambda _: hashing.BlockHashListWithBlockSize([], 1, size), bad),
        _call(f"BlockHashListWithBlockSize([], {size!r}, {size!r})",
              lambda _: hashing.BlockHashListWithBlockSize([], size, size), bad),
    ]
    for call in calls:
        verdict, detail = judge(None, lambda _: None, call)
        if verdict not in ALLOWED or verdict.name != "REFUSED":
            raise AssertionError(f"{call.describe}\n  {verdict.value}\n  {detail}")


def test_numpy_block_sizes_are_taken_as_ints() -> None:
    """impl's one integer rule: a numpy integer block size is taken, as the plain int."""
    request = Request("r", [1, 2, 3, 4, 5],
                      block_hasher=hashing.get_request_block_hasher(np.int64(2), hashing.sha256))
    reference = Request("r", [1, 2, 3, 4, 5],
                        block_hasher=hashing.get_request_block_hasher(2, hashing.sha256))
    assert request.block_hashes == reference.block_hashes and len(request.block_hashes) == 2
    view = hashing.BlockHashListWithBlockSize(list(request.block_hashes), np.int32(1),
                                              np.uint8(2))
    assert type(view.hash_block_size) is int and type(view.target_block_size) is int
    assert view[0] == b"".join(request.block_hashes)


def test_constant_list_is_a_list() -> None:
    """A request's token list reads as a plain list (vLLM's callers index and slice it)."""
    tokens = ConstantList([1, 2, 3])
    assert tokens[1:] == [2, 3] and isinstance(tokens, list)
