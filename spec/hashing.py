"""Prefix hashing, as an executable model (vLLM 0.13's vllm/v1/core/kv_cache_utils.py).

A request's tokens are cut into full blocks of ``block_size``; block ``i`` covers tokens
``[i * block_size, (i + 1) * block_size)`` and a partial tail block gets no hash. Block ``i``
hashes the payload ``(parent, tokens_i, extra_i)`` where ``parent`` is block ``i - 1``'s hash
and, for block 0, the seed ``none_hash``. So a hash names a whole prefix: two chains agree at
block ``i`` only if they agree on every block up to ``i``.

``extra_i`` is ``None`` or a tuple, always in the order LoRA, multimodal features, cache salt,
prompt embeddings:

* the LoRA adapter goes into every block;
* a multimodal feature goes into the blocks it overlaps, found by vLLM 0.13's walk over the
  features (``mm_walk``), which carries a feature index from block to block;
* the cache salt goes into block 0 only (it changes block 0's hash, and the chain carries the
  change to every later block);
* the prompt embeddings of the block's own rows go into every block.

How each key is written is the *key format* (``KeyFormat``), the profile's choice
(``key_format``):

* ``UNTAGGED`` (vllm-0.13): the bare values: the LoRA name, the feature's identifier, the
  salt, the embedding bytes. Values of different kinds can be equal, so a cache salt equal to
  a LoRA name gives the same block 0 as that adapter (docs/findings.md, B10).
* ``TAGGED`` (vllm-0.33, and kvspec's default): each key is a tuple led by its kind
  (``lora_key``, ``mm_key``, ``salt_key``, ``embeds_key``), so the tenant, the LoRA adapter and
  the salt, can be read back from block 0's keys (``first_block_tenant``), and requests of
  different tenants never share a block hash (``isolated``; ``tagged_chains_isolated`` is the
  statement CrossHair checks). The walk stays vLLM 0.13's: vLLM 0.33 also changed which
  features a block boundary touches, which is not part of the format.

Everything here is a small function over plain values (bytes, ints, tuples); the hash
function is a parameter, so the same model describes sha256, CBOR and xxhash chains, and
``chain_payloads`` describes the chain with the hash left symbolic (the payload itself).
Keys of the prefix cache are block hashes followed by the 4-byte big-endian KV-cache group id.

vLLM 0.33's other hashing changes are parameters of the profile too (the last section): the
root seed (``none_hash_seed``), the coarse view (``coarse_hashes_for``), the hash unit
(``hash_block_size``), lookahead hashing (``lookahead_*``) and the extra keys events carry
(``event_extra_keys``); docs/vllm-0.33-hashing-events.md.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable
from enum import Enum
from typing import Any

from kvspec.spec.pool import Profile

GROUP_ID_BYTES = 4
MAX_GROUP_ID = 2**32 - 1
LOW_64_BITS = 2**64 - 1

ExtraKeys = tuple[Any, ...] | None
HashFunction = Callable[[Any], bytes]

# What the prefix cache must keep apart: the LoRA adapter, as (name, path), and the cache salt
# (an empty salt is no salt). Requests of one tenant may share blocks; of two, never.
Tenant = tuple[tuple[str, str] | None, str | None]


# --- Keys: block hash + group id ---------------------------------------------------------------


def _splits_into(key: bytes, block_hash: bytes, group_id: int) -> bool:
    """The key is four bytes longer than the hash and splits back into hash and group id."""
    return (
        len(key) == len(block_hash) + GROUP_ID_BYTES
        and key_block_hash(key) == block_hash
        and key_group_id(key) == group_id
    )


def key_with_group(block_hash: bytes, group_id: int) -> bytes:
    """The prefix-cache key of ``block_hash`` in KV-cache group ``group_id``.

    pre: 0 <= group_id <= MAX_GROUP_ID
    post: _splits_into(__return__, block_hash, group_id)
    """
    return block_hash + group_id.to_bytes(GROUP_ID_BYTES, "big")


def key_block_hash(key: bytes) -> bytes:
    """The block hash inside a key (at least four bytes long): all but the last four bytes."""
    return key[: len(key) - GROUP_ID_BYTES]


def key_group_id(key: bytes) -> int:
    """The group id inside a key (at least four bytes long): its last four bytes, big-endian."""
    return int.from_bytes(key[len(key) - GROUP_ID_BYTES :], "big")


def external_hash(block_hash: bytes, as_int: bool) -> bytes | int:
    """The hash as KV events carry it: its low 64 bits as an int, or the bytes unchanged.

    post: (0 <= __return__ <= LOW_64_BITS) if as_int else __return__ == block_hash
    """
    if not as_int:
        return block_hash
    return int.from_bytes(block_hash, "big") & LOW_64_BITS


# --- Blocks of a token sequence -----------------------------------------------------------------


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    """How many full blocks ``num_tokens`` tokens fill (the partial tail is not hashed).

    pre: num_tokens >= 0
    pre: block_size > 0
    post: __return__ >= 0
    post: __return__ * block_size <= num_tokens < (__return__ + 1) * block_size
    """
    return num_tokens // block_size


def block_span(index: int, block_size: int) -> tuple[int, int]:
    """The token range ``[start, end)`` of block ``index``.

    pre: index >= 0
    pre: block_size > 0
    post: __return__ == (index * block_size, (index + 1) * block_size)
    """
    start = index * block_size
    return start, start + block_size


def parent_hash(previous: bytes | None, none_hash: bytes) -> bytes:
    """The parent a block chains to: the previous block's hash, or the seed for block 0.

    Like vLLM, an empty previous hash counts as no parent.
    """
    return previous if previous else none_hash


def block_payload(
    previous: bytes | None, none_hash: bytes, token_ids: tuple[int, ...], extra_keys: ExtraKeys
) -> tuple[bytes, tuple[int, ...], ExtraKeys]:
    """What a block's hash is taken of: ``(parent, tokens, extra_keys)``."""
    return (parent_hash(previous, none_hash), token_ids, extra_keys)


