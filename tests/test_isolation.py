"""Isolation by construction: requests that differ in cache salt or LoRA adapter never share a
cached block, with tagged extra keys (kvspec's default and vLLM 0.33's form); with vLLM 0.13's
untagged keys a salt equal to a LoRA name shares that adapter's first block.

Tenants are drawn from one small alphabet of names used both as salts and as LoRA names, with
two adapter paths, so the generator draws a salt equal to a LoRA name and two adapters of one
name at different paths (``test_the_generator_draws_the_collisions``). ``drive`` admits their
requests through impl's real ``KVCacheManager`` (and so its ``BlockPool``): prompts overlap
across tenants, requests finish or keep running, and every prefix-cache hit and every cached
block is checked against the tenant that cached it (``spec.hashing.tenant``). In the tagged
format no hit ever crosses tenants; in the untagged format Hypothesis finds the shared block
(``test_untagged_keys_share_a_block_across_tenants``). The spec's statement,
``spec.hashing.tagged_chains_isolated``, is checked here by Hypothesis, and by CrossHair in
``make check``.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, find, given, settings, strategies as st

from kvspec import vllm_plugin
from kvspec.impl import hashing
from kvspec.impl.hashing import ExtraKeyFormat, get_request_block_hasher, sha256
from kvspec.impl.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from kvspec.impl.kv_cache_manager import KVCacheManager
from kvspec.impl.request import LoRARequest, Request
from kvspec.spec import hashing as spec_hashing
from kvspec.spec.hashing import KeyFormat, Tenant, tenant
from kvspec.spec.pool import Profile

REPO_ROOT = Path(__file__).resolve().parent.parent
BS = 2
NAMES = ("x", "y")  # both salts and LoRA names: a salt can equal a LoRA name
PATHS = ("/adapters/1", "/adapters/2")  # two adapters can share a name


@pytest.fixture(autouse=True)
def _restore_key_format() -> Iterator[None]:
    before = hashing.EXTRA_KEY_FORMAT
    yield
    hashing.set_extra_key_format(before)


# ---------------------------------------------------------------------- the generator


@dataclass(frozen=True)
class Identity:
    """A request's isolation-relevant fields: its LoRA adapter and its salt."""

    lora_name: str | None
    lora_path: str
    cache_salt: str | None

    @property
    def tenant(self) -> Tenant:
        return tenant(self.lora_name, self.lora_path, self.cache_salt)

    def lora_request(self) -> LoRARequest | None:
        if self.lora_name is None:
            return None
        return LoRARequest(self.lora_name, 1 + PATHS.index(self.lora_path), self.lora_path)


identities = st.builds(
    Identity,
    lora_name=st.none() | st.sampled_from(NAMES),
    lora_path=st.sampled_from(PATHS),
    cache_salt=st.none() | st.sampled_from(("", *NAMES)),
)
prompts = st.lists(st.integers(0, 1), min_size=1, max_size=9)


@dataclass(frozen=True)
class Step:
    identity: Identity
    prompt: tuple[int, ...]
    keep_running: bool


steps = st.lists(st.builds(Step, identities, prompts.map(tuple), st.booleans()),
                 min_size=2, max_size=10)


def salt_as_lora(a: Identity, b: Identity) -> bool:
    """One request is salted with the other's LoRA name, and they are different tenants."""
    return a.tenant != b.tenant and any(
        x.cache_salt is not None and x.cache_salt == y.lora_name and x.lora_name is None
        and y.cache_salt is None for x, y in ((a, b), (b, a)))


# ---------------------------------------------------------------------- the driver


@dataclass(frozen=True)
class Crossing:
    """A block one tenant cached (or holds) that another tenant hit (or holds)."""

    block_id: int
    owner: Identity
    intruder: Identity


