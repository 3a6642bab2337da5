"""The Request the KV-cache manager reads: token bookkeeping, block hashes, bad input."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, strategies as st

import kvspec.impl.hashing as hashing
from kvspec.impl.request import (
    ConstantList,
    InvalidRequestError,
    LoRARequest,
    MultiModalFeatureSpec,
    PlaceholderRange,
    ReadOnlyListError,
    Request,
    RequestStatus,
)


def hasher(block_size: int = 4) -> Any:
    return hashing.get_request_block_hasher(block_size, hashing.sha256)


def snapshot(request: Request) -> tuple[Any, ...]:
    return (list(request.all_token_ids), list(request.output_token_ids),
            list(request.block_hashes), request.num_tokens, request.num_output_tokens)


def test_defaults_and_counts() -> None:
    request = Request("r1", [1, 2, 3, 4, 5], eos_token_id=2, arrival_time=12.5)
    assert request.request_id == "r1"
    assert request.prompt_token_ids == [1, 2, 3, 4, 5]
    assert request.all_token_ids == [1, 2, 3, 4, 5]
    assert (request.num_tokens, request.num_prompt_tokens, request.num_output_tokens) == (5, 5, 0)
    assert request.num_computed_tokens == 0
    assert request.num_preemptions == 0
    assert request.block_hashes == []
    assert request.status is RequestStatus.WAITING and not request.is_finished()
    assert request.arrival_time == 12.5
    assert request.eos_token_id == 2
    assert request.lora_request is None and request.cache_salt is None
    assert request.mm_features == [] and not request.has_encoder_inputs
    assert request.skip_reading_prefix_cache is False
    assert request.num_tokens_with_spec == 5


def test_prompt_list_is_copied() -> None:
    prompt = [1, 2, 3]
    request = Request("r", prompt)
    prompt.append(4)
    assert request.num_tokens == 3


def test_append_int_and_list() -> None:
    request = Request("r", [1, 2, 3], block_hasher=hasher(4))
    assert request.block_hashes == []
    request.append_output_token_ids(4)
    assert len(request.block_hashes) == 1
    request.append_output_token_ids([5, 6, 7, 8, 9])
    assert request.output_token_ids == [4, 5, 6, 7, 8, 9]
    assert request.all_token_ids == list(range(1, 10))
    assert (request.num_tokens, request.num_output_tokens, request.num_prompt_tokens) == (9, 6, 3)
    assert len(request.block_hashes) == 2
    expected = hasher(4)(Request("fresh", list(range(1, 10))))
    assert request.block_hashes == expected


@given(
    prompt=st.lists(st.integers(0, 50_000), max_size=12),
    chunks=st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=5), max_size=6),
    block_size=st.integers(1, 4),
)
def test_block_hashes_always_cover_the_full_blocks(prompt: list[int], chunks: list[list[int]],
                                                    block_size: int) -> None:
    request = Request("r", prompt, block_hasher=hasher(block_size))
    for chunk in chunks:
        request.append_output_token_ids(chunk if len(chunk) > 1 else chunk[0])
        assert len(request.block_hashes) == request.num_tokens // block_size
    scratch = Request("s", list(request.all_token_ids), block_hasher=hasher(block_size))
    assert request.block_hashes == scratch.block_hashes
    event(f"blocks: {min(len(scratch.block_hashes), 5)}")


def test_token_lists_are_read_only() -> None:
    request = Request("r", [1, 2])
    mutations: list[Callable[[], object]] = [
        lambda: request.all_token_ids.append(3),
        lambda: request.all_token_ids.extend([3]),
        lambda: request.output_token_ids.insert(0, 3),
        lambda: request.all_token_ids.pop(),
        lambda: request.all_token_ids.remove(1),
        lambda: request.all_token_ids.clear(),
        lambda: request.all_token_ids.sort(),
        lambda: request.all_token_ids.reverse(),
        lambda: request.all_token_ids.__setitem__(0, 9),
        lambda: request.all_token_ids.__delitem__(0),
        lambda: request.all_token_ids.__iadd__([1]),
        lambda: request.all_token_ids.__imul__(2),
    ]
    for mutate in mutations:
        with pytest.raises(ReadOnlyListError):
            mutate()
    assert request.all_token_ids == [1, 2]
    assert issubclass(ReadOnlyListError, ValueError) and issubclass(ReadOnlyListError, TypeError)
    assert isinstance(request.all_token_ids, ConstantList)
    assert request.all_token_ids[0:1] == [1]


@pytest.mark.parametrize("bad", [[1.0], ["a"], [None], (x for x in [1]), "12", 3.0, None,
                                 [True, 1.5], [1, np.int64(2)], [1, 2, b"x"], [[1]]])
def test_bad_appended_tokens_change_nothing(bad: Any) -> None:
    request = Request("r", [1, 2, 3], block_hasher=hasher(2))
    before = snapshot(request)
    with pytest.raises(InvalidRequestError):
        request.append_output_token_ids(bad)
    assert snapshot(request) == before


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"request_id": 5, "prompt_token_ids": [1]}, "5"),
        ({"request_id": "r", "prompt_token_ids": None}, "'r'"),
        ({"request_id": "r", "prompt_token_ids": [1, "x"]}, "'x'"),
        ({"request_id": "r", "prompt_token_ids": "abc"}, "'abc'"),
        ({"request_id": "r", "prompt_token_ids": [1], "block_hasher": 3}, "3"),
    ],
)
def test_bad_construction_is_refused(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        Request(**kwargs)


def test_unsorted_or_negative_mm_features_are_refused() -> None:
    a = MultiModalFeatureSpec(None, "image", "a", PlaceholderRange(5, 2))
    b = MultiModalFeatureSpec(None, "image", "b", PlaceholderRange(1, 2))
    with pytest.raises(InvalidRequestError, match="sorted"):
        Request("r", list(range(10)), mm_features=[a, b])
    with pytest.raises(InvalidRequestError, match="-1"):
        PlaceholderRange(-1, 2)
    request = Request("r", list(range(10)), mm_features=[b, a])
    assert request.num_encoder_inputs == 2 and request.get_num_encoder_embeds(1) == 2
    with pytest.raises(IndexError):
        request.get_num_encoder_embeds(2)


def test_prompt_embeds_only() -> None:
    embeds = np.zeros((6, 3), dtype=np.float32)
    request = Request("r", None, prompt_embeds=embeds, block_hasher=hasher(4))
    assert request.num_prompt_tokens == 6
    assert request.all_token_ids == [0] * 6
    assert len(request.block_hashes) == 1


@dataclass
class SamplingParams:
    max_tokens: int = 9
    skip_reading_prefix_cache: bool | None = True


def test_lora_request_and_params() -> None:
    lora = LoRARequest("adapter", 7, "/path")
    assert lora.adapter_id == 7 and lora.lora_name == "adapter"
    with pytest.raises(AttributeError):
        lora.lora_name = "other"  # type: ignore[misc]

    request = Request("r", [1], sampling_params=SamplingParams(), lora_request=lora)
    assert request.max_tokens == 9 and request.skip_reading_prefix_cache is True
    pooling = Request("p", [1], pooling_params=object())
    assert pooling.max_tokens == 1


def test_status_order_and_repr() -> None:
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    assert all(RequestStatus.is_finished(s) for s in RequestStatus if s.name.startswith("FIN"))
    request = Request("r", [1, 2])
    request.status = RequestStatus.FINISHED_ABORTED
    assert request.is_finished()
    assert "'r'" in repr(request)


def test_deepcopy_keeps_tokens_and_hashes() -> None:
    request = Request("r", [1, 2, 3, 4], block_hasher=hasher(2))
    clone = copy.deepcopy(request)
    assert clone.all_token_ids == request.all_token_ids
    assert clone.block_hashes == request.block_hashes
    clone.append_output_token_ids(5)
    assert request.num_tokens == 4
    assert clone.all_token_ids == [1, 2, 3, 4, 5] and clone.output_token_ids == [5]
    assert len(clone.block_hashes) == 2


def test_token_list_pickles_and_copies() -> None:
    tokens = ConstantList([1, 2, 3])
    for clone in (pickle.loads(pickle.dumps(tokens)), copy.copy(tokens), copy.deepcopy(tokens)):
        assert type(clone) is ConstantList and clone == [1, 2, 3]
