"""The layers ``kvspec audit`` checks, and how each one's machine is built for a target.

A `Layer` names a component (the free queue, the prefix-cache map, the pool, the manager, the
block table), the test file whose machine the mutant catalogue scores (the ``checker`` of
build/mutants.json's entries: a name, not a file read here) and how to build its machine
(`LayerMachine`) for a target and a profile. `LAYERS` is the registry, in audit order;
`layers_for` says which of them ``--layer`` selects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from hypothesis.stateful import RuleBasedStateMachine

from kvspec.conformance.vllm_targets import LayerUnavailable, TargetError, pool_target
from kvspec.spec.pool import NewPool, Profile

__all__ = ["LAYERS", "LAYER_NAMES", "Layer", "LayerMachine", "LayerUnavailable", "layers_for",
           "policy_layer"]

LAYER_NAMES = ("free-queue", "hash-map", "pool", "manager", "attention", "block-table",
               "offload")


@dataclass(frozen=True)
class LayerMachine:
    """A layer's machine, ready to run against one target under one profile."""

    machine: type[RuleBasedStateMachine]
    target_class: str  # what is being driven, for the report
    api: str  # which adapter drives it
    out_of_contract: frozenset[str] = frozenset()
    notes: tuple[str, ...] = ()  # what the report should say about this machine


@dataclass(frozen=True)
class Layer:
    name: str
    description: str
    checker: str  # the test file whose machine the mutant catalogue scores
    build: Callable[[str, Profile], LayerMachine]


def _check_builds(make: Callable[[], Any], command: NewPool, what: str) -> None:
    """A target that cannot be built is a usage error, not a discrepancy."""
    try:
        make().perform(command)
    except Exception as error:
        raise TargetError(f"cannot build target {what}: {type(error).__name__}: "
                          f"{error}") from error


def _build_pool(target: str, profile: Profile) -> LayerMachine:
    from kvspec.conformance import pool_machine

    info = pool_target(target)
    out_of_contract = frozenset(getattr(pool_machine, "OUT_OF_CONTRACT", ()))
    if target == "impl" and profile is Profile.V0_33:
        # impl's pool serves either release's API, chosen when it is built: under the 0.33
        # profile it is built for 0.33 (as the plugin builds it under vLLM 0.33).
        from kvspec.conformance.vllm_targets import IMPL_POOL, Vllm033Pool

        def make_033() -> Any:
            return Vllm033Pool(IMPL_POOL, pool_arguments={"vllm_api": "0.33"})
        _check_builds(make_033, NewPool(2, True, True, profile=profile),
                      f"{IMPL_POOL!r} as a vLLM 0.33 BlockPool")
        machine = pool_machine.machine_for(make_033, profile)
        # impl does what vLLM 0.33 does where a second watcher replaces the first (vLLM's bug,
        # docs/findings.md B11), for a drop-in's sake: left out rather than reported each time.
        machine.excluded = frozenset({pool_machine.WATCHED_TWICE})
        return LayerMachine(machine, IMPL_POOL, "vLLM 0.33 BlockPool API (vllm_api='0.33')",
                            out_of_contract, notes=(
                                f"left out: {pool_machine.WATCHED_TWICE!r} (impl follows "
                                "vLLM 0.33 there, docs/findings.md B11)",))
    _check_builds(info.make, NewPool(2, True, True), f"{info.pool_path!r} as a BlockPool")
    return LayerMachine(pool_machine.machine_for(info.make, profile), info.pool_path, info.api,
                        out_of_contract)


def _build_manager(target: str, profile: Profile) -> LayerMachine:
    try:
        from kvspec.conformance import manager_machine
    except ImportError as error:
        raise LayerUnavailable(f"no manager machine in this checkout ({error})") from error
    out_of_contract = frozenset(manager_machine.OUT_OF_CONTRACT)
    if profile is Profile.V0_33:
        return _build_manager_033(target, out_of_contract)
    if target == "impl":
        return LayerMachine(manager_machine.machine_for(manager_machine.ImplManager),
                            "kvspec.impl.kv_cache_manager:KVCacheManager",
                            "vLLM 0.13 KVCacheManager API", out_of_contract)
    if target != "vllm":
        raise LayerUnavailable(f"no KVCacheManager adapter for target {target!r} yet")
    from kvspec.conformance import vllm_targets
    from kvspec.conformance.manager_targets import Vllm013Manager

    if vllm_targets.vllm_version() is None:
        raise TargetError(vllm_targets.no_vllm_message())
    manager_class = vllm_targets.load_class(vllm_targets.VLLM_MANAGER)
    if not vllm_targets.has_013_manager_api(manager_class):
        raise LayerUnavailable("no adapter for this vLLM's KVCacheManager API (0.13's only)")
    layouts, left_out = vllm_targets.vllm_013_layouts(manager_machine.ALL_LAYOUTS)
    return LayerMachine(
        manager_machine.machine_for(Vllm013Manager, tuple(layouts)),
        vllm_targets.VLLM_MANAGER, "vLLM 0.13 KVCacheManager API", out_of_contract,
        notes=tuple(f"layout left out: {reason}" for reason in left_out))


