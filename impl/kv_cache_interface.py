"""KV-cache specs and config: what each layer stores per block, and how blocks are grouped.

Mirrors ``vllm/v1/kv_cache_interface.py`` of vLLM 0.13 (field names, class hierarchy,
``page_size_bytes``), with three deliberate differences:

* Every class is a frozen dataclass, so specs compare and hash by value (the hybrid
  coordinator groups KV-cache groups by spec equality).
* ``dtype`` accepts a ``torch.dtype`` or a string (``"bfloat16"``, ``"bf16"``, ``"fp8"``,
  ``torch.float16`` ...) and is stored as its canonical string name (``"bfloat16"``), so this
  module never imports torch and ``FullAttentionSpec(..., dtype=torch.bfloat16) ==
  FullAttentionSpec(..., dtype="bfloat16")``. ``torch_dtype`` gives the ``torch.dtype`` back.
* ``max_memory_usage_bytes`` takes vLLM's ``VllmConfig`` (read duck-typed: the model's
  ``max_model_len``, the scheduler's ``max_num_batched_tokens`` and
  ``max_num_encoder_input_tokens``, the context-parallel sizes) as vLLM's does, or those
  lengths as integers; each kind's rule is ``kvspec.impl.kv_cache_sizing.request_blocks``.

Sequences given to ``KVCacheTensor``, ``KVCacheGroupSpec`` and ``KVCacheConfig`` are stored as
tuples. Bad values raise ``InvalidKVCacheSpec`` (a ``ValueError``) naming the value; specs that
cannot merge raise its subclasses ``KVCacheSpecMismatch`` (where vLLM asserts) and
``WindowSizeMismatch`` (where vLLM raises ``ValueError``).

``EncoderOnlyAttentionSpec`` and ``UniformTypeKVCacheSpecs`` exist for planning
(``kvspec.impl.kv_cache_planning``); as in vLLM, no manager serves them.

vLLM's own spec and config objects (or a fork's) are accepted wherever impl takes a spec or a
config: ``as_kv_cache_spec`` and ``as_kv_cache_config`` recognise them by what they are (the
class name of a spec kind, and the fields that kind has), never by importing vLLM, and give
impl's equal object. The managers keep the caller's object and compute with impl's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Protocol, TypeVar

from kvspec.impl.errors import (
    InvalidKVCacheSpec,
    KVCacheSpecMismatch,
    UnsupportedKVCacheSpecType,
    WindowSizeMismatch,
)
from kvspec.impl.kv_cache_sizing import request_blocks

__all__ = [
    "DTYPE_SIZES",
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "InvalidKVCacheSpec",
    "KVCacheConfig",
    "KVCacheConfigLike",
    "KVCacheGroupSpec",
    "KVCacheGroupSpecLike",
    "KVCacheSpec",
    "KVCacheSpecLike",
    "KVCacheSpecMismatch",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "MambaSpec",
    "SinkFullAttentionSpec",
    "SlidingWindowSpec",
    "UniformTypeKVCacheSpecs",
    "UnsupportedKVCacheSpecType",
    "WindowSizeMismatch",
    "as_kv_cache_config",
    "as_kv_cache_spec",
    "canonical_dtype",
    "dtype_size",
    "spec_fields",
    "spec_is_a",
    "spec_kind",
]


# Bytes per element of every dtype a KV cache or a Mamba state uses, by canonical name.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
}

_DTYPE_ALIASES: dict[str, str] = {
    "double": "float64",
    "float": "float32",
    "fp32": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "fp8_inc": "float8_e4m3fn",
    "long": "int64",
    "int": "int32",
    "short": "int16",
}


def canonical_dtype(dtype: object) -> str:
    """The canonical name of ``dtype`` (a ``torch.dtype`` or a string), e.g. ``"bfloat16"``.

    >>> canonical_dtype("bf16")
    'bfloat16'
    """
    if isinstance(dtype, str):
        name = dtype
    elif type(dtype).__name__ == "dtype" and type(dtype).__module__ == "torch":
        name = str(dtype)
    else:
        raise InvalidKVCacheSpec(f"dtype must be a torch.dtype or a string, got {dtype!r}")
    name = name.lower().removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_SIZES:
        raise InvalidKVCacheSpec(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}")
    return name


def dtype_size(dtype: object) -> int:
    """Bytes per element of ``dtype`` (a ``torch.dtype`` or a string)."""
    return DTYPE_SIZES[canonical_dtype(dtype)]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Sizes in tokens, bytes and elements are int64 where vLLM's worker uses them.
_MAX_SIZE = 2**63 - 1


def _require_positive(owner: object, name: str, value: object) -> None:
    if type(value) is not int or not 0 < value <= _MAX_SIZE:
        raise InvalidKVCacheSpec(
            f"{type(owner).__name__}.{name} must be a positive int (at most 2**63 - 1), "
            f"got {value!r}"
        )


def _names(owner: object, field_name: str, names: object) -> tuple[str, ...]:
    """Layer names: a sequence of str (a str itself is refused: it is not a list of names)."""
    if isinstance(names, str | bytes) or not isinstance(names, Sequence | set | frozenset):
        raise InvalidKVCacheSpec(
            f"{type(owner).__name__}.{field_name} must be a sequence of layer names, "
            f"got {names!r}")
    named = tuple(names)
    for name in named:
        if type(name) is not str:
            raise InvalidKVCacheSpec(
                f"{type(owner).__name__}.{field_name} holds {name!r}, not a layer name")
    return named


def _members(owner: object, field_name: str, values: object, kind: type) -> tuple[Any, ...]:
    """A sequence of ``kind`` objects, as a tuple."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise InvalidKVCacheSpec(
            f"{type(owner).__name__}.{field_name} must be a sequence of {kind.__name__}, "
            f"got {values!r}")
    members = tuple(values)
    for member in members:
        if not isinstance(member, kind):
            raise InvalidKVCacheSpec(
                f"{type(owner).__name__}.{field_name} holds {member!r}, not a {kind.__name__}")
    return members


