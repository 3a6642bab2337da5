"""The request block hasher's most frequent call, compiled: the one that completes no block.

vLLM's ``Request`` calls its block hasher after every token it appends, so with blocks of 16
tokens 15 calls in 16 complete no block and return ``[]``, decided from ``num_tokens`` and
the number of hashes alone. In Python that decision costs a function frame, and kvspec's type
checks cost more than vLLM's code, which has none. This module is compiled with mypyc (impl's
``COMPILED_MODULES``): ``early_exit`` wraps the hasher of impl/hashing.py in a compiled
closure that makes that decision in C, with the same checks, and hands every other call to
the hasher unchanged, which reads and checks the request again. In the pure-Python build the
wrapper would only add a frame, so ``early_exit`` returns the hasher itself. Either way the
results and refusals are the hasher's own.

It imports nothing from impl/: hashing imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["EarlyExit", "early_exit"]

# True in the compiled build: a compiled module's file is its extension, not a .py/.pyc.
_COMPILED = not __file__.endswith((".py", ".pyc"))


def early_exit(size: int, hasher: Callable[[Any], list[Any]]) -> Callable[[Any], list[Any]]:
    """``hasher`` (blocks of ``size`` tokens), answering ``[]`` itself, compiled, when the
    request's ``block_hashes`` is a list, its ``num_tokens`` an int, and the tokens complete
    no new block; ``hasher`` itself in the pure-Python build."""
    if not _COMPILED:
        return hasher
    return EarlyExit(size, hasher)


class EarlyExit:
    """The compiled wrapper ``early_exit`` returns. A class rather than a closure: a request
    holding its hasher is deep-copied (vLLM's and impl's ``Request`` keep it), and, as for a
    Python function, a copy shares the hasher (a compiled closure could not be copied)."""

    def __init__(self, size: int, hasher: Callable[[Any], list[Any]]) -> None:
        self.size = size
        self.hasher = hasher

    def __call__(self, request: Any) -> list[Any]:
        try:
            block_hashes = request.block_hashes
            num_tokens = request.num_tokens
        except AttributeError:
            return self.hasher(request)  # refused there, typed
        size = self.size
        if (type(block_hashes) is list and type(num_tokens) is int
                and len(block_hashes) * size + size > num_tokens):
            return []
        return self.hasher(request)

    def __copy__(self) -> EarlyExit:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> EarlyExit:
        return self