def drive(program: list[Step], key_format: ExtraKeyFormat) -> Crossing | None:
    """Admit the program's requests through a real KVCacheManager, hashing with
    ``key_format``; the first block shared across tenants, or None."""
    hashing.set_extra_key_format(key_format)
    config = KVCacheConfig(32, (), (KVCacheGroupSpec(("l0",), FullAttentionSpec(BS, 1, 8,
                                                                                 "float16")),))
    manager = KVCacheManager(config, max_model_len=64, hash_block_size=BS)
    hasher = get_request_block_hasher(BS, sha256)
    cached_by: dict[bytes, Identity] = {}  # block key -> who cached it
    running: list[tuple[Request, Identity]] = []
    for index, step in enumerate(program):
        identity = step.identity
        request = Request(f"r{index}", list(step.prompt), block_hasher=hasher,
                          lora_request=identity.lora_request(), cache_salt=identity.cache_salt)
        hits, num_hit = manager.get_computed_blocks(request)
        for block in hits.blocks[0]:
            owner = cached_by[block.block_hash]  # type: ignore[index]
            if owner.tenant != identity.tenant:
                return Crossing(block.block_id, owner, identity)
        if num_hit:
            event("prefix hit")
        if manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits) is None:
            event("pool full")
            continue
        mine = manager.get_blocks(request.request_id).blocks[0]
        for block in mine:
            if block.block_hash is not None:
                owner = cached_by.setdefault(block.block_hash, identity)
                if owner.tenant != identity.tenant:
                    return Crossing(block.block_id, owner, identity)
        for other, other_identity in running:  # no block held by two tenants at once
            if other_identity.tenant != identity.tenant:
                theirs = {b.block_id for b in manager.get_blocks(other.request_id).blocks[0]}
                shared = [b.block_id for b in mine if b.block_id in theirs]
                if shared:
                    return Crossing(shared[0], other_identity, identity)
        if step.keep_running:
            running.append((request, identity))
        else:
            manager.free(request)
    return None


# ---------------------------------------------------------------------- the properties


@given(program=steps)
def test_tagged_keys_never_share_a_block_across_tenants(program: list[Step]) -> None:
    crossing = drive(program, ExtraKeyFormat.TAGGED)
    assert crossing is None, crossing
    if any(salt_as_lora(a.identity, b.identity) for a in program for b in program):
        event("a salt equal to a LoRA name was drawn")
    if drive(program, ExtraKeyFormat.UNTAGGED) is not None:
        event("the program shares a block across tenants with vLLM 0.13's keys")


FIND_SETTINGS = settings(max_examples=3000, database=None, derandomize=True, deadline=None,
                         suppress_health_check=list(HealthCheck))


def test_the_generator_draws_the_collisions() -> None:
    """The generator reaches both 0.13 collisions: a salt equal to a LoRA name, and two
    adapters of one name at different paths."""
    pair = find(st.tuples(identities, identities), lambda p: salt_as_lora(*p),
                settings=FIND_SETTINGS)
    assert salt_as_lora(*pair)
    same_name = find(st.tuples(identities, identities),
                     lambda p: p[0].lora_name is not None and p[0].lora_name == p[1].lora_name
                     and p[0].lora_path != p[1].lora_path, settings=FIND_SETTINGS)
    assert same_name[0].tenant != same_name[1].tenant


def test_untagged_keys_share_a_block_across_tenants() -> None:
    """vLLM 0.13's keys: Hypothesis finds a program in which a request salted with a LoRA name
    hits the block that adapter's request cached (docs/findings.md, B10)."""
    def shares_salt_with_lora(program: list[Step]) -> bool:
        crossing = drive(program, ExtraKeyFormat.UNTAGGED)
        return crossing is not None and salt_as_lora(crossing.owner, crossing.intruder)
    program = find(steps, shares_salt_with_lora, settings=FIND_SETTINGS)
    crossing = drive(program, ExtraKeyFormat.UNTAGGED)
    assert crossing is not None and salt_as_lora(crossing.owner, crossing.intruder)
    # The same program under tagged keys keeps them apart.
    assert drive(program, ExtraKeyFormat.TAGGED) is None


