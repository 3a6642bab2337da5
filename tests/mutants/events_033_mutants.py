"""vLLM 0.33's hashing and events: bugs in the fixed-seed root, lookahead hashing, the coarse
view, the map-encoded wire, and the copies a router counts, each caught by a check of
spec/hashing.py's or spec/events.py's (through tests/test_hashing.py, tests/test_kv_events_033.py
and the pool machine)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from msgspec.structs import replace as with_fields

from kvspec.impl import hashing, kv_events_033
from kvspec.impl.block_pool import BlockPool
from tests.mutants import Mutant, replace

HASHING = "tests/test_hashing.py"
EVENTS = "tests/test_kv_events_033.py"
MACHINE = ("tests/test_pool_machine.py",)


def root_random_under_0_33() -> None:
    """init_none_hash keeps vLLM 0.13's random root under vLLM 0.33 (no fixed seed)."""
    original = hashing.resolve_none_hash_seed

    def resolve_none_hash_seed(hash_fn: Any) -> str | None:
        seed = original(hash_fn)
        return None if seed == hashing.DEFAULT_NONE_HASH_SEED else seed
    replace(hashing, "resolve_none_hash_seed", resolve_none_hash_seed)


def root_fixed_for_xxhash() -> None:
    """vLLM 0.33's fixed seed given to xxhash too (a predictable seed for a non-cryptographic
    hash: collisions can be precomputed offline)."""
    original = hashing.resolve_none_hash_seed

    def resolve_none_hash_seed(hash_fn: Any) -> str | None:
        seed = original(hash_fn)
        return hashing.DEFAULT_NONE_HASH_SEED if seed is not None and len(seed) == 64 else seed
    replace(hashing, "resolve_none_hash_seed", resolve_none_hash_seed)


def lookahead_tokens_left_out() -> None:
    """The lookahead hasher waits for the lookahead tokens but does not hash them."""
    def lookahead_request_block_hasher(block_size: Any, fn: Any, lookahead: Any,
                                       ) -> Callable[[Any], list[Any]]:
        count = int(lookahead)
        plain = hashing.get_request_block_hasher(block_size, fn)

        def hasher(request: Any) -> list[Any]:
            class Shorter:  # the request less its lookahead tokens
                def __getattr__(self, name: str) -> Any:
                    return getattr(request, name)
                num_tokens = max(0, request.num_tokens - count)
                all_token_ids = list(request.all_token_ids)[:num_tokens]
            return plain(Shorter())
        return hasher
    replace(hashing, "lookahead_request_block_hasher", lookahead_request_block_hasher)


def coarse_view_concatenates_under_0_33() -> None:
    """vLLM 0.33's coarse view keeps 0.13's concatenation instead of the boundary hash."""
    replace(hashing.BlockHashListWithBlockSizeV033, "_coarse",
            hashing.BlockHashListWithBlockSize._coarse)


def events_0_33_array_encoded() -> None:
    """The vllm-0.33 profile's events written as 0.13's arrays."""
    kv_events_033.EVENT_CLASSES["vllm-0.33"] = kv_events_033.EVENT_CLASSES["vllm-0.13"]


def decoded_0_33_events_unhashable() -> None:
    """BlockStoredV033 hashes its extra keys as they are, as vLLM 0.33 does: a decoded event
    with a multimodal key holds a list and cannot be counted."""
    def __hash__(self: Any) -> int:
        return hash((tuple(self.block_hashes), self.parent_block_hash, tuple(self.token_ids),
                     tuple(self.extra_keys) if self.extra_keys else None))
    replace(kv_events_033.BlockStoredV033, "__hash__", __hash__)


def stored_event_drops_a_hash() -> None:
    """A BlockStored of several blocks leaves out the last block's hash (an off-by-one)."""
    original = BlockPool._stored_event

    def stored_event(self: BlockPool, *args: Any) -> Any:
        stored = original(self, *args)
        if len(stored.block_hashes) < 2:
            return stored
        return with_fields(stored, block_hashes=list(stored.block_hashes)[:-1])
    replace(BlockPool, "_stored_event", stored_event)


MUTANTS = [
    Mutant("root_random_under_0_33", "no fixed-seed root hash under vLLM 0.33",
           root_random_under_0_33,
           (f"{HASHING}::test_0_33_root_is_the_fixed_seeds_hash_without_pythonhashseed",),
           "test_0_33_root_is_the_fixed_seeds_hash_without_pythonhashseed"),
    Mutant("root_fixed_for_xxhash", "xxhash's root derived from the public fixed seed",
           root_fixed_for_xxhash,
           (f"{HASHING}::test_0_33_root_stays_random_for_xxhash",),
           "test_0_33_root_stays_random_for_xxhash"),
    Mutant("lookahead_tokens_left_out", "lookahead hashing ignores the lookahead tokens",
           lookahead_tokens_left_out,
           (f"{HASHING}::test_lookahead_hashes_agree_with_spec",),
           "test_lookahead_hashes_agree_with_spec"),
    Mutant("coarse_view_concatenates_under_0_33", "0.33's coarse view concatenates",
           coarse_view_concatenates_under_0_33,
           (f"{HASHING}::test_0_33_coarse_view_is_the_boundary_hash",),
           "test_0_33_coarse_view_is_the_boundary_hash"),
    Mutant("events_0_33_array_encoded", "0.33's events array-encoded",
           events_0_33_array_encoded,
           (f"{EVENTS}::test_impl_bytes_are_the_specs_per_profile",),
           "test_impl_bytes_are_the_specs_per_profile"),
    Mutant("decoded_0_33_events_unhashable", "a decoded 0.33 event cannot be counted",
           decoded_0_33_events_unhashable,
           (f"{EVENTS}::test_decoded_0_33_events_with_multimodal_keys_stay_countable",),
           "test_decoded_0_33_events_with_multimodal_keys_stay_countable"),
    Mutant("stored_event_drops_a_hash", "a BlockStored loses its last block's hash",
           stored_event_drops_a_hash, MACHINE, "event_stream_holds_every_copy"),
]
