"""kvspec's vLLM plugin: off unless asked for, refuses what it cannot serve before changing
anything, and rebinds what vLLM's loaded modules took from the modules it replaces.

The parts that need vLLM run in the vLLM environment when it exists
(``make vllm-env VLLM=0.13.0``): vLLM's own plugin loader, given ``VLLM_USE_KVSPEC=1``, puts
kvspec in place of its KV-cache modules.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvspec import vllm_plugin

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm-0.13.0" / "bin" / "python"
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_register_does_nothing_unless_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_plugin.ENV_SWITCH, raising=False)
    before = dict(sys.modules)
    vllm_plugin.register()
    assert not vllm_plugin.installed()
    assert sys.modules.keys() == before.keys()


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_switch_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(vllm_plugin.ENV_SWITCH, value)
    assert vllm_plugin.enabled()


def test_unsupported_release_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_plugin, "_vllm_version", lambda: "0.33.0")
    before = dict(sys.modules)
    with pytest.raises(vllm_plugin.UnsupportedVllmVersion) as refused:
        vllm_plugin.install()
    message = str(refused.value)
    assert "\n" not in message and "0.13.x" in message and "0.33.0" in message
    assert not vllm_plugin.installed() and sys.modules.keys() == before.keys()


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_no_vllm_is_refused_in_one_line() -> None:
    with pytest.raises(vllm_plugin.UnsupportedVllmVersion, match="has none"):
        vllm_plugin.install()


def _module(name: str, **attrs: object) -> ModuleType:
    module = ModuleType(name)
    vars(module).update(attrs)
    return module


def test_loaded_vllm_modules_are_rebound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM module that imported a name from a replaced module before the plugin ran (the
    engine core imports get_kv_cache_configs at import) gets kvspec's object of that name;
    names the original only re-exports, and names kvspec lacks, stay."""

    def theirs() -> None: ...

    theirs.__module__ = "vllm.v1.core.kv_cache_utils"

    def foreign() -> None: ...

    foreign.__module__ = "vllm.v1.kv_cache_interface"

    def ours() -> None: ...

    original = _module("vllm.v1.core.kv_cache_utils", get_kv_cache_configs=theirs,
                       KVCacheConfig=foreign, only_in_vllm=theirs)
    replacement = _module("kvspec.impl.kv_cache_utils", get_kv_cache_configs=ours,
                          KVCacheConfig=ours)
    consumer = _module("vllm.v1.engine.fake_core", get_kv_cache_configs=theirs,
                       KVCacheConfig=foreign)
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.fake_core", consumer)
    rebound = vllm_plugin._rebind_imported_names(
        {"vllm.v1.core.kv_cache_utils": original},
        {"vllm.v1.core.kv_cache_utils": replacement})
    assert rebound == ["vllm.v1.engine.fake_core.get_kv_cache_configs"]
    assert consumer.get_kv_cache_configs is ours and consumer.KVCacheConfig is foreign


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm-0.13.0 (make vllm-env)")
def test_vllm_loads_the_plugin_through_its_entry_point() -> None:
    script = """
import sys
from vllm.plugins import load_general_plugins
import vllm.v1.core.sched.scheduler as scheduler  # imported before the plugin loads
load_general_plugins()
import vllm.v1.core.kv_cache_manager as manager_module
from kvspec import vllm_plugin
from kvspec.impl.kv_cache_manager import KVCacheManager
assert vllm_plugin.installed(), "plugin not installed"
assert manager_module.KVCacheManager is KVCacheManager
assert scheduler.KVCacheManager is KVCacheManager, "scheduler not rebound"
print("ok", vllm_plugin._installed["profile"])
"""
    env = dict(os.environ, VLLM_USE_KVSPEC="1", HF_HUB_OFFLINE="1")
    result = subprocess.run([str(VLLM_PYTHON), "-c", script], env=env, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0 and "ok vllm-0.13" in result.stdout, result.stderr[-3000:]


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm-0.13.0 (make vllm-env)")
def test_plugin_off_leaves_vllm_alone() -> None:
    script = """
from vllm.plugins import load_general_plugins
load_general_plugins()
import vllm.v1.core.kv_cache_manager as manager_module
assert manager_module.__name__ == "vllm.v1.core.kv_cache_manager", manager_module
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_KVSPEC"}
    result = subprocess.run([str(VLLM_PYTHON), "-c", script], env=env, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]