# --- The key format -----------------------------------------------------------------------------


class KeyFormat(Enum):
    """How a block's extra keys are written (module docstring)."""

    UNTAGGED = "untagged"  # vllm-0.13: bare values
    TAGGED = "tagged"  # vllm-0.33: (kind, ...) tuples


def key_format(profile: Profile) -> KeyFormat:
    """The key format of a profile: vLLM 0.13 writes bare values, vLLM 0.33 tags them."""
    return KeyFormat.UNTAGGED if profile is Profile.V0_13 else KeyFormat.TAGGED


# vLLM 0.33's tags: the first element of each tagged key.
LORA_TAG = "lora"
MM_TAG = "mm"
SALT_TAG = "cache_salt"
EMBEDS_TAG = "prompt_embeds"


def lora_key(lora_name: str, lora_path: str, fmt: KeyFormat) -> Any:
    """The LoRA adapter's key: its name, or ``("lora", name, path)``."""
    return (LORA_TAG, lora_name, lora_path) if fmt is KeyFormat.TAGGED else lora_name


def mm_key(identifier: str, offset: int, block_start: int, fmt: KeyFormat) -> Any:
    """A multimodal feature's key: its identifier, or ``("mm", identifier, offset - start)``
    (where the feature starts, relative to the block; negative when it began earlier)."""
    if fmt is KeyFormat.TAGGED:
        return (MM_TAG, identifier, offset - block_start)
    return identifier


def salt_key(cache_salt: str, fmt: KeyFormat) -> Any:
    """The cache salt's key: the salt, or ``("cache_salt", salt)``."""
    return (SALT_TAG, cache_salt) if fmt is KeyFormat.TAGGED else cache_salt


def embeds_key(embeds: bytes, fmt: KeyFormat) -> Any:
    """The block's prompt-embedding key: the raw bytes, or ``("prompt_embeds", sha256 of
    them)``."""
    if fmt is KeyFormat.TAGGED:
        return (EMBEDS_TAG, hashlib.sha256(embeds).digest())
    return embeds


# --- Isolation ----------------------------------------------------------------------------------


def tenant(lora_name: str | None, lora_path: str, cache_salt: str | None) -> Tenant:
    """The tenant of a request: its LoRA adapter (name and path) and its salt, if not empty."""
    return (None if lora_name is None else (lora_name, lora_path), cache_salt or None)


