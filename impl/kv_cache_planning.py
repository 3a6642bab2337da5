"""KV-cache planning: how a model's layers are grouped and how many blocks its cache gets.

vLLM 0.13 keeps these functions in ``vllm.v1.core.kv_cache_utils``; here they live apart
(``kv_cache_utils`` re-exports them under the same names) because ``kv_cache_utils`` is
compiled with mypyc and this module, which runs once at start-up on the caller's own objects,
is not. The engine core calls ``get_kv_cache_configs(vllm_config, specs_per_worker,
memory_per_worker)``: it checks each worker can hold one full-length request
(``check_enough_kv_cache_memory``), groups the layers of the whole model
(``get_kv_cache_groups``), sizes each worker's tensors for its memory
(``get_kv_cache_config_from_groups``) and gives every worker the smallest block count; then
``generate_scheduler_kv_cache_config`` gives the scheduler one config.

One place for the arithmetic
----------------------------
Page-size unification, the split of layers into groups, tensor sharing, block counts, a
request's blocks per layer kind, the binary search of ``estimate_max_model_len`` and the
concurrency figure are ``kvspec.impl.kv_cache_sizing``'s (``kvspec plan`` runs the same code
on a model's layout, through ``kvspec.models.plan``); each spec kind's request size is its
``max_memory_usage_bytes``, which for impl's specs is ``kv_cache_sizing.request_blocks``. This
module adapts vLLM's objects to them.

Whose objects come out
----------------------
Everything built here is of the caller's classes, so that vLLM's code and its tests (which
compare with ``==``: dataclass equality needs the same class) get their own:

* A ``KVCacheGroupSpec``, ``KVCacheTensor``, ``KVCacheConfig``, ``FullAttentionSpec`` or
  ``UniformTypeKVCacheSpecs`` is the class of that name from the module that defines the
  input's spec (or group) class: vLLM's for vLLM's specs, impl's for impl's. An attention-free
  model has no spec, so its config comes from ``vllm_config``'s package (vLLM's
  ``kv_cache_interface`` for vLLM's ``VllmConfig``; impl's otherwise).
* A spec is merged, resized and grouped by its own methods (``merge``,
  ``copy_with_new_block_size``, ``max_memory_usage_bytes``) and compared by its own ``==``; a
  spec's kind is recognised by class name along its bases (``spec_is_a``), as vLLM's
  ``isinstance`` would.
* ``vllm_config`` is read duck-typed: ``model_config.max_model_len``,
  ``scheduler_config.max_num_batched_tokens`` / ``max_num_encoder_input_tokens`` /
  ``disable_hybrid_kv_cache_manager``, ``cache_config.num_gpu_blocks_override`` and
  ``parallel_config.decode_context_parallel_size`` / ``prefill_context_parallel_size``.

Errors and differences from vLLM 0.13
-------------------------------------
Where vLLM raises ``ValueError`` (not enough memory, hybrid specs that cannot be unified) the
error here is a ``KVCachePlanningError`` subclass (a ``ValueError``) with a compatible message;
where it raises ``NotImplementedError`` (pages that cannot be unified) so does
``PageSizeNotUnifiable`` (a ``ValueError`` too, raised also where vLLM asserts that a grown page
matches: a Mamba page does not grow). Where vLLM asserts, a typed ``ValueError`` comes instead:
``InconsistentLayerSpec`` (two workers give one layer different specs), ``NonUniformPageSize``,
``InconsistentNumBlocks``, ``EmptyKVCacheGroups``. Other differences, each on purpose:

* ``estimate_max_model_len`` leaves ``vllm_config`` as it was (vLLM leaves
  ``model_config.max_model_len`` set to the last length it tried): the specs read each trial
  length from a view of the config.
* ``get_kv_cache_configs`` refuses spec and memory lists of different lengths (vLLM's ``zip``
  drops the extra workers).
* Negative memory gives 0 blocks (as vLLM's ``get_num_blocks``) in the uniform-type case too.
* Log records go to the ``kvspec.impl.kv_cache_planning`` logger, each time (vLLM logs the
  cache size and concurrency once per process).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import logging
import sys
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from kvspec.impl import kv_cache_interface as _interface
from kvspec.impl.errors import (
    EmptyKVCacheGroups,
    HybridKVCacheSpecsNotUnifiable,
    InconsistentLayerSpec,
    InconsistentNumBlocks,
    InsufficientKVCacheMemory,
    InvalidPlanArgument,
    KVCachePlanningError,
    NonUniformPageSize,
    PageSizeNotUnifiable,
    UnknownLayerError,
)
from kvspec.impl.kv_cache_interface import (
    KVCacheSpecMismatch,
    UniformTypeKVCacheSpecs,
    spec_is_a,
)
from kvspec.impl.kv_cache_sizing import (
    longest_fitting,
    max_concurrency,
    num_blocks_for,
    split_into_groups,
    tensor_sharing,
    unify_page_sizes,
)

__all__ = [
    "EmptyKVCacheGroups",
    "HybridKVCacheSpecsNotUnifiable",
    "InconsistentLayerSpec",
    "InconsistentNumBlocks",
    "InsufficientKVCacheMemory",
    "InvalidPlanArgument",
    "KVCachePlanningError",
    "NonUniformPageSize",
    "PageSizeNotUnifiable",
    "UnknownLayerError",
    "check_enough_kv_cache_memory",
    "create_kv_cache_group_specs",
    "estimate_max_model_len",
    "generate_scheduler_kv_cache_config",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_configs",
    "get_kv_cache_groups",
    "get_kv_cache_groups_uniform_page_size",
    "get_kv_cache_groups_uniform_spec",
    "get_kv_cache_groups_uniform_type",
    "get_max_concurrency_for_kv_cache_config",
    "get_num_blocks",
    "get_uniform_page_size",
    "is_kv_cache_page_size_uniform",
    "is_kv_cache_spec_uniform",
    "is_kv_cache_type_attention_free",
    "max_memory_usage_bytes",
    "may_override_num_blocks",
    "report_kv_cache_config",
    "unify_hybrid_kv_cache_specs",
    "unify_kv_cache_spec_page_size",
]

logger = logging.getLogger(__name__)

GiB = 1 << 30
_MEMORY_DOCS = "https://docs.vllm.ai/en/latest/configuration/conserving_memory/"


# ---------------------------------------------------------------------- the caller's classes

# Where a host keeps its KV-cache classes, by the top-level package of its VllmConfig.
_HOST_INTERFACE_MODULES = {"vllm": "vllm.v1.kv_cache_interface"}

_family_classes: dict[tuple[type, str], type] = {}


def _family_class(obj: object, name: str) -> Any:
    """The class called ``name`` from the module that defines ``obj``'s class (or one of its
    bases): vLLM's ``KVCacheConfig`` for vLLM's specs and groups, impl's for impl's."""
    key = (type(obj), name)
    found = _family_classes.get(key)
    if found is None:
        for cls in type(obj).__mro__:
            candidate = getattr(sys.modules.get(cls.__module__), name, None)
            if isinstance(candidate, type):
                found = candidate
                break
        else:
            found = getattr(_interface, name)
        _family_classes[key] = found
    return found


def _config_family_class(vllm_config: object, name: str) -> Any:
    """The class called ``name`` of ``vllm_config``'s package, for a plan without any spec to
    take it from (an attention-free model); impl's for a package without one."""
    root = type(vllm_config).__module__.partition(".")[0]
    module_name = _HOST_INTERFACE_MODULES.get(root)
    if module_name is not None:
        try:
            candidate = getattr(importlib.import_module(module_name), name, None)
        except ImportError:
            candidate = None
        if isinstance(candidate, type):
            return candidate
    return getattr(_interface, name)


