"""KV-cache groups, page sizes and block counts of a layout: vLLM 0.13's arithmetic, pure.

What is modelled (vLLM 0.13, ``kv_cache_utils.get_kv_cache_groups`` and
``get_kv_cache_config_from_groups``; ``HybridAttentionMambaModelConfig``):

1. Each layer gets a spec: its kind, ``block_size`` tokens per block, and its shape. The page
   size of one block of one layer is ``block_size * num_kv_heads * head_size * 2 * dtype bytes``
   (K and V); an MLA layer stores one latent vector per token (no factor 2); a Mamba layer
   stores one request's whole state per block (``sum(prod(shape) * dtype bytes)``).
2. Attention + Mamba hybrids: the attention block size is raised (in steps of 16 tokens, 64
   for MLA) until one attention page holds a Mamba state, and the Mamba page is padded up to
   the attention page. The Mamba group uses the same block size unless told otherwise.
3. All layers with one equal spec: a single group of every layer.
4. Otherwise page sizes are unified (a smaller attention page has its block size multiplied by
   ``max_page // page``; anything else is rejected), layers are bucketed by equal spec in order
   of first appearance, and each bucket is cut into groups of ``group_size`` layers, where
   ``group_size`` is the smallest bucket (or the largest, when that is under 1.25 times the
   smallest: less padding). A bucket of ``n`` layers becomes ``g = cdiv(n, group_size)``
   groups, the ``k``-th taking every ``g``-th layer from ``k``.
5. Memory: ``group_size`` tensors (one per position in a group) each hold ``num_blocks`` pages,
   and a block id names the same page in all of them, so one block costs
   ``page_size * group_size`` bytes and ``num_blocks = memory // (page_size * group_size)``.
   Block 0 is the null block, so ``num_blocks - 1`` blocks hold data.
6. A request of ``n`` tokens needs, per group (vLLM's ``max_memory_usage_bytes`` in blocks):
   full / MLA ``cdiv(n, bs)``; sliding window ``cdiv(min(w - 1 + B, n), bs) + 1``; chunked
   local ``cdiv(min(c + B, n), bs)``; cross-attention ``cdiv(encoder_len, bs)``; Mamba
   ``cdiv(n, bs)``, which is 1 here: without prefix caching vLLM makes a Mamba block
   ``max_model_len`` tokens long. ``B`` is ``max_num_batched_tokens`` (the chunked-prefill
   step).

Steps 4 and 5, the request sizes of step 6, the binary search for the longest request and the
concurrency figure are written once, over any spec type, in ``kvspec.impl.kv_cache_sizing``
(``unify_page_sizes``, ``split_into_groups``, ``tensor_sharing``, ``num_blocks_for``,
``request_blocks``, ``longest_fitting``, ``max_concurrency``; models/ sits above impl/):
``kv_cache_groups`` below applies them to a layout's ``GroupSpec``s, and
``kvspec.impl.kv_cache_planning`` (vLLM 0.13's ``get_kv_cache_configs`` and friends) to the
spec objects of vLLM's callers.

Every count and size the plan reads (block sizes, block counts, token counts, memory bytes)
is an int from 1 to 2**63 - 1, the int64 range vLLM's tensors and memory figures live in;
anything else is refused with ``InvalidPlanArgument`` (``InvalidMemorySize`` for memory),
naming the value.

Not modelled by ``kv_cache_groups`` (``impl.kv_cache_planning`` handles them for spec objects):
layers of one kind with different shapes (vLLM's ``UniformTypeKVCacheSpecs``), the hybrid
allocator switched off, context parallelism. Not modelled anywhere: fp8/quantised KV caches,
speculative Mamba blocks, pipeline parallelism.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kvspec.impl import errors as impl_errors
from kvspec.impl.errors import InvalidPlanArgument
from kvspec.impl.kv_cache_sizing import (
    longest_fitting,
    max_concurrency,
    num_blocks_for,
    request_blocks,
    split_into_groups,
    tensor_sharing,
    unify_page_sizes,
)
from kvspec.models.layout import DTYPE_BYTES, InvalidLayout, LayerLayout, ModelLayout

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "GroupPlan",
    "GroupSpec",
    "InvalidMemorySize",
    "InvalidPlanArgument",
    "KVCacheGroup",
    "MemoryPlan",
    "PageSizeNotUnifiable",
    "format_bytes",
    "kv_cache_groups",
    "layer_specs",
    "longest_fitting",
    "max_concurrency",
    "max_context_tokens",
    "num_blocks_for",
    "num_blocks_for_memory",
    "parse_memory",
    "plan_memory",
    "request_blocks",
    "split_into_groups",
    "tensor_sharing",
    "unify_page_sizes",
]

# vLLM's default chunked-prefill step for online serving.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# Block-size steps of the attention kernels when sizing a page for a Mamba state.
_KERNEL_BLOCK_ALIGNMENT = 16
_MLA_KERNEL_BLOCK_ALIGNMENT = 64


class InvalidMemorySize(InvalidPlanArgument):
    """A memory size string or value cannot be read as a positive number of bytes, or a budget
    that holds no block."""


class PageSizeNotUnifiable(impl_errors.PageSizeNotUnifiable, InvalidLayout):
    """Layers whose pages cannot be made one size by growing block sizes (a page that does not
    divide the largest, or a Mamba page, which does not grow with its block size): impl's
    ``PageSizeNotUnifiable`` (a ``NotImplementedError`` too, as vLLM raises), naming the model,
    and an ``InvalidLayout``."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The largest count or size the plan takes: int64, as vLLM's tensors and memory figures hold.
