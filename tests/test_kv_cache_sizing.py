"""vLLM 0.13's sizing arithmetic over any spec type (impl/kv_cache_sizing.py), worked by hand on
plain values: page-size unification, the grouping of layers, tensor sharing, blocks per budget
and per request, the longest request that fits and concurrency. The same arithmetic through
vLLM's planning functions and impl's specs: tests/test_kv_cache_planning.py.
"""

from __future__ import annotations

import pytest

from kvspec.impl.kv_cache_sizing import (
    InvalidPlanArgument,
    PageSizeNotUnifiable,
    longest_fitting,
    max_concurrency,
    num_blocks_for,
    request_blocks,
    split_into_groups,
    tensor_sharing,
    unify_page_sizes,
)

# A spec here is (kind, block size, bytes per token): its page is block size x bytes per token.
Spec = tuple[str, int, int]


def page(spec: Spec) -> int:
    return spec[1] * spec[2]


def grown(spec: Spec, ratio: int) -> Spec:
    return (spec[0], spec[1] * ratio, spec[2])


def test_unify_grows_smaller_pages_by_a_whole_block_multiple() -> None:
    big, small = ("full", 16, 8), ("window", 16, 2)
    named = [("a", big), ("b", small), ("c", small)]
    assert unify_page_sizes(named, page, grown) == [
        ("a", big), ("b", ("window", 64, 2)), ("c", ("window", 64, 2))]
    same = [("a", big), ("b", ("window", 32, 4))]
    unified = unify_page_sizes(same, page, grown)
    assert unified == same and unified[1][1] is same[1][1]  # kept, the same objects
    with pytest.raises(PageSizeNotUnifiable, match="layer 'b' has a 48-byte page"):
        unify_page_sizes([("a", ("full", 16, 8)), ("b", ("window", 16, 3))], page, grown)
    # A page that does not grow with its block size (a Mamba state) cannot be unified.
    with pytest.raises(PageSizeNotUnifiable, match="layer 'm'"):
        unify_page_sizes([("a", big), ("m", ("mamba", 1, 32))], page, lambda spec, ratio: spec)


def test_groups_take_every_kth_layer_of_a_bucket() -> None:
    # 12 sliding and 13 full layers: 13 < 1.25 x 12, so groups of 13, one padding slot.
    named = [(f"s{i}", "sliding") for i in range(12)] + [(f"f{i}", "full") for i in range(13)]
    assert split_into_groups(named) == [("sliding", [[f"s{i}" for i in range(12)]]),
                                        ("full", [[f"f{i}" for i in range(13)]])]
    # 2 full and 5 sliding: groups of 2, the sliding bucket cut into 3, strided.
    named = [("f0", "full"), ("f1", "full")] + [(f"s{i}", "sliding") for i in range(5)]
    assert split_into_groups(named) == [("full", [["f0", "f1"]]),
                                        ("sliding", [["s0", "s3"], ["s1", "s4"], ["s2"]])]
    assert split_into_groups([]) == []


def test_tensor_i_holds_layer_i_of_every_group() -> None:
    assert tensor_sharing([["a0", "a1"], ["b0", "b1"], ["c0"]]) == [["a0", "b0", "c0"],
                                                                    ["a1", "b1"]]
    assert tensor_sharing([]) == []


def test_blocks_a_budget_holds() -> None:
    assert num_blocks_for(10 * 64 * 3 + 63, 64, 3) == 10
    assert num_blocks_for(-5, 64, 3) == 0
    with pytest.raises(InvalidPlanArgument, match="page size"):
        num_blocks_for(100, 0, 1)


@pytest.mark.parametrize(("kind", "options", "expected"), [
    ("full", {}, 7),  # cdiv(100, 16)
    ("mla", {}, 7),
    ("mamba", {}, 7),
    ("sliding_window", {"sliding_window": 10}, 3),  # cdiv(min(10 - 1 + 8, 100), 16) + 1
    ("chunked_local", {"attention_chunk_size": 32}, 3),  # cdiv(min(32 + 8, 100), 16)
    ("cross_attention", {}, 2),  # cdiv(20 encoder tokens, 16)
    ("encoder_only", {}, 0),
])
def test_blocks_one_request_holds_at_its_peak(kind: str, options: dict[str, int],
                                              expected: int) -> None:
    assert request_blocks(kind, 16, 100, max_num_batched_tokens=8, num_encoder_tokens=20,
                          **options) == expected


def test_a_kind_without_its_size_is_refused() -> None:
    with pytest.raises(InvalidPlanArgument, match="'sliding_window'"):
        request_blocks("sliding_window", 16, 100, max_num_batched_tokens=8, num_encoder_tokens=0)
    with pytest.raises(InvalidPlanArgument, match="'linear'"):
        request_blocks("linear", 16, 100, max_num_batched_tokens=8, num_encoder_tokens=0)


def test_longest_fitting_and_concurrency() -> None:
    assert longest_fitting(lambda n: n <= 1000, 4096) == 1000
    assert longest_fitting(lambda n: True, 4096) == 4096
    assert longest_fitting(lambda n: False, 4096) == 0
    assert max_concurrency(30, 8) == 3.75
    with pytest.raises(InvalidPlanArgument, match="holds 0 blocks"):
        max_concurrency(30, 0)
