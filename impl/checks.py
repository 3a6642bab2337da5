"""The argument checks that impl's public methods share, in one place.

A public method of impl checks its arguments in one block at its top, with these helpers, and
raises its layer's typed error (impl/errors.py) naming the value, before anything changes.

The rule for integers, the same across impl/ (docs/hostile-input.md): an integer argument is a
Python ``int`` or a NumPy integer scalar (``np.integer``), never a ``bool`` or a float. It is
converted to a plain ``int`` once, in the check block. Public parameters that take integers are
annotated ``SupportsIndex``: mypyc does not check that annotation at the call (it would raise a
bare ``TypeError`` for an ``int`` one), so the method's own check runs in both builds.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Protocol

from kvspec.impl.errors import InvalidKVCacheConfig, InvalidManagerArgument


def as_int(value: object) -> int | None:
    """``value`` as an int when it is an integer (a Python or numpy one, never a bool)."""
    if type(value) is int:
        return value
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return int(value)
    # A NumPy integer exists only once NumPy is imported: looked up, not imported, so that
    # the pool's start-up does not pay for NumPy (impl's block tables import it themselves).
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.integer):
        return int(value)
    return None


# ---------------------------------------- manager stack (kv_cache_manager, kv_cache_coordinator,
# single_type_kv_cache_manager)

# Token counts and positions are int64 on vLLM's worker (positions, slot mappings); world
# sizes are torch.distributed's int32.
MAX_NUM_TOKENS = 2**63 - 1
MAX_WORLD_SIZE = 2**31 - 1


class Flag(Protocol):
    """The annotation of a public ``bool`` parameter. mypy takes a ``bool`` and nothing else
    for it (an int's ``&`` with a bool gives an int, numpy's bool gives ``np.bool_``); mypyc,
    which would refuse anything but a bool with a bare ``TypeError`` at the call, does not
    check a Protocol, so ``check_flag`` in the method's check block refuses it, typed."""

    def __and__(self, other: bool, /) -> bool: ...


class Text(Protocol):
    """The annotation of a public ``str`` parameter (a request id), for the same reason as
    ``Flag``: mypy takes a ``str`` (``casefold`` is str's alone); mypyc does not check it."""

    def casefold(self) -> str: ...


def _bound(value: int) -> str:
    return "2**63 - 1" if value == MAX_NUM_TOKENS else str(value)


def check_count(
    name: str,
    value: object,
    high: int = MAX_NUM_TOKENS,
    low: int = 0,
    error: type[ValueError] = InvalidManagerArgument,
) -> int:
    """``value`` as a plain int if it is an integer (``as_int``) in ``[low, high]``; ``error``
    naming it otherwise."""
    count = value if type(value) is int else as_int(value)
    if count is None or not low <= count <= high:
        raise error(f"{name} must be an int in [{low}, {_bound(high)}], got {value!r}")
    return count


def check_flag(name: str, value: object, error: type[ValueError] = InvalidManagerArgument) -> bool:
    """``value`` if it is a bool; ``error`` naming it otherwise."""
    if type(value) is not bool:
        raise error(f"{name} must be a bool, got {value!r}")
    return value


def check_request_id(request_id: object) -> str:
    """``request_id`` if it is a str."""
    if type(request_id) is not str:
        raise InvalidManagerArgument(f"a request id must be a str, got {request_id!r}")
    return request_id


def request_id_of(request: object, error: type[ValueError] = InvalidManagerArgument) -> str:
    """The id of a request (vLLM's ``Request`` or impl's, read duck-typed): a str."""
    request_id = getattr(request, "request_id", None)
    if type(request_id) is not str:
        raise error(
            f"{request!r} is not a request: its request_id must be a str, got {request_id!r}")
    return request_id


def block_hashes_of(request: object, error: type[ValueError] = InvalidManagerArgument
                    ) -> list[Any]:
    """A request's block hashes: a list (of bytes, checked where they are read)."""
    hashes = getattr(request, "block_hashes", None)
    if type(hashes) is not list:
        raise error(f"{request!r} is not a request: its block_hashes must be a list of bytes, "
                    f"got {hashes!r}")
    return hashes


def check_world_sizes(dcp_world_size: object, pcp_world_size: object,
                      error: type[ValueError] = InvalidKVCacheConfig) -> tuple[int, int]:
    """The two context-parallel world sizes, each an int in [1, MAX_WORLD_SIZE]."""
    return (check_count("dcp_world_size", dcp_world_size, MAX_WORLD_SIZE, 1, error),
            check_count("pcp_world_size", pcp_world_size, MAX_WORLD_SIZE, 1, error))


# ---------------------------------------- hashing and requests (hashing, request), block tables


def shown(value: object, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about large arguments."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]} ...{text[-1]}"


def all_ints(values: Sequence[Any]) -> bool:
    """Whether every element of a list or tuple is an int, at C speed: ``sum`` raises on
    non-numbers, and its result is an ``int`` only if every element is one (a float or a numpy
    scalar anywhere makes it a float or a numpy scalar). bool, an int to Python, passes: it
    pickles and encodes distinctly from 0 and 1 (docs/hostile-input.md)."""
    try:
        return type(sum(values)) is int
    except TypeError:
        return False


def first_non_int(values: Sequence[Any]) -> object:
    """The first element of ``values`` that is not an int (``values`` itself if there is none),
    to name in a refusal."""
    return next((v for v in values if not isinstance(v, int)), values)


# ---------------------------------------- block pool stack (kv_cache_utils, block_pool,
# eviction), metrics and stats


class BlockLike(Protocol):
    """The annotation of a public parameter that takes one block (impl's ``KVCacheBlock``, or
    vLLM's): mypy takes anything with an int ``block_id``; mypyc, which would refuse anything
    but a ``KVCacheBlock`` with a bare ``TypeError`` at the call, does not check a Protocol, so
    the method's check block refuses what is not the block it needs, typed."""

    @property
    def block_id(self) -> int: ...


class HashBytes(Protocol):
    """The annotation of a public block-hash parameter, for the same reason as ``Flag``: mypy
    takes ``bytes`` (and its ``NewType``s ``BlockHash``, ``BlockHashWithGroupId``), whose
    ``decode`` ``str`` lacks; the check block refuses anything but ``bytes``."""

    def decode(self, encoding: str = ..., errors: str = ...) -> str: ...


def check_index(
    name: str, value: object, size: int, error: type[ValueError] | type[LookupError]
) -> int:
    """``value`` as a plain int if it is an integer (``as_int``) in ``[0, size)``; ``error``
    naming it otherwise (a block id of a pool of ``size`` blocks, ...)."""
    index = value if type(value) is int else as_int(value)
    if index is None or not 0 <= index < size:
        raise error(f"{name} {value!r} is not an int in [0, {size})")
    return index