def _with_block_size(spec: Any, block_size: int) -> Any:
    """``spec`` with ``block_size`` tokens per block, built by the spec's own class."""
    copy_with = getattr(spec, "copy_with_new_block_size", None)
    if callable(copy_with):
        return copy_with(block_size)
    return dataclasses.replace(spec, block_size=block_size)


# ---------------------------------------------------------------------- reading vllm_config

_REQUIRED = object()


def _config_value(vllm_config: object, section: str, name: str, default: Any = _REQUIRED) -> Any:
    value = getattr(getattr(vllm_config, section, None), name, default)
    if value is _REQUIRED:
        raise InvalidPlanArgument(f"vllm_config has no {section}.{name}: {vllm_config!r}")
    return value


def _max_model_len(vllm_config: object) -> int:
    value = _config_value(vllm_config, "model_config", "max_model_len")
    if type(value) is not int or value <= 0:
        raise InvalidPlanArgument(
            f"vllm_config.model_config.max_model_len must be a positive int, got {value!r}"
        )
    return value


class _Overlay:
    """``base`` with some attributes replaced; every other attribute is read from ``base``."""

    def __init__(self, base: object, **replaced: object) -> None:
        self._base = base
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def _with_max_model_len(vllm_config: Any, max_model_len: int) -> Any:
    """A view of ``vllm_config`` whose ``model_config.max_model_len`` is ``max_model_len``."""
    model_config = _Overlay(vllm_config.model_config, max_model_len=max_model_len)
    return _Overlay(vllm_config, model_config=model_config)


