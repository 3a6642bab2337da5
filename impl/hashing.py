"""Prefix hashing with vLLM 0.13 semantics: chained block hashes, extra keys, group-id keys.

A block's hash is ``hash_fn((parent, tuple(token_ids), extra_keys))`` where ``parent`` is the
previous block's hash (``NONE_HASH`` for the first block) and ``extra_keys`` is ``None`` or a
tuple of ``lora_name``, multimodal identifiers, ``cache_salt`` (first block only) and prompt
embedding bytes, in that order. Hashes of the default function (sha256 of a highest-protocol
pickle) are byte-for-byte those vLLM 0.13 computes for the same seed.

Keys of the prefix-cache map append the KV-cache group id as 4 big-endian bytes.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pickle
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NewType, Protocol, cast, overload

if TYPE_CHECKING:
    from kvspec.impl.request import RequestLike



def _optional_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# Optional dependencies: only the CBOR and xxhash variants need them.
_cbor2: Any = _optional_module("cbor2")
_xxhash: Any = _optional_module("xxhash")

__all__ = [
    "NONE_HASH",
    "USE_INT_BLOCK_HASHES",
    "BlockHash",
    "BlockHashList",
    "BlockHashListWithBlockSize",
    "BlockHashWithGroupId",
    "ExternalBlockHash",
    "HashFunctionUnavailableError",
    "HashingError",
    "InvalidBlockHashError",
    "InvalidBlockSizeError",
    "InvalidGroupIdError",
    "InvalidMultiModalIndexError",
    "UnknownHashFunctionError",
    "generate_block_hash_extra_keys",
    "get_block_hash",
    "get_group_id",
    "get_hash_fn_by_name",
    "get_request_block_hasher",
    "hash_block_tokens",
    "init_none_hash",
    "make_block_hash_with_group_id",
    "maybe_convert_block_hash",
    "need_extra_keys",
    "sha256",
    "sha256_cbor",
    "tensor_data",
    "xxhash",
    "xxhash_cbor",
]

BlockHash = NewType("BlockHash", bytes)
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
ExternalBlockHash = bytes | int

HashFunction = Callable[[Any], bytes]

GROUP_ID_BYTES = 4
_MAX_GROUP_ID = 2**32
_LOW_64_BITS = 2**64 - 1
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


# --------------------------------------------------------------------------- errors


class HashingError(ValueError):
    """Base class of the errors this module raises for bad input."""


class InvalidGroupIdError(HashingError):
    """A KV-cache group id outside [0, 2**32) or not an int."""


class InvalidBlockHashError(HashingError):
    """A block hash that is not bytes, or a group-id key too short to hold a group id."""


class UnknownHashFunctionError(HashingError):
    """A hash-function name that is none of sha256, sha256_cbor, xxhash, xxhash_cbor."""


class HashFunctionUnavailableError(HashingError):
    """A known hash function whose optional dependency (cbor2, xxhash) is not installed."""


class InvalidBlockSizeError(HashingError):
    """A block size that is not positive, or a target size not a multiple of the hash size."""


class InvalidMultiModalIndexError(HashingError):
    """A multimodal feature index that counts back past the first feature."""


# --------------------------------------------------------------------------- group-id keys

# Group ids are small in practice; precomputed suffixes avoid an int.to_bytes per key.
_GROUP_ID_SUFFIXES = tuple(gid.to_bytes(GROUP_ID_BYTES, "big") for gid in range(256))


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """The prefix-cache key: ``block_hash`` followed by ``group_id`` as 4 big-endian bytes."""
    if type(block_hash) is not bytes and not isinstance(block_hash, bytes):
        raise InvalidBlockHashError(f"block hash must be bytes, got {block_hash!r}")
    if type(group_id) is int and 0 <= group_id < 256:
        return BlockHashWithGroupId(block_hash + _GROUP_ID_SUFFIXES[group_id])
    if not isinstance(group_id, int) or isinstance(group_id, bool):
        raise InvalidGroupIdError(f"group id must be an int, got {group_id!r}")
    if not 0 <= group_id < _MAX_GROUP_ID:
        raise InvalidGroupIdError(f"group id {group_id} is outside [0, 2**32)")
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(GROUP_ID_BYTES, "big"))


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes):
        raise InvalidBlockHashError(f"block hash key must be bytes, got {key!r}")
    if len(key) < GROUP_ID_BYTES:
        raise InvalidBlockHashError(
            f"block hash key {key!r} is shorter than the {GROUP_ID_BYTES}-byte group id"
        )


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """The block hash inside a group-id key (everything but the last 4 bytes)."""
    _check_key(key)
    return BlockHash(key[:-GROUP_ID_BYTES])


def get_group_id(key: BlockHashWithGroupId) -> int:
    """The group id inside a group-id key (the last 4 bytes, big-endian)."""
    _check_key(key)
    return int.from_bytes(key[-GROUP_ID_BYTES:], "big")


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


# Read once at import, like vLLM's envs; tests may assign this module attribute directly.
USE_INT_BLOCK_HASHES: bool = _env_flag("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", True)


def maybe_convert_block_hash(hash_bytes: BlockHash) -> ExternalBlockHash:
    """The hash as KV events carry it: its low 64 bits as an int (default), or the bytes."""
    if not USE_INT_BLOCK_HASHES:
        return hash_bytes
    # The low 64 bits of a big-endian number are its last 8 bytes.
    return int.from_bytes(hash_bytes[-8:], "big")


# --------------------------------------------------------------------------- hash functions


def sha256(value: Any) -> bytes:
    """SHA-256 of ``value`` pickled with the highest protocol (32 bytes)."""
    return hashlib.sha256(pickle.dumps(value, protocol=_PICKLE_PROTOCOL)).digest()


def sha256_cbor(value: Any) -> bytes:
    """SHA-256 of ``value`` encoded as canonical CBOR (32 bytes); needs cbor2."""
    if _cbor2 is None:
        raise HashFunctionUnavailableError("'sha256_cbor' needs the cbor2 package")
    return hashlib.sha256(_cbor2.dumps(value, canonical=True)).digest()


def xxhash(value: Any) -> bytes:
    """XXH3-128 of ``value`` pickled with the highest protocol (16 bytes); needs xxhash."""
    if _xxhash is None:
        raise HashFunctionUnavailableError("'xxhash' needs the xxhash package")
    digest: bytes = _xxhash.xxh3_128_digest(pickle.dumps(value, protocol=_PICKLE_PROTOCOL))
    return digest


def xxhash_cbor(value: Any) -> bytes:
    """XXH3-128 of ``value`` encoded as canonical CBOR (16 bytes); needs cbor2 and xxhash."""
    if _xxhash is None or _cbor2 is None:
        raise HashFunctionUnavailableError("'xxhash_cbor' needs the cbor2 and xxhash packages")
    digest: bytes = _xxhash.xxh3_128_digest(_cbor2.dumps(value, canonical=True))
    return digest


_HASH_FUNCTIONS: dict[str, HashFunction] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash,
    "xxhash_cbor": xxhash_cbor,
}


def get_hash_fn_by_name(name: str) -> HashFunction:
    """The hash function called ``name`` (sha256, sha256_cbor, xxhash or xxhash_cbor)."""
    try:
        fn = _HASH_FUNCTIONS[name]
    except (KeyError, TypeError):
        raise UnknownHashFunctionError(
            f"unknown hash function {name!r}; expected one of {sorted(_HASH_FUNCTIONS)}"
        ) from None
    needs_cbor = name.endswith("_cbor")
    needs_xxhash = name.startswith("xxhash")
    if (needs_cbor and _cbor2 is None) or (needs_xxhash and _xxhash is None):
        raise HashFunctionUnavailableError(f"hash function {name!r} needs a missing package")
    return fn


# --------------------------------------------------------------------------- chaining

NONE_HASH: BlockHash


def init_none_hash(hash_fn: HashFunction) -> None:
    """Seed every chain: random bytes if PYTHONHASHSEED is unset, else ``hash_fn(seed)``."""
    global NONE_HASH
    seed = os.environ.get("PYTHONHASHSEED")
    NONE_HASH = BlockHash(os.urandom(32) if seed is None else hash_fn(seed))
    kv_cache_utils = sys.modules.get("kvspec.impl.kv_cache_utils")
    if kv_cache_utils is not None:  # its re-export (vLLM keeps NONE_HASH there)
        vars(kv_cache_utils)["NONE_HASH"] = NONE_HASH


init_none_hash(sha256)


def hash_block_tokens(
    hash_function: HashFunction,
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """The hash of one block chained to its parent (``NONE_HASH`` when the parent is falsy)."""
    parent = parent_block_hash if parent_block_hash else NONE_HASH
    payload = (parent, tuple(curr_block_token_ids), extra_keys)
    if hash_function is sha256:
        return BlockHash(hashlib.sha256(pickle.dumps(payload, _PICKLE_PROTOCOL)).digest())
    return BlockHash(hash_function(payload))


# --------------------------------------------------------------------------- extra keys


class _PlaceholderLike(Protocol):
    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...


class _MultiModalFeatureLike(Protocol):
    @property
    def identifier(self) -> str: ...

    @property
    def mm_position(self) -> _PlaceholderLike: ...


def need_extra_keys(request: RequestLike) -> bool:
    """Whether the request's blocks carry extra keys from multimodal input, LoRA or a salt.

    As in vLLM 0.13, prompt embeddings are not part of this test; the request block hasher
    still adds their bytes (see ``_request_has_extra_key_sources``).
    """
    return (
        bool(request.mm_features)
        or request.lora_request is not None
        or request.cache_salt is not None
    )


def _request_has_extra_key_sources(request: RequestLike) -> bool:
    return need_extra_keys(request) or request.prompt_embeds is not None


def _mm_extra_keys(
    mm_features: Sequence[_MultiModalFeatureLike] | None,
    start: int,
    end: int,
    start_mm_idx: int,
) -> tuple[list[Any], int]:
    """Identifiers of the features (sorted by offset) keyed into the block ``[start, end)``.

    vLLM 0.13's walk, modelled by ``spec.hashing.mm_walk``: it starts at ``start_mm_idx``
    (negative counts from the end), and a feature ending exactly at ``start`` still counts.
    Also returns the index the next block's walk starts from.
    """
    keys: list[Any] = []
    if not mm_features:
        return keys, start_mm_idx
    last = mm_features[-1].mm_position
    if last.offset + last.length < start:
        return keys, start_mm_idx
    count = len(mm_features)
    if start_mm_idx < 0:
        if -start_mm_idx > count:
            raise InvalidMultiModalIndexError(
                f"multimodal index {start_mm_idx} counts back past the first of {count} features"
            )
        start_mm_idx += count
    index = start_mm_idx
    while index < count:
        feature = mm_features[index]
        offset = feature.mm_position.offset
        feature_end = offset + feature.mm_position.length
        if end <= offset:
            break  # the block lies before this feature
        if start > feature_end:
            index += 1  # the block lies after this feature
            continue
        keys.append(feature.identifier)
        if end >= feature_end:
            index += 1  # the feature ends inside the block; the next one may start in it too
        else:
            break
    return keys, index


def tensor_data(tensor: Any) -> memoryview:
    """The raw bytes of a (CPU) torch tensor, any dtype (bf16 too), as a uint8 memoryview
    (vLLM's ``tensor_data``, which ``kv_cache_utils`` re-exports)."""
    import torch

    data: memoryview = tensor.flatten().contiguous().view(torch.uint8).numpy().data
    return data


def _prompt_embeds_bytes(prompt_embeds: Any, start: int, end: int) -> bytes:
    """The raw bytes of rows ``[start, end)`` of a torch tensor or numpy array."""
    rows = prompt_embeds[start:end]
    if hasattr(rows, "untyped_storage"):  # a torch tensor
        return bytes(tensor_data(rows.cpu()))
    import numpy as np

    return bytes(np.ascontiguousarray(rows).tobytes())


def generate_block_hash_extra_keys(
    request: RequestLike, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """The extra keys of tokens ``[start_token_idx, end_token_idx)`` and the next mm index.

    Order: ``lora_name``, multimodal identifiers, ``cache_salt`` (only when the block starts at
    token 0), prompt-embedding bytes. ``None`` when there are none.
    """
    keys: list[Any] = []
    lora_request = request.lora_request
    if lora_request is not None:
        keys.append(lora_request.lora_name)
    mm_keys, next_mm_idx = _mm_extra_keys(
        request.mm_features, start_token_idx, end_token_idx, start_mm_idx
    )
    keys.extend(mm_keys)
    if start_token_idx == 0 and request.cache_salt:
        keys.append(request.cache_salt)
    if request.prompt_embeds is not None:
        keys.append(_prompt_embeds_bytes(request.prompt_embeds, start_token_idx, end_token_idx))
    return (tuple(keys) if keys else None), next_mm_idx


# --------------------------------------------------------------------------- request hasher


def get_request_block_hasher(
    block_size: int, caching_hash_fn: HashFunction
) -> Callable[[RequestLike], list[BlockHash]]:
    """A function giving the hashes of a request's new full blocks (those not yet hashed)."""
    if type(block_size) is not int or block_size <= 0:
        raise InvalidBlockSizeError(f"block size must be a positive int, got {block_size!r}")
    dumps = pickle.dumps
    new_sha256 = hashlib.sha256
    protocol = _PICKLE_PROTOCOL
    use_sha256 = caching_hash_fn is sha256

    def request_block_hasher(request: RequestLike) -> list[BlockHash]:
        block_hashes = request.block_hashes
        start = len(block_hashes) * block_size
        # Most calls (a decode step) complete no block: decide that from num_tokens before
        # touching the token list (vLLM's ConstantList has a Python-level __len__).
        num_tokens = request.num_tokens
        if start + block_size > num_tokens:
            return []
        tokens = request.all_token_ids
        parent: bytes = block_hashes[-1] if block_hashes else NONE_HASH
        new_hashes: list[bytes] = []
        if not _request_has_extra_key_sources(request):
            # Hot path: every payload is (parent, tokens, None). zip over one iterator repeated
            # block_size times cuts the full blocks into tuples at C speed.
            stop = start + (num_tokens - start) // block_size * block_size
            blocks = zip(*[iter(tokens[start:stop])] * block_size, strict=False)
            append = new_hashes.append
            if use_sha256:
                for block in blocks:
                    parent = new_sha256(dumps((parent, block, None), protocol)).digest()
                    append(parent)
            else:
                for block in blocks:
                    parent = caching_hash_fn((parent, block, None))
                    append(parent)
            return cast(list[BlockHash], new_hashes)
        mm_idx = 0 if start == 0 else -1
        end = start + block_size
        while end <= num_tokens:
            extra_keys, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            parent = hash_block_tokens(
                caching_hash_fn, BlockHash(parent), tokens[start:end], extra_keys
            )
            new_hashes.append(parent)
            start = end
            end += block_size
        return cast(list[BlockHash], new_hashes)

    return request_block_hasher


# --------------------------------------------------------------------------- coarse view


class BlockHashListWithBlockSize:
    """A lazy view of fine block hashes as hashes of blocks ``scale`` times larger.

    vLLM 0.13: coarse hash ``i`` is the concatenation of fine hashes
    ``[i * scale, (i + 1) * scale)``. The view follows its list as that list grows.
    """

    __slots__ = ("block_hashes", "hash_block_size", "scale_factor", "target_block_size")

    def __init__(
        self, block_hashes: list[BlockHash], hash_block_size: int, target_block_size: int
    ) -> None:
        if type(hash_block_size) is not int or hash_block_size <= 0:
            raise InvalidBlockSizeError(
                f"hash block size must be a positive int, got {hash_block_size!r}"
            )
        if type(target_block_size) is not int or target_block_size <= 0:
            raise InvalidBlockSizeError(
                f"target block size must be a positive int, got {target_block_size!r}"
            )
        if target_block_size % hash_block_size != 0:
            raise InvalidBlockSizeError(
                f"target block size {target_block_size} is not a multiple of "
                f"hash block size {hash_block_size}"
            )
        self.block_hashes = block_hashes
        self.hash_block_size = hash_block_size
        self.target_block_size = target_block_size
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def _coarse(self, index: int) -> BlockHash:
        scale = self.scale_factor
        base = index * scale
        return BlockHash(b"".join(self.block_hashes[base : base + scale]))

    @overload
    def __getitem__(self, index: int) -> BlockHash: ...

    @overload
    def __getitem__(self, index: slice) -> list[BlockHash]: ...

    def __getitem__(self, index: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(index, slice):
            return [self._coarse(i) for i in range(*index.indices(len(self)))]
        if isinstance(index, int) and not isinstance(index, bool):
            length = len(self)
            position = index + length if index < 0 else index
            if not 0 <= position < length:
                raise IndexError(f"coarse block index {index} out of range for length {length}")
            return self._coarse(position)
        raise TypeError(f"invalid index type {type(index).__name__!r}: {index!r}")

    def __iter__(self) -> Iterator[BlockHash]:
        for i in range(len(self)):
            yield self._coarse(i)

    def __repr__(self) -> str:
        return (
            f"BlockHashListWithBlockSize(len={len(self)}, hash_block_size="
            f"{self.hash_block_size}, target_block_size={self.target_block_size})"
        )


BlockHashList = list[BlockHash] | BlockHashListWithBlockSize
