"""The argument checks impl's public methods share (impl/checks.py): the integer rule (a Python
or NumPy integer, never a bool or a float), ranges, flags, request ids and hashes read duck-typed,
and the helpers that name a large value in a refusal.
"""

from __future__ import annotations

import enum
from types import SimpleNamespace

import numpy as np
import pytest

from kvspec.impl.checks import (
    MAX_NUM_TOKENS,
    MAX_WORLD_SIZE,
    all_ints,
    as_int,
    block_hashes_of,
    check_count,
    check_flag,
    check_index,
    check_request_id,
    check_world_sizes,
    first_non_int,
    request_id_of,
    shown,
)
from kvspec.impl.errors import InvalidKVCacheConfig, InvalidManagerArgument, InvalidStatsError


class Color(enum.IntEnum):
    RED = 3


@pytest.mark.parametrize(("value", "expected"), [
    (7, 7), (-2, -2), (2**70, 2**70), (np.int8(5), 5), (np.uint64(2**63), 2**63),
    (np.int64(-1), -1), (Color.RED, 3),
])
def test_as_int_takes_python_and_numpy_integers(value: object, expected: int) -> None:
    converted = as_int(value)
    assert converted == expected and type(converted) is int


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, np.float32(2), "3", None,
                                   [1], b"\x01"])
def test_as_int_refuses_bools_floats_and_the_rest(value: object) -> None:
    assert as_int(value) is None


def test_check_count_takes_a_range_and_names_what_it_refuses() -> None:
    assert check_count("n", np.int32(4)) == 4 and type(check_count("n", np.int32(4))) is int
    assert check_count("n", 0) == 0 and check_count("n", MAX_NUM_TOKENS) == MAX_NUM_TOKENS
    assert check_count("n", 5, high=5, low=5) == 5
    with pytest.raises(InvalidManagerArgument, match=r"n must be an int in \[0, 2\*\*63 - 1\], "
                                                     r"got -1"):
        check_count("n", -1)
    with pytest.raises(InvalidManagerArgument, match=r"in \[1, 9\], got 10"):
        check_count("n", 10, high=9, low=1)
    with pytest.raises(InvalidStatsError, match="got True"):
        check_count("n", True, error=InvalidStatsError)


def test_check_flag_and_request_ids() -> None:
    assert check_flag("on", True) is True and check_flag("on", False) is False
    with pytest.raises(InvalidManagerArgument, match="on must be a bool, got 1"):
        check_flag("on", 1)
    assert check_request_id("r-1") == "r-1"
    with pytest.raises(InvalidManagerArgument, match="got 7"):
        check_request_id(7)


def test_a_request_is_read_duck_typed() -> None:
    request = SimpleNamespace(request_id="r", block_hashes=[b"h"])
    assert request_id_of(request) == "r"
    assert block_hashes_of(request) is request.block_hashes
    with pytest.raises(InvalidManagerArgument, match="request_id must be a str, got None"):
        request_id_of(object())
    with pytest.raises(InvalidStatsError, match=r"block_hashes must be a list of bytes, got \(\)"):
        block_hashes_of(SimpleNamespace(block_hashes=()), InvalidStatsError)


def test_check_index_and_world_sizes() -> None:
    assert check_index("block id", np.int16(2), 3, LookupError) == 2
    with pytest.raises(LookupError, match=r"block id 3 is not an int in \[0, 3\)"):
        check_index("block id", 3, 3, LookupError)
    assert check_world_sizes(2, np.int64(1)) == (2, 1)
    with pytest.raises(InvalidKVCacheConfig, match="dcp_world_size"):
        check_world_sizes(0, 1)
    with pytest.raises(InvalidKVCacheConfig, match="pcp_world_size"):
        check_world_sizes(1, MAX_WORLD_SIZE + 1)


def test_large_values_are_named_in_short() -> None:
    assert shown([1, 2]) == "[1, 2]"
    long = shown(list(range(1000)), limit=20)
    assert len(long) == 20 and long.startswith("[0, 1, 2") and long.endswith(" ...]")
    assert all_ints([1, 2, True]) and all_ints(()) and not all_ints([1, 2.0])
    assert not all_ints([1, np.int64(2)]) and not all_ints([1, "2"])
    assert first_non_int([1, 2.5, "x"]) == 2.5
    assert first_non_int([1, 2]) == [1, 2]  # none: the values themselves