def _require_optional_positive(owner: object, name: str, value: object) -> None:
    if value is not None:
        _require_positive(owner, name, value)


def spec_is_a(spec: object, class_name: str) -> bool:
    """Whether ``spec``'s class is, or derives from, a class called ``class_name``: vLLM's
    ``isinstance(spec, FullAttentionSpec)`` for a spec of any family (impl's, vLLM's, a
    fork's), without importing vLLM."""
    return any(cls.__name__ == class_name for cls in type(spec).__mro__)


@dataclass(frozen=True)
class _RequestLengths:
    """What ``max_memory_usage_bytes`` reads from vLLM's ``VllmConfig``."""

    max_model_len: int
    max_num_batched_tokens: int
    max_num_encoder_tokens: int
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1

    @classmethod
    def of(
        cls,
        vllm_config: object,
        max_num_batched_tokens: int | None,
        max_num_encoder_tokens: int | None,
    ) -> _RequestLengths:
        """From a ``VllmConfig``, or from ``max_model_len`` as an int and the two lengths
        (each defaulting to ``max_model_len``)."""
        values: dict[str, object]
        if isinstance(vllm_config, int) and not isinstance(vllm_config, bool):
            values = {
                "max_model_len": vllm_config,
                "max_num_batched_tokens": (
                    vllm_config if max_num_batched_tokens is None else max_num_batched_tokens
                ),
                "max_num_encoder_tokens": (
                    vllm_config if max_num_encoder_tokens is None else max_num_encoder_tokens
                ),
            }
        else:
            model = getattr(vllm_config, "model_config", None)
            scheduler = getattr(vllm_config, "scheduler_config", None)
            parallel = getattr(vllm_config, "parallel_config", None)
            values = {
                "max_model_len": getattr(model, "max_model_len", None),
                "max_num_batched_tokens": getattr(scheduler, "max_num_batched_tokens", None),
                "max_num_encoder_tokens": getattr(
                    scheduler, "max_num_encoder_input_tokens", None
                ),
                "decode_context_parallel_size": getattr(
                    parallel, "decode_context_parallel_size", 1
                ),
                "prefill_context_parallel_size": getattr(
                    parallel, "prefill_context_parallel_size", 1
                ),
            }
        checked: dict[str, int] = {}
        for name, value in values.items():
            least = 0 if name == "max_num_encoder_tokens" else 1
            if type(value) is not int or value < least:
                raise InvalidKVCacheSpec(
                    f"max_memory_usage_bytes needs {name} as an int >= {least}, got {value!r} "
                    f"from {vllm_config!r}"
                )
            checked[name] = value
        return cls(**checked)


