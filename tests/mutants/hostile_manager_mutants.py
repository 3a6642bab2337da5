"""Hostile-input mutants of the KV-cache manager stack: each brings back one failure the
manager's part of the hostile-input suite (tests/hostile/test_manager.py) exists to catch: a
refusal that changes state, a silent acceptance, an untyped error, an error that does not name
the value. Most are the stack as it was before the suite; each is killed by the suite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from itertools import chain
from typing import Any

from kvspec.impl import (
    kv_cache_coordinator as coord,
    kv_cache_interface as kci,
    kv_cache_manager as kvm,
    single_type_kv_cache_manager as stm,
)
from kvspec.impl.errors import InvalidManagerArgument
from tests.mutants import Mutant, replace

HOSTILE_MANAGER = "tests/hostile/test_manager.py"

CHANGED = "refused, but the state changed"
SILENT = "accepted without a word"
UNTYPED = "an error that is neither a ValueError nor a LookupError"
UNNAMED = "a typed error whose message does not name the value"


def keys_checked_after_allocating() -> None:
    """allocate_slots leaves the request's hashes (and event fields) to the pool, which reads
    them in stage 5, after the blocks are allocated: a hash that is not bytes leaves the
    request holding blocks it was refused."""
    replace(coord.KVCacheCoordinator, "check_keys", lambda self, *args: None)


def computed_tokens_trusted() -> None:
    """allocate_slots takes request.num_computed_tokens as it comes: a count beyond the
    request's slots makes stage 1 free blocks the request still attends to."""
    replace(coord.KVCacheCoordinator, "check_computed_tokens", lambda self, *args: None)
    replace(coord.UnitaryKVCacheCoordinator, "check_computed_tokens", lambda self, *args: None)


def max_model_len_unbounded() -> None:
    """The settings check max_model_len is a positive int, with no upper bound: 2**64 is
    accepted."""
    original = coord.check_settings

    def check(max_model_len: Any, *args: Any) -> Any:
        checked = original(1 if type(max_model_len) is int and max_model_len > 0
                           else max_model_len, *args)
        return dataclasses.replace(checked, max_model_len=max_model_len)
    for module in (coord, kvm):
        replace(module, "check_settings", check)


def blocks_add_unchecked() -> None:
    """KVCacheBlocks.__add__ zips the groups strictly and lets zip's bare ValueError out."""
    def add(self: kvm.KVCacheBlocks, other: Any) -> kvm.KVCacheBlocks:
        if not isinstance(other, kvm.KVCacheBlocks):  # the operand's type is still checked
            raise InvalidManagerArgument(f"cannot add {other!r} to KVCacheBlocks")
        return kvm.KVCacheBlocks(tuple(
            list(chain(a, b)) for a, b in zip(self.blocks, other.blocks, strict=True)))
    replace(kvm.KVCacheBlocks, "__add__", add)


def hits_trusted() -> None:
    """allocate_slots checks the hits' shape but not that they are the request's cache hits:
    a block of another pool, a block handed back, another prompt's block, is attached."""
    replace(coord.KVCacheCoordinator, "check_hits", lambda self, *args: None)


def hit_memo_ignores_changes() -> None:
    """The last lookup's result is remembered without a copy of its groups: hits written into
    after the lookup still pass for the lookup's own."""
    original = kvm.KVCacheManager.get_computed_blocks

    def get_computed_blocks(self: kvm.KVCacheManager, request: Any) -> Any:
        result = original(self, request)
        last = self._last_lookup
        if last is not None and last[0] is result[0]:
            self._last_lookup = (last[0], last[1], last[1], *last[3:])  # type: ignore[assignment]
        return result
    replace(kvm.KVCacheManager, "get_computed_blocks", get_computed_blocks)


def hit_memo_ignores_evictions() -> None:
    """evict_blocks does not count as a call that may evict: hits evicted since their lookup
    still pass for the lookup's own."""
    def evict_blocks(self: kvm.KVCacheManager, block_ids: Any) -> None:
        self.block_pool.evict_blocks(block_ids)
    replace(kvm.KVCacheManager, "evict_blocks", evict_blocks)


def coordinator_allocates_group_by_group() -> None:
    """coordinator.allocate_new_blocks lets each group take its blocks in turn: more than the
    pool has leaves the first groups' blocks (or a new empty entry) behind."""
    def allocate_new_blocks(self: coord.KVCacheCoordinator, request_id: Any, num_tokens: Any,
                            num_encoder_tokens: Any = 0) -> Any:
        return self.allocate_new_blocks_unchecked(stm.check_request_id(request_id),
                                         stm.check_count("num_tokens", num_tokens),
                                         stm.check_count("num_encoder_tokens",
                                                         num_encoder_tokens))
    replace(coord.KVCacheCoordinator, "allocate_new_blocks", allocate_new_blocks)


def request_id_unchecked() -> None:
    """The attention-type managers and coordinators take any request id: free(None) is a
    silent no-op, a list id an unhashable TypeError."""
    for module in (stm, coord):  # KVCacheManager leaves request ids to its coordinator
        replace(module, "check_request_id", lambda request_id: request_id)