def _require_memory(name: str, value: object) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidPlanArgument(f"{name} must be a number of bytes, got {value!r}")
    return value


# ---------------------------------------------------------------------- memory per request


def max_memory_usage_bytes(vllm_config: object, kv_cache_specs: Iterable[Any]) -> int:
    """Bytes one request of ``max_model_len`` tokens can hold at once, summed over the specs
    (each spec's own ``max_memory_usage_bytes``)."""
    return sum(spec.max_memory_usage_bytes(vllm_config) for spec in kv_cache_specs)


def estimate_max_model_len(
    vllm_config: object, kv_cache_spec: Mapping[str, Any], available_memory: int
) -> int:
    """The longest request (at most ``max_model_len`` tokens) whose KV cache fits in
    ``available_memory`` bytes; 0 when not even one token fits. ``vllm_config`` is not
    changed."""
    upper = _max_model_len(vllm_config)
    memory = _require_memory("available_memory", available_memory)
    specs = list(kv_cache_spec.values())

    def fits(model_len: int) -> bool:
        return max_memory_usage_bytes(_with_max_model_len(vllm_config, model_len), specs) <= memory

    return longest_fitting(fits, upper)


def check_enough_kv_cache_memory(
    vllm_config: object, kv_cache_spec: Mapping[str, Any], available_memory: int
) -> None:
    """Raise ``InsufficientKVCacheMemory`` unless ``available_memory`` holds the KV cache of
    one request of ``max_model_len`` tokens (nothing to check without layers)."""
    if not kv_cache_spec:
        return
    memory = _require_memory("available_memory", available_memory)
    if memory <= 0:
        raise InsufficientKVCacheMemory(
            f"No available memory for the cache blocks ({memory} bytes). Try increasing "
            f"`gpu_memory_utilization` when initializing the engine. See {_MEMORY_DOCS} for "
            "more details.",
            available_bytes=int(memory),
        )
    max_model_len = _max_model_len(vllm_config)
    needed = max_memory_usage_bytes(vllm_config, kv_cache_spec.values())
    if needed > memory:
        estimated = estimate_max_model_len(vllm_config, kv_cache_spec, available_memory)
        estimate = (
            f"Based on the available memory, the estimated maximum model length is {estimated}. "
            if estimated > 0
            else ""
        )
        raise InsufficientKVCacheMemory(
            f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"{needed / GiB:.2f} GiB KV cache is needed, which is larger than the available "
            f"KV cache memory ({memory / GiB:.2f} GiB). {estimate}Try increasing "
            f"`gpu_memory_utilization` or decreasing `max_model_len` when initializing the "
            f"engine. See {_MEMORY_DOCS} for more details.",
            available_bytes=int(memory),
            needed_bytes=needed,
            estimated_max_model_len=estimated,
        )