def first_block_tenant(keys: ExtraKeys) -> Tenant:
    """The tenant written in block 0's tagged keys: the LoRA key's name and path and the salt
    key's salt. Untagged keys do not say which kind a value is, so there is no such reading."""
    lora: tuple[str, str] | None = None
    salt: str | None = None
    for key in keys or ():
        if key[0] == LORA_TAG:
            lora = (key[1], key[2])
        elif key[0] == SALT_TAG:
            salt = key[1]
    return (lora, salt)


def isolated(
    chain_a: tuple[Any, ...], tenant_a: Tenant, chain_b: tuple[Any, ...], tenant_b: Tenant
) -> bool:
    """Isolation: chains of two different tenants have no block hash in common, so neither
    tenant's request can hit a block the other cached (whatever the tokens)."""
    return tenant_a == tenant_b or all(a != b for a in chain_a for b in chain_b)


def tagged_chains_isolated(
    token_ids_a: tuple[int, ...],
    token_ids_b: tuple[int, ...],
    block_size: int,
    lora_a: str | None,
    path_a: str,
    salt_a: str | None,
    lora_b: str | None,
    path_b: str,
    salt_b: str | None,
) -> bool:
    """With tagged keys, the chains of two requests (in the collision-free model,
    ``chain_payloads``) are ``isolated``: a salt never stands in for a LoRA adapter, nor one
    adapter for another, whatever the tokens.

    Why it holds: block 0's keys give back the tenant (``first_block_tenant``, in the contract
    of ``block_extra_keys``), so different tenants differ at block 0, and every later block's
    payload holds block 0's (payloads of different depths differ).

    pre: block_size > 0
    pre: len(token_ids_a) <= 3 * block_size and len(token_ids_b) <= 3 * block_size
    post: __return__
    """
    none_hash = b"seed"
    chains = []
    for tokens, lora, path, salt in ((token_ids_a, lora_a, path_a, salt_a),
                                     (token_ids_b, lora_b, path_b, salt_b)):
        extras = new_blocks_extra_keys(len(tokens), block_size, 0, lora, (), (), (), salt, None,
                                       KeyFormat.TAGGED, path)
        chains.append(chain_payloads(none_hash, tokens, block_size, extras))
    return isolated(chains[0], tenant(lora_a, path_a, salt_a),
                    chains[1], tenant(lora_b, path_b, salt_b))


# --- Extra keys ---------------------------------------------------------------------------------


def _sorted_positions(offsets: tuple[int, ...], lengths: tuple[int, ...]) -> bool:
    """Features in token order, none overlapping the next (what a request accepts)."""
    return (
        len(offsets) == len(lengths)
        and all(o >= 0 for o in offsets)
        and all(n >= 0 for n in lengths)
        and all(offsets[i] + lengths[i] <= offsets[i + 1] for i in range(len(offsets) - 1))
    )


def _walk_result_ok(
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    start: int,
    end: int,
    start_mm_idx: int,
    result: tuple[tuple[int, ...], int],
) -> bool:
    """Included features overlap the block (a feature ending at ``start`` counts), come in
    increasing order, and the next index is a feature index, one past the last, or the
    index given (when the walk did not start)."""
    included, next_index = result
    count = len(offsets)
    return (
        all(offsets[i] < end and start <= offsets[i] + lengths[i] for i in included)
        and all(included[k] < included[k + 1] for k in range(len(included) - 1))
        and (next_index == start_mm_idx or 0 <= next_index <= count)
    )