_SpecT = TypeVar("_SpecT", bound="KVCacheSpec")


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer stores per KV-cache block. ``block_size`` is in tokens."""

    block_size: int

    # kv_cache_sizing.request_blocks kind: how many blocks a request holds at its peak.
    _REQUEST_KIND: ClassVar[str] = "full"

    def __post_init__(self) -> None:
        _require_positive(self, "block_size", self.block_size)

    @property
    def type_id(self) -> str:
        """Layers whose specs share a type_id can share one KV-cache group."""
        return f"{type(self).__name__}_{self.block_size}_{self.page_size_bytes}"

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer occupies."""
        raise NotImplementedError(f"{type(self).__name__} has no page size")

    def max_memory_usage_bytes(
        self,
        vllm_config: object,
        max_num_batched_tokens: int | None = None,
        max_num_encoder_tokens: int | None = None,
    ) -> int:
        """Bytes one request can hold in one layer at its peak, for vLLM's ``VllmConfig`` (or
        ``max_model_len`` as an int; the other two lengths then default to it)."""
        lengths = _RequestLengths.of(vllm_config, max_num_batched_tokens, max_num_encoder_tokens)
        return self._request_blocks(lengths) * self.page_size_bytes

    def _request_blocks(self, lengths: _RequestLengths) -> int:
        return request_blocks(
            self._REQUEST_KIND,
            self.block_size,
            lengths.max_model_len,
            max_num_batched_tokens=lengths.max_num_batched_tokens,
            num_encoder_tokens=lengths.max_num_encoder_tokens,
            sliding_window=getattr(self, "sliding_window", None),
            attention_chunk_size=getattr(self, "attention_chunk_size", None),
        )

    def copy_with_new_block_size(self: _SpecT, block_size: int) -> _SpecT:
        """This spec with ``block_size`` tokens per block."""
        return replace(self, block_size=block_size)

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        """One spec standing for ``specs``, which must all be equal (``KVCacheSpecMismatch``
        otherwise)."""
        if not specs:
            raise KVCacheSpecMismatch("cannot merge an empty list of KV-cache specs")
        first = specs[0]
        for other in specs[1:]:
            if other != first:
                raise KVCacheSpecMismatch(
                    f"all layers of one KV-cache group must have the same spec: {first!r} and "
                    f"{other!r} differ"
                )
        return first


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """An attention layer: K and V of ``num_kv_heads`` heads of ``head_size`` per token."""

    num_kv_heads: int
    head_size: int
    dtype: Any  # a torch.dtype or a string on input; always the canonical name once built

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive(self, "num_kv_heads", self.num_kv_heads)
        _require_positive(self, "head_size", self.head_size)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def torch_dtype(self) -> Any:
        """``dtype`` as a ``torch.dtype`` (imports torch)."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_size(self.dtype)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Full (global) attention. ``sliding_window`` / ``attention_chunk_size`` are set only
    when a local layer is stored as a full one (hybrid allocator off); ``head_size_v`` when
    V has a different head size from K."""

    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    head_size_v: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_optional_positive(self, "sliding_window", self.sliding_window)
        _require_optional_positive(self, "attention_chunk_size", self.attention_chunk_size)
        _require_optional_positive(self, "head_size_v", self.head_size_v)

    @property
    def page_size_bytes(self) -> int:
        head_size_v = self.head_size if self.head_size_v is None else self.head_size_v
        return (
            self.block_size
            * self.num_kv_heads
            * (self.head_size + head_size_v)
            * dtype_size(self.dtype)
        )

    def _request_blocks(self, lengths: _RequestLengths) -> int:
        # With context parallelism each rank keeps 1/cp of a request's tokens.
        ranks = lengths.decode_context_parallel_size * lengths.prefill_context_parallel_size
        if ranks > 1:
            lengths = replace(lengths, max_model_len=_cdiv(lengths.max_model_len, ranks))
        return super()._request_blocks(lengths)

    @classmethod
    def merge_window_sizes(cls, window_sizes: set[int]) -> int | None:
        """The one window size of a group's layers, None if none has one;
        ``WindowSizeMismatch`` if they differ."""
        if len(window_sizes) > 1:
            raise WindowSizeMismatch(
                f"all attention layers of one KV-cache group must have the same window size, "
                f"got {sorted(window_sizes)}"
            )
        return next(iter(window_sizes), None)

    @classmethod
    def merge(cls: type[_SpecT], specs: Sequence[_SpecT]) -> _SpecT:
        """Full-attention specs that differ only in sliding_window / attention_chunk_size
        merge into one carrying the (single) non-None value of each (vLLM 0.13's order of
        checks: kinds, then window sizes, then shapes, then windows of both sorts)."""
        if not specs:
            raise KVCacheSpecMismatch("cannot merge an empty list of KV-cache specs")
        first = specs[0]
        if not isinstance(first, FullAttentionSpec):
            return super().merge(specs)
        full: list[FullAttentionSpec] = []
        for spec in specs:
            if not isinstance(spec, FullAttentionSpec) or type(spec) is not type(first):
                raise KVCacheSpecMismatch(
                    f"all layers of one KV-cache group must be {type(first).__name__}: cannot "
                    f"merge {first!r} with {spec!r}"
                )
            full.append(spec)
        head = full[0]
        sliding_window = head.merge_window_sizes(
            {spec.sliding_window for spec in full if spec.sliding_window is not None}
        )
        chunk_size = head.merge_window_sizes(
            {spec.attention_chunk_size for spec in full if spec.attention_chunk_size is not None}
        )
        base = replace(head, sliding_window=None, attention_chunk_size=None)
        for member in full:
            if replace(member, sliding_window=None, attention_chunk_size=None) != base:
                raise KVCacheSpecMismatch(
                    f"all layers of one KV-cache group must have the same attention spec: "
                    f"{first!r} and {member!r} differ"
                )
        if sliding_window is not None and chunk_size is not None:
            raise KVCacheSpecMismatch(
                f"a KV-cache group cannot hold both sliding-window (window {sliding_window}) "
                f"and chunked local attention (chunk {chunk_size}) layers"
            )
        merged = replace(base, sliding_window=sliding_window, attention_chunk_size=chunk_size)
        return merged  # type: ignore[return-value,unused-ignore]


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent vector per token (no separate K and V).
    ``cache_dtype_str == "fp8_ds_mla"`` is DeepSeek's 656-byte-per-token fp8 layout."""

    cache_dtype_str: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cache_dtype_str is not None and type(self.cache_dtype_str) is not str:
            raise InvalidKVCacheSpec(
                f"MLAAttentionSpec.cache_dtype_str must be a str or None, "
                f"got {self.cache_dtype_str!r}")

    FP8_DS_MLA_BYTES_PER_TOKEN: ClassVar[int] = 656

    @property
    def page_size_bytes(self) -> int:
        if self.cache_dtype_str == "fp8_ds_mla":
            return self.block_size * self.FP8_DS_MLA_BYTES_PER_TOKEN
        return self.block_size * self.num_kv_heads * self.head_size * dtype_size(self.dtype)


