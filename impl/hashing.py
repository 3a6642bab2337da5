"""Prefix hashing with vLLM 0.13's API: chained block hashes, extra keys, group-id keys.

A block's hash is ``hash_fn((parent, tuple(token_ids), extra_keys))`` where ``parent`` is the
previous block's hash (``NONE_HASH`` for the first block) and ``extra_keys`` is ``None`` or a
tuple of keys from the request's LoRA adapter, the multimodal features the block overlaps, its
cache salt (first block only) and the block's prompt embeddings, in that order.

How each extra key is written is one setting, ``EXTRA_KEY_FORMAT`` (``set_extra_key_format``):

* ``ExtraKeyFormat.TAGGED``, kvspec's own default: each key is a tuple led by its kind, as vLLM 0.33
  writes them: ``("lora", lora_name, lora_path)``, ``("mm", identifier, offset - block
  start)``, ``("cache_salt", salt)``, ``("prompt_embeds", sha256 digest of the block's
  embedding bytes)``. No key of one kind can equal a key of another, so requests that differ
  in LoRA adapter or cache salt never share a block (``spec.hashing.isolated``).
* ``ExtraKeyFormat.UNTAGGED``: vLLM 0.13's bare values (the LoRA name, the identifier, the
  salt, the raw embedding bytes). Hashes are then byte for byte vLLM 0.13's for the same seed,
  including its collision: a cache salt equal to a LoRA name gives that adapter's first block
  (docs/findings.md, B10). The vllm-0.13 profile and kvspec's vLLM 0.13 plugin select it,
  and so does impl in any process that has vLLM 0.13 imported (``impl/host_profile.py``).

Set the format once, before hashing: a cache keyed in one format never hits in the other. Only
requests with extra keys are affected; the multimodal walk is vLLM 0.13's in both formats.

Every function here refuses bad input before computing anything, with a ``HashingError`` (a
``ValueError``) or, for a malformed request (impl's own or a duck-typed one, such as vLLM's),
an ``InvalidRequestError``; each message names the value. The request block hasher checks what
it reads at the cost of a few type checks per call and one C-level ``sum`` over the tokens it
hashes; a call that completes no block returns before reading the token list.

Keys of the prefix-cache map append the KV-cache group id as 4 big-endian bytes.
"""

from __future__ import annotations

import enum
import hashlib
import importlib
import os
import pickle
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NewType, Protocol, SupportsIndex, cast, overload

from kvspec.impl.checks import all_ints, as_int, first_non_int, shown
from kvspec.impl.errors import (
    BlockHashFormatError as InvalidBlockHashError,
    HashFunctionUnavailableError,
    HashingError,
    InvalidBlockIndexError,
    InvalidBlockRangeError,
    InvalidBlockSizeError,
    InvalidExtraKeyFormatError,
    InvalidExtraKeysError,
    InvalidGroupIdError,
    InvalidHashFunctionError,
    InvalidMultiModalIndexError,
    InvalidRequestError,
    InvalidTensorError,
    InvalidTokenIdsError,
    UnhashableValueError,
    UnknownHashFunctionError,
)
from kvspec.impl.request_hasher import early_exit


def _optional_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# Optional dependencies: only the CBOR and xxhash variants need them.
_cbor2: Any = _optional_module("cbor2")
_xxhash: Any = _optional_module("xxhash")