def test_the_collision_in_one_example() -> None:
    """The smallest case, by hand: salt "x" and LoRA "x" over the same three tokens."""
    program = [Step(Identity("x", PATHS[0], None), (0, 1, 0), False),
               Step(Identity(None, PATHS[0], "x"), (0, 1, 0), False)]
    crossing = drive(program, ExtraKeyFormat.UNTAGGED)
    assert crossing == Crossing(crossing.block_id if crossing else -1, program[0].identity,
                                program[1].identity)
    assert drive(program, ExtraKeyFormat.TAGGED) is None


# ---------------------------------------------------------------------- the spec's statement


names = st.none() | st.sampled_from(NAMES)


@given(tokens_a=st.lists(st.integers(0, 1), max_size=6).map(tuple),
       tokens_b=st.lists(st.integers(0, 1), max_size=6).map(tuple),
       block_size=st.integers(1, 3), lora_a=names, salt_a=names, lora_b=names, salt_b=names,
       path_a=st.sampled_from(PATHS), path_b=st.sampled_from(PATHS))
def test_spec_states_isolation_for_tagged_keys(
        tokens_a: tuple[int, ...], tokens_b: tuple[int, ...], block_size: int,
        lora_a: str | None, salt_a: str | None, lora_b: str | None, salt_b: str | None,
        path_a: str, path_b: str) -> None:
    assert spec_hashing.tagged_chains_isolated(tokens_a, tokens_b, block_size, lora_a, path_a,
                                               salt_a, lora_b, path_b, salt_b)


def test_spec_untagged_keys_are_not_isolated() -> None:
    """The same statement fails for vLLM 0.13's keys: block 0 of salt "x" is block 0 of LoRA
    "x", and LoRA paths are not keyed at all."""
    def chain(lora: str | None, path: str, salt: str | None) -> tuple[object, ...]:
        extras = spec_hashing.new_blocks_extra_keys(4, 2, 0, lora, (), (), (), salt, None,
                                                    KeyFormat.UNTAGGED, path)
        return spec_hashing.chain_payloads(b"seed", (0, 1, 0, 1), 2, extras)

    salted, adapted = chain(None, "", "x"), chain("x", "/a", None)
    assert not spec_hashing.isolated(salted, tenant(None, "", "x"), adapted,
                                     tenant("x", "/a", None))
    assert salted[0] == adapted[0] and salted[1] != adapted[1]  # the first block only
    assert not spec_hashing.isolated(chain("x", "/a", None), tenant("x", "/a", None),
                                     chain("x", "/b", None), tenant("x", "/b", None))
    assert spec_hashing.first_block_tenant(
        spec_hashing.block_extra_keys("x", (), "y", None, 0, KeyFormat.TAGGED, "/a")) == (
        ("x", "/a"), "y")


def test_profiles_choose_the_key_format() -> None:
    assert spec_hashing.key_format(Profile.V0_13) is KeyFormat.UNTAGGED
    assert spec_hashing.key_format(Profile.V0_33) is KeyFormat.TAGGED
    assert hashing.EXTRA_KEY_FORMAT is ExtraKeyFormat.TAGGED  # kvspec on its own
    assert {f.value for f in ExtraKeyFormat} == {f.value for f in KeyFormat}


@given(identity=identities, start=st.sampled_from([0, 2]),
       key_format=st.sampled_from(list(ExtraKeyFormat)))
def test_impl_keys_are_the_spec_keys(identity: Identity, start: int,
                                     key_format: ExtraKeyFormat) -> None:
    """impl writes each kind of key as the spec says, in both formats."""
    hashing.set_extra_key_format(key_format)
    request = Request("r", [0, 1, 0, 1], lora_request=identity.lora_request(),
                      cache_salt=identity.cache_salt,
                      mm_features=None)
    keys, _ = hashing.generate_block_hash_extra_keys(request, start, start + 2, 0)
    assert keys == spec_hashing.block_extra_keys(
        identity.lora_name, (), identity.cache_salt, None, start, KeyFormat(key_format.value),
        identity.lora_path)


# ---------------------------------------------------------------------- the plugin's switch


