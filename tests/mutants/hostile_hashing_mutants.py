"""Hashing and request mutants: each brings back one defect the hostile-input suite for hashing
and requests (tests/hostile/test_hashing_request.py) or the isolation tests
(tests/test_isolation.py) exist to catch: a silent acceptance, an untyped error, an unnamed
value, a refusal that changes the request, and extra keys that let two tenants share a block.
"""

from __future__ import annotations

from typing import Any

from kvspec import vllm_plugin
from kvspec.impl import hashing, request as request_module
from tests.mutants import Mutant, replace

HOSTILE = "tests/hostile/test_hashing_request.py"
ISOLATION = "tests/test_isolation.py"


def tokens_trusted() -> None:
    """hash_block_tokens hashes whatever it is given as tokens: 'abc' becomes ('a', 'b', 'c')
    and [1.5] is hashed as is (the defect the issue reported)."""
    replace(hashing, "_token_tuple", lambda tokens: tuple(tokens))


def append_not_atomic() -> None:
    """append_output_token_ids leaves the new tokens in place when the block hasher fails:
    the request has tokens whose blocks were never hashed."""
    replace(request_module.Request, "_drop_last_tokens", lambda self, count: None)


def salt_unchecked() -> None:
    """Request takes any cache_salt (an int, bytes): the request is built, and its hashing
    fails later, or hashes a salt of another type."""
    replace(request_module, "check_cache_salt", lambda salt: salt)


def overlapping_features_accepted() -> None:
    """Multimodal features are checked for order only, not for overlap: a feature inside
    another is left out of the blocks it covers (the walk stops at the outer one), so two
    requests with different inner features share those blocks."""
    original = hashing.check_mm_features

    def check_mm_features(mm_features: Any) -> Any:
        features = sorted(mm_features or (), key=lambda f: f.mm_position.offset)
        if list(mm_features or ()) != features:
            return original(mm_features)  # unsorted: still refused
        return tuple((f.identifier, f.mm_position.offset, f.mm_position.length)
                     for f in features)
    replace(hashing, "check_mm_features", check_mm_features)
    replace(request_module, "check_mm_features", check_mm_features)


def not_a_request_untyped() -> None:
    """The hashing functions let the AttributeError of a non-request through (an untyped
    error for need_extra_keys(None) or the block hasher given None)."""
    replace(hashing, "_not_a_request", lambda request, error: error)


def token_refusal_unnamed() -> None:
    """hash_block_tokens refuses bad tokens without saying which value it got."""
    original = hashing._token_tuple

    def token_tuple(tokens: Any) -> Any:
        try:
            return original(tokens)
        except hashing.InvalidTokenIdsError:
            raise hashing.InvalidTokenIdsError("bad token ids") from None
    replace(hashing, "_token_tuple", token_tuple)


def lora_key_untagged() -> None:
    """The tagged format writes the LoRA key bare (vLLM 0.13's form, the name only): two
    adapters of one name at different paths share every block."""
    replace(hashing, "_lora_key", lambda name, path, tagged: name)


def salt_key_untagged() -> None:
    """The tagged format writes the cache salt bare: its bytes are no longer vLLM 0.33's (the
    LoRA key, still tagged, keeps salts and adapters apart)."""
    replace(hashing, "_salt_key", lambda salt, tagged: salt)


def plugin_keeps_tagged_keys() -> None:
    """The vLLM 0.13 plugin leaves the key format as it finds it (tagged): vLLM 0.13's own
    tests, and caches written by vLLM 0.13, see other hash bytes."""
    original = vllm_plugin.install

    def install() -> dict[str, Any]:
        key_format = hashing.EXTRA_KEY_FORMAT
        try:
            return original()
        finally:
            hashing.set_extra_key_format(key_format)
    replace(vllm_plugin, "install", install)


def block_size_unbounded() -> None:
    """The request block hasher and the coarse view take any positive block size: 2**32 and
    beyond are accepted (the issue's defect), sizes no KV-cache block of vLLM's worker has."""
    def block_size(what: str, value: Any) -> int:
        if type(value) is not int or value <= 0:
            raise hashing.InvalidBlockSizeError(f"{what} must be a positive int, got {value!r}")
        return value
    replace(hashing, "_block_size", block_size)


def numpy_block_size_refused() -> None:
    """The hashing functions take a block size of Python's int only: np.int64(16), which the
    pool and the block tables take (impl's one integer rule), is refused here."""
    def block_size(what: str, value: Any) -> int:
        if type(value) is not int or not 0 < value <= hashing.MAX_BLOCK_SIZE:
            raise hashing.InvalidBlockSizeError(f"{what} must be a positive int, got {value!r}")
        return value
    replace(hashing, "_block_size", block_size)


def _mutant(name: str, plant: Any, checker: str, killed_by: str = "") -> Mutant:
    description = " ".join((plant.__doc__ or "").split())
    return Mutant(name, description, plant, (checker,), killed_by)


# The generated tests, not the found-defect list at the top of the file, are named as killers:
# the suite finds each of these on its own.
HASHING_CALLS = "test_hashing_functions_refuse_bad_calls_and_change_nothing"
BAD_REQUESTS = "test_hashing_refuses_bad_requests_and_changes_nothing"
REQUEST_CALLS = "test_request_refuses_bad_calls_and_changes_nothing"
CONSTRUCTOR = "test_request_constructor_refuses_bad_arguments"

MUTANTS: list[Mutant] = [
    _mutant("hostile_hash_tokens_trusted", tokens_trusted, f"{HOSTILE}::{HASHING_CALLS}",
            HASHING_CALLS),
    _mutant("hostile_append_not_atomic", append_not_atomic, f"{HOSTILE}::{REQUEST_CALLS}",
            REQUEST_CALLS),
    _mutant("hostile_request_salt_unchecked", salt_unchecked, f"{HOSTILE}::{CONSTRUCTOR}",
            CONSTRUCTOR),
    _mutant("hostile_overlapping_features_accepted", overlapping_features_accepted,
            f"{HOSTILE}::{CONSTRUCTOR}", CONSTRUCTOR),
    _mutant("hostile_not_a_request_untyped", not_a_request_untyped, f"{HOSTILE}::{BAD_REQUESTS}",
            BAD_REQUESTS),
    _mutant("hostile_token_refusal_unnamed", token_refusal_unnamed,
            f"{HOSTILE}::{HASHING_CALLS}", HASHING_CALLS),
    _mutant("hostile_hash_block_size_unbounded", block_size_unbounded,
            f"{HOSTILE}::test_block_sizes_past_the_bound_are_refused", "accepted without a word"),
    _mutant("hostile_hash_numpy_block_size_refused", numpy_block_size_refused,
            f"{HOSTILE}::test_numpy_block_sizes_are_taken_as_ints", "InvalidBlockSizeError"),
    _mutant("isolation_lora_key_untagged", lora_key_untagged,
            f"{ISOLATION}::test_tagged_keys_never_share_a_block_across_tenants",
            "test_tagged_keys_never_share_a_block_across_tenants"),
    _mutant("isolation_salt_key_untagged", salt_key_untagged,
            f"{ISOLATION}::test_impl_keys_are_the_spec_keys",
            "test_impl_keys_are_the_spec_keys"),
    _mutant("isolation_plugin_keeps_tagged_keys", plugin_keeps_tagged_keys,
            f"{ISOLATION}::test_plugin_keeps_untagged_keys_unless_asked",
            "test_plugin_keeps_untagged_keys_unless_asked"),
]