MAX_PLAN_INT = 2**63 - 1


def _require_positive_int(name: str, value: object) -> int:
    if type(value) is not int or not 0 < value <= MAX_PLAN_INT:
        raise InvalidPlanArgument(
            f"{name} must be a positive int at most 2**63 - 1, got {shown(value)}")
    return value


def _require_layout(layout: object) -> ModelLayout:
    if not isinstance(layout, ModelLayout):
        raise InvalidPlanArgument(f"not a ModelLayout: {shown(layout)}")
    return layout


def shown(value: object) -> str:
    """``repr(value)``, cut short for a value too long to name in a one-line error."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:40]}... ({len(text)} characters)"


@dataclass(frozen=True)
class GroupSpec:
    """The spec every layer of one KV-cache group shares (the pure twin of impl's specs)."""

    kind: str
    block_size: int
    dtype: str
    num_kv_heads: int = 0
    head_size: int = 0
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    mamba_shapes: tuple[tuple[int, ...], ...] = ()
    mamba_dtypes: tuple[str, ...] = ()
    mamba_type: str | None = None
    page_size_padded: int | None = None

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes one block of one layer really uses, before padding."""
        if self.kind == "mamba":
            total = 0
            for shape, dtype in zip(self.mamba_shapes, self.mamba_dtypes, strict=True):
                elements = 1
                for size in shape:
                    elements *= size
                total += elements * DTYPE_BYTES[dtype]
            return total
        per_token = self.num_kv_heads * self.head_size * DTYPE_BYTES[self.dtype]
        if self.kind != "mla":
            per_token *= 2  # K and V
        return self.block_size * per_token

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer occupies."""
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def blocks_for_request(
        self, num_tokens: int, max_num_batched_tokens: int, num_encoder_tokens: int
    ) -> int:
        """Blocks of this group one request of ``num_tokens`` tokens can hold at once."""
        if self.kind == "mamba":
            # The plan models Mamba without prefix caching, where vLLM 0.13 makes a Mamba block
            # max_model_len tokens long: one block per request, whatever ``block_size`` says.
            return 1
        return request_blocks(
            self.kind,
            self.block_size,
            num_tokens,
            max_num_batched_tokens=max_num_batched_tokens,
            num_encoder_tokens=num_encoder_tokens,
            sliding_window=self.sliding_window,
            attention_chunk_size=self.attention_chunk_size,
        )

    def describe(self) -> str:
        """A short human-readable form, e.g. ``sliding_window(window=1024, 16 x 128, bfloat16)``."""
        if self.kind == "mamba":
            states = ", ".join(
                f"{'x'.join(map(str, shape))} {dtype}"
                for shape, dtype in zip(self.mamba_shapes, self.mamba_dtypes, strict=True)
            )
            padded = (
                f", padded {self.real_page_size_bytes:,} -> {self.page_size_padded:,} B"
                if self.page_size_padded is not None
                else ""
            )
            return f"mamba({self.mamba_type or 'mamba'}: {states}{padded})"
        extra = ""
        if self.sliding_window is not None:
            extra = f"window={self.sliding_window}, "
        elif self.attention_chunk_size is not None:
            extra = f"chunk={self.attention_chunk_size}, "
        heads = "latent" if self.kind == "mla" else f"{self.num_kv_heads} kv heads"
        return f"{self.kind}({extra}{heads} x {self.head_size}, {self.dtype})"


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one block table, and their spec."""

    group_id: int
    layer_names: tuple[str, ...]
    spec: GroupSpec


@dataclass(frozen=True)
class GroupPlan:
    """A layout's KV-cache groups for one block size, and their shared page geometry."""

    model: str
    requested_block_size: int
    groups: tuple[KVCacheGroup, ...]
    page_size_bytes: int  # one block of one layer, the same for every group
    layers_per_block: int  # layers sharing a block id: the number of KV-cache tensors
    adjustments: tuple[str, ...] = ()

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs: its page in each of the ``layers_per_block`` tensors."""
        return self.page_size_bytes * self.layers_per_block

    @property
    def padding_layers(self) -> int:
        """Tensor slots left empty because a group has fewer layers than ``layers_per_block``."""
        return sum(self.layers_per_block - len(g.layer_names) for g in self.groups)

    def blocks_per_request(
        self, num_tokens: int, max_num_batched_tokens: int, num_encoder_tokens: int = 0
    ) -> int:
        """Blocks (summed over groups) one request of ``num_tokens`` tokens can hold at once."""
        return sum(
            g.spec.blocks_for_request(num_tokens, max_num_batched_tokens, num_encoder_tokens)
            for g in self.groups
        )

    def kv_cache_tensors(self, num_blocks: int) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """``(size_bytes, shared_by)`` of each KV-cache tensor: tensor ``i`` holds layer ``i``
        of every group that has one."""
        return tuple(
            (self.page_size_bytes * num_blocks, tuple(shared_by))
            for shared_by in tensor_sharing([g.layer_names for g in self.groups])
        )


def _layer_spec(layer: LayerLayout, block_size: int) -> GroupSpec:
    return GroupSpec(
        kind=layer.kind,
        block_size=block_size,
        dtype=layer.dtype,
        num_kv_heads=layer.num_kv_heads,
        head_size=layer.head_size,
        sliding_window=layer.sliding_window,
        attention_chunk_size=layer.attention_chunk_size,
        mamba_shapes=layer.mamba_shapes,
        mamba_dtypes=layer.mamba_dtypes,
        mamba_type=layer.mamba_type,
    )


def layer_specs(
    layout: ModelLayout, block_size: int = 16, *, mamba_block_size: int | None = None
) -> tuple[list[tuple[str, GroupSpec]], list[str]]:
    """Each layer's spec, in layer order, with vLLM's attention/Mamba page alignment applied
    (module docstring, 1-2; what vLLM's model runner reports per layer), and the adjustments
    made, in words."""
    _require_layout(layout)
    _require_positive_int("block_size", block_size)
    if mamba_block_size is not None:
        _require_positive_int("mamba_block_size", mamba_block_size)
    mamba_layers = [layer for layer in layout.layers if layer.kind == "mamba"]
    attention_layers = [layer for layer in layout.layers if layer.is_attention]
    adjustments: list[str] = []
    attention_block_size = block_size
    mamba_padded: int | None = None
    if mamba_layers and attention_layers:
        per_token = {layer.bytes_per_token for layer in attention_layers}
        if len(per_token) != 1:
            raise InvalidLayout(
                f"model {layout.name!r}: attention layers of a Mamba hybrid must all take the "
                f"same bytes per token, got {sorted(per_token)}"
            )
        token_bytes = per_token.pop()
        state = max(layer.state_bytes for layer in mamba_layers)
        alignment = (
            _MLA_KERNEL_BLOCK_ALIGNMENT
            if any(layer.kind == "mla" for layer in attention_layers)
            else _KERNEL_BLOCK_ALIGNMENT
        )
        needed = alignment * _cdiv(state, alignment * token_bytes)
        if needed > attention_block_size:
            adjustments.append(
                f"attention block size raised {block_size} -> {needed} tokens so one attention "
                f"page ({needed} x {token_bytes:,} B) holds a Mamba state ({state:,} B)"
            )
            attention_block_size = needed
        attention_page = attention_block_size * token_bytes
        if attention_page != state:
            mamba_padded = attention_page
            adjustments.append(
                f"Mamba page padded {state:,} -> {attention_page:,} B to match the attention page"
            )
    chosen_mamba_block_size = attention_block_size if mamba_block_size is None else mamba_block_size
    specs: list[tuple[str, GroupSpec]] = []
    for layer in layout.layers:
        if layer.kind == "mamba":
            spec = replace(
                _layer_spec(layer, chosen_mamba_block_size), page_size_padded=mamba_padded
            )
        else:
            spec = _layer_spec(layer, attention_block_size)
        specs.append((layer.name, spec))
    return specs, adjustments


def kv_cache_groups(
    layout: ModelLayout, block_size: int = 16, *, mamba_block_size: int | None = None
) -> GroupPlan:
    """How vLLM 0.13 groups ``layout``'s layers into KV-cache groups (module docstring, 1-4)."""
    specs, adjustments = layer_specs(layout, block_size, mamba_block_size=mamba_block_size)
    distinct = {spec for _, spec in specs}
    if len(distinct) == 1:
        spec = specs[0][1]
        group = KVCacheGroup(0, tuple(name for name, _ in specs), spec)
        return GroupPlan(
            layout.name, block_size, (group,), spec.page_size_bytes, len(specs), tuple(adjustments)
        )
    if len({spec.kind for spec in distinct}) == 1:
        raise InvalidLayout(
            f"model {layout.name!r}: {specs[0][1].kind} layers of different shapes (vLLM's "
            "UniformTypeKVCacheSpecs) are not modelled"
        )

    try:
        unified = unify_page_sizes(
            specs,
            page_size=lambda spec: spec.page_size_bytes,
            scale_block_size=lambda spec, ratio: replace(
                spec, block_size=spec.block_size * ratio
            ),
        )
    except impl_errors.PageSizeNotUnifiable as error:
        raise PageSizeNotUnifiable(f"model {layout.name!r}: {error}") from None
    rescaled: set[GroupSpec] = set()
    for (_, spec), (_, grown) in zip(specs, unified, strict=True):
        if grown is not spec and spec not in rescaled:
            rescaled.add(spec)
            adjustments.append(
                f"{spec.kind} block size raised {spec.block_size} -> {grown.block_size} "
                "tokens to match the largest page"
            )

    groups: list[KVCacheGroup] = []
    for spec, bucket_groups in split_into_groups(unified):
        for names in bucket_groups:
            groups.append(KVCacheGroup(len(groups), tuple(names), spec))
    return GroupPlan(
        layout.name,
        block_size,
        tuple(groups),
        unified[0][1].page_size_bytes,
        max(len(g.layer_names) for g in groups),
        tuple(adjustments),
    )


def num_blocks_for_memory(groups: GroupPlan, memory_bytes: int) -> int:
    """Blocks ``memory_bytes`` of KV cache holds (vLLM's ``get_num_blocks``), null block
    included."""
    _require_positive_int("memory_bytes", memory_bytes)
    return num_blocks_for(memory_bytes, groups.page_size_bytes, groups.layers_per_block)


def max_context_tokens(
    groups: GroupPlan,
    usable_blocks: int,
    max_model_len: int,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    num_encoder_tokens: int = 0,
) -> int:
    """The longest request (at most ``max_model_len`` tokens) whose blocks fit in
    ``usable_blocks``; 0 when not even one token fits."""
    _require_positive_int("max_model_len", max_model_len)
    _require_positive_int("max_num_batched_tokens", max_num_batched_tokens)

    def fits(num_tokens: int) -> bool:
        needed = groups.blocks_per_request(num_tokens, max_num_batched_tokens, num_encoder_tokens)
        return needed <= usable_blocks

    return longest_fitting(fits, max_model_len)


@dataclass(frozen=True)
class MemoryPlan:
    """What a memory budget (or a block count) buys for one layout."""

    layout: ModelLayout
    groups: GroupPlan
    memory_bytes: int
    num_blocks: int  # including the null block
    max_model_len: int
    max_num_batched_tokens: int
    max_context_tokens: int
    blocks_per_max_request: int  # blocks one request of max_model_len tokens holds

    @property
    def usable_blocks(self) -> int:
        """Blocks that can hold data: every block but the null block."""
        return max(self.num_blocks - 1, 0)

    @property
    def min_block_size(self) -> int:
        return min(g.spec.block_size for g in self.groups.groups)

    @property
    def pool_tokens(self) -> int:
        """Token slots in the pool if every usable block went to one attention group."""
        return self.usable_blocks * self.min_block_size

    @property
    def kv_cache_tokens(self) -> int:
        """vLLM's logged "GPU KV cache size": ``num_blocks // num_groups * min block size``."""
        return self.num_blocks // len(self.groups.groups) * self.min_block_size

    @property
    def max_concurrency(self) -> float:
        """Requests of ``max_model_len`` tokens that fit at once in the usable blocks (vLLM's
        logged figure divides all ``num_blocks``, the null block included)."""
        return max_concurrency(self.usable_blocks, self.blocks_per_max_request)

    @property
    def context_limited_by(self) -> str:
        return "model" if self.max_context_tokens >= self.max_model_len else "memory"


def plan_memory(
    layout: ModelLayout,
    *,
    memory_bytes: int | None = None,
    num_blocks: int | None = None,
    block_size: int = 16,
    mamba_block_size: int | None = None,
    max_model_len: int | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
) -> MemoryPlan:
    """Plan ``layout`` for a memory budget or a block count (give exactly one)."""
    _require_layout(layout)
    if (memory_bytes is None) == (num_blocks is None):
        raise InvalidPlanArgument(
            f"give exactly one of memory_bytes ({memory_bytes!r}) and num_blocks ({num_blocks!r})"
        )
    _require_positive_int("max_num_batched_tokens", max_num_batched_tokens)
    model_len = layout.max_model_len if max_model_len is None else max_model_len
    _require_positive_int("max_model_len", model_len)
    groups = kv_cache_groups(layout, block_size, mamba_block_size=mamba_block_size)
    if memory_bytes is not None:
        blocks = num_blocks_for_memory(groups, memory_bytes)
        if blocks < 1:
            # vLLM refuses a KV-cache budget with no room for a block (its engine stops with
            # "No available memory for the cache blocks" or "To serve at least one request
            # ... KV cache is needed": vllm/v1/core/kv_cache_utils.py,
            # check_enough_kv_cache_memory).
            raise InvalidMemorySize(
                f"memory {format_bytes(memory_bytes)} ({memory_bytes:,} B) holds no block of "
                f"{layout.name}: one block takes {groups.bytes_per_block:,} B "
                f"({groups.page_size_bytes:,} B x {groups.layers_per_block} layers)")
        memory = memory_bytes
    else:
        blocks = _require_positive_int("num_blocks", num_blocks)
        memory = blocks * groups.bytes_per_block
    encoder_tokens = layout.max_encoder_len or 0
    return MemoryPlan(
        layout=layout,
        groups=groups,
        memory_bytes=memory,
        num_blocks=blocks,
        max_model_len=model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_context_tokens=max_context_tokens(
            groups, max(blocks - 1, 0), model_len, max_num_batched_tokens, encoder_tokens
        ),
        blocks_per_max_request=groups.blocks_per_request(
            model_len, max_num_batched_tokens, encoder_tokens
        ),
    )


# --- memory sizes --------------------------------------------------------------------------

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
# ASCII only: str.isdigit digits of other scripts ("١") and Unicode spaces are not sizes.
_MEMORY = re.compile(r"[ \t]*([0-9]+(?:\.[0-9]+)?|\.[0-9]+)[ \t]*([a-zA-Z]*)[ \t]*", re.ASCII)
# More digits than any size up to 2**63 - 1 bytes needs (19, and a fraction's worth more):
# refused before int() reads them (it refuses past 4,300 digits with a bare ValueError).
_MAX_MEMORY_DIGITS = 40


def parse_memory(text: str) -> int:
    """Bytes in a size like ``"80GiB"``, ``"80 GB"``, ``"1.5T"`` or ``"123456"``.

    ``KiB``/``MiB``/``GiB``/``TiB`` and the bare ``K``/``M``/``G``/``T`` are powers of 1024;
    ``KB``/``MB``/``GB``/``TB`` powers of 1000. Fractions round down to whole bytes.
    """
    if not isinstance(text, str):
        raise InvalidMemorySize(f"memory size must be a string, got {shown(text)}")
    match = _MEMORY.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise InvalidMemorySize(
            f"cannot read memory size {shown(text)}; write e.g. 80GiB, 80GB, 512MiB or a "
            "byte count"
        )
    number = match.group(1)
    if len(number) > _MAX_MEMORY_DIGITS:
        raise InvalidMemorySize(f"memory size {shown(text)} is more than 2**63 - 1 bytes")
    whole, _, fraction = number.partition(".")
    scale = _UNITS[unit]
    # Exact integer arithmetic: "0.1GiB" must not suffer float rounding.
    denominator = int(10 ** len(fraction))
    result = (int(whole or "0") * denominator + int(fraction or "0")) * scale // denominator
    if result <= 0:
        raise InvalidMemorySize(f"memory size {shown(text)} is not a positive number of bytes")
    if result > MAX_PLAN_INT:
        raise InvalidMemorySize(f"memory size {shown(text)} is more than 2**63 - 1 bytes")
    return result


def format_bytes(count: int) -> str:
    """``count`` bytes in the largest binary unit that keeps it at least 1 (e.g. ``80 GiB``)."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if count >= scale:
            if count % scale == 0:
                return f"{count // scale} {unit}"
            if count >= 2**1000:  # past float's range: round in integers
                hundredths = (count * 100 + scale // 2) // scale
                return f"{hundredths // 100}.{hundredths % 100:02d} {unit}"
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"