def mm_walk(
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    start: int,
    end: int,
    start_mm_idx: int,
) -> tuple[tuple[int, ...], int]:
    """vLLM 0.13's walk over multimodal features for the block ``[start, end)``.

    Feature ``i`` covers tokens ``[offsets[i], offsets[i] + lengths[i])``; features are sorted
    by offset and do not overlap. Returns the indices of the features whose identifiers go into
    the block, in order, and the index the next block's walk starts from. A negative
    ``start_mm_idx`` counts from the end (-1 is the last feature).

    * If the last feature ends before ``start`` (``offset + length < start``), nothing is
      included and the index comes back unchanged.
    * Walking from ``start_mm_idx``: a feature starting at or after ``end`` stops the walk; a
      feature the block has passed (``start > offset + length``: a feature ending exactly at
      ``start`` still counts) is skipped; otherwise it is included, and the walk moves on
      only if the feature ends within the block (``end >= offset + length``).

    pre: _sorted_positions(offsets, lengths)
    pre: 0 <= start < end
    pre: not offsets or -len(offsets) <= start_mm_idx <= len(offsets)
    post: _walk_result_ok(offsets, lengths, start, end, start_mm_idx, __return__)
    """
    count = len(offsets)
    if count == 0 or offsets[-1] + lengths[-1] < start:
        return (), start_mm_idx
    index = start_mm_idx + count if start_mm_idx < 0 else start_mm_idx
    included: tuple[int, ...] = ()
    while index < count:
        feature_end = offsets[index] + lengths[index]
        if end <= offsets[index]:
            break
        if start > feature_end:
            index += 1
            continue
        included = (*included, index)
        if end < feature_end:
            break
        index += 1
    return included, index


def _keys_in_order(
    keys: ExtraKeys,
    lora_name: str | None,
    mm_identifiers: tuple[str, ...],
    cache_salt: str | None,
    embeds: bytes | None,
    start: int,
    fmt: KeyFormat,
    lora_path: str,
    mm_offsets: tuple[int, ...],
) -> bool:
    """``None`` when no source applies; else one key per source, in the source order; with
    tagged keys, block 0's keys give back the tenant."""
    salted = start == 0 and bool(cache_salt)
    count = (lora_name is not None) + len(mm_identifiers) + salted + (embeds is not None)
    if keys is None:
        return count == 0
    first = 1 if lora_name is not None else 0
    after_mm = first + len(mm_identifiers)
    return (
        len(keys) == count
        and (lora_name is None or keys[0] == lora_key(lora_name, lora_path, fmt))
        and keys[first:after_mm] == tuple(
            mm_key(i, o, start, fmt) for i, o in zip(mm_identifiers, mm_offsets, strict=True))
        and (not salted or keys[after_mm] == salt_key(cache_salt or "", fmt))
        and (embeds is None or keys[-1] == embeds_key(embeds, fmt))
        and (fmt is KeyFormat.UNTAGGED or start != 0
             or first_block_tenant(keys) == tenant(lora_name, lora_path, cache_salt))
    )


def block_extra_keys(
    lora_name: str | None,
    mm_identifiers: tuple[str, ...],
    cache_salt: str | None,
    embeds: bytes | None,
    start: int,
    fmt: KeyFormat = KeyFormat.UNTAGGED,
    lora_path: str = "",
    mm_offsets: tuple[int, ...] = (),
) -> ExtraKeys:
    """The extra keys of a block starting at token ``start``, or ``None`` if it has none.

    Order: LoRA, multimodal features (``mm_offsets`` are their offsets, which tagged keys
    need), cache salt (only when ``start == 0`` and the salt is non-empty), prompt embeddings;
    each written in format ``fmt``.

    pre: start >= 0
    pre: len(mm_offsets) == len(mm_identifiers) or (fmt is KeyFormat.UNTAGGED and not mm_offsets)
    post: _keys_in_order(__return__, lora_name, mm_identifiers, cache_salt, embeds, start, fmt, lora_path, mm_offsets or (0,) * len(mm_identifiers))
    """  # noqa: E501 (a PEP 316 condition must fit on one line)
    offsets = mm_offsets or (0,) * len(mm_identifiers)  # unread by untagged keys
    keys: tuple[Any, ...] = ()
    if lora_name is not None:
        keys = (lora_key(lora_name, lora_path, fmt),)
    keys = keys + tuple(
        mm_key(i, o, start, fmt) for i, o in zip(mm_identifiers, offsets, strict=True))
    if start == 0 and cache_salt:
        keys = (*keys, salt_key(cache_salt, fmt))
    if embeds is not None:
        keys = (*keys, embeds_key(embeds, fmt))
    return keys if keys else None


