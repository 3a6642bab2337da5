"""The compiled early exit of the request block hasher (impl/request_hasher.py): it answers
``[]`` itself exactly for the calls that complete no block, hands every other call (malformed
ones included) to the hasher, is shared by a copied request, and is what
``get_request_block_hasher`` builds in the compiled build only. The hasher's own results:
tests/test_hashing.py.
"""

from __future__ import annotations

import copy
from typing import Any

import kvspec.impl.hashing as hashing
from kvspec import impl
from kvspec.impl.request_hasher import EarlyExit, early_exit


def test_early_exit_answers_only_the_calls_that_complete_no_block() -> None:
    """The compiled build's wrapper (impl/request_hasher.py) returns [] itself exactly when
    the request's list of hashes and int token count say no block completes; every other call,
    malformed ones included, goes to the hasher. Checked on the class itself in both builds."""
    seen: list[Any] = []

    def hasher(request: Any) -> list[Any]:
        seen.append(request)
        return ["hashed"]

    class Fake:
        def __init__(self, block_hashes: Any, num_tokens: Any) -> None:
            self.block_hashes, self.num_tokens = block_hashes, num_tokens

    wrapper = EarlyExit(4, hasher)
    assert wrapper(Fake([b"h"], 7)) == [] and not seen  # 1 block hashed, 7 tokens: none new
    assert wrapper(Fake([], 3)) == [] and not seen
    for request in (Fake([b"h"], 8), Fake([], 4), Fake((), 3), Fake([], 3.0), Fake([], True),
                    Fake(None, 3), object()):
        assert wrapper(request) == ["hashed"]
        assert seen.pop() is request
    assert copy.copy(wrapper) is wrapper and copy.deepcopy(wrapper) is wrapper
    built = hashing.get_request_block_hasher(4, hashing.sha256)
    assert isinstance(built, EarlyExit) == impl.COMPILED
    assert (early_exit(4, hasher) is hasher) == (not impl.COMPILED)
