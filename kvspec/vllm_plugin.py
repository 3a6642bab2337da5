"""kvspec inside vLLM: kvspec's KV-cache modules in place of vLLM's, switched on by one variable.

Set-up, in an environment where vLLM 0.13 runs::

    pip install 'kvspec[vllm]'
    export VLLM_USE_KVSPEC=1

vLLM runs every *general plugin* (entry-point group ``vllm.general_plugins``) once in each of
its processes at start-up; kvspec's is ``register`` below. Without ``VLLM_USE_KVSPEC=1`` it does
nothing, so installing kvspec never changes a vLLM that has not opted in (the switch follows
the pattern of vLLM's own opt-in native block pool, ``VLLM_USE_RUST_BLOCK_POOL=1``).

Switched on, ``install`` puts ``kvspec.impl``'s modules in place of vLLM's
(``REPLACED_MODULES``): they become ``sys.modules[<vLLM's name>]``, so every later import gets
kvspec's, and every name an already imported vLLM module took from one of vLLM's originals
(the engine core imports ``get_kv_cache_configs`` and friends before plugins load; the
scheduler imports ``KVCacheManager``) is rebound to kvspec's object of the same name. The
classes kvspec builds for vLLM's callers (KV events, prefix-cache stats, eviction events) are
bound to vLLM's own (``kvspec.impl.host_types``), so vLLM's code, tests and event consumers see
their own types. A vLLM release kvspec has no profile for is refused with one line naming the
supported ones, rather than run half-working.

Block hashes stay vLLM 0.13's bytes: ``install`` selects the untagged extra-key format
(``kvspec.impl.hashing.ExtraKeyFormat.UNTAGGED``), in which a ``cache_salt`` equal to a LoRA
name shares that adapter's first cached block (docs/findings.md, B10). Tagged keys, vLLM
0.33's form, which keep requests that differ in salt or LoRA apart, are an opt-in::

    export VLLM_KVSPEC_TAGGED_EXTRA_KEYS=1

It changes the hash bytes of every request with a LoRA adapter, a cache salt, multimodal
input or prompt embeddings: blocks cached without it (an external KV cache, a KV connector's
store, another engine's hashes in KV events) are not hits with it, and a deployment must set it
in every process alike.

``python -m pytest -p kvspec.vllm_plugin ...`` installs kvspec before the test modules are
imported (``make vllm-tests`` runs vLLM's own tests that way).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
from types import ModuleType
from typing import Any

__all__ = [
    "ENV_SWITCH",
    "REPLACED_MODULES",
    "SUPPORTED_VLLM",
    "TAGGED_KEYS_SWITCH",
    "UnsupportedVllmVersion",
    "enabled",
    "install",
    "installed",
    "register",
    "tagged_keys_requested",
]

ENV_SWITCH = "VLLM_USE_KVSPEC"
# Opt-in: vLLM 0.33's tagged extra keys instead of 0.13's bare ones (module docstring).
TAGGED_KEYS_SWITCH = "VLLM_KVSPEC_TAGGED_EXTRA_KEYS"

# vLLM's module -> kvspec's module that takes its place.
REPLACED_MODULES: dict[str, str] = {
    "vllm.v1.core.block_pool": "kvspec.impl.block_pool",
    "vllm.v1.core.kv_cache_utils": "kvspec.impl.kv_cache_utils",
    "vllm.v1.core.kv_cache_manager": "kvspec.impl.kv_cache_manager",
    "vllm.v1.core.kv_cache_coordinator": "kvspec.impl.kv_cache_coordinator",
    "vllm.v1.core.single_type_kv_cache_manager": "kvspec.impl.single_type_kv_cache_manager",
    "vllm.v1.core.kv_cache_metrics": "kvspec.impl.kv_cache_metrics",
    "vllm.v1.worker.block_table": "kvspec.impl.block_table",
}

# vLLM release series (major.minor) -> the spec profile kvspec's implementation follows there.
SUPPORTED_VLLM: dict[str, str] = {"0.13": "vllm-0.13"}


class UnsupportedVllmVersion(ValueError):
    """The vLLM in this process is a release kvspec has no profile for, or there is none."""


_installed: dict[str, Any] = {}


def _switched_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def enabled() -> bool:
    """Whether ``VLLM_USE_KVSPEC`` asks for kvspec (1, true, yes or on)."""
    return _switched_on(ENV_SWITCH)


def tagged_keys_requested() -> bool:
    """Whether ``VLLM_KVSPEC_TAGGED_EXTRA_KEYS`` asks for tagged extra keys (1, true, yes, on)."""
    return _switched_on(TAGGED_KEYS_SWITCH)


def installed() -> bool:
    """Whether kvspec's modules are in place of vLLM's in this process."""
    return bool(_installed)


def register() -> None:
    """vLLM's general-plugin hook: install kvspec when ``VLLM_USE_KVSPEC=1``, else nothing."""
    if enabled():
        install()


