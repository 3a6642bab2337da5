"""impl/single_type_kv_cache_manager.py: one manager per attention type, and the pure rules
they run.

* the pure rules (``blocks_needed``, ``sliding_window_hit``, ...) are spec/attention_rules.py's
  on every input: CrossHair's ``diffbehavior`` runs both on symbolic inputs (negative and
  zero sizes included) and reports any input where results or exception types differ. Each
  pair runs in a subprocess with a wall-clock cap; a CrossHair that cannot run here skips;
* the specs no manager serves, and a sink whose length is not whole blocks, are refused
  when the manager is built;
* the ``..._unchecked`` twins (docs/architecture.md, "Checked once"): each does what its
  public method does on arguments that pass the checks, and the twins are exactly the
  operations whose checks read the manager's state or scan a list; the others (``free``,
  ``get_num_common_prefix_blocks``) have none and refuse a bad request id themselves.

tests/hostile/test_manager.py throws every kind of bad value at every public method of every
attention type's manager; conformance/attention_manager_machine.py (the attention layer's
machine) calls them directly against the spec.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvspec.impl.block_pool import BlockPool
from kvspec.impl.hashing import get_request_block_hasher, sha256
from kvspec.impl.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from kvspec.impl.kv_cache_manager import (
    InvalidKVCacheConfig,
    InvalidManagerArgument,
    KVCacheManager,
    Request,
    UnsupportedKVCacheSpec,
)
from kvspec.impl.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
    spec_manager_map,
)

ROOT = Path(__file__).resolve().parent.parent
# CrossHair's limits are CPU seconds, which a loaded machine stretches in wall time (48 s
# with the cores shared among a dozen processes): the subprocess's timeout only stops a hang.
HANG_CAP = 600
BS = 4

RULES = (
    "blocks_needed",
    "num_blocks_to_allocate",
    "sliding_window_skipped_tokens",
    "chunked_local_skipped_tokens",
    "mamba_skipped_tokens",
    "skipped_blocks",
    "sliding_window_blocks_for_hit",
    "full_attention_hit_blocks",
    "sliding_window_hit",
    "chunked_local_hit",
    "mamba_hit_blocks",
)

# The operations with an ``..._unchecked`` twin: those whose public method's checks read the
# manager's state or scan a list (docs/architecture.md, "Checked once"), and
# ``num_slots_held``, the query the coordinators' checks read, which has no public method.
TWINS = {
    "get_num_blocks_to_allocate", "save_new_computed_blocks", "allocate_new_blocks",
    "cache_blocks", "remove_skipped_blocks", "num_blocks_freed_by_skip",
    "find_longest_cache_hit", "num_slots_held",
}

SPECS: tuple[KVCacheSpec, ...] = (
    FullAttentionSpec(BS, 1, 8, "float16"),
    SlidingWindowSpec(BS, 1, 8, "float16", sliding_window=5),
    ChunkedLocalAttentionSpec(BS, 1, 8, "float16", attention_chunk_size=8),
    MambaSpec(BS, shapes=((2, 2),), dtypes=("float16",)),
    CrossAttentionSpec(BS, 1, 8, "float16"),
    SinkFullAttentionSpec(BS, 1, 8, "float16", sink_len=BS),
)


def config(*specs: KVCacheSpec, num_blocks: int = 16) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, (), tuple(
        KVCacheGroupSpec((f"layer.{i}",), s) for i, s in enumerate(specs)))


def full(bs: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(bs, 1, 8, "float16")


def manager_of(spec: KVCacheSpec, pool: BlockPool) -> SingleTypeKVCacheManager:
    return get_manager_for_kv_cache_spec(spec, block_pool=pool, kv_cache_group_id=0)


def snapshot(manager: SingleTypeKVCacheManager) -> Any:
    pool = manager.block_pool
    return (
        {rid: [b.block_id for b in blocks] for rid, blocks in manager.req_to_blocks.items()},
        dict(manager.num_cached_block),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
    )


# ---------------------------------------------------------------------- the pure rules


@pytest.mark.skipif(importlib.util.find_spec("crosshair") is None,
                    reason="crosshair-tool is not installed")
@pytest.mark.parametrize("rule", RULES)
def test_spec_and_impl_rules_agree(rule: str) -> None:
    command = [
        sys.executable, "-m", "crosshair", "diffbehavior",
        "--exception_equivalence", "SAME_TYPE", "--per_condition_timeout", "3",
        f"kvspec.spec.attention_rules.{rule}", f"kvspec.impl.single_type_kv_cache_manager.{rule}",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=HANG_CAP,
                            check=False)
    assert result.returncode == 0 and "No differences found" in result.stdout, (
        f"crosshair diffbehavior {rule}:\n{result.stdout}\n{result.stderr}")


# ---------------------------------------------------------------------- managers refused


@dataclass(frozen=True)
class NovelSpec(KVCacheSpec):
    """A spec type no manager handles."""

    @property
    def page_size_bytes(self) -> int:
        return 1


def test_spec_type_no_manager_handles() -> None:
    with pytest.raises(UnsupportedKVCacheSpec, match="NovelSpec") as refused:
        KVCacheManager(config(NovelSpec(BS)), max_model_len=64, hash_block_size=BS)
    assert isinstance(refused.value, LookupError) and isinstance(refused.value, KeyError)
    with pytest.raises(LookupError):
        KVCacheManager(config(full(), NovelSpec(BS)), max_model_len=64, hash_block_size=BS,
                       enable_caching=False)


def test_sink_length_must_be_whole_blocks() -> None:
    with pytest.raises(InvalidKVCacheConfig, match="sink_len"):
        KVCacheManager(config(SinkFullAttentionSpec(BS, 1, 8, "float16", sink_len=6)),
                       max_model_len=64, hash_block_size=BS)
    manager = KVCacheManager(config(SinkFullAttentionSpec(BS, 1, 8, "float16", sink_len=8)),
                             max_model_len=64, hash_block_size=BS)
    assert manager.block_pool.get_num_free_blocks() == 16 - 1 - 2


# ---------------------------------------------------------------------- the twins


MANAGER_CLASSES: list[type[SingleTypeKVCacheManager]] = sorted(
    {SingleTypeKVCacheManager, *spec_manager_map.values()}, key=lambda cls: cls.__name__)


@pytest.mark.parametrize("manager_class", MANAGER_CLASSES)
def test_the_twins_are_the_operations_whose_checks_cost(manager_class: type) -> None:
    twins = {name.removesuffix("_unchecked") for name in dir(manager_class)
             if name.endswith("_unchecked")}
    assert twins == TWINS
    assert all(hasattr(manager_class, name) for name in twins - {"num_slots_held"})


def test_only_full_attention_counts_a_common_prefix() -> None:
    for spec in SPECS:
        pool = BlockPool(16, True, BS)
        manager = manager_of(spec, pool)
        manager.allocate_new_blocks("a", 8)
        shared = [b for b in manager.req_to_blocks["a"] if not b.is_null]
        if not isinstance(spec, CrossAttentionSpec):  # never has cache hits
            pool.touch(shared)
            manager.save_new_computed_blocks("b", shared)
        expected = len(shared) if isinstance(manager, FullAttentionManager) else 0
        assert manager.get_num_common_prefix_blocks("a") == expected, type(manager).__name__
        assert manager.get_num_common_prefix_blocks("nobody") == 0


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: type(spec).__name__)
@pytest.mark.parametrize("operation", ["free", "get_num_common_prefix_blocks"])
@pytest.mark.parametrize("bad", [None, 3, ["a"]])
def test_the_methods_without_a_twin_refuse_a_bad_request_id(
        spec: KVCacheSpec, operation: str, bad: Any) -> None:
    manager = manager_of(spec, BlockPool(16, True, BS))
    manager.allocate_new_blocks("a", 5)
    before = snapshot(manager)
    with pytest.raises(InvalidManagerArgument,
                       match=re.escape(f"a request id must be a str, got {bad!r}")):
        getattr(manager, operation)(bad)
    assert snapshot(manager) == before


@pytest.mark.parametrize("spec", [s for s in SPECS if not isinstance(s, CrossAttentionSpec)],
                         ids=lambda spec: type(spec).__name__)
def test_each_twin_does_what_its_public_method_does(spec: KVCacheSpec) -> None:
    """The same calls, with arguments that pass the checks, through the public methods on one
    manager and through the twins on another (each over its own pool): the same results and
    the same states."""
    public = manager_of(spec, BlockPool(16, True, BS))
    twin = manager_of(spec, BlockPool(16, True, BS))

    def both(name: str, *args: Any) -> Any:
        result = getattr(public, name)(*args)
        assert _ids(getattr(twin, f"{name}_unchecked")(*args)) == _ids(result), name
        assert snapshot(twin) == snapshot(public), name
        return result

    hasher = get_request_block_hasher(BS, sha256)
    a = Request("a", list(range(13)), block_hasher=hasher)
    both("get_num_blocks_to_allocate", "a", 13, [])
    both("allocate_new_blocks", "a", 13)
    both("cache_blocks", a, 12)
    both("num_blocks_freed_by_skip", "a", 12)
    both("remove_skipped_blocks", "a", 12)
    public.free("a")
    twin.free("a")
    assert snapshot(twin) == snapshot(public)
    args = (a.block_hashes, 12, [0])
    hits = type(public).find_longest_cache_hit(*args, public.block_pool, spec, False, BS)
    twin_hits = type(twin).find_longest_cache_hit_unchecked(*args, twin.block_pool, spec,
                                                             False, BS)
    assert _ids(hits) == _ids(twin_hits)
    real = [b for b in hits[0] if not b.is_null]
    public.block_pool.touch(real)
    twin.block_pool.touch([b for b in twin_hits[0] if not b.is_null])
    public.save_new_computed_blocks("b", hits[0])
    twin.save_new_computed_blocks_unchecked("b", twin_hits[0])
    assert snapshot(twin) == snapshot(public)


def _ids(value: Any) -> Any:
    """A result with each block replaced by its id (the two managers' blocks differ)."""
    if isinstance(value, (list, tuple)):
        return [_ids(item) for item in value]
    return getattr(value, "block_id", value)
