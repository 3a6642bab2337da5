"""kvspec inside vLLM: kvspec's KV-cache modules in place of vLLM's, switched on by one variable.

Set-up, in an environment where vLLM runs (no extra: installing kvspec changes no vLLM, torch
or numpy; the release is checked here, when vLLM starts)::

    pip install kvspec
    export VLLM_USE_KVSPEC=1

Each vLLM process that runs kvspec says so in one INFO line of vLLM's log, formatted as vLLM's
own lines are (kvspec's version, compiled or pure-Python build, vLLM's version, the process id,
profile), under vLLM 0.13 and 0.33 alike, and in the processes vLLM forks after the plugin ran
(the engine core, workers), which inherit kvspec without running the plugin. A switch value
that is not one of 1/0, true/false, yes/no, on/off (any case) or empty, and a vLLM release
kvspec cannot serve, stop vLLM at start-up with one ERROR line and exit status 1, before any
engine starts (vLLM runs general plugins while it reads its arguments; docs/plugin.md).

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

import copy
import importlib
import importlib.metadata
import logging
import logging.config
import os
import sys
from types import ModuleType
from typing import Any, NamedTuple

from kvspec.impl import host_profile

__all__ = [
    "ENV_SWITCH",
    "POOL_LEVEL_MODULES",
    "REPLACED_MODULES",
    "SUPPORTED_VLLM",
    "TAGGED_KEYS_SWITCH",
    "InvalidSwitchValue",
    "UnsupportedVllmVersion",
    "VllmSeries",
    "enabled",
    "install",
    "installed",
    "register",
    "switch",
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

# vLLM 0.33: kvspec serves the pool-level module only. 0.33's managers, coordinators and
# KVCacheManager stay vLLM's and run over kvspec's pool: kvspec has no 0.33 manager layer, and
# 0.33's kv_cache_utils holds 0.33 hashing and planning functions (resolve_block_hashes,
# lookahead keys, ...) that kvspec.impl.kv_cache_utils does not serve (docs/plugin.md).
POOL_LEVEL_MODULES: dict[str, str] = {
    "vllm.v1.core.block_pool": "kvspec.impl.block_pool",
}


class VllmSeries(NamedTuple):
    """What kvspec does inside one vLLM release series."""

    profile: str
    """The spec profile kvspec's implementation follows there."""
    replaced: dict[str, str]
    """vLLM's module -> kvspec's module that takes its place."""
    pool_api: str
    """The BlockPool API (``kvspec.impl.block_pool.POOL_APIS``) kvspec's pools serve."""
    tagged_keys: bool
    """Whether the release's extra keys are tagged (0.33) rather than bare (0.13)."""


def _served(release: str, replaced: dict[str, str]) -> VllmSeries:
    """What the plugin does inside ``release``: the profile and the extra-key format come
    from impl's one table of releases (``host_profile.VLLM_PROFILES``), so that the plugin and
    impl used without it behave as the same vLLM."""
    profile, key_format = host_profile.VLLM_PROFILES[release]
    return VllmSeries(profile, replaced, pool_api=release, tagged_keys=key_format == "tagged")


# vLLM release series (major.minor) -> what kvspec does there: the releases the plugin serves.
SUPPORTED_VLLM: dict[str, VllmSeries] = {
    "0.13": _served("0.13", REPLACED_MODULES),
    "0.33": _served("0.33", POOL_LEVEL_MODULES),
}


class UnsupportedVllmVersion(ValueError):
    """The vLLM in this process is a release kvspec has no profile for, or there is none."""


class InvalidSwitchValue(ValueError):
    """A switch variable holds a value that is neither on nor off."""


_installed: dict[str, Any] = {}

# The values a switch understands, compared without case or surrounding blanks; unset is off.
SWITCH_ON = frozenset({"1", "true", "yes", "on"})
SWITCH_OFF = frozenset({"", "0", "false", "no", "off"})


def switch(name: str) -> bool:
    """Whether the switch variable ``name`` is on; ``InvalidSwitchValue`` for a value that is
    neither (``=2`` or a typo must not silently mean off)."""
    value = os.environ.get(name)
    if value is None:
        return False
    word = value.strip().lower()
    if word in SWITCH_ON:
        return True
    if word in SWITCH_OFF:
        return False
    raise InvalidSwitchValue(
        f"{name}={value!r} is not understood: use 1/0, true/false, yes/no or on/off")