__all__ = [
    "CACHE_SALT_TAG",
    "DEFAULT_NONE_HASH_SEED",
    "EXTRA_KEY_FORMAT",
    "LORA_TAG",
    "MM_TAG",
    "NONE_HASH",
    "PROMPT_EMBEDS_TAG",
    "USE_INT_BLOCK_HASHES",
    "BlockHash",
    "BlockHashList",
    "BlockHashListWithBlockSize",
    "BlockHashListWithBlockSizeV033",
    "BlockHashWithGroupId",
    "ExternalBlockHash",
    "ExtraKeyFormat",
    "HashFunctionUnavailableError",
    "HashingError",
    "InvalidBlockHashError",
    "InvalidBlockIndexError",
    "InvalidBlockRangeError",
    "InvalidBlockSizeError",
    "InvalidExtraKeyFormatError",
    "InvalidExtraKeysError",
    "InvalidGroupIdError",
    "InvalidHashFunctionError",
    "InvalidMultiModalIndexError",
    "InvalidRequestError",
    "InvalidTensorError",
    "InvalidTokenIdsError",
    "RequestLike",
    "UnhashableValueError",
    "UnknownHashFunctionError",
    "check_cache_salt",
    "check_lora",
    "check_mm_features",
    "check_prompt_embeds",
    "extra_key_format",
    "generate_block_hash_extra_keys",
    "get_block_hash",
    "get_group_id",
    "get_hash_fn_by_name",
    "get_none_hash_seed",
    "get_request_block_hasher",
    "hash_block_tokens",
    "init_none_hash",
    "lookahead_request_block_hasher",
    "make_block_hash_with_group_id",
    "maybe_convert_block_hash",
    "need_extra_keys",
    "resolve_none_hash_seed",
    "set_extra_key_format",
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


class RequestLike(Protocol):
    """What impl reads of a request: ``kvspec.impl.request.Request`` or vLLM's own
    (``vllm.v1.request.Request``), which has the same fields; impl never checks the class."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_preemptions(self) -> int: ...

    @property
    def skip_reading_prefix_cache(self) -> bool: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def block_hashes(self) -> list[BlockHash]: ...

    @property
    def lora_request(self) -> Any: ...

    @property
    def mm_features(self) -> Any: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def prompt_embeds(self) -> Any: ...


GROUP_ID_BYTES = 4
_MAX_GROUP_ID = 2**32
# The largest block size the hashing functions take: vLLM's worker holds block sizes and slot
# arithmetic in 32-bit ints (the attention kernels take ``block_size`` as an ``int``; the
# block table is int32), so no KV-cache block is longer. vLLM's hashing itself sets no bound.
MAX_BLOCK_SIZE = 2**31 - 1
_LOW_64_BITS = 2**64 - 1
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


# --------------------------------------------------------------------------- errors


# --------------------------------------------------------------------------- group-id keys

# Group ids are small in practice; precomputed suffixes avoid an int.to_bytes per key.
_GROUP_ID_SUFFIXES = tuple(gid.to_bytes(GROUP_ID_BYTES, "big") for gid in range(256))


def make_block_hash_with_group_id(
    block_hash: BlockHash, group_id: SupportsIndex
) -> BlockHashWithGroupId:
    """The prefix-cache key: ``block_hash`` followed by ``group_id`` as 4 big-endian bytes."""
    if type(block_hash) is not bytes and not isinstance(block_hash, bytes):
        raise InvalidBlockHashError(f"block hash must be bytes, got {block_hash!r}")
    if type(group_id) is int and 0 <= group_id < 256:  # the hot path: one check
        return BlockHashWithGroupId(block_hash + _GROUP_ID_SUFFIXES[group_id])
    gid = as_int(group_id)
    if gid is None:
        raise InvalidGroupIdError(f"group id must be an int, got {group_id!r}")
    if not 0 <= gid < _MAX_GROUP_ID:
        raise InvalidGroupIdError(f"group id {gid} is outside [0, 2**32)")
    return BlockHashWithGroupId(block_hash + gid.to_bytes(GROUP_ID_BYTES, "big"))


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
    if not isinstance(hash_bytes, bytes):
        raise InvalidBlockHashError(f"block hash must be bytes, got {hash_bytes!r}")
    if not USE_INT_BLOCK_HASHES:
        return hash_bytes
    # The low 64 bits of a big-endian number are its last 8 bytes.
    return int.from_bytes(hash_bytes[-8:], "big")


# --------------------------------------------------------------------------- hash functions


def _pickled(value: Any) -> bytes:
    try:
        return pickle.dumps(value, protocol=_PICKLE_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as error:
        raise UnhashableValueError(f"cannot pickle {shown(value)} to hash it: {error}") from None


def _cbor(value: Any) -> bytes:
    try:
        encoded: bytes = _cbor2.dumps(value, canonical=True)
    except (_cbor2.CBOREncodeError, TypeError, RecursionError) as error:
        raise UnhashableValueError(
            f"cannot encode {shown(value)} as CBOR to hash it: {error}") from None
    return encoded


def sha256(value: Any) -> bytes:
    """SHA-256 of ``value`` pickled with the highest protocol (32 bytes)."""
    return hashlib.sha256(_pickled(value)).digest()


def sha256_cbor(value: Any) -> bytes:
    """SHA-256 of ``value`` encoded as canonical CBOR (32 bytes); needs cbor2."""
    if _cbor2 is None:
        raise HashFunctionUnavailableError("'sha256_cbor' needs the cbor2 package")
    return hashlib.sha256(_cbor(value)).digest()


def xxhash(value: Any) -> bytes:
    """XXH3-128 of ``value`` pickled with the highest protocol (16 bytes); needs xxhash."""
    if _xxhash is None:
        raise HashFunctionUnavailableError("'xxhash' needs the xxhash package")
    digest: bytes = _xxhash.xxh3_128_digest(_pickled(value))
    return digest


def xxhash_cbor(value: Any) -> bytes:
    """XXH3-128 of ``value`` encoded as canonical CBOR (16 bytes); needs cbor2 and xxhash."""
    if _xxhash is None or _cbor2 is None:
        raise HashFunctionUnavailableError("'xxhash_cbor' needs the cbor2 and xxhash packages")
    digest: bytes = _xxhash.xxh3_128_digest(_cbor(value))
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


def _check_hash_function(hash_function: object) -> None:
    if not callable(hash_function):
        raise InvalidHashFunctionError(f"hash function must be callable, got {hash_function!r}")


def _is_hash(value: object) -> bool:
    """A block hash: bytes, or an int (what Python's builtin ``hash`` gives, which vLLM 0.13's
    own tests use as the hash function; the prefix cache itself keys bytes only)."""
    return isinstance(value, bytes) or type(value) is int


def _digest(hash_function: HashFunction, payload: Any) -> bytes:
    """``hash_function(payload)``, refused unless it is a hash (``_is_hash``): a chain of
    anything else would hand the prefix cache values that are not block hashes."""
    digest = hash_function(payload)
    if not _is_hash(digest):
        raise InvalidHashFunctionError(
            f"hash function {hash_function!r} returned {shown(digest)}, not bytes")
    return digest


# A fixed payload to confirm a hash function is sha256 of the pickle (_is_pickle_sha256).
_PROBE = (b"kvspec", (0, 1, 2**40), None)


def _is_pickle_sha256(hash_function: object) -> bool:
    """Whether ``hash_function`` is ``sha256`` above, or vLLM's own ``sha256``
    (``vllm.utils.hashing.sha256``, the function vLLM's engine hands the block hasher by
    default; the same in 0.13 and 0.33): SHA-256 of the value pickled with the highest
    protocol, bytes for bytes. The request block hasher then computes it inline, without the
    two calls per block (``_digest`` and the function) and the result check; every other
    function is called as it is. vLLM's is recognised by identity with the attribute of its
    module, its own module name and no ``__wrapped__`` (a test's replacement or wrapper is
    none of these), and by its result on ``_PROBE``, checked once here."""
    if hash_function is sha256:
        return True
    module = sys.modules.get("vllm.utils.hashing")
    if (module is None or hash_function is not getattr(module, "sha256", None)
            or getattr(hash_function, "__module__", None) != "vllm.utils.hashing"
            or hasattr(hash_function, "__wrapped__")):
        return False
    try:
        digest = cast(HashFunction, hash_function)(_PROBE)
    except Exception:  # not the function it looks like: call it as it is
        return False
    return digest == hashlib.sha256(pickle.dumps(_PROBE, _PICKLE_PROTOCOL)).digest()


# --------------------------------------------------------------------------- chaining

NONE_HASH: BlockHash

# vLLM 0.33's root seed when PYTHONHASHSEED is unset and the algorithm is collision resistant:
# NONE_HASH = hash_fn("vllm-none-hash"), the same in every process (spec.hashing.none_hash_seed).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
# The functions whose seed stays random under vLLM 0.33: impl's and vLLM's xxhash variants
# (vLLM compares with its own two functions; impl's carry the same names).
_NON_CRYPTO_HASH_NAMES = ("xxhash", "xxhash_cbor")
# The seed NONE_HASH was derived from; None when it is random bytes (vLLM 0.13's rule).
_NONE_HASH_SEED: str | None = None


def _fixed_seed_rule() -> bool:
    """Whether init_none_hash follows vLLM 0.33's seeding: inside a vLLM 0.33 process
    (``host_profile``, asked at the first init_none_hash call, never at import)."""
    from kvspec.impl import host_profile

    return host_profile.current().profile == "vllm-0.33"


def resolve_none_hash_seed(hash_fn: HashFunction) -> str | None:
    """The seed NONE_HASH is derived from (``hash_fn(seed)``), or None for random bytes.

    PYTHONHASHSEED wins if set. Otherwise, under vLLM 0.33 (``host_profile``): a fresh random
    seed for xxhash and xxhash_cbor (a predictable seed would let an attacker precompute
    collisions), else the fixed ``DEFAULT_NONE_HASH_SEED`` (sha256, sha256_cbor), so
    processes share a prefix cache; under vLLM 0.13 and kvspec on its own: None (the root is
    32 random bytes).
    """
    _check_hash_function(hash_fn)
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if not _fixed_seed_rule():
        return None
    if getattr(hash_fn, "__name__", None) in _NON_CRYPTO_HASH_NAMES:
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED  # sha256, sha256_cbor and any other function, as in vLLM


def get_none_hash_seed() -> str | None:
    """The seed NONE_HASH was derived from (vLLM 0.33's, which falls back to
    ``DEFAULT_NONE_HASH_SEED`` before any init_none_hash); None when the root is random bytes
    with no seed (vLLM 0.13's rule)."""
    return _NONE_HASH_SEED


def _set_none_hash(none_hash: bytes, seed: str | None) -> None:
    global NONE_HASH, _NONE_HASH_SEED
    NONE_HASH = BlockHash(none_hash)
    _NONE_HASH_SEED = seed
    kv_cache_utils = sys.modules.get("kvspec.impl.kv_cache_utils")
    if kv_cache_utils is not None:  # its re-export (vLLM keeps NONE_HASH there)
        vars(kv_cache_utils)["NONE_HASH"] = NONE_HASH


def init_none_hash(hash_fn: HashFunction) -> None:
    """Seed every chain: ``hash_fn(seed)`` for the seed ``resolve_none_hash_seed`` gives, or
    32 random bytes when it gives none."""
    seed = resolve_none_hash_seed(hash_fn)
    _set_none_hash(os.urandom(32) if seed is None else _digest(hash_fn, seed), seed)


# At import, vLLM 0.13's rule without asking the host (the profile is chosen at first use):
# PYTHONHASHSEED's hash if set, else random bytes. vLLM calls init_none_hash at engine start.
_IMPORT_SEED = os.environ.get("PYTHONHASHSEED")
_set_none_hash(os.urandom(32) if _IMPORT_SEED is None else _digest(sha256, _IMPORT_SEED),
               _IMPORT_SEED)


# Sequences whose elements are characters or bytes, never token ids.
_BYTES_OR_TEXT = (str, bytes, bytearray, memoryview)


def _token_tuple(tokens: object) -> tuple[int, ...]:
    """``tokens`` (a list, tuple or other sequence of ints) as a tuple, or a refusal."""
    if type(tokens) is tuple:
        block: tuple[Any, ...] = tokens
    elif isinstance(tokens, list) or (
        isinstance(tokens, Sequence) and not isinstance(tokens, _BYTES_OR_TEXT)
    ):
        block = tuple(tokens)
    else:
        raise InvalidTokenIdsError(f"token ids must be a sequence of ints, got {shown(tokens)}")
    if not all_ints(block):
        raise InvalidTokenIdsError(
            f"token ids must be ints, got {first_non_int(block)!r} in {shown(tokens)}")
    return block


def _valid_key(key: object) -> bool:
    kind = type(key)
    if kind is str or kind is bytes or kind is int:
        return True
    return kind is tuple and all(_valid_key(part) for part in cast(tuple[Any, ...], key))


def _check_extra_keys(extra_keys: object) -> None:
    """Extra keys are ``None`` or a tuple of what either format writes: str, bytes, int, and
    tuples of those."""
    if extra_keys is None:
        return
    if type(extra_keys) is not tuple:
        raise InvalidExtraKeysError(f"extra keys must be None or a tuple, got {shown(extra_keys)}")
    for key in extra_keys:
        if not _valid_key(key):
            raise InvalidExtraKeysError(
                f"extra key {shown(key)} is not a str, bytes, int or a tuple of them")


def _hash_block(
    hash_function: HashFunction, parent: bytes, tokens: tuple[int, ...], extra_keys: Any
) -> BlockHash:
    """The hash of one block, its arguments already checked."""
    payload = (parent, tokens, extra_keys)
    if hash_function is sha256:
        return BlockHash(hashlib.sha256(pickle.dumps(payload, _PICKLE_PROTOCOL)).digest())
    return BlockHash(_digest(hash_function, payload))


def hash_block_tokens(
    hash_function: HashFunction,
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """The hash of one block chained to its parent (``NONE_HASH`` when the parent is ``None``
    or empty)."""
    _check_hash_function(hash_function)
    if parent_block_hash is not None and not _is_hash(parent_block_hash):
        raise InvalidBlockHashError(
            f"parent block hash must be a block hash (bytes) or None, got "
            f"{shown(parent_block_hash)}")
    tokens = _token_tuple(curr_block_token_ids)
    _check_extra_keys(extra_keys)
    return _hash_block(hash_function, parent_block_hash or NONE_HASH, tokens, extra_keys)


# --------------------------------------------------------------------------- the key format


class ExtraKeyFormat(enum.Enum):
    """How extra keys are written (module docstring): vLLM 0.33's tagged tuples, or vLLM
    0.13's bare values."""

    TAGGED = "tagged"
    UNTAGGED = "untagged"


# The tags, vLLM 0.33's: the first element of each tagged key.
LORA_TAG = "lora"
MM_TAG = "mm"
CACHE_SALT_TAG = "cache_salt"
PROMPT_EMBEDS_TAG = "prompt_embeds"

# The one setting; set_extra_key_format changes it (tests and the vLLM plugin). Until its
# first use it holds kvspec's own default; at first use (extra_key_format) it becomes the
# host's: vLLM 0.13's untagged keys inside a vLLM 0.13 process (impl/host_profile.py).
EXTRA_KEY_FORMAT: ExtraKeyFormat = ExtraKeyFormat.TAGGED
_FORMAT_CHOSEN = False  # by the host at first use, or by set_extra_key_format


def extra_key_format() -> ExtraKeyFormat:
    """The format extra keys are written in; at the first call, the host's (the vLLM in this
    process, ``host_profile.current()``) unless ``set_extra_key_format`` chose one."""
    global EXTRA_KEY_FORMAT, _FORMAT_CHOSEN
    if not _FORMAT_CHOSEN:
        from kvspec.impl import host_profile  # once: the profile is kept from then on

        EXTRA_KEY_FORMAT = ExtraKeyFormat(host_profile.current().extra_keys)
        _FORMAT_CHOSEN = True
    return EXTRA_KEY_FORMAT


def set_extra_key_format(key_format: ExtraKeyFormat | str) -> ExtraKeyFormat:
    """Write extra keys in ``key_format`` (an ``ExtraKeyFormat`` or its value, ``"tagged"`` or
    ``"untagged"``) from now on; returns the format it replaces.

    Set it once, before any request is hashed: hashes change with it, so blocks cached in one
    format are never hits in the other.
    """
    global EXTRA_KEY_FORMAT, _FORMAT_CHOSEN
    try:
        chosen = ExtraKeyFormat(key_format)
    except ValueError:
        raise InvalidExtraKeyFormatError(
            f"extra-key format must be one of {[f.value for f in ExtraKeyFormat]}, "
            f"got {key_format!r}") from None
    previous = extra_key_format()
    EXTRA_KEY_FORMAT = chosen
    _FORMAT_CHOSEN = True
    return previous


# One function per kind of key, so that each kind's two forms sit side by side.


def _lora_key(lora_name: str, lora_path: str, tagged: bool) -> Any:
    return (LORA_TAG, lora_name, lora_path) if tagged else lora_name


def _mm_key(identifier: str, offset: int, block_start: int, tagged: bool) -> Any:
    return (MM_TAG, identifier, offset - block_start) if tagged else identifier


def _salt_key(cache_salt: str, tagged: bool) -> Any:
    return (CACHE_SALT_TAG, cache_salt) if tagged else cache_salt


def _embeds_key(embeds_bytes: bytes, tagged: bool) -> Any:
    if tagged:
        return (PROMPT_EMBEDS_TAG, hashlib.sha256(embeds_bytes).digest())
    return embeds_bytes


# --------------------------------------------------------------------------- extra-key sources


# A request's extra-key sources, checked: the LoRA key (written in the call's format; it is the
# same in every block) or None, the multimodal features as (identifier, offset, length), the
# salt, the prompt embeddings. A plain tuple: one is built per hashing call that has sources.
_KeySources = tuple[Any, tuple[tuple[str, int, int], ...], str | None, Any]


def _not_a_request(request: object, error: AttributeError) -> InvalidRequestError:
    return InvalidRequestError(
        f"{shown(request)} is not a request: it has no {error.name or 'needed'} attribute")


def check_lora(lora_request: object) -> tuple[str, str]:
    """The LoRA adapter's (name, path): both must be str (vLLM's LoRARequest has both)."""
    name = getattr(lora_request, "lora_name", None)
    path = getattr(lora_request, "lora_path", None)
    if type(name) is not str or type(path) is not str:
        raise InvalidRequestError(
            f"lora_request must have a str lora_name and lora_path, got {shown(lora_request)}")
    return name, path


def check_cache_salt(cache_salt: object) -> str | None:
    if cache_salt is not None and type(cache_salt) is not str:
        raise InvalidRequestError(f"cache_salt must be a str or None, got {shown(cache_salt)}")
    return cache_salt


def check_mm_features(mm_features: object) -> tuple[tuple[str, int, int], ...]:
    """Each feature's (identifier, offset, length): a str and two ints >= 0, the features in
    token order without overlapping (the walk reads them in order and stops at the first one
    the block has not reached, so an overlapped feature would be left out of its blocks)."""
    if mm_features is None:
        return ()
    if not isinstance(mm_features, list | tuple):
        raise InvalidRequestError(
            f"mm_features must be a list of features, got {shown(mm_features)}")
    checked: list[tuple[str, int, int]] = []
    end = 0
    for feature in mm_features:
        identifier = getattr(feature, "identifier", None)
        position = getattr(feature, "mm_position", None)
        offset = getattr(position, "offset", None)
        length = getattr(position, "length", None)
        if (type(identifier) is not str or type(offset) is not int or type(length) is not int
                or offset < 0 or length < 0):
            raise InvalidRequestError(
                f"multimodal feature {shown(feature)} needs a str identifier and an "
                f"mm_position with an int offset and length >= 0")
        if offset < end:
            raise InvalidRequestError(
                f"multimodal feature {identifier!r} at offset {offset} starts before the "
                f"previous feature ends ({end}): features must be sorted by offset and must "
                f"not overlap")
        end = offset + length
        checked.append((identifier, offset, length))
    return tuple(checked)


def _is_embeddings(value: object) -> bool:
    """A torch tensor or a numpy array (not of Python objects) of at least one dimension."""
    if hasattr(value, "untyped_storage"):  # a torch tensor
        return int(cast(Any, value).dim()) >= 1
    numpy = sys.modules.get("numpy")
    return (numpy is not None and isinstance(value, numpy.ndarray) and value.ndim >= 1
            and not value.dtype.hasobject)


def check_prompt_embeds(prompt_embeds: object) -> Any:
    if prompt_embeds is not None and not _is_embeddings(prompt_embeds):
        raise InvalidRequestError(
            f"prompt_embeds must be a torch tensor or numpy array, got {shown(prompt_embeds)}")
    return prompt_embeds


def _key_sources(request: RequestLike, tagged: bool) -> _KeySources | None:
    """The request's checked extra-key sources, or None when it has none (the common case,
    decided from four attribute reads)."""
    try:
        lora_request = request.lora_request
        mm_features = request.mm_features
        cache_salt = request.cache_salt
        prompt_embeds = request.prompt_embeds
    except AttributeError as error:
        raise _not_a_request(request, error) from None
    if (lora_request is None and cache_salt is None and prompt_embeds is None
            and (mm_features is None or (type(mm_features) is list and not mm_features))):
        return None
    lora_key = None
    if lora_request is not None:
        lora_key = _lora_key(*check_lora(lora_request), tagged)
    features = () if type(mm_features) is list and not mm_features else (
        check_mm_features(mm_features))
    if cache_salt is not None:
        check_cache_salt(cache_salt)
    if prompt_embeds is not None:
        check_prompt_embeds(prompt_embeds)
    return lora_key, features, cache_salt, prompt_embeds


def need_extra_keys(request: RequestLike) -> bool:
    """Whether the request's blocks carry extra keys from multimodal input, LoRA or a salt.

    As in vLLM 0.13, prompt embeddings are not part of this test (the request block hasher
    still keys their bytes), and a salt counts even when empty.
    """
    sources = _key_sources(request, extra_key_format() is ExtraKeyFormat.TAGGED)
    if sources is None:
        return False
    lora_key, features, cache_salt, _ = sources
    return bool(features) or lora_key is not None or cache_salt is not None


def _mm_extra_keys(
    features: tuple[tuple[str, int, int], ...],
    start: int,
    end: int,
    start_mm_idx: int,
    tagged: bool,
) -> tuple[list[Any], int]:
    """Keys of the features (in token order) the block ``[start, end)`` overlaps.

    vLLM 0.13's walk, modelled by ``spec.hashing.mm_walk``: it starts at ``start_mm_idx``
    (negative counts from the end, already checked to be in range), and a feature ending
    exactly at ``start`` still counts. Also returns the index the next block's walk starts
    from.
    """
    keys: list[Any] = []
    if not features:
        return keys, start_mm_idx
    _, last_offset, last_length = features[-1]
    if last_offset + last_length < start:
        return keys, start_mm_idx
    count = len(features)
    index = start_mm_idx + count if start_mm_idx < 0 else start_mm_idx
    while index < count:
        identifier, offset, length = features[index]
        feature_end = offset + length
        if end <= offset:
            break  # the block lies before this feature
        if start > feature_end:
            index += 1  # the block lies after this feature
            continue
        keys.append(_mm_key(identifier, offset, start, tagged))
        if end >= feature_end:
            index += 1  # the feature ends inside the block; the next one may start in it too
        else:
            break
    return keys, index


def tensor_data(tensor: Any) -> memoryview:
    """The raw bytes of a CPU torch tensor, any dtype (bf16 too), as a uint8 memoryview
    (vLLM's ``tensor_data``, which ``kv_cache_utils`` re-exports)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        raise InvalidTensorError(f"tensor_data needs a CPU torch tensor, got {shown(tensor)}")
    data: memoryview = tensor.flatten().contiguous().view(torch.uint8).numpy().data
    return data


def _prompt_embeds_bytes(prompt_embeds: Any, start: int, end: int) -> bytes:
    """The raw bytes of rows ``[start, end)`` of a torch tensor or numpy array."""
    rows = prompt_embeds[start:end]
    if hasattr(rows, "untyped_storage"):  # a torch tensor
        return bytes(tensor_data(rows.cpu()))
    import numpy as np

    return bytes(np.ascontiguousarray(rows).tobytes())


def _block_extra_keys(
    sources: _KeySources, start: int, end: int, start_mm_idx: int, tagged: bool
) -> tuple[tuple[Any, ...] | None, int]:
    """The extra keys of the block ``[start, end)`` from checked sources, and the next mm
    index: LoRA, multimodal identifiers, salt (block 0 only, when non-empty), embeddings."""
    lora_key, features, cache_salt, prompt_embeds = sources
    keys: list[Any] = [] if lora_key is None else [lora_key]
    next_mm_idx = start_mm_idx
    if features:
        mm_keys, next_mm_idx = _mm_extra_keys(features, start, end, start_mm_idx, tagged)
        keys.extend(mm_keys)
    if start == 0 and cache_salt:
        keys.append(_salt_key(cache_salt, tagged))
    if prompt_embeds is not None:
        embeds = _prompt_embeds_bytes(prompt_embeds, start, end)
        keys.append(_embeds_key(embeds, tagged))
    return (tuple(keys) if keys else None), next_mm_idx


def _check_mm_index(start_mm_idx: int, count: int) -> None:
    if count and not -count <= start_mm_idx <= count:
        raise InvalidMultiModalIndexError(
            f"multimodal index {start_mm_idx} is outside [-{count}, {count}] for {count} "
            f"features")


def generate_block_hash_extra_keys(
    request: RequestLike,
    start_token_idx: SupportsIndex,
    end_token_idx: SupportsIndex,
    start_mm_idx: SupportsIndex,
) -> tuple[tuple[Any, ...] | None, int]:
    """The extra keys of tokens ``[start_token_idx, end_token_idx)`` and the next mm index.

    Order: LoRA, multimodal identifiers, ``cache_salt`` (only when the block starts at token 0
    and the salt is not empty), prompt embeddings; each written in ``EXTRA_KEY_FORMAT``.
    ``None`` when there are none.
    """
    start, end, mm_idx = as_int(start_token_idx), as_int(end_token_idx), as_int(start_mm_idx)
    if start is None or end is None:
        raise InvalidBlockRangeError(
            f"block bounds must be ints, got {start_token_idx!r} and {end_token_idx!r}")
    if not 0 <= start < end:
        raise InvalidBlockRangeError(f"block [{start}, {end}) is not a range of tokens from 0")
    if mm_idx is None:
        raise InvalidMultiModalIndexError(f"multimodal index must be an int, got {start_mm_idx!r}")
    tagged = extra_key_format() is ExtraKeyFormat.TAGGED
    sources = _key_sources(request, tagged)
    if sources is None:
        return None, mm_idx
    _check_mm_index(mm_idx, len(sources[1]))
    return _block_extra_keys(sources, start, end, mm_idx, tagged)


# --------------------------------------------------------------------------- request hasher


def _block_size(what: str, value: object) -> int:
    """A block size: an int (or numpy integer) in ``[1, MAX_BLOCK_SIZE]``, as a plain int."""
    size = as_int(value)
    if size is None or not 0 < size <= MAX_BLOCK_SIZE:
        raise InvalidBlockSizeError(
            f"{what} must be a positive int at most 2**31 - 1, got {value!r}")
    return size


def get_request_block_hasher(
    block_size: SupportsIndex, caching_hash_fn: HashFunction,
    num_hash_lookahead_tokens: SupportsIndex = 0,
) -> Callable[[RequestLike], list[BlockHash]]:
    """A function giving the hashes of a request's new full blocks (those not yet hashed).

    With ``num_hash_lookahead_tokens`` L > 0 (vLLM 0.33's lookahead hashing), each block's
    hash also covers the L tokens after it (``lookahead_request_block_hasher``)."""
    size = _block_size("block size", block_size)
    _check_hash_function(caching_hash_fn)
    if num_hash_lookahead_tokens != 0:
        return lookahead_request_block_hasher(size, caching_hash_fn, num_hash_lookahead_tokens)
    extra_key_format()  # the host's format, chosen before the first request (not per call)
    dumps = pickle.dumps
    new_sha256 = hashlib.sha256
    protocol = _PICKLE_PROTOCOL
    use_sha256 = _is_pickle_sha256(caching_hash_fn)

    def request_block_hasher(request: RequestLike) -> list[BlockHash]:
        try:
            block_hashes = request.block_hashes
            # Most calls (a decode step) complete no block: decide that from num_tokens before
            # touching the token list (vLLM's ConstantList has a Python-level __len__).
            num_tokens = request.num_tokens
        except AttributeError as error:
            raise _not_a_request(request, error) from None
        if type(block_hashes) is not list or type(num_tokens) is not int:
            raise InvalidRequestError(
                f"request {shown(request)} must have a list of block_hashes and an int "
                f"num_tokens, got {shown(block_hashes)} and {num_tokens!r}")
        start = len(block_hashes) * size
        if start + size > num_tokens:
            return []
        parent: bytes = block_hashes[-1] if block_hashes else NONE_HASH
        if not (isinstance(parent, bytes) or type(parent) is int):  # _is_hash, inlined
            raise InvalidRequestError(
                f"request {shown(request)} holds a block hash {shown(parent)} that is not "
                f"bytes")
        try:
            tokens = request.all_token_ids
        except AttributeError as error:
            raise _not_a_request(request, error) from None
        stop = start + (num_tokens - start) // size * size
        new_tokens: Any  # a list or tuple of ints once checked below
        try:
            new_tokens = tokens[start:stop]
        except (TypeError, KeyError):
            new_tokens = None
        total: object = None  # the tokens' sum: an int exactly when all are ints (all_ints)
        if ((type(new_tokens) is list or type(new_tokens) is tuple)
                and len(new_tokens) == stop - start):
            try:
                total = sum(new_tokens)
            except TypeError:  # a token that is not a number
                total = None
        if type(total) is not int:
            raise InvalidRequestError(
                f"request {shown(request)} has num_tokens {num_tokens} but its token ids "
                f"[{start}:{stop}] are not that many ints: {shown(tokens)}")
        # The extra-key sources, read here: most requests have none (_key_sources decides the
        # same from the same four reads, a call later), and then the format is not read.
        try:
            lora_request = request.lora_request
            mm_features = request.mm_features
            cache_salt = request.cache_salt
            prompt_embeds = request.prompt_embeds
        except AttributeError as error:
            raise _not_a_request(request, error) from None
        sources: _KeySources | None = None
        tagged = False
        if not (lora_request is None and cache_salt is None and prompt_embeds is None
                and (mm_features is None or (type(mm_features) is list and not mm_features))):
            tagged = EXTRA_KEY_FORMAT is ExtraKeyFormat.TAGGED
            sources = _key_sources(request, tagged)
        if sources is None:
            # Hot path: every payload is (parent, tokens, None).
            if stop - start == size:  # one block: what a decode step completes
                one: list[Any] = [  # BlockHash values (a NewType call would cost)
                    new_sha256(dumps((parent, tuple(new_tokens), None), protocol)).digest()
                    if use_sha256 else
                    _digest(caching_hash_fn, (parent, tuple(new_tokens), None))]
                return one
            # zip over one iterator repeated ``size`` times cuts the full blocks into tuples
            # at C speed (its set-up costs more than one block's slice, hence the case above).
            blocks = zip(*[iter(new_tokens)] * size, strict=False)
            new_hashes: list[Any] = []  # BlockHash values (a NewType call per hash would cost)
            append = new_hashes.append
            if use_sha256:
                for block in blocks:
                    parent = new_sha256(dumps((parent, block, None), protocol)).digest()
                    append(parent)
            else:
                for block in blocks:
                    parent = _digest(caching_hash_fn, (parent, block, None))
                    append(parent)
            return new_hashes
        new_hashes = []
        mm_idx = 0 if start == 0 else -1
        for offset in range(0, stop - start, size):
            block_start = start + offset
            extra_keys, mm_idx = _block_extra_keys(
                sources, block_start, block_start + size, mm_idx, tagged)
            parent = _hash_block(caching_hash_fn, parent,
                                 tuple(new_tokens[offset : offset + size]), extra_keys)
            new_hashes.append(parent)
        return new_hashes

    # Compiled, the calls that complete no block are answered before this closure is entered.
    return early_exit(size, request_block_hasher)


def _lookahead_count(value: object) -> int:
    count = as_int(value)
    if count is None or not 0 <= count <= MAX_BLOCK_SIZE:
        raise InvalidBlockSizeError(
            f"num_hash_lookahead_tokens must be an int in [0, 2**31 - 1], got {value!r}")
    return count


def _rewound_mm_index(features: tuple[tuple[str, int, int], ...], mm_idx: int,
                      end: int) -> int:
    """The walk's index moved back over the features that reach past ``end`` (a lookahead
    window's walk went past them, but the next block overlaps them too)."""
    while mm_idx > 0:
        _, offset, length = features[mm_idx - 1]
        if offset + length <= end:
            break
        mm_idx -= 1
    return mm_idx


def lookahead_request_block_hasher(
    block_size: SupportsIndex, caching_hash_fn: HashFunction,
    num_hash_lookahead_tokens: SupportsIndex,
) -> Callable[[RequestLike], list[BlockHash]]:
    """vLLM 0.33's request block hasher with lookahead L (``spec.hashing.lookahead_*``).

    Block ``[start, end)`` hashes its own tokens with the extra keys ``(E, *tokens[end:end +
    L])``, where ``E`` is the extra keys of the window ``[start, end + L)`` (its embedding rows
    and the features it overlaps; the walk's index is rewound to the first feature reaching
    past ``end``). A block is hashed once its L lookahead tokens exist. L = 0 is the plain
    hasher."""
    size = _block_size("block size", block_size)
    _check_hash_function(caching_hash_fn)
    lookahead = _lookahead_count(num_hash_lookahead_tokens)
    if lookahead == 0:
        return get_request_block_hasher(size, caching_hash_fn)
    extra_key_format()

    def request_block_hasher(request: RequestLike) -> list[BlockHash]:
        try:
            block_hashes = request.block_hashes
            num_tokens = request.num_tokens
        except AttributeError as error:
            raise _not_a_request(request, error) from None
        if type(block_hashes) is not list or type(num_tokens) is not int:
            raise InvalidRequestError(
                f"request {shown(request)} must have a list of block_hashes and an int "
                f"num_tokens, got {shown(block_hashes)} and {num_tokens!r}")
        start = len(block_hashes) * size
        hashable = num_tokens - lookahead
        if start + size > hashable:
            return []
        parent: bytes = block_hashes[-1] if block_hashes else NONE_HASH
        if not _is_hash(parent):
            raise InvalidRequestError(
                f"request {shown(request)} holds a block hash {shown(parent)} that is not "
                f"bytes")
        try:
            tokens = request.all_token_ids
        except AttributeError as error:
            raise _not_a_request(request, error) from None
        stop = start + (hashable - start) // size * size
        try:
            new_tokens = tokens[start:stop + lookahead]
        except (TypeError, KeyError):
            new_tokens = None
        if (
            (type(new_tokens) is not list and type(new_tokens) is not tuple)
            or len(new_tokens) != stop + lookahead - start
            or not all_ints(new_tokens)
        ):
            raise InvalidRequestError(
                f"request {shown(request)} has num_tokens {num_tokens} but its token ids "
                f"[{start}:{stop + lookahead}] are not that many ints: {shown(tokens)}")
        tagged = extra_key_format() is ExtraKeyFormat.TAGGED
        sources = _key_sources(request, tagged)
        mm_idx = 0 if start == 0 else -1
        new_hashes: list[BlockHash] = []
        for offset in range(0, stop - start, size):
            block_start = start + offset
            block_end = block_start + size
            window_keys: tuple[Any, ...] | None = None
            if sources is not None:
                window_keys, mm_idx = _block_extra_keys(
                    sources, block_start, block_end + lookahead, mm_idx, tagged)
                if sources[1]:
                    mm_idx = _rewound_mm_index(sources[1], mm_idx, block_end)
            extra_keys = (window_keys, *new_tokens[offset + size:offset + size + lookahead])
            parent = _hash_block(caching_hash_fn, parent,
                                 tuple(new_tokens[offset:offset + size]), extra_keys)
            new_hashes.append(BlockHash(parent))
        return new_hashes

    return request_block_hasher


# --------------------------------------------------------------------------- coarse view


class BlockHashListWithBlockSize:
    """A lazy view of fine block hashes as hashes of blocks ``scale`` times larger.

    vLLM 0.13: coarse hash ``i`` is the concatenation of fine hashes
    ``[i * scale, (i + 1) * scale)``. The view follows its list as that list grows.
    """

    __slots__ = ("block_hashes", "hash_block_size", "scale_factor", "target_block_size")

    def __init__(
        self,
        block_hashes: list[BlockHash],
        hash_block_size: SupportsIndex,
        target_block_size: SupportsIndex,
    ) -> None:
        if not isinstance(block_hashes, list):
            raise InvalidBlockHashError(
                f"block_hashes must be a list of block hashes, got {shown(block_hashes)}")
        hash_size = _block_size("hash block size", hash_block_size)
        target_size = _block_size("target block size", target_block_size)
        if target_size % hash_size != 0:
            raise InvalidBlockSizeError(
                f"target block size {target_size} is not a multiple of "
                f"hash block size {hash_size}"
            )
        self.block_hashes = block_hashes
        self.hash_block_size = hash_size
        self.target_block_size = target_size
        self.scale_factor = target_size // hash_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def _coarse(self, index: int) -> BlockHash:
        scale = self.scale_factor
        base = index * scale
        fine = self.block_hashes[base : base + scale]
        for block_hash in fine:  # the list is the caller's, and may have grown since
            if not isinstance(block_hash, bytes):
                raise InvalidBlockHashError(
                    f"block hash {shown(block_hash)} at fine index "
                    f"{base + fine.index(block_hash)} is not bytes")
        return BlockHash(b"".join(fine))

    @overload
    def __getitem__(self, index: int) -> BlockHash: ...

    @overload
    def __getitem__(self, index: slice) -> list[BlockHash]: ...

    def __getitem__(self, index: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(index, slice):
            try:
                positions = range(*index.indices(len(self)))
            except TypeError:  # a slice of something other than ints
                raise InvalidBlockIndexError(f"invalid slice {index!r}") from None
            return [self._coarse(i) for i in positions]
        if isinstance(index, int) and not isinstance(index, bool):
            length = len(self)
            position = index + length if index < 0 else index
            if not 0 <= position < length:
                raise IndexError(f"coarse block index {index} out of range for length {length}")
            return self._coarse(position)
        raise InvalidBlockIndexError(f"invalid index type {type(index).__name__!r}: {index!r}")

    def __iter__(self) -> Iterator[BlockHash]:
        for i in range(len(self)):
            yield self._coarse(i)

    def __repr__(self) -> str:
        return (
            f"BlockHashListWithBlockSize(len={len(self)}, hash_block_size="
            f"{self.hash_block_size}, target_block_size={self.target_block_size})"
        )


class BlockHashListWithBlockSizeV033(BlockHashListWithBlockSize):
    """vLLM 0.33's coarse view: coarse hash ``i`` is fine hash ``(i + 1) * scale - 1``, the
    last of its group, which already chains over the whole prefix (0.33's
    ``BlockHashListWithBlockSize``; ``spec.hashing.coarse_hashes_for``). So a coarse block's
    key is the fine key at its end, the key a partial entry at that boundary has too."""

    __slots__ = ()

    def _coarse(self, index: int) -> BlockHash:
        position = (index + 1) * self.scale_factor - 1
        block_hash = self.block_hashes[position]
        if not isinstance(block_hash, bytes):  # the list is the caller's
            raise InvalidBlockHashError(
                f"block hash {shown(block_hash)} at fine index {position} is not bytes")
        return BlockHash(block_hash)


BlockHashList = list[BlockHash] | BlockHashListWithBlockSize