def uncached_coordinator_keys_counts() -> None:
    """Without prefix caching the coordinator still runs every group's cache_blocks: the
    decoder group records keyed counts, then cross-attention raises."""
    replace(coord.KVCacheCoordinatorNoPrefixCache, "cache_blocks_unchecked",
            coord.KVCacheCoordinator.cache_blocks_unchecked)


def mamba_shapes_coerced() -> None:
    """MambaSpec turns each shape size into an int with int(): 2.5 becomes 2, silently."""
    original = kci.MambaSpec.__post_init__

    def post_init(self: kci.MambaSpec) -> None:
        try:
            shapes = tuple(tuple(int(d) for d in shape) for shape in self.shapes)
        except (TypeError, ValueError):
            shapes = self.shapes
        object.__setattr__(self, "shapes", shapes)
        original(self)
    replace(kci.MambaSpec, "__post_init__", post_init)


def config_sequences_unchecked() -> None:
    """KVCacheConfig makes tuples of its sequences without checking them: None gets Python's
    bare TypeError."""
    original = kci.KVCacheConfig.__post_init__

    def post_init(self: kci.KVCacheConfig) -> None:
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))
        original(self)
    replace(kci.KVCacheConfig, "__post_init__", post_init)


def lookup_trusts_the_request() -> None:
    """get_computed_blocks reads the request's fields as they come: something that is not a
    request gets an AttributeError (or, with prefix caching off, no word at all), a bad flag
    is taken for its truth value."""
    def get_computed_blocks(self: kvm.KVCacheManager, request: Any) -> Any:
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        blocks, num_hits = self.coordinator.find_longest_cache_hit_unchecked(
            request.block_hashes, request.num_tokens - 1)
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(request.num_tokens, num_hits,
                                           request.num_preemptions > 0)
        return self._blocks_result(blocks), num_hits
    replace(kvm.KVCacheManager, "get_computed_blocks", get_computed_blocks)


def refusal_names_nothing() -> None:
    """A count out of range is refused without saying which value it got."""
    original = stm.check_count

    def check_count(name: str, value: object, *args: Any, **kwargs: Any) -> int:
        try:
            return original(name, value, *args, **kwargs)
        except ValueError as error:
            raise type(error)(f"{name} is out of range") from None
    for module in (stm, coord, kvm):
        replace(module, "check_count", check_count)


def _mutant(name: str, plant: Callable[[], None], killed_by: str, test: str = "") -> Mutant:
    """A mutant checked by the hostile manager suite, or by its ``test`` alone: the test
    that kills it, named where the file's tests before it cost seconds of every run."""
    description = " ".join((plant.__doc__ or "").split())
    checker = f"{HOSTILE_MANAGER}::{test}" if test else HOSTILE_MANAGER
    return Mutant(name, description, plant, (checker,), killed_by)


MUTANTS: list[Mutant] = [
    _mutant("hostile_manager_keys_checked_after_allocating", keys_checked_after_allocating,
            CHANGED, "test_a_block_hash_that_is_not_bytes_is_refused_before_allocating"),
    # Caught by whichever call the draw reaches first with a count beyond the slots
    # (allocate_slots, cache_blocks, num_blocks_freed_by_skip): any failure of the suite.
    _mutant("hostile_manager_computed_tokens_trusted", computed_tokens_trusted, ""),
    _mutant("hostile_manager_max_model_len_unbounded", max_model_len_unbounded, SILENT,
            "test_kv_cache_manager_constructor_refuses_bad_arguments"),
    _mutant("hostile_manager_blocks_add_unchecked", blocks_add_unchecked, UNNAMED),
    _mutant("hostile_manager_hits_trusted", hits_trusted, SILENT,
            "test_hits_that_are_not_the_requests_are_refused"),
    _mutant("hostile_manager_hit_memo_ignores_changes", hit_memo_ignores_changes, SILENT,
            "test_the_lookups_own_hits_changed_in_place_are_refused"),
    _mutant("hostile_manager_hit_memo_ignores_evictions", hit_memo_ignores_evictions, SILENT,
            "test_the_lookups_own_hits_evicted_since_are_refused"),
    # Caught on a request for more blocks than the pool has: a group's refusal names its own
    # share, not the count asked for, or the first groups keep theirs.
    _mutant("hostile_coordinator_allocates_group_by_group",
            coordinator_allocates_group_by_group, "coordinator.allocate_new_blocks(<too many",
            "test_coordinators_refuse_bad_calls_and_change_nothing"),
    _mutant("hostile_manager_request_id_unchecked", request_id_unchecked, SILENT),
    _mutant("hostile_uncached_coordinator_keys_counts", uncached_coordinator_keys_counts,
            "PrefixCachingNotSupported",
            "test_uncached_coordinator_cache_blocks_refuses_before_any_group_changes"),
    _mutant("hostile_mamba_shapes_coerced", mamba_shapes_coerced, SILENT,
            "test_spec_constructors_refuse_bad_fields"),
    _mutant("hostile_config_sequences_unchecked", config_sequences_unchecked, UNTYPED,
            "test_config_classes_and_converters_refuse_bad_values"),
    _mutant("hostile_lookup_trusts_the_request", lookup_trusts_the_request,
            "manager.get_computed_blocks("),
    _mutant("hostile_manager_refusal_names_nothing", refusal_names_nothing, UNNAMED),
]