def enabled() -> bool:
    """Whether ``VLLM_USE_KVSPEC`` asks for kvspec (``switch``)."""
    return switch(ENV_SWITCH)


def tagged_keys_requested() -> bool:
    """Whether ``VLLM_KVSPEC_TAGGED_EXTRA_KEYS`` asks for tagged extra keys (``switch``)."""
    return switch(TAGGED_KEYS_SWITCH)


def installed() -> bool:
    """Whether kvspec's modules are in place of vLLM's in this process."""
    return bool(_installed)


# kvspec's lines in vLLM's log: a child of vLLM's own logger, which vLLM configures.
_VLLM_LOG = logging.getLogger("vllm.kvspec")


def _log(level: int, message: str, *args: object) -> None:
    """One line in vLLM's log (``vllm.kvspec``), formatted as vLLM formats its own.

    vLLM 0.13 configures its logging when ``vllm.logger`` is imported, before any plugin runs.
    vLLM 0.33 configures it later (``vllm.logger.configure_logging``, from the parsed arguments
    or the engine's config): in the process that reads the arguments (``vllm serve``'s front
    end, an offline ``LLM``) general plugins run first, while the ``vllm`` logger has no
    handler, and a line logged then is dropped (INFO) or written bare by Python's last-resort
    handler (ERROR). There the line goes through the handler vLLM's default configuration
    makes (``_vllm_default_handler``), once: vLLM's own configuration, later, does not repeat
    it. Engine-core and worker processes configure logging before they load plugins.
    """
    handler = None if logging.getLogger("vllm").handlers else _vllm_default_handler()
    if handler is None:
        _VLLM_LOG.log(level, message, *args, stacklevel=2)
        return
    # Only this handler, as vLLM's configured logger does not propagate either; the level is
    # the handler's (VLLM_LOGGING_LEVEL), not the unconfigured logger's WARNING.
    propagate, logger_level = _VLLM_LOG.propagate, _VLLM_LOG.level
    _VLLM_LOG.addHandler(handler)
    _VLLM_LOG.propagate = False
    _VLLM_LOG.setLevel(handler.level)
    try:
        _VLLM_LOG.log(level, message, *args, stacklevel=2)
    finally:
        _VLLM_LOG.removeHandler(handler)
        _VLLM_LOG.propagate = propagate
        _VLLM_LOG.setLevel(logger_level)
        handler.close()


def _vllm_default_handler() -> logging.Handler | None:
    """The handler vLLM's default configuration gives its ``vllm`` logger (stream, level,
    format), made by logging.config's configurator from the dict vLLM's ``dictConfig`` reads
    (``vllm.logger.DEFAULT_LOGGING_CONFIG``). None where vLLM will not configure its logging
    (``VLLM_CONFIGURE_LOGGING=0``: its lines go to the application's loggers, and so does this
    one), configures it from the user's file (``VLLM_LOGGING_CONFIG_PATH``), or is absent."""
    try:
        from vllm import envs
        from vllm.logger import DEFAULT_LOGGING_CONFIG
    except Exception:  # no vLLM, or one this code does not know: plain logging
        return None
    if not envs.VLLM_CONFIGURE_LOGGING or envs.VLLM_LOGGING_CONFIG_PATH:
        return None
    configurator = logging.config.DictConfigurator(copy.deepcopy(DEFAULT_LOGGING_CONFIG))
    handler_config = configurator.config["handlers"]["vllm"]
    formatters = configurator.config["formatters"]
    name = handler_config["formatter"]
    formatters[name] = configurator.configure_formatter(formatters[name])
    handler: logging.Handler = configurator.configure_handler(handler_config)
    handler.addFilter(_name_the_process)
    return handler


def _name_the_process(record: logging.LogRecord) -> bool:
    """vLLM 0.33's format names the process (``%(vllm_process_name)s``), a field its record
    factory adds once its logging is configured; before that, the factory gives the process's
    own name."""
    record.__dict__.setdefault("vllm_process_name", record.processName)
    return True