def _vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:  # a source checkout without package metadata
        vllm = importlib.import_module("vllm")
    except ImportError:
        raise UnsupportedVllmVersion(
            f"kvspec's vLLM plugin needs vLLM ({_supported()}), and this Python has none"
        ) from None
    return str(getattr(vllm, "__version__", "unknown"))


def _supported() -> str:
    return ", ".join(f"{series}.x" for series in SUPPORTED_VLLM)


def _series(version: str) -> str:
    return ".".join(version.split(".")[:2])


def install() -> dict[str, Any]:
    """Put kvspec's modules in place of vLLM's in this process (idempotent).

    Returns what was done: the vLLM version, the profile, and the names rebound in vLLM's
    already imported modules. Raises ``UnsupportedVllmVersion`` for a vLLM release without a
    profile, before anything is changed.
    """
    if _installed:
        return _installed
    version = _vllm_version()
    profile = SUPPORTED_VLLM.get(_series(version))
    if profile is None:
        raise UnsupportedVllmVersion(
            f"kvspec's vLLM plugin supports vLLM {_supported()}; this is vLLM {version} "
            f"(unset {ENV_SWITCH} to run vLLM's own KV-cache manager)"
        )

    from kvspec.impl import hashing, host_types

    # vLLM 0.13's public functions return untagged keys, and its callers, tests and KV-cache
    # stores expect their bytes; tagged keys only when asked for.
    key_format = (hashing.ExtraKeyFormat.TAGGED if tagged_keys_requested()
                  else hashing.ExtraKeyFormat.UNTAGGED)
    hashing.set_extra_key_format(key_format)
    host_types.bind_vllm()
    originals = {name: sys.modules.get(name) for name in REPLACED_MODULES}
    replacements = {name: importlib.import_module(ours) for name, ours in REPLACED_MODULES.items()}
    for name, module in replacements.items():
        sys.modules[name] = module
        parent_name, _, child = name.rpartition(".")
        parent = sys.modules.get(parent_name)
        if parent is not None:
            setattr(parent, child, module)
    rebound = _rebind_imported_names(originals, replacements)
    _log_through_vllm()
    _installed.update(vllm=version, profile=profile, rebound=rebound,
                      modules=dict(REPLACED_MODULES), extra_keys=key_format.value)
    return _installed


def _log_through_vllm() -> None:
    """kvspec's log lines (KV-cache size and concurrency at start-up, refused prefix-cache
    resets) go where vLLM's go: vLLM configures only its own ``vllm`` logger."""
    vllm_logger = logging.getLogger("vllm")
    kvspec_logger = logging.getLogger("kvspec")
    for handler in vllm_logger.handlers:
        if handler not in kvspec_logger.handlers:
            kvspec_logger.addHandler(handler)
    if vllm_logger.handlers:
        kvspec_logger.setLevel(vllm_logger.getEffectiveLevel())
        kvspec_logger.propagate = False


def _rebind_imported_names(
    originals: dict[str, ModuleType | None], replacements: dict[str, ModuleType]
) -> list[str]:
    """In every loaded vLLM module, point each name taken from a replaced original at kvspec's
    object of the same name. Returns ``module.name`` of each rebinding."""
    ours_by_id: dict[int, Any] = {}
    for name, original in originals.items():
        if original is None:
            continue
        replacement = replacements[name]
        for attr, value in vars(original).items():
            if attr.startswith("__") or not hasattr(replacement, attr):
                continue
            # Only what the original defines itself: a name it re-exports (a dataclass
            # from kv_cache_interface, typing's helpers) is not kvspec's to replace.
            if getattr(value, "__module__", None) == name:
                ours_by_id[id(value)] = getattr(replacement, attr)
    rebound = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("vllm.") or module_name in originals:
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            ours = ours_by_id.get(id(value))
            if ours is not None and ours is not value:
                namespace[attr] = ours
                rebound.append(f"{module_name}.{attr}")
    return sorted(rebound)


# -- pytest: ``python -m pytest -p kvspec.vllm_plugin`` runs a test suite with kvspec in place


def pytest_configure(config: Any) -> None:
    install()


def pytest_report_header(config: Any) -> str:
    info = _installed
    return (f"kvspec in place of vLLM {info.get('vllm')}'s KV-cache modules "
            f"(profile {info.get('profile')}, {info.get('extra_keys')} extra keys)")
