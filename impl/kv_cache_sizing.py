"""vLLM 0.13's KV-cache sizing arithmetic, layout-free, over any spec type.

Page-size unification, the grouping of layers, which layers share a KV-cache tensor, the blocks a
memory budget holds, the blocks one request holds at its peak, the longest request that fits and
the concurrency figure: each written once, for any hashable spec, with page sizes and block-size
changes passed in as functions so each caller keeps its own spec classes. Two callers:
``kvspec.impl.kv_cache_planning`` (vLLM 0.13's ``get_kv_cache_configs`` and friends, over the
spec objects of vLLM's callers) and ``kvspec.models.plan`` (over a model layout's ``GroupSpec``s;
models/ sits above impl/ and imports this module).

vLLM 0.13 reference: ``vllm/v1/core/kv_cache_utils.py`` (``unify_kv_cache_spec_page_size``,
``_get_kv_cache_groups_uniform_page_size``, ``get_kv_cache_config_from_groups``,
``get_num_blocks``, ``get_max_concurrency_for_kv_cache_config``, ``estimate_max_model_len``)
and ``vllm/v1/kv_cache_interface.py`` (``max_memory_usage_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from kvspec.impl.errors import InvalidPlanArgument, PageSizeNotUnifiable

__all__ = [
    "InvalidPlanArgument",
    "PageSizeNotUnifiable",
    "longest_fitting",
    "max_concurrency",
    "num_blocks_for",
    "request_blocks",
    "split_into_groups",
    "tensor_sharing",
    "unify_page_sizes",
]

# A bucket less than this much larger than the smallest sets the group size instead (vLLM
# 0.13's heuristic: 12 sliding + 13 full layers make two groups of 13, one padding slot,
# rather than groups of 12 and a second full group of one).
_GROUP_SIZE_SLACK = 1.25


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


SpecT = TypeVar("SpecT", bound=Hashable)


def unify_page_sizes(
    named_specs: Sequence[tuple[str, SpecT]],
    page_size: Callable[[SpecT], int],
    scale_block_size: Callable[[SpecT, int], SpecT],
) -> list[tuple[str, SpecT]]:
    """``(layer, spec)`` pairs with one page size: a spec whose page is smaller than the largest
    gets its block size multiplied by ``largest // page`` (``scale_block_size(spec, ratio)``
    builds it); other specs are kept as they are (the same objects).

    Raises ``PageSizeNotUnifiable`` when a page does not divide the largest, or growing the
    block size does not give the largest page (a Mamba state does not grow with it).
    """
    pages = [page_size(spec) for _, spec in named_specs]
    if len(set(pages)) <= 1:
        return list(named_specs)
    largest = max(pages)
    unified: list[tuple[str, SpecT]] = []
    grown: dict[SpecT, SpecT] = {}
    for (name, spec), page in zip(named_specs, pages, strict=True):
        if page != largest:
            if spec not in grown:
                ratio, remainder = divmod(largest, page)
                bigger = scale_block_size(spec, ratio)
                if remainder or page_size(bigger) != largest:
                    raise PageSizeNotUnifiable(
                        f"layer {name!r} has a {page:,}-byte page that cannot be grown to the "
                        f"largest page ({largest:,} B) by a whole multiple of its block size"
                    )
                grown[spec] = bigger
            spec = grown[spec]
        unified.append((name, spec))
    return unified


def split_into_groups(
    named_specs: Sequence[tuple[str, SpecT]],
) -> list[tuple[SpecT, list[list[str]]]]:
    """vLLM 0.13's grouping of layers whose specs share one page size.

    Layers are bucketed by equal spec, in order of first appearance; ``group_size`` is the
    smallest bucket (or the largest, when that is under 1.25 times the smallest: less
    padding), and each bucket of ``n`` layers is cut into ``cdiv(n, group_size)`` groups, the
    ``k``-th taking every ``cdiv(n, group_size)``-th layer from ``k``. Returns each bucket's
    spec (its first layer's) and its groups' layer names.
    """
    buckets: dict[SpecT, list[str]] = {}  # keyed by the first layer's spec object
    for name, spec in named_specs:
        buckets.setdefault(spec, []).append(name)
    if not buckets:
        return []
    sizes = [len(names) for names in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < group_size * _GROUP_SIZE_SLACK:
        group_size = max(sizes)
    # Strided, not consecutive: with pipeline parallelism each stage holds a slice of every
    # group's layers, and consecutive cuts would leave one stage's groups unevenly full.
    split: list[tuple[SpecT, list[list[str]]]] = []
    for spec, names in buckets.items():
        num_groups = _cdiv(len(names), group_size)
        split.append((spec, [names[k::num_groups] for k in range(num_groups)]))
    return split


def tensor_sharing(group_layer_names: Sequence[Sequence[str]]) -> list[list[str]]:
    """The layers sharing each KV-cache tensor: tensor ``i`` holds layer ``i`` of every group
    that has one (a block id names the same page in all of them)."""
    width = max((len(names) for names in group_layer_names), default=0)
    return [[names[i] for names in group_layer_names if i < len(names)] for i in range(width)]


def num_blocks_for(memory_bytes: float, page_size_bytes: int, num_layers: int) -> int:
    """Blocks ``memory_bytes`` holds when a block id costs one page in each of ``num_layers``
    tensors (vLLM's ``get_num_blocks``; 0 for no or negative memory)."""
    if page_size_bytes <= 0 or num_layers <= 0:
        raise InvalidPlanArgument(
            f"page size ({page_size_bytes!r}) and layers per block ({num_layers!r}) must be "
            "positive"
        )
    return max(int(memory_bytes // page_size_bytes // num_layers), 0)


def request_blocks(
    kind: str,
    block_size: int,
    num_tokens: int,
    *,
    max_num_batched_tokens: int,
    num_encoder_tokens: int,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
) -> int:
    """Blocks one layer of ``kind`` holds for a request of ``num_tokens`` tokens at its peak:
    vLLM 0.13's ``max_memory_usage_bytes`` in pages. ``B`` is ``max_num_batched_tokens``
    (the chunked-prefill step): full, MLA and Mamba ``cdiv(n, bs)``; sliding window
    ``cdiv(min(w - 1 + B, n), bs) + 1``; chunked local ``cdiv(min(c + B, n), bs)``;
    cross-attention ``cdiv(encoder_len, bs)``; ``encoder_only`` 0 (no KV cache kept between
    steps).
    """
    if kind in ("full", "mla", "mamba"):
        return _cdiv(num_tokens, block_size)
    if kind == "sliding_window" and sliding_window is not None:
        held = min(sliding_window - 1 + max_num_batched_tokens, num_tokens)
        return _cdiv(held, block_size) + 1  # the window may start mid-block
    if kind == "chunked_local" and attention_chunk_size is not None:
        return _cdiv(min(attention_chunk_size + max_num_batched_tokens, num_tokens), block_size)
    if kind == "cross_attention":
        return _cdiv(num_encoder_tokens, block_size)
    if kind == "encoder_only":
        return 0
    raise InvalidPlanArgument(
        f"no request size for a {kind!r} layer (sliding_window={sliding_window!r}, "
        f"attention_chunk_size={attention_chunk_size!r})"
    )


def longest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest ``n`` in ``[1, upper]`` with ``fits(n)``, or 0 when ``fits(1)`` is false.
    ``fits`` must be monotone: once false, false for every larger ``n`` (a binary search)."""
    if not fits(1):
        return 0
    low, high = 1, upper  # fits(low) holds
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def max_concurrency(num_blocks: int, blocks_per_request: int) -> float:
    """Requests of ``blocks_per_request`` blocks that ``num_blocks`` blocks hold at once."""
    if blocks_per_request <= 0:
        raise InvalidPlanArgument(
            f"a request holds {blocks_per_request!r} blocks: concurrency is unbounded"
        )
    return num_blocks / blocks_per_request