def register() -> None:
    """vLLM's general-plugin hook: install kvspec when ``VLLM_USE_KVSPEC`` is on, else nothing.

    A refusal (a switch value not understood, a vLLM release kvspec cannot serve) is one ERROR
    line in vLLM's log and ``SystemExit(1)``: vLLM calls this hook unguarded
    (``vllm.plugins.load_general_plugins``), first while it reads its arguments, so the process
    stops there, before any engine or worker starts, without a traceback. Running vLLM's own
    manager instead would hide that the kvspec asked for is not what runs.
    """
    try:
        if not enabled():
            return
        tagged_keys_requested()  # checked before anything changes
        install()
    except (InvalidSwitchValue, UnsupportedVllmVersion) as refused:
        _log(logging.ERROR, "kvspec: %s", refused)
        raise SystemExit(1) from None


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
    series = SUPPORTED_VLLM.get(_series(version))
    if series is None:
        raise UnsupportedVllmVersion(
            f"kvspec's vLLM plugin supports vLLM {_supported()}; this is vLLM {version} "
            f"(unset {ENV_SWITCH} to run vLLM's own KV-cache manager)"
        )

    from kvspec.impl import block_pool, hashing, host_types

    # vLLM 0.13's public functions return untagged keys, and its callers, tests and KV-cache
    # stores expect their bytes; tagged keys only when asked for. 0.33's are tagged.
    key_format = (hashing.ExtraKeyFormat.TAGGED if series.tagged_keys or tagged_keys_requested()
                  else hashing.ExtraKeyFormat.UNTAGGED)
    hashing.set_extra_key_format(key_format)
    block_pool.set_default_pool_api(series.pool_api)
    host_types.bind_vllm()
    replaced = series.replaced
    originals = {name: sys.modules.get(name) for name in replaced}
    replacements = {name: importlib.import_module(ours) for name, ours in replaced.items()}
    for name, module in replacements.items():
        sys.modules[name] = module
        parent_name, _, child = name.rpartition(".")
        parent = sys.modules.get(parent_name)
        if parent is not None:
            setattr(parent, child, module)
    rebound = _rebind_imported_names(originals, replacements)
    _log_through_vllm()
    _record_profile(version, series.profile, key_format.value, len(replaced))
    _installed.update(vllm=version, profile=series.profile, rebound=rebound,
                      modules=dict(replaced), extra_keys=key_format.value)
    return _installed


def _record_profile(version: str, profile: str, extra_keys: str, replaced: int) -> None:
    """impl's host profile is the one installed (``kvspec.impl.host_profile``), and vLLM's log
    says, once per process, that kvspec runs and as what."""
    from kvspec.impl import host_profile

    host_profile.choose(host_profile.HostProfile(
        vllm=version, profile=profile, extra_keys=extra_keys, vllm_classes=True))
    _announced.update(version=version, profile=profile, extra_keys=extra_keys,
                      replaced=replaced)
    _announce()
    global _announced_in_forks
    if not _announced_in_forks:
        _announced_in_forks = True
        os.register_at_fork(after_in_child=_announce_in_forked_child)


# What the line says; kept for the processes forked after install().
_announced: dict[str, Any] = {}
_announced_in_forks = False


def _announce() -> None:
    import kvspec
    from kvspec import impl

    info = _announced
    _log(logging.INFO,
         "kvspec %s (%s build) runs vLLM %s's KV-cache modules (%d replaced) in process %d: "
         "profile %s, %s extra keys", kvspec.__version__,
         "compiled" if impl.COMPILED else "pure-Python", info["version"], info["replaced"],
         os.getpid(), info["profile"], info["extra_keys"])


def _announce_in_forked_child() -> None:
    """A process vLLM forks after the plugin ran (by default its engine core and workers, on
    Linux) runs kvspec as inherited: vLLM does not run general plugins there again
    (``plugins_loaded``), so this says so, once, in that process's own line."""
    if _installed and _announced:
        _log_through_vllm()
        _announce()


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
    import pytest

    try:
        install()
    except UnsupportedVllmVersion as refused:  # one line, not an internal-error traceback
        raise pytest.UsageError(f"kvspec: {refused}") from None


def pytest_report_header(config: Any) -> str:
    info = _installed
    return (f"kvspec in place of vLLM {info.get('vllm')}'s KV-cache modules "
            f"(profile {info.get('profile')}, {info.get('extra_keys')} extra keys)")
