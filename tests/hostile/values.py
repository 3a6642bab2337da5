"""Bad values shared by the hostile-input components, as Hypothesis strategies of ``Bad``.

Each ``Bad`` carries a stable label for the counterexample (a bare ``object()`` would print
its address, and the two builds' runs are compared by label) and the forms in which an error
message may name it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

__all__ = [
    "Bad",
    "HalfwayError",
    "Opaque",
    "bad_count",
    "bad_int",
    "bad_positive",
    "halfway",
    "huge_int",
    "negative_int",
    "not_a_bool",
    "not_an_int",
    "not_bytes",
    "not_iterable",
]


class Opaque:
    """An object of no type impl knows, with a stable repr."""

    def __repr__(self) -> str:
        return "Opaque()"

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)


@dataclass(frozen=True)
class Bad:
    value: Any
    label: str
    named: tuple[str, ...] = ()

    @property
    def forms(self) -> tuple[str, ...]:
        """What naming it in a message may look like."""
        return self.named or (repr(self.value), str(self.value))


class HalfwayError(RuntimeError):
    """Raised by ``halfway``'s iterator: the caller's own failure, not impl's."""


def halfway(items: list[Any]) -> Iterator[Any]:
    """An iterator that yields ``items`` and then fails: an argument that breaks while impl
    reads it (a generator over a closed stream). impl must read it whole before changing
    anything, so the failure leaves no trace."""
    yield from items
    raise HalfwayError(f"the caller's iterator failed after {len(items)} items")


def _bad(value: Any, label: str | None = None, *named: str) -> Bad:
    return Bad(value, label if label is not None else repr(value), tuple(named))


# Values of the wrong type for an int parameter. impl's one rule for integers
# (impl/checks.py, docs/hostile-input.md): an int or a numpy integer scalar (np.int64(3) is
# a good int, taken as 3), never a bool, a float (numpy's included) or anything else.
_NOT_INTS = [
    _bad(None), _bad("3"), _bad(3.0), _bad(2.5), _bad(float("nan"), "nan", "nan"),
    _bad(float("inf"), "inf", "inf"), _bad([1]), _bad((1,)), _bad(b"1"), _bad(True),
    _bad(Opaque()),
    _bad(np.float32(1.5), "np.float32(1.5)", "np.float32(1.5)", "1.5"), _bad(1 + 0j),
]


def not_an_int() -> st.SearchStrategy[Bad]:
    return st.sampled_from(_NOT_INTS)


def negative_int() -> st.SearchStrategy[Bad]:
    return st.integers(min_value=-(2**65), max_value=-1).map(_bad)


def huge_int() -> st.SearchStrategy[Bad]:
    return st.sampled_from([2**31, 2**32, 2**63, 2**64, 2**100]).map(_bad)


def bad_int(low: int, high: int | None = None) -> st.SearchStrategy[Bad]:
    """Anything but an int in ``[low, high]`` (``high`` None: no upper bound)."""
    below = st.integers(max_value=low - 1, min_value=min(low - 1, -(2**65))).map(_bad)
    parts = [not_an_int(), below]
    if high is not None:
        parts += [st.integers(min_value=high + 1, max_value=max(high + 1, 2**65)).map(_bad),
                  huge_int().filter(lambda b: b.value > high)]
    return st.one_of(parts)


def bad_count(high: int | None = None) -> st.SearchStrategy[Bad]:
    """Not a count in ``[0, high]``."""
    return bad_int(0, high)


def bad_positive(high: int | None = None) -> st.SearchStrategy[Bad]:
    """Not an int in ``[1, high]``."""
    return bad_int(1, high)


def not_bytes() -> st.SearchStrategy[Bad]:
    return st.sampled_from([
        _bad(None), _bad("abc"), _bad(3), _bad(2.5), _bad([1, 2]), _bad(bytearray(b"ab"),
        "bytearray(b'ab')"), _bad(memoryview(b"ab"), "memoryview(b'ab')", "<memory at"),
        _bad(Opaque()), _bad(True),
    ])


def not_a_bool() -> st.SearchStrategy[Bad]:
    return st.sampled_from([_bad(None), _bad(1), _bad("yes"), _bad(0.0), _bad(Opaque())])


def not_iterable() -> st.SearchStrategy[Bad]:
    return st.sampled_from([_bad(None), _bad(3), _bad(2.5), _bad(Opaque())])
