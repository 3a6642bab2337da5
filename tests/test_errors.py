"""impl's typed errors (impl/errors.py): every one is a ``ValueError`` or a ``LookupError`` (the
four family bases aside, whose every member is one), so a caller catches bad input with the
built-in class it expects, and shows the message it was raised with, the value it names as
written (a ``KeyError``'s own ``str`` would quote it).
"""

from __future__ import annotations

import inspect

import pytest

from kvspec.impl import errors

ERRORS = sorted((cls for cls in vars(errors).values()
                 if inspect.isclass(cls) and issubclass(cls, BaseException)
                 and cls.__module__ == errors.__name__), key=lambda cls: cls.__name__)
# The bases a layer's refusals share, so that a caller may catch all of one layer's.
FAMILIES = (errors.BlockPoolError, errors.KVCacheManagerError, errors.BlockTableError,
            errors.OffloadingError)


def test_the_families_are_bases_only() -> None:
    for family in FAMILIES:
        members = [cls for cls in ERRORS if cls is not family and issubclass(cls, family)]
        assert members, family
        assert not issubclass(family, ValueError | LookupError), family


@pytest.mark.parametrize("cls", [cls for cls in ERRORS if cls not in FAMILIES],
                         ids=lambda cls: cls.__name__)
def test_every_error_is_a_value_or_lookup_error_showing_its_message(
        cls: type[Exception]) -> None:
    assert issubclass(cls, ValueError | LookupError)
    message = "block_size must be an int >= 1, got 'sixteen'"
    raised = (cls(message, 0) if cls is errors.InsufficientKVCacheMemory
              else cls(message))
    assert str(raised) == message


def test_insufficient_memory_keeps_its_figures() -> None:
    raised = errors.InsufficientKVCacheMemory("too small", 1024, 4096, 100)
    assert (raised.available_bytes, raised.needed_bytes, raised.estimated_max_model_len) == (
        1024, 4096, 100)
    bare = errors.InsufficientKVCacheMemory("no memory", 0)
    assert (bare.needed_bytes, bare.estimated_max_model_len) == (None, None)