def get_max_concurrency_for_kv_cache_config(vllm_config: object, kv_cache_config: Any) -> float:
    """Requests of ``max_model_len`` tokens that ``kv_cache_config.num_blocks`` blocks hold at
    once (vLLM's logged "maximum concurrency"; the null block is counted)."""
    groups = list(kv_cache_config.kv_cache_groups)
    layers_per_group = max((len(group.layer_names) for group in groups), default=0)
    if layers_per_group == 0:
        raise EmptyKVCacheGroups(
            f"no layers in the KV-cache groups of {kv_cache_config!r}: concurrency is undefined"
        )
    request_bytes = layers_per_group * max_memory_usage_bytes(
        vllm_config, (group.kv_cache_spec for group in groups)
    )
    block_bytes = groups[0].kv_cache_spec.page_size_bytes * layers_per_group
    blocks_per_request = -(-request_bytes // block_bytes)
    return max_concurrency(kv_cache_config.num_blocks, blocks_per_request)


# ---------------------------------------------------------------------- block counts


def may_override_num_blocks(vllm_config: object, num_blocks: int) -> int:
    """``cache_config.num_gpu_blocks_override`` when set, else ``num_blocks``."""
    override = _config_value(vllm_config, "cache_config", "num_gpu_blocks_override", None)
    if override is None:
        return num_blocks
    if type(override) is not int or override < 0:
        raise InvalidPlanArgument(
            f"cache_config.num_gpu_blocks_override must be an int >= 0, got {override!r}"
        )
    logger.info(
        "Overriding num_gpu_blocks=%d with num_gpu_blocks_override=%d", num_blocks, override
    )
    return override


def get_num_blocks(
    vllm_config: object, num_layers: int, available_memory: int, page_size: int
) -> int:
    """Blocks ``available_memory`` holds when one block costs ``page_size`` bytes in each of
    ``num_layers`` tensors (0 at least), or the configured override."""
    memory = _require_memory("available_memory", available_memory)
    return may_override_num_blocks(vllm_config, num_blocks_for(memory, page_size, num_layers))


def get_uniform_page_size(kv_cache_specs: Iterable[Any]) -> int:
    """The one page size of ``kv_cache_specs``; ``NonUniformPageSize`` if they have several
    (or none)."""
    page_sizes = {spec.page_size_bytes for spec in kv_cache_specs}
    if len(page_sizes) != 1:
        raise NonUniformPageSize(
            f"the specs must share one page size, got {sorted(page_sizes)} bytes"
        )
    page_size: int = page_sizes.pop()
    return page_size


# ---------------------------------------------------------------------- layer kinds


def is_kv_cache_type_attention_free(kv_cache_spec: Mapping[str, Any]) -> bool:
    """Whether the model keeps no KV cache at all (no layer has a spec)."""
    return not kv_cache_spec


def is_kv_cache_spec_uniform(kv_cache_spec: Mapping[str, Any]) -> bool:
    """Whether every layer's spec merges into one (full attention with and without a sliding
    window does); True for no layers. A ``WindowSizeMismatch`` (or vLLM's ``ValueError``)
    from merging is raised, as in vLLM."""
    if not kv_cache_spec:
        return True
    specs = list(kv_cache_spec.values())
    try:
        specs[0].merge(specs)
    except (AssertionError, KVCacheSpecMismatch):  # vLLM's specs assert; impl's raise
        return False
    return True


def is_kv_cache_page_size_uniform(kv_cache_spec: Mapping[str, Any]) -> bool:
    """Whether every layer's page has one size (False for no layers)."""
    return len({spec.page_size_bytes for spec in kv_cache_spec.values()}) == 1


def unify_kv_cache_spec_page_size(kv_cache_spec: Mapping[str, Any]) -> Mapping[str, Any]:
    """The specs with one page size: ``kv_cache_spec`` itself when its pages already have one
    size, else a new dict where each smaller page's block size is multiplied up to the largest
    page. ``PageSizeNotUnifiable`` (a ``NotImplementedError``) when one cannot be."""
    if len({spec.page_size_bytes for spec in kv_cache_spec.values()}) <= 1:
        return kv_cache_spec
    unified = unify_page_sizes(
        list(kv_cache_spec.items()),
        page_size=lambda spec: spec.page_size_bytes,
        scale_block_size=lambda spec, ratio: _with_block_size(spec, spec.block_size * ratio),
    )
    return dict(unified)


def _is_one_type(kv_cache_spec: Mapping[str, Any]) -> bool:
    return is_kv_cache_spec_uniform(kv_cache_spec) or UniformTypeKVCacheSpecs.is_uniform_type(
        kv_cache_spec
    )


def unify_hybrid_kv_cache_specs(kv_cache_spec: MutableMapping[str, Any]) -> None:
    """With the hybrid KV-cache manager off, make the layers one type, in place: when full
    attention is mixed with sliding-window or chunked local layers, those become full-attention
    specs that remember their window. ``HybridKVCacheSpecsNotUnifiable`` if the result is
    still not one type."""
    if _is_one_type(kv_cache_spec):
        return
    logger.warning(
        "Hybrid KV cache manager is disabled for this hybrid model: KV cache outside sliding "
        "windows is kept (no memory saving); the compute of such layers is still saved."
    )
    specs = list(kv_cache_spec.values())
    has_full = any(spec_is_a(spec, "FullAttentionSpec") for spec in specs)
    has_local = any(
        spec_is_a(spec, "SlidingWindowSpec") or spec_is_a(spec, "ChunkedLocalAttentionSpec")
        for spec in specs
    )
    if has_full and has_local:
        for name, spec in list(kv_cache_spec.items()):
            if spec_is_a(spec, "SlidingWindowSpec"):
                window = {"sliding_window": spec.sliding_window}
            elif spec_is_a(spec, "ChunkedLocalAttentionSpec"):
                window = {"attention_chunk_size": spec.attention_chunk_size}
            else:
                continue
            kv_cache_spec[name] = _family_class(spec, "FullAttentionSpec")(
                block_size=spec.block_size,
                num_kv_heads=spec.num_kv_heads,
                head_size=spec.head_size,
                dtype=spec.dtype,
                **window,
            )
    if not _is_one_type(kv_cache_spec):
        kinds = sorted({type(spec).__name__ for spec in kv_cache_spec.values()})
        raise HybridKVCacheSpecsNotUnifiable(
            f"Hybrid KV cache manager is disabled but failed to convert the KV cache specs "
            f"({', '.join(kinds)}) to one unified type."
        )


# ---------------------------------------------------------------------- groups


def create_kv_cache_group_specs(
    kv_cache_spec: Mapping[str, Any], grouped_layer_names: Sequence[Sequence[str]]
) -> list[Any]:
    """One ``KVCacheGroupSpec`` per list of layer names, with the merge of their specs."""
    groups = []
    for names in grouped_layer_names:
        if not names:
            raise EmptyKVCacheGroups("a KV-cache group needs at least one layer")
        missing = [name for name in names if name not in kv_cache_spec]
        if missing:
            raise UnknownLayerError(f"layers {missing!r} have no KV-cache spec")
        specs = [kv_cache_spec[name] for name in names]
        merged = specs[0].merge(specs)
        groups.append(_family_class(merged, "KVCacheGroupSpec")(list(names), merged))
    return groups


def get_kv_cache_groups_uniform_spec(kv_cache_specs: Mapping[str, Any]) -> list[Any]:
    """All layers (one mergeable spec) in a single group."""
    return create_kv_cache_group_specs(kv_cache_specs, [list(kv_cache_specs)])


def get_kv_cache_groups_uniform_type(spec: Any) -> list[Any]:
    """All layers of a ``UniformTypeKVCacheSpecs`` in a single group."""
    return [_family_class(spec, "KVCacheGroupSpec")(list(spec.kv_cache_specs), spec)]


def get_kv_cache_groups_uniform_page_size(kv_cache_spec: Mapping[str, Any]) -> list[Any]:
    """Layers whose pages have one size, grouped as vLLM does (``kv_cache_sizing``,
    ``split_into_groups``): groups of equal spec and near-equal size, padded where a kind's
    layer count is not a multiple of the group size."""
    split = split_into_groups(list(kv_cache_spec.items()))
    if not split:
        return []
    group_size = max(len(names) for _, groups in split for names in groups)
    for _, groups in split:
        layers = sum(len(names) for names in groups)
        padding = len(groups) * group_size - layers
        if padding:
            logger.warning(
                "Add %d padding layers, may waste at most %.2f%% KV cache memory",
                padding,
                padding / layers * 100,
            )
    return create_kv_cache_group_specs(
        kv_cache_spec, [names for _, groups in split for names in groups]
    )


def _uniform_type_spec(kv_cache_spec: Mapping[str, Any]) -> Any:
    """A ``UniformTypeKVCacheSpecs`` (of the specs' family) of all layers, if they are of one
    type; else None."""
    if not UniformTypeKVCacheSpecs.is_uniform_type(kv_cache_spec):
        return None
    first = next(iter(kv_cache_spec.values()))
    family = _family_class(first, "UniformTypeKVCacheSpecs")
    return family(block_size=first.block_size, kv_cache_specs=kv_cache_spec)


def get_kv_cache_groups(vllm_config: object, kv_cache_spec: MutableMapping[str, Any]) -> list[Any]:
    """The model's KV-cache groups: none for an attention-free model; one for one spec, or for
    one type of layers with different shapes (``UniformTypeKVCacheSpecs``); else groups of
    one page size (``get_kv_cache_groups_uniform_page_size``). With
    ``scheduler_config.disable_hybrid_kv_cache_manager`` the specs are first made one type, in
    ``kv_cache_spec`` itself (``unify_hybrid_kv_cache_specs``)."""
    if _config_value(vllm_config, "scheduler_config", "disable_hybrid_kv_cache_manager", False):
        unify_hybrid_kv_cache_specs(kv_cache_spec)
    if is_kv_cache_type_attention_free(kv_cache_spec):
        return []
    if is_kv_cache_spec_uniform(kv_cache_spec):
        return get_kv_cache_groups_uniform_spec(kv_cache_spec)
    uniform_type = _uniform_type_spec(kv_cache_spec)
    if uniform_type is not None:
        return get_kv_cache_groups_uniform_type(uniform_type)
    return get_kv_cache_groups_uniform_page_size(unify_kv_cache_spec_page_size(kv_cache_spec))


# ---------------------------------------------------------------------- configs


def get_kv_cache_config_from_groups(
    vllm_config: object, kv_cache_groups: Sequence[Any], available_memory: int
) -> Any:
    """The ``KVCacheConfig`` of ``kv_cache_groups`` for ``available_memory`` bytes.

    No groups: one block (the null block) and no tensors. One ``UniformTypeKVCacheSpecs``
    group: one tensor per layer, sized by its own page. Otherwise tensor ``i`` is shared by
    layer ``i`` of every group, and a block costs one page in each tensor.
    """
    if not kv_cache_groups:
        config_class = _config_family_class(vllm_config, "KVCacheConfig")
        return config_class(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[])
    memory = _require_memory("available_memory", available_memory)
    first = kv_cache_groups[0]
    tensor_class = _family_class(first, "KVCacheTensor")
    if len(kv_cache_groups) == 1 and spec_is_a(first.kv_cache_spec, "UniformTypeKVCacheSpecs"):
        per_layer = first.kv_cache_spec.kv_cache_specs
        num_blocks = may_override_num_blocks(
            vllm_config, num_blocks_for(memory, first.kv_cache_spec.page_size_bytes, 1)
        )
        tensors = [
            tensor_class(size=per_layer[name].page_size_bytes * num_blocks, shared_by=[name])
            for name in first.layer_names
        ]
    else:
        group_size = max(len(group.layer_names) for group in kv_cache_groups)
        if group_size == 0:
            raise EmptyKVCacheGroups(f"no KV-cache group has a layer: {kv_cache_groups!r}")
        page_size = get_uniform_page_size(group.kv_cache_spec for group in kv_cache_groups)
        num_blocks = get_num_blocks(vllm_config, group_size, available_memory, page_size)
        tensors = [
            tensor_class(size=page_size * num_blocks, shared_by=shared_by)
            for shared_by in tensor_sharing([group.layer_names for group in kv_cache_groups])
        ]
    return _family_class(first, "KVCacheConfig")(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=list(kv_cache_groups)
    )


def _with_num_blocks(kv_cache_config: Any, num_blocks: int) -> Any:
    """``kv_cache_config`` cut down to ``num_blocks`` blocks, its tensors in proportion."""
    old = kv_cache_config.num_blocks
    if old == num_blocks:
        return kv_cache_config
    tensors = [
        dataclasses.replace(tensor, size=tensor.size // old * num_blocks)
        for tensor in kv_cache_config.kv_cache_tensors
    ]
    return dataclasses.replace(kv_cache_config, num_blocks=num_blocks, kv_cache_tensors=tensors)


def report_kv_cache_config(vllm_config: object, kv_cache_config: Any) -> None:
    """Log the KV-cache size in tokens and the concurrency at ``max_model_len``."""
    groups = kv_cache_config.kv_cache_groups
    min_block_size = min(group.kv_cache_spec.block_size for group in groups)
    num_tokens = kv_cache_config.num_blocks // len(groups) * min_block_size
    dcp = _config_value(vllm_config, "parallel_config", "decode_context_parallel_size", 1)
    pcp = _config_value(vllm_config, "parallel_config", "prefill_context_parallel_size", 1)
    if pcp * dcp > 1:
        num_tokens *= pcp * dcp
        logger.info(
            "Multiplying the GPU KV cache size by the cp_world_size %d "
            "(pcp_world_size %d * dcp_world_size %d).",
            pcp * dcp,
            pcp,
            dcp,
        )
    logger.info("GPU KV cache size: %s tokens", f"{num_tokens:,}")
    logger.info(
        "Maximum concurrency for %s tokens per request: %.2fx",
        f"{_max_model_len(vllm_config):,}",
        get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config),
    )


def get_kv_cache_configs(
    vllm_config: object,
    kv_cache_specs: Sequence[Mapping[str, Any]],
    available_memory: Sequence[int],
) -> list[Any]:
    """Each worker's ``KVCacheConfig``: the layers of all workers grouped together (so every
    worker's block tables mean the same), each worker's tensors sized for its memory, and
    every worker given the smallest block count, its tensors shrunk in proportion."""
    if len(kv_cache_specs) != len(available_memory):
        raise InvalidPlanArgument(
            f"{len(kv_cache_specs)} workers' KV-cache specs but {len(available_memory)} "
            "memory sizes"
        )
    for specs, memory in zip(kv_cache_specs, available_memory, strict=True):
        check_enough_kv_cache_memory(vllm_config, specs, memory)

    # Pipeline stages hold different layers; tensor-parallel ranks the same ones.
    merged: dict[str, Any] = {}
    for worker, specs in enumerate(kv_cache_specs):
        for name, spec in specs.items():
            known = merged.setdefault(name, spec)
            if known is not spec and known != spec:
                raise InconsistentLayerSpec(
                    f"layer {name!r} has spec {spec!r} on worker {worker} but {known!r} on an "
                    "earlier one"
                )
    global_groups = get_kv_cache_groups(vllm_config, merged)

    configs = []
    for specs, memory in zip(kv_cache_specs, available_memory, strict=True):
        worker_groups = [
            type(group)([name for name in group.layer_names if name in specs], group.kv_cache_spec)
            for group in global_groups
        ]
        configs.append(get_kv_cache_config_from_groups(vllm_config, worker_groups, memory))

    fewest = min(config.num_blocks for config in configs)
    configs = [_with_num_blocks(config, fewest) for config in configs]
    for config in configs:
        if config.kv_cache_groups:
            report_kv_cache_config(vllm_config, config)
    return configs


def generate_scheduler_kv_cache_config(kv_cache_configs: Sequence[Any]) -> Any:
    """The scheduler's config: a copy of the first worker's (all have the same groups and
    block count), with one layer's spec standing for a ``UniformTypeKVCacheSpecs`` group."""
    if not kv_cache_configs:
        raise InvalidPlanArgument("no KV-cache configs to build the scheduler's from")
    counts = [config.num_blocks for config in kv_cache_configs]
    if len(set(counts)) > 1:
        raise InconsistentNumBlocks(f"the workers' KV-cache configs have {counts} blocks")
    config = copy.deepcopy(kv_cache_configs[0])
    groups = [
        dataclasses.replace(
            group, kv_cache_spec=next(iter(group.kv_cache_spec.kv_cache_specs.values()))
        )
        if spec_is_a(group.kv_cache_spec, "UniformTypeKVCacheSpecs")
        else group
        for group in config.kv_cache_groups
    ]
    return dataclasses.replace(config, kv_cache_groups=groups)