def _keyed_by_sources(
    extras: tuple[ExtraKeys, ...],
    num_tokens: int,
    block_size: int,
    num_hashed_blocks: int,
    lora_name: str | None,
    cache_salt: str | None,
    embed_rows: tuple[bytes, ...] | None,
    fmt: KeyFormat,
    lora_path: str,
) -> bool:
    """One entry per new full block; the LoRA key leads every block's keys, the salt key is in
    block 0's only, and each block ends with the key of its own embedding rows."""
    if len(extras) != num_tokens // block_size - num_hashed_blocks:
        return False
    for offset, keys in enumerate(extras):
        start, end = block_span(num_hashed_blocks + offset, block_size)
        salted = start == 0 and bool(cache_salt)
        if keys is None:
            if lora_name is not None or salted or embed_rows is not None:
                return False
            continue
        if lora_name is not None and keys[0] != lora_key(lora_name, lora_path, fmt):
            return False
        if embed_rows is not None and keys[-1] != embeds_key(b"".join(embed_rows[start:end]),
                                                              fmt):
            return False
        salt_at = len(keys) - 1 - (embed_rows is not None)
        if salted and keys[salt_at] != salt_key(cache_salt or "", fmt):
            return False
    return True


def new_blocks_extra_keys(
    num_tokens: int,
    block_size: int,
    num_hashed_blocks: int,
    lora_name: str | None,
    mm_identifiers: tuple[str, ...],
    mm_offsets: tuple[int, ...],
    mm_lengths: tuple[int, ...],
    cache_salt: str | None,
    embed_rows: tuple[bytes, ...] | None,
    fmt: KeyFormat = KeyFormat.UNTAGGED,
    lora_path: str = "",
) -> tuple[ExtraKeys, ...]:
    """The extra keys of the blocks one hasher call adds to a request, in format ``fmt``.

    The request has ``num_tokens`` tokens and ``num_hashed_blocks`` blocks already hashed; the
    call hashes the full blocks after those. Its multimodal walk starts at feature 0 when it
    begins at block 0 and at the last feature otherwise, then carries the index from block to
    block. ``embed_rows`` holds each prompt token's embedding bytes; a block past the prompt
    gets the bytes of the rows it has (``b""`` for none), as slicing a tensor gives.

    Hashing in one call and hashing in several calls give the same keys, except around
    multimodal features that the later calls' walk (which starts at the last feature) sees
    differently: a feature ending exactly where such a call's first block starts, or a feature
    before the last one reaching into that block. That is vLLM 0.13's behaviour, kept here on purpose.

    pre: num_tokens >= 0
    pre: block_size > 0
    pre: 0 <= num_hashed_blocks <= num_tokens // block_size
    pre: len(mm_identifiers) == len(mm_offsets)
    pre: _sorted_positions(mm_offsets, mm_lengths)
    post: _keyed_by_sources(__return__, num_tokens, block_size, num_hashed_blocks, lora_name, cache_salt, embed_rows, fmt, lora_path)
    """  # noqa: E501 (a PEP 316 condition must fit on one line)
    mm_idx = 0 if num_hashed_blocks == 0 else -1
    extras: tuple[ExtraKeys, ...] = ()
    for index in range(num_hashed_blocks, num_tokens // block_size):
        start, end = block_span(index, block_size)
        included, mm_idx = mm_walk(mm_offsets, mm_lengths, start, end, mm_idx)
        embeds = None if embed_rows is None else b"".join(embed_rows[start:end])
        identifiers = tuple(mm_identifiers[i] for i in included)
        offsets = tuple(mm_offsets[i] for i in included)
        extras = (*extras, block_extra_keys(lora_name, identifiers, cache_salt, embeds, start,
                                            fmt, lora_path, offsets))
    return extras


# --- Chains -------------------------------------------------------------------------------------


def _is_chain(
    chain: tuple[Any, ...],
    none_hash: bytes,
    token_ids: tuple[int, ...],
    block_size: int,
    extra_keys: tuple[ExtraKeys, ...],
) -> bool:
    """One link per full block; link ``i`` holds block ``i``'s tokens and extra keys, and its
    parent is link ``i - 1`` (the seed for link 0)."""
    return len(chain) == len(token_ids) // block_size and all(
        chain[i]
        == (
            chain[i - 1] if i else none_hash,
            token_ids[i * block_size : (i + 1) * block_size],
            extra_keys[i],
        )
        for i in range(len(chain))
    )