def test_plugin_keeps_untagged_keys_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under vLLM 0.13 the plugin selects 0.13's untagged keys; VLLM_KVSPEC_TAGGED_EXTRA_KEYS
    opts into tagged ones. (vLLM itself is stood in for: only the version is read here.)"""
    monkeypatch.setattr(vllm_plugin, "_vllm_version", lambda: "0.13.0")
    monkeypatch.setattr(vllm_plugin, "_installed", {})
    from kvspec.impl import host_types
    monkeypatch.setattr(host_types, "bind_vllm", lambda: None)
    monkeypatch.setitem(vllm_plugin.SUPPORTED_VLLM, "0.13",
                        vllm_plugin.SUPPORTED_VLLM["0.13"]._replace(replaced={}))
    monkeypatch.setattr(vllm_plugin, "_log_through_vllm", lambda: None)
    for value, expected in ((None, ExtraKeyFormat.UNTAGGED), ("0", ExtraKeyFormat.UNTAGGED),
                            ("1", ExtraKeyFormat.TAGGED), ("yes", ExtraKeyFormat.TAGGED)):
        if value is None:
            monkeypatch.delenv(vllm_plugin.TAGGED_KEYS_SWITCH, raising=False)
        else:
            monkeypatch.setenv(vllm_plugin.TAGGED_KEYS_SWITCH, value)
        vllm_plugin._installed.clear()
        hashing.set_extra_key_format(ExtraKeyFormat.TAGGED if expected is
                                     ExtraKeyFormat.UNTAGGED else ExtraKeyFormat.UNTAGGED)
        info = vllm_plugin.install()
        assert hashing.EXTRA_KEY_FORMAT is expected
        assert info["extra_keys"] == expected.value
    vllm_plugin._installed.clear()


def test_plugin_refusal_leaves_the_key_format(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_plugin, "_vllm_version", lambda: "0.99.0")
    monkeypatch.setattr(vllm_plugin, "_installed", {})
    before = hashing.EXTRA_KEY_FORMAT
    with pytest.raises(vllm_plugin.UnsupportedVllmVersion):
        vllm_plugin.install()
    assert hashing.EXTRA_KEY_FORMAT is before


VLLM_013 = REPO_ROOT / ".venv-vllm-0.13.0" / "bin" / "python"

# Under vLLM 0.13 with the plugin: salt "x" and LoRA "x" over one prompt; prints whether their
# first blocks' hashes are equal.
PLUGIN_SIDE = """
from kvspec import vllm_plugin
vllm_plugin.install()
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.request import Request
from vllm.sampling_params import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
ku.init_none_hash(sha256)
hasher = ku.get_request_block_hasher(2, sha256)
def request(rid, **kw):
    return Request(rid, [0, 1, 0, 1], SamplingParams(max_tokens=4), None, None,
                   block_hasher=hasher, **kw)
salted = request("salted", cache_salt="x")
adapted = request("adapted", lora_request=LoRARequest("x", 1, "/adapters/x"))
print(ku.__name__, salted.block_hashes[0] == adapted.block_hashes[0])
"""


@pytest.mark.slow
@pytest.mark.parametrize(("switch", "shared"), [(None, True), ("1", False)])
def test_plugin_inside_vllm_0_13(switch: str | None, shared: bool) -> None:
    """In vLLM 0.13 with kvspec in place: 0.13's bytes (the collision included) by default,
    isolation with the opt-in."""
    if not VLLM_013.exists():
        pytest.skip("no .venv-vllm-0.13.0 (make vllm-env VLLM=0.13.0 builds it)")
    env = {k: v for k, v in os.environ.items() if k != vllm_plugin.TAGGED_KEYS_SWITCH}
    env.update(PYTHONHASHSEED="0", VLLM_TARGET_DEVICE="cpu")
    if switch is not None:
        env[vllm_plugin.TAGGED_KEYS_SWITCH] = switch
    proc = subprocess.run([str(VLLM_013), "-c", PLUGIN_SIDE], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=900, check=True)
    assert proc.stdout.split()[-2:] == ["kvspec.impl.kv_cache_utils", str(shared)], proc.stdout