def _build_manager_033(target: str, out_of_contract: frozenset[str]) -> LayerMachine:
    """vLLM 0.33's KVCacheManager against the spec's vllm-0.33 profile: over vLLM's own
    BlockPool (``vllm``), or over kvspec's (``impl``: impl has no 0.33 manager; under vLLM
    0.33 kvspec serves the pool beneath vLLM's managers, as the plugin installs it)."""
    from kvspec.conformance import manager_machine, vllm_targets
    from kvspec.conformance.manager_targets import Vllm033Manager, kvspec_pool_under_033

    if target not in ("vllm", "impl"):
        raise LayerUnavailable(f"no vLLM 0.33 KVCacheManager adapter for target {target!r}")
    version = vllm_targets.vllm_version()
    if version is None:
        if target == "impl":
            raise LayerUnavailable(
                "impl has no 0.33 manager: this layer drives vLLM 0.33's managers over "
                "kvspec's pool and needs vLLM 0.33 in this interpreter")
        raise TargetError(vllm_targets.no_vllm_message())
    manager_class = vllm_targets.load_class(vllm_targets.VLLM_MANAGER)
    if not vllm_targets.has_033_manager_api(manager_class):
        raise LayerUnavailable(f"vLLM {version}'s KVCacheManager has no 0.33 API")
    layouts, left_out = vllm_targets.vllm_033_layouts(manager_machine.ALL_LAYOUTS)
    make: Callable[[], Any] = Vllm033Manager
    shown = vllm_targets.VLLM_MANAGER
    if target == "impl":
        make, shown = kvspec_pool_under_033(), (f"{vllm_targets.VLLM_MANAGER} over "
                                                 f"{vllm_targets.IMPL_POOL}")
    return LayerMachine(
        manager_machine.machine_for(make, tuple(layouts), profile=Profile.V0_33), shown,
        "vLLM 0.33 KVCacheManager API", out_of_contract,
        notes=tuple(f"layout left out: {reason}" for reason in left_out))


def _build_attention(target: str, profile: Profile) -> LayerMachine:
    """The attention-type managers called directly (conformance/attention_manager_machine.py)."""
    from kvspec.conformance import attention_manager_machine as attention

    make = attention.adapter_for(target)
    if make.profile is not profile and target == "vllm":
        raise LayerUnavailable(f"the installed vLLM's managers follow {make.profile.value}, "
                               f"not --profile {profile.value}")
    classes = ", ".join(attention.MANAGER_NAMES[kind] for kind in make.kinds)
    return LayerMachine(attention.machine_for(make), f"{make.manager_module}: {classes}",
                        f"{make.api} ({make.name})",
                        frozenset(attention.OUT_OF_CONTRACT), notes=make.notes)


def policy_layer(layer: str, policy_name: str, target: str, profile: Profile) -> LayerMachine:
    """The pool or manager machine under an eviction policy (``--policy``): for ``impl``,
    impl's plug-in of that policy; for a ``module:Class`` that is an impl `EvictionPolicy`
    plug-in, impl's pool (and manager) built with it; for any other class, a pool with vLLM
    0.13's API and kvspec's policy calls that claims the policy itself (pool layer only)."""
    from kvspec.conformance import manager_machine, pool_machine
    from kvspec.conformance.targets import IMPL_POLICIES, VllmApiPool, load
    from kvspec.conformance.vllm_targets import IMPL_POOL, Vllm033Pool
    from kvspec.impl.eviction import EvictionPolicy
    from kvspec.spec.eviction import policy_named

    try:
        policy = policy_named(policy_name)
    except ValueError as error:
        raise TargetError(str(error)) from None
    plug_in: str | None
    pool_path = "kvspec.impl.block_pool:BlockPool"
    if target == "impl":
        plug_in = IMPL_POLICIES.get(policy_name)
    elif ":" in target:
        try:
            found = load(target)
        except (ImportError, AttributeError) as error:
            raise TargetError(f"cannot load target {target!r}: {error}") from error
        if isinstance(found, type) and issubclass(found, EvictionPolicy):
            plug_in = target
        else:
            plug_in, pool_path = None, target
    else:
        raise LayerUnavailable(f"--policy audits impl or a module:Class target, not {target!r}")
    shown = plug_in or pool_path
    if layer == "manager":
        if pool_path != "kvspec.impl.block_pool:BlockPool":
            raise LayerUnavailable("a pool class is audited on the pool layer only")
        return LayerMachine(
            manager_machine.machine_for(lambda: manager_machine.ImplManager(plug_in),
                                        policy=policy),
            shown, f"impl's KVCacheManager with eviction policy {policy_name}",
            frozenset(manager_machine.OUT_OF_CONTRACT))

    def make() -> VllmApiPool:
        if profile is Profile.V0_33 and pool_path == IMPL_POOL:
            # impl's pool built for 0.33's API under the 0.33 profile (as `_build_pool`).
            return Vllm033Pool(pool_path, policy_path=plug_in,
                               pool_arguments={"vllm_api": "0.33"})
        return VllmApiPool(pool_path, policy_path=plug_in)
    _check_builds(make, NewPool(2, True, True, policy=policy),
                  f"{shown!r} as a BlockPool with policy {policy_name}")
    return LayerMachine(pool_machine.machine_for(make, profile, policy), shown,
                        f"vLLM 0.13 BlockPool API + eviction policy {policy_name}",
                        frozenset(pool_machine.OUT_OF_CONTRACT))