def chain_payloads(
    none_hash: bytes,
    token_ids: tuple[int, ...],
    block_size: int,
    extra_keys: tuple[ExtraKeys, ...],
) -> tuple[Any, ...]:
    """The chain with the hash function left symbolic: each block's "hash" is its payload.

    Payloads are nested values, so two chains are equal exactly when every block's parent,
    tokens and extra keys are: the model of a collision-free hash.

    pre: block_size > 0
    pre: len(extra_keys) == len(token_ids) // block_size
    post: _is_chain(__return__, none_hash, token_ids, block_size, extra_keys)
    """
    chain: tuple[Any, ...] = ()
    previous: Any = None
    for index in range(len(token_ids) // block_size):
        start, end = block_span(index, block_size)
        previous = (previous if previous else none_hash, token_ids[start:end], extra_keys[index])
        chain = (*chain, previous)
    return chain


def chain_hashes(
    hash_fn: HashFunction,
    none_hash: bytes,
    token_ids: tuple[int, ...],
    block_size: int,
    extra_keys: tuple[ExtraKeys, ...],
    previous: bytes | None = None,
) -> tuple[bytes, ...]:
    """The block hashes of ``token_ids``' full blocks, chained onto ``previous``.

    ``chain_payloads`` with ``hash_fn`` applied at each step: block ``i``'s hash is
    ``hash_fn(block_payload(hash of block i - 1, none_hash, tokens_i, extra_i))``.
    """
    hashes: tuple[bytes, ...] = ()
    for index in range(len(token_ids) // block_size):
        start, end = block_span(index, block_size)
        payload = block_payload(previous, none_hash, token_ids[start:end], extra_keys[index])
        previous = hash_fn(payload)
        hashes = (*hashes, previous)
    return hashes


def _concatenates(coarse: tuple[bytes, ...], fine: tuple[bytes, ...], scale: int) -> bool:
    """One coarse hash per whole group of ``scale`` fine hashes, each their concatenation."""
    return len(coarse) == len(fine) // scale and all(
        coarse[i] == b"".join(fine[i * scale : (i + 1) * scale]) for i in range(len(coarse))
    )


def coarse_hashes(fine_hashes: tuple[bytes, ...], scale: int) -> tuple[bytes, ...]:
    """vLLM 0.13's hashes for blocks ``scale`` times the hash block size: concatenations.

    Coarse block ``i`` is the concatenation of fine hashes ``[i * scale, (i + 1) * scale)``;
    a trailing partial group has no coarse hash.

    pre: scale > 0
    post: _concatenates(__return__, fine_hashes, scale)
    """
    return tuple(
        b"".join(fine_hashes[i * scale : (i + 1) * scale])
        for i in range(len(fine_hashes) // scale)
    )


# --- vLLM 0.33: the root seed, coarse views, the hash unit, lookahead ---------------------------

# The seed 0.33 derives the root hash from when PYTHONHASHSEED is unset and the algorithm is
# collision resistant (kv_cache_utils.DEFAULT_NONE_HASH_SEED): hash_fn("vllm-none-hash").
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
# A predictable seed lets an attacker precompute colliding blocks of a non-cryptographic hash
# offline (vLLM #12621), so those keep a random seed.
CRYPTOGRAPHIC = frozenset({"sha256", "sha256_cbor"})


def none_hash_seed(profile: Profile, algorithm: str, pythonhashseed: str | None) -> str | None:
    """The seed the root hash is ``hash_fn(seed)`` of, or None for a random root.

    PYTHONHASHSEED, when set, is the seed in both releases. Unset: vllm-0.13's root is 32
    random bytes for every algorithm; vllm-0.33's is ``hash_fn("vllm-none-hash")`` for sha256
    and sha256_cbor (so separate processes and replicas share a prefix cache by default) and
    random for xxhash and xxhash_cbor.

    pre: algorithm in ALGORITHMS
    post: (__return__ is None) == (pythonhashseed is None and (profile is Profile.V0_13 or algorithm not in CRYPTOGRAPHIC))
    post: __return__ is None or __return__ == pythonhashseed or __return__ == DEFAULT_NONE_HASH_SEED
    """  # noqa: E501 (a PEP 316 condition must fit on one line)
    if pythonhashseed is not None:
        return pythonhashseed
    if profile is Profile.V0_33 and algorithm in CRYPTOGRAPHIC:
        return DEFAULT_NONE_HASH_SEED
    return None


def root_reproducible(profile: Profile, algorithm: str, pythonhashseed: str | None) -> bool:
    """Named invariant: two processes agree on the root hash exactly when it has a seed, and
    under vllm-0.33 a collision-resistant algorithm always has one."""
    seeded = none_hash_seed(profile, algorithm, pythonhashseed) is not None
    return seeded == (pythonhashseed is not None or (
        profile is Profile.V0_33 and algorithm in CRYPTOGRAPHIC))


def none_hash(hash_fn: HashFunction, seed: str) -> bytes:
    """The root hash of a seed: the hash function applied to the seed string itself."""
    return hash_fn(seed)


def _boundary_hashes(coarse: tuple[bytes, ...], fine: tuple[bytes, ...], scale: int) -> bool:
    """One coarse hash per whole group of ``scale`` fine hashes: the group's last one."""
    return len(coarse) == len(fine) // scale and all(
        coarse[i] == fine[(i + 1) * scale - 1] for i in range(len(coarse)))


def coarse_hashes_for(profile: Profile, fine_hashes: tuple[bytes, ...],
                      scale: int) -> tuple[bytes, ...]:
    """The hashes of blocks ``scale`` times the hash block size, per release.

    vllm-0.13 concatenates each group of fine hashes (``coarse_hashes``); vllm-0.33 takes
    each group's last fine hash, which already chains over the whole prefix
    (``BlockHashListWithBlockSize._get_value_at``). So under 0.33 a coarse block's key is the
    fine key at its end boundary, which is what lets a partial entry of a block at a fine
    boundary and a full entry at the block's end use one hash list.

    pre: scale > 0
    post: profile is Profile.V0_13 or _boundary_hashes(__return__, fine_hashes, scale)
    """
    if profile is Profile.V0_13:
        return coarse_hashes(fine_hashes, scale)
    return tuple(fine_hashes[(i + 1) * scale - 1] for i in range(len(fine_hashes) // scale))


class BadHashUnit(ValueError):
    """A prefix_match_unit the KV-cache groups cannot use."""


def hash_block_size(group_block_sizes: tuple[int, ...], prefix_match_unit: int | None) -> int:
    """vLLM 0.33's ``hash_block_size`` (``prefix_match_unit``): the token granularity of a
    request's block hashes, with prefix caching on (``resolve_kv_cache_block_sizes``, without
    its DCP scaling and the Mamba and per-state-alignment fallbacks).

    One group: its block size; any other unit is refused (hits land on the block size).
    Several groups: the unit if set, else the GCD of the block sizes; every block size must be
    a multiple of it. vllm-0.13 has no unit: it hashes at the smallest block size.

    pre: len(group_block_sizes) >= 1 and all(b > 0 for b in group_block_sizes)
    pre: prefix_match_unit is None or prefix_match_unit > 0
    raises: BadHashUnit
    post: all(b % __return__ == 0 for b in group_block_sizes)
    """
    if len(group_block_sizes) == 1:
        size = group_block_sizes[0]
        if prefix_match_unit not in (None, size):
            raise BadHashUnit(f"prefix_match_unit={prefix_match_unit} with one KV-cache group "
                              f"of block size {size}: unset it or set it to {size}")
        return size
    unit = (prefix_match_unit if prefix_match_unit is not None
            else functools.reduce(math.gcd, group_block_sizes))
    if any(b % unit for b in group_block_sizes):
        raise BadHashUnit(f"prefix_match_unit={unit} does not divide the KV-cache group "
                          f"block sizes {list(group_block_sizes)}")
    return unit


# Lookahead hashing (vLLM 0.33, RFC #50438, for EAGLE drafters): with L =
# num_hash_lookahead_tokens > 0 a block's hash also covers the L tokens after it, which the
# drafter's KV at the block's last position depends on. The hashed tokens stay the block's;
# its extra keys become ``(E, *next_L_tokens)``, where E is the extra keys of the window
# [start, end + L). A block is hashed only once its L lookahead tokens exist.


def num_lookahead_blocks(num_tokens: int, block_size: int, lookahead: int) -> int:
    """How many blocks a request of ``num_tokens`` tokens has hashes for.

    pre: num_tokens >= 0 and block_size > 0 and lookahead >= 0
    post: __return__ * block_size + lookahead <= num_tokens or __return__ == 0
    post: (__return__ + 1) * block_size + lookahead > num_tokens
    """
    return max(0, num_tokens - lookahead) // block_size


def lookahead_extra_keys(window_keys: ExtraKeys, lookahead_tokens: tuple[int, ...]) -> ExtraKeys:
    """A block's extra keys under lookahead: the window's keys, then the lookahead tokens
    (with L = 0 there is no lookahead and the keys are the block's own)."""
    if not lookahead_tokens:
        return window_keys
    return (window_keys, *lookahead_tokens)


def lookahead_chain_payloads(
    none_hash: bytes,
    token_ids: tuple[int, ...],
    block_size: int,
    lookahead: int,
    window_keys: tuple[ExtraKeys, ...],
) -> tuple[Any, ...]:
    """``chain_payloads`` under lookahead ``L``: block ``i`` chains its own tokens with extra
    keys ``(window_keys[i], *tokens[end_i:end_i + L])``; only blocks whose lookahead tokens
    exist are in the chain.

    (Its contract is ``chain_payloads``'s; ``lookahead_separates_next_tokens`` is the
    statement CrossHair checks.)
    """
    count = num_lookahead_blocks(len(token_ids), block_size, lookahead)
    extras = tuple(
        lookahead_extra_keys(window_keys[i], token_ids[(i + 1) * block_size:
                                                       (i + 1) * block_size + lookahead])
        for i in range(count))
    return chain_payloads(none_hash, token_ids[:count * block_size], block_size, extras)


def lookahead_separates_next_tokens(
    token_ids_a: tuple[int, ...], token_ids_b: tuple[int, ...], block_size: int, lookahead: int
) -> bool:
    """Named invariant: with lookahead, two requests share block ``i``'s hash only if they
    agree on every token up to block ``i``'s end plus L (the drafter's KV there depends on
    them); without it, only up to the block's end.

    pre: block_size > 0 and 0 <= lookahead <= 2
    pre: len(token_ids_a) <= 3 * block_size + 2 and len(token_ids_b) <= 3 * block_size + 2
    post: __return__
    """
    count_a = num_lookahead_blocks(len(token_ids_a), block_size, lookahead)
    count_b = num_lookahead_blocks(len(token_ids_b), block_size, lookahead)
    chain_a = lookahead_chain_payloads(b"seed", token_ids_a, block_size, lookahead,
                                       (None,) * count_a)
    chain_b = lookahead_chain_payloads(b"seed", token_ids_b, block_size, lookahead,
                                       (None,) * count_b)
    for i in range(min(count_a, count_b)):
        covered = (i + 1) * block_size + lookahead
        if (chain_a[i] == chain_b[i]) != (token_ids_a[:covered] == token_ids_b[:covered]):
            return False
    return True


def event_extra_keys(keys: ExtraKeys) -> ExtraKeys:
    """A block's tagged extra keys as vllm-0.33's BlockStored carries them
    (``to_event_extra_keys``): untagged again for consumers, the LoRA key as its name (the
    path is dropped), a multimodal key as ``(identifier, offset in block)``, the salt bare,
    the prompt-embedding key as its digest. Lookahead tokens are not in the event's extra keys
    (they are its ``lookahead_token_ids``)."""
    if keys is None:
        return None
    return tuple(key[1:] if key[0] == MM_TAG else key[1] for key in keys)


def event_keys_lose_the_lora_path(name: str, path_a: str, path_b: str) -> bool:
    """Named property (a fact to tolerate, docs/findings.md): two adapters of one name and
    different paths hash apart but publish the same event extra keys, so an event consumer
    that rebuilds hashes from the events cannot tell them apart.

    post: __return__
    """
    keys_a = (lora_key(name, path_a, KeyFormat.TAGGED),)
    keys_b = (lora_key(name, path_b, KeyFormat.TAGGED),)
    return event_extra_keys(keys_a) == event_extra_keys(keys_b) and (
        path_a == path_b or keys_a != keys_b)
