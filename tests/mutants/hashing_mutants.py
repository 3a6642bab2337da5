"""Prefix-hashing mutants: bugs that break prefix-cache isolation or key layout.

Each replaces one function of impl.hashing, in that module and in every impl module that
imported it by name, so the bug is seen wherever the function is used.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from kvspec.impl import hashing, request_hasher
from kvspec.impl.hashing import BlockHash, BlockHashWithGroupId, HashFunction
from kvspec.impl.request import Request
from tests.mutants import Mutant, replace

HASHING_TESTS = "tests/test_hashing.py"
REQUEST_HASHER_TESTS = "tests/test_request_hasher.py"


def _replace_everywhere(name: str, replacement: Any) -> None:
    original = getattr(hashing, name)
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("kvspec.impl") and getattr(module, name, None) is original:
            setattr(module, name, replacement)


def salt_in_every_block() -> None:
    """The cache salt goes into every block's extra keys, not only block 0's."""
    original = hashing._block_extra_keys

    def block_extra_keys(sources: Any, start: int, end: int, start_mm_idx: int,
                         tagged: bool) -> tuple[tuple[Any, ...] | None, int]:
        keys, next_mm_idx = original(sources, start, end, start_mm_idx, tagged)
        if start > 0 and sources.cache_salt:
            keys = (*(keys or ()), hashing._salt_key(sources.cache_salt, tagged))
        return keys, next_mm_idx

    _replace_everywhere("_block_extra_keys", block_extra_keys)


def request_hasher_ignores_parent() -> None:
    """The request block hasher seeds every block with NONE_HASH instead of chaining."""

    def get_request_block_hasher(
        block_size: int, caching_hash_fn: HashFunction
    ) -> Callable[[Request], list[BlockHash]]:
        def request_block_hasher(request: Request) -> list[BlockHash]:
            start = len(request.block_hashes) * block_size
            mm_idx = 0 if start == 0 else -1
            hashes: list[BlockHash] = []
            while start + block_size <= request.num_tokens:
                end = start + block_size
                extra, mm_idx = hashing.generate_block_hash_extra_keys(
                    request, start, end, mm_idx)
                hashes.append(hashing.hash_block_tokens(
                    caching_hash_fn, None, request.all_token_ids[start:end], extra))
                start = end
            return hashes

        return request_block_hasher

    _replace_everywhere("get_request_block_hasher", get_request_block_hasher)


def group_id_little_endian() -> None:
    """Group ids are appended to keys little-endian."""

    def make_block_hash_with_group_id(
        block_hash: BlockHash, group_id: int
    ) -> BlockHashWithGroupId:
        return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "little"))

    _replace_everywhere("make_block_hash_with_group_id", make_block_hash_with_group_id)


def early_exit_takes_a_completed_block() -> None:
    """The compiled wrapper answers [] also when the tokens complete exactly one more block
    (``>=`` for ``>``): a decode step's completed block is never hashed."""
    def call(self: request_hasher.EarlyExit, request: Any) -> list[Any]:
        size = self.size
        if len(request.block_hashes) * size + size >= request.num_tokens:
            return []
        return self.hasher(request)

    replace(request_hasher.EarlyExit, "__call__", call)


def any_hash_function_inlined() -> None:
    """The request block hasher takes every hash function for sha256 of the pickle and
    computes that inline: a caller's own function (xxhash, a spy, a different algorithm) is
    never called."""
    replace(hashing, "_is_pickle_sha256", lambda hash_function: True)


MUTANTS: list[Mutant] = [
    Mutant(
        "hash-salt-every-block",
        "the cache salt is keyed into every block, not only the first",
        salt_in_every_block,
        (f"{HASHING_TESTS}::test_request_hashes_agree_with_spec",),
    ),
    Mutant(
        "hash-parent-ignored",
        "the request hasher does not chain blocks to their parent",
        request_hasher_ignores_parent,
        (f"{HASHING_TESTS}::test_request_hashes_agree_with_spec",),
    ),
    Mutant(
        "hash-group-id-little-endian",
        "group ids are appended to prefix-cache keys little-endian",
        group_id_little_endian,
        (f"{HASHING_TESTS}::test_group_id_key_round_trip_matches_spec",),
    ),
    Mutant(
        "hash-early-exit-off-by-one",
        "the compiled hasher's no-new-block answer also swallows a call that completes a block",
        early_exit_takes_a_completed_block,
        (f"{REQUEST_HASHER_TESTS}::test_early_exit_answers_only_the_calls_that_complete_no_block",),
    ),
    Mutant(
        "hash-any-function-inlined",
        "the request block hasher computes sha256 inline whatever hash function it was given",
        any_hash_function_inlined,
        (f"{HASHING_TESTS}::test_request_hasher_calls_any_other_hash_function_once_per_block",),
    ),
]
