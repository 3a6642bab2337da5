"""Drop-in mutants: bugs that break kvspec where vLLM's callers meet it, each planted into
impl/ or the plugin and killed by the test that states the promise (tests/test_vllm_compat.py,
tests/test_kv_cache_blocks.py, tests/test_kv_cache_interface.py, tests/test_vllm_plugin.py,
tests/test_kv_cache_metrics.py, tests/test_kv_events.py).
"""

from __future__ import annotations

import time
from typing import Any

from kvspec import vllm_plugin
from kvspec.impl import (
    kv_cache_interface,
    kv_cache_metrics,
    kv_cache_utils,
    kv_events,
    single_type_kv_cache_manager as stm,
)
from tests.mutants import Mutant, replace

COMPAT = "tests/test_vllm_compat.py"
BLOCKS = "tests/test_kv_cache_blocks.py"
INTERFACE = "tests/test_kv_cache_interface.py"
PLUGIN = "tests/test_vllm_plugin.py"
METRICS = "tests/test_kv_cache_metrics.py"
EVENTS = "tests/test_kv_events.py"


def free_reverses_callers_list() -> None:
    """free() reverses the request's block list in place (vLLM 0.13 leaves it as it was), so
    a list a caller got from get_blocks reads reversed afterwards."""
    def free(self: stm.SingleTypeKVCacheManager, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            blocks.reverse()
            self.block_pool.free_blocks(blocks)
        self.num_cached_block.pop(request_id, None)
    replace(stm.SingleTypeKVCacheManager, "free", free)


def free_queue_keeps_callers_list() -> None:
    """FreeKVCacheBlockQueue keeps the caller's list as its entries: appending to the queue
    grows the caller's list (a regression vLLM's own tests caught)."""
    original = kv_cache_utils.FreeKVCacheBlockQueue.__init__

    def init(self: kv_cache_utils.FreeKVCacheBlockQueue, blocks: Any) -> None:
        original(self, blocks)
        if type(blocks) is list:
            blocks[:] = self._entries
            self._entries = blocks
    replace(kv_cache_utils.FreeKVCacheBlockQueue, "__init__", init)


def foreign_specs_refused() -> None:
    """Specs are recognised by isinstance only: vLLM's own spec objects are refused."""
    def spec_kind(spec: object) -> Any:
        return type(spec) if isinstance(spec, kv_cache_interface.KVCacheSpec) else None
    replace(kv_cache_interface, "spec_kind", spec_kind)
    replace(stm, "spec_kind", spec_kind)


def plugin_rebinds_nothing() -> None:
    """The plugin replaces vLLM's modules for later imports but leaves the names vLLM's
    loaded modules already took (the scheduler keeps vLLM's KVCacheManager)."""
    def rebind(originals: Any, replacements: Any) -> list[str]:
        return []
    replace(vllm_plugin, "_rebind_imported_names", rebind)


def free_queue_links_one_off() -> None:
    """The free queue's linked-list view skips a neighbour: next_free_block is two ahead."""
    original = kv_cache_utils.FreeKVCacheBlockQueue._neighbour

    def neighbour(self: Any, block: Any, step: int) -> Any:
        found = original(self, block, step)
        if step > 0 and found is not None and found is not self.fake_free_list_tail:
            return original(self, found, step)
        return found
    replace(kv_cache_utils.FreeKVCacheBlockQueue, "_neighbour", neighbour)


def context_parallel_layout_ignored() -> None:
    """Block tables built without ranks take one rank on its own, not the process's
    context-parallel layout (inside vLLM: its pcp/dcp groups)."""
    from kvspec.impl import block_table

    def layout(pcp_world_size: Any, pcp_rank: Any, dcp_world_size: Any,
               dcp_rank: Any) -> tuple[int, int, int, int]:
        given = (pcp_world_size, pcp_rank, dcp_world_size, dcp_rank)
        return tuple(d if g is None else g for g, d in zip(given, (1, 0, 1, 0), strict=True))  # type: ignore[return-value]
    replace(block_table, "_context_parallel", layout)


def metrics_clock_bound_at_import() -> None:
    """The metrics collector's clock defaults to time.monotonic_ns as it was when the module
    was imported, so patching time.monotonic_ns (as vLLM's tests do) does not reach it."""
    bound = time.monotonic_ns
    replace(kv_cache_metrics.BlockMetricsState.__init__, "__defaults__", (bound,))
    kwdefaults = dict(kv_cache_metrics.KVCacheMetricsCollector.__init__.__kwdefaults__ or {})
    kwdefaults["clock"] = bound
    replace(kv_cache_metrics.KVCacheMetricsCollector.__init__, "__kwdefaults__", kwdefaults)


def events_encode_as_maps() -> None:
    """The event batch is declared without array_like, so it goes out as a msgpack map of
    field names, which vLLM's decoder refuses ("Expected array, got object")."""
    import msgspec

    # defstruct: annotations written in a function body would not resolve later (PEP 563).
    events = kv_events.BlockStored | kv_events.BlockRemoved | kv_events.AllBlocksCleared
    batch = msgspec.defstruct("KVEventBatch", [
        ("ts", float), ("events", list[events]),
        ("data_parallel_rank", int | None, None)], omit_defaults=True, gc=False)
    replace(kv_events, "KVEventBatch", batch)


def _mutant(name: str, plant: Any, *checker: str) -> Mutant:
    description = " ".join((plant.__doc__ or "").split())
    return Mutant(name, description, plant, checker)


MUTANTS: list[Mutant] = [
    _mutant("compat_free_reverses_callers_list", free_reverses_callers_list, COMPAT),
    _mutant("compat_free_queue_keeps_callers_list", free_queue_keeps_callers_list, BLOCKS),
    _mutant("compat_foreign_specs_refused", foreign_specs_refused, INTERFACE, COMPAT),
    _mutant("compat_plugin_rebinds_nothing", plugin_rebinds_nothing, PLUGIN),
    _mutant("compat_free_queue_links_one_off", free_queue_links_one_off, BLOCKS, COMPAT),
    _mutant("compat_context_parallel_layout_ignored", context_parallel_layout_ignored, COMPAT),
    _mutant("compat_metrics_clock_bound_at_import", metrics_clock_bound_at_import, METRICS),
    _mutant("compat_events_encode_as_maps", events_encode_as_maps, EVENTS),
]