def _component_layer(module_name: str, target: str, profile: Profile, api: str) -> LayerMachine:
    """A layer whose machine module offers ``adapter_for(target)`` and ``machine_for``: the
    free queue, the hash map and the block tables (the same machine under every profile:
    what they do does not differ between the releases kvspec follows)."""
    import importlib

    try:
        module = importlib.import_module(f"kvspec.conformance.{module_name}")
    except ModuleNotFoundError as error:
        raise LayerUnavailable(f"no {module_name} in this checkout ({error})") from error
    make_adapter = module.adapter_for(target)
    adapter = make_adapter()
    target_class = getattr(adapter, "target_path", None) or getattr(
        adapter, "target_class", None) or target
    import inspect

    # The free queue and the map take the profile (0.33's prepend_n and contain).
    takes_profile = "profile" in inspect.signature(module.machine_for).parameters
    machine = (module.machine_for(make_adapter, profile=profile) if takes_profile
               else module.machine_for(make_adapter))
    return LayerMachine(machine, str(target_class), api,
                        frozenset(getattr(module, "OUT_OF_CONTRACT", ())))


def _build_offload(target: str, profile: Profile) -> LayerMachine:
    """The offload tier's manager (conformance/offload_machine.py): impl's, or the installed
    vLLM's (0.13's LRU and ARC managers, 0.33's CPUOffloadingManager with both policies)."""
    from kvspec.conformance import offload_machine

    make = offload_machine.adapter_for(target, profile)
    adapter = make()
    if isinstance(adapter, offload_machine.Api013Adapter):
        shown = ", ".join(f"{c.__module__}:{c.__name__}" for c in adapter.classes.values())
        api = "vLLM 0.13 OffloadingManager API (LRU and ARC)"
    else:
        manager = (adapter.manager_class if isinstance(adapter, offload_machine.Api033Adapter)
                   else type(adapter))
        shown = f"{manager.__module__}:{manager.__name__}"
        api = "vLLM 0.33 OffloadingManager API (CPUOffloadingManager, LRU and ARC policies)"
    return LayerMachine(offload_machine.machine_for(make, profile), shown, api,
                        frozenset(offload_machine.OUT_OF_CONTRACT))


LAYERS: dict[str, Layer] = {
    "free-queue": Layer("free-queue", "FreeKVCacheBlockQueue: the free order on its own",
                        "tests/test_free_queue_machine.py", partial(
                            _component_layer, "free_queue_machine",
                            api="vLLM FreeKVCacheBlockQueue API")),
    "hash-map": Layer("hash-map", "BlockHashToBlockMap: the prefix-cache map on its own",
                      "tests/test_hash_map_machine.py", partial(
                          _component_layer, "hash_map_machine",
                          api="vLLM BlockHashToBlockMap API")),
    "pool": Layer("pool", "BlockPool: allocation, ref counts, free order, prefix-cache keys, "
                  "events", "tests/test_pool_machine.py", _build_pool),
    "manager": Layer("manager", "KVCacheManager: hits, allocate_slots, free, per-group "
                     "tables", "tests/test_manager_machine.py", _build_manager),
    "attention": Layer("attention", "Full, sliding-window, chunked-local and Mamba managers "
                       "called directly: hits over several groups, skipped blocks, allocation",
                       "tests/test_attention_manager_machine.py", _build_attention),
    "block-table": Layer("block-table", "BlockTable: rows and slot mapping",
                         "tests/test_block_table_machine.py", partial(
                             _component_layer, "block_table_machine",
                             api="vLLM BlockTable / MultiGroupBlockTable API")),
    "offload": Layer("offload", "OffloadingManager: the CPU tier's stores, loads, pins, "
                     "eviction (LRU, ARC) and events", "tests/test_offload_machine.py",
                     _build_offload),
}


def layers_for(layer: str, target: str) -> list[str]:
    """Which layers ``--layer`` names: ``auto`` picks by target (a class: by its name)."""
    if layer == "all" or (layer == "auto" and target in ("impl", "vllm")):
        return list(LAYER_NAMES)
    if layer == "auto":
        class_name = target.partition(":")[2]
        return next(([name] for word, name in (("Offloading", "offload"), ("Manager", "manager"),
                                                ("Table", "block-table"),
                                                ("Queue", "free-queue"), ("Map", "hash-map"))
                     if word in class_name), ["pool"])
    if layer not in LAYERS:
        raise TargetError(f"unknown layer {layer!r}: use {', '.join(LAYER_NAMES)} or all")
    return [layer]