@dataclass(frozen=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` sink tokens held in blocks shared by every request
    (reserved once when the manager is built; ``sink_len`` must be a multiple of the block
    size)."""

    sink_len: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_optional_positive(self, "sink_len", self.sink_len)


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention: a token attends only within its ``attention_chunk_size``
    chunk."""

    attention_chunk_size: int

    _REQUEST_KIND: ClassVar[str] = "chunked_local"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive(self, "attention_chunk_size", self.attention_chunk_size)


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: a token attends to the previous ``sliding_window`` tokens
    (itself included)."""

    sliding_window: int

    _REQUEST_KIND: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive(self, "sliding_window", self.sliding_window)

    def _request_blocks(self, lengths: _RequestLengths) -> int:
        if lengths.decode_context_parallel_size != 1:
            raise InvalidKVCacheSpec(
                f"sliding-window attention does not support decode context parallelism "
                f"(decode_context_parallel_size={lengths.decode_context_parallel_size})"
            )
        return super()._request_blocks(lengths)


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder-to-encoder cross-attention: K and V of the encoder output, written once.
    Never prefix-cached."""

    _REQUEST_KIND: ClassVar[str] = "cross_attention"


@dataclass(frozen=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """An encoder-only attention layer: no KV cache outlives a step, so a request holds no
    blocks (vLLM 0.13's ``EncoderOnlyAttentionSpec``; no manager serves it)."""

    _REQUEST_KIND: ClassVar[str] = "encoder_only"


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """A state-space layer: one block holds the whole recurrent state of a request.

    ``shapes[i]`` / ``dtypes[i]`` describe the i-th state tensor (conv state, SSM state);
    ``page_size_padded`` rounds the page up so it matches the attention layers' page.
    ``num_speculative_blocks`` extra blocks hold states for speculative tokens.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    num_speculative_blocks: int = 0

    # vLLM 0.13: cdiv(max_model_len, block_size) blocks (one when the Mamba block is
    # max_model_len tokens long, as without prefix caching); speculative blocks not counted.
    _REQUEST_KIND: ClassVar[str] = "mamba"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.shapes, Sequence) or not all(
                isinstance(shape, Sequence) for shape in self.shapes):
            raise InvalidKVCacheSpec(
                f"MambaSpec.shapes must be a sequence of shapes, got {self.shapes!r}")
        shapes = tuple(tuple(shape) for shape in self.shapes)
        for shape in shapes:
            if any(type(d) is not int or d <= 0 for d in shape):
                raise InvalidKVCacheSpec(
                    f"MambaSpec shape {shape!r} must hold positive int sizes")
        if not isinstance(self.dtypes, Sequence) or isinstance(self.dtypes, str):
            raise InvalidKVCacheSpec(
                f"MambaSpec.dtypes must be a sequence of dtypes, got {self.dtypes!r}")
        dtypes = tuple(canonical_dtype(d) for d in self.dtypes)
        if len(shapes) != len(dtypes):
            raise InvalidKVCacheSpec(
                f"MambaSpec has {len(shapes)} shapes but {len(dtypes)} dtypes"
            )
        if type(self.mamba_type) is not str:
            raise InvalidKVCacheSpec(
                f"MambaSpec.mamba_type must be a str, got {self.mamba_type!r}")
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)
        if (type(self.num_speculative_blocks) is not int
                or not 0 <= self.num_speculative_blocks < 2**31):
            raise InvalidKVCacheSpec(
                f"MambaSpec.num_speculative_blocks must be an int in [0, 2**31), "
                f"got {self.num_speculative_blocks!r}"
            )
        _require_optional_positive(self, "page_size_padded", self.page_size_padded)
        if self.page_size_padded is not None and self.page_size_padded < self.unpadded_bytes:
            raise InvalidKVCacheSpec(
                f"MambaSpec.page_size_padded={self.page_size_padded} is smaller than the "
                f"state it must hold ({self.unpadded_bytes} bytes)"
            )

    @property
    def unpadded_bytes(self) -> int:
        """Bytes of the state tensors, before padding."""
        return sum(
            math.prod(shape) * DTYPE_SIZES[dtype]
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.unpadded_bytes


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers of one attention type (they hold the same token slots per request) whose pages
    differ in size, as one KV-cache group: a block id names one page in each layer's own
    tensor, so a block costs the sum of their pages (vLLM 0.13's ``UniformTypeKVCacheSpecs``).

    ``kv_cache_specs`` maps each layer to its spec, of any family. Like vLLM's, it is not
    hashable (it holds a dict), and no manager serves it: the scheduler gets one layer's spec
    instead (``generate_scheduler_kv_cache_config``).
    """

    kv_cache_specs: dict[str, Any]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.kv_cache_specs, Mapping) or not self.kv_cache_specs:
            raise InvalidKVCacheSpec(
                f"UniformTypeKVCacheSpecs.kv_cache_specs must map layer names to specs, got "
                f"{self.kv_cache_specs!r}"
            )
        odd = {name: spec.block_size for name, spec in self.kv_cache_specs.items()
               if spec.block_size != self.block_size}
        if odd:
            raise InvalidKVCacheSpec(
                f"UniformTypeKVCacheSpecs of block size {self.block_size} holds layers of "
                f"other block sizes: {odd}"
            )
        object.__setattr__(self, "kv_cache_specs", dict(self.kv_cache_specs))

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_bytes(
        self,
        vllm_config: object,
        max_num_batched_tokens: int | None = None,
        max_num_encoder_tokens: int | None = None,
    ) -> int:
        # Every layer holds as many blocks as the layer that needs most. A foreign spec's
        # method takes the config alone, so the two lengths go only to impl's specs.
        def blocks(spec: Any) -> int:
            if isinstance(spec, KVCacheSpec):
                needed = spec.max_memory_usage_bytes(
                    vllm_config, max_num_batched_tokens, max_num_encoder_tokens
                )
            else:
                needed = spec.max_memory_usage_bytes(vllm_config)
            return _cdiv(needed, spec.page_size_bytes)

        return max(blocks(spec) for spec in self.kv_cache_specs.values()) * self.page_size_bytes

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: Mapping[str, Any]) -> bool:
        """Whether the layers of ``kv_cache_specs`` (specs of any family) are of one type:
        one block size, and full attention (MLA included), cross-attention, sliding windows
        of one size, chunks of one size, or Mamba with one speculative block count.
        False for no layers; ``UnsupportedKVCacheSpecType`` for another kind."""
        specs = list(kv_cache_specs.values())
        if not specs or len({spec.block_size for spec in specs}) > 1:
            return False
        first = specs[0]
        for kind, same in (
            ("FullAttentionSpec", ()),
            ("CrossAttentionSpec", ()),
            ("SlidingWindowSpec", ("sliding_window",)),
            ("ChunkedLocalAttentionSpec", ("attention_chunk_size",)),
            ("MambaSpec", ("num_speculative_blocks",)),
        ):
            if spec_is_a(first, kind):
                return all(
                    spec_is_a(spec, kind)
                    and all(getattr(spec, name) == getattr(first, name) for name in same)
                    for spec in specs
                )
        raise UnsupportedKVCacheSpecType(
            f"no uniform-type rule for {type(first).__name__}: {first!r}"
        )

    @classmethod
    def from_specs(cls, kv_cache_specs: Mapping[str, Any]) -> UniformTypeKVCacheSpecs | None:
        """One spec for all of ``kv_cache_specs`` if they are of one type, else None."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        block_size = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size=block_size, kv_cache_specs=dict(kv_cache_specs))


@dataclass(frozen=True)
class KVCacheTensor:
    """One KV-cache tensor of ``size`` bytes, shared by the layers named in ``shared_by``."""

    size: int
    shared_by: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if type(self.size) is not int or not 0 <= self.size <= _MAX_SIZE:
            raise InvalidKVCacheSpec(
                f"KVCacheTensor.size must be an int in [0, 2**63 - 1], got {self.size!r}")
        object.__setattr__(self, "shared_by", _names(self, "shared_by", self.shared_by))


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table, and the spec they all have."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", _names(self, "layer_names", self.layer_names))
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise InvalidKVCacheSpec(
                f"KVCacheGroupSpec.kv_cache_spec must be a KVCacheSpec, "
                f"got {self.kv_cache_spec!r}"
            )


@dataclass(frozen=True)
class KVCacheConfig:
    """The whole KV cache of a model: ``num_blocks`` blocks (block 0 is the null block), the
    tensors that hold them, and the groups of layers sharing block tables."""

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    def __post_init__(self) -> None:
        if type(self.num_blocks) is not int or not 0 <= self.num_blocks <= _MAX_SIZE:
            raise InvalidKVCacheSpec(
                f"KVCacheConfig.num_blocks must be an int in [0, 2**63 - 1], "
                f"got {self.num_blocks!r}"
            )
        object.__setattr__(self, "kv_cache_tensors", _members(
            self, "kv_cache_tensors", self.kv_cache_tensors, KVCacheTensor))
        object.__setattr__(self, "kv_cache_groups", _members(
            self, "kv_cache_groups", self.kv_cache_groups, KVCacheGroupSpec))


def spec_fields(spec: KVCacheSpec) -> dict[str, Any]:
    """The fields of ``spec`` as a dict (for printing and serialising layouts)."""
    return {f.name: getattr(spec, f.name) for f in fields(spec)}


# ---------------------------------------------------------------------- vLLM's objects


class KVCacheSpecLike(Protocol):
    """A KV-cache spec as vLLM's callers give it (impl's or vLLM's); ``as_kv_cache_spec``
    gives impl's."""

    @property
    def block_size(self) -> int: ...


class KVCacheGroupSpecLike(Protocol):
    """A KV-cache group as vLLM's callers give it (impl's ``KVCacheGroupSpec`` or vLLM's)."""

    @property
    def layer_names(self) -> Sequence[str]: ...

    @property
    def kv_cache_spec(self) -> KVCacheSpecLike: ...


class KVCacheConfigLike(Protocol):
    """A KV-cache config as vLLM's callers give it (impl's ``KVCacheConfig`` or vLLM's)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def kv_cache_groups(self) -> Sequence[KVCacheGroupSpecLike]: ...


# Spec kinds by class name: how a spec object from vLLM (whose classes have these names and
# fields) is recognised without importing vLLM. The name is matched exactly, as vLLM's
# ``spec_manager_map`` matches the exact type: a subclass is a kind of its own.
_SPEC_KINDS: dict[str, type[KVCacheSpec]] = {
    cls.__name__: cls
    for cls in (
        FullAttentionSpec,
        MLAAttentionSpec,
        SinkFullAttentionSpec,
        SlidingWindowSpec,
        ChunkedLocalAttentionSpec,
        MambaSpec,
        CrossAttentionSpec,
    )
}

_converted_specs: dict[object, KVCacheSpec] = {}


def spec_kind(spec: object) -> type[KVCacheSpec] | None:
    """impl's spec class for ``spec``'s kind: its own class for an impl spec, the class of the
    same name for a foreign one; None for a kind impl does not know."""
    if isinstance(spec, KVCacheSpec):
        return type(spec)
    return _SPEC_KINDS.get(type(spec).__name__)


def as_kv_cache_spec(spec: object) -> KVCacheSpec:
    """``spec`` as impl's spec: itself, or impl's spec of the same kind built from the fields
    of a foreign spec object (vLLM's ``FullAttentionSpec(..., dtype=torch.float16)`` gives
    impl's ``FullAttentionSpec(..., dtype="float16")``). Conversions are remembered."""
    if isinstance(spec, KVCacheSpec):
        return spec
    try:
        return _converted_specs[spec]
    except (KeyError, TypeError):  # not converted yet, or unhashable
        pass
    kind = spec_kind(spec)
    if kind is None:
        raise InvalidKVCacheSpec(
            f"{spec!r} is not a KV-cache spec of a kind kvspec knows "
            f"({', '.join(sorted(_SPEC_KINDS))})"
        )
    values = {f.name: getattr(spec, f.name) for f in fields(kind) if hasattr(spec, f.name)}
    try:
        converted = kind(**values)
    except TypeError as missing:
        raise InvalidKVCacheSpec(f"{spec!r} lacks a field of {kind.__name__}: {missing}") from None
    with contextlib.suppress(TypeError):
        _converted_specs[spec] = converted
    return converted


def as_kv_cache_config(config: object) -> KVCacheConfig:
    """``config`` as impl's ``KVCacheConfig``: itself, or impl's equal config built from the
    fields of a foreign one (vLLM's, whose sequences are lists and specs vLLM's)."""
    if isinstance(config, KVCacheConfig):
        return config
    try:
        num_blocks = config.num_blocks  # type: ignore[attr-defined]
        tensors = config.kv_cache_tensors  # type: ignore[attr-defined]
        groups = config.kv_cache_groups  # type: ignore[attr-defined]
        return KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=tuple(KVCacheTensor(t.size, tuple(t.shared_by)) for t in tensors),
            kv_cache_groups=tuple(
                KVCacheGroupSpec(tuple(g.layer_names), as_kv_cache_spec(g.kv_cache_spec))
                for g in groups
            ),
        )
    except (AttributeError, TypeError) as error:
        raise InvalidKVCacheSpec(f"{config!r} is not a KV-cache config: {error}") from None
