"""kvspec's vLLM plugin: off unless asked for, refuses what it cannot serve before changing
anything, and rebinds what vLLM's loaded modules took from the modules it replaces.

The parts that need vLLM run in the vLLM environments when they exist
(``make vllm-env VLLM=0.13.0``, ``VLLM=0.33.0``): vLLM's own plugin loader, given
``VLLM_USE_KVSPEC=1``, puts kvspec in place of its KV-cache modules and says so in vLLM's log.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from kvspec import vllm_plugin
from kvspec.impl import block_pool, hashing, host_profile, host_types, kv_events
from kvspec.spec import hashing as spec_hashing
from kvspec.spec.pool import Profile

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm-0.13.0" / "bin" / "python"
# Each vLLM environment (make vllm-env VLLM=...): release series -> its Python.
VLLM_PYTHONS = {"0.13": VLLM_PYTHON, "0.33": ROOT / ".venv-vllm-0.33.0" / "bin" / "python"}
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_register_does_nothing_unless_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(vllm_plugin.ENV_SWITCH, raising=False)
    before = dict(sys.modules)
    vllm_plugin.register()
    assert not vllm_plugin.installed()
    assert sys.modules.keys() == before.keys()


@pytest.mark.parametrize("value", ["1", "true", "YES", "on", " On "])
def test_switch_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(vllm_plugin.ENV_SWITCH, value)
    assert vllm_plugin.enabled()


@pytest.mark.parametrize("value", ["0", "false", "No", "OFF", "", "  "])
def test_switch_off_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(vllm_plugin.TAGGED_KEYS_SWITCH, value)
    assert not vllm_plugin.tagged_keys_requested()


@pytest.mark.parametrize("value", ["2", "garbage", "enabled", "1 1", "-1"])
def test_switch_value_not_understood(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """A value that is neither on nor off is an error naming the variable and the value, not
    a silent off."""
    for name, read in ((vllm_plugin.ENV_SWITCH, vllm_plugin.enabled),
                       (vllm_plugin.TAGGED_KEYS_SWITCH, vllm_plugin.tagged_keys_requested)):
        monkeypatch.setenv(name, value)
        with pytest.raises(vllm_plugin.InvalidSwitchValue) as refused:
            read()
        message = str(refused.value)
        assert "\n" not in message and name in message and repr(value) in message
        monkeypatch.delenv(name)


@pytest.mark.parametrize(("variable", "value", "version"), [
    (vllm_plugin.ENV_SWITCH, "2", "0.13.0"),
    (vllm_plugin.TAGGED_KEYS_SWITCH, "maybe", "0.13.0"),
    (None, None, "0.99.0"),
])
def test_register_refuses_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture, variable: str | None,
                                      value: str | None, version: str) -> None:
    """vLLM calls register() unguarded: a refusal is one ERROR line and exit status 1 (no
    traceback), and nothing is installed."""
    monkeypatch.setenv(vllm_plugin.ENV_SWITCH, "1")
    monkeypatch.delenv(vllm_plugin.TAGGED_KEYS_SWITCH, raising=False)
    if variable is not None:
        monkeypatch.setenv(variable, value or "")
    monkeypatch.setattr(vllm_plugin, "_vllm_version", lambda: version)
    before = dict(sys.modules)
    with caplog.at_level(logging.INFO, logger="vllm.kvspec"), \
            pytest.raises(SystemExit) as stopped:
        vllm_plugin.register()
    assert stopped.value.code == 1
    (record,) = [r for r in caplog.records if r.name == "vllm.kvspec"]
    line = record.getMessage()
    assert record.levelno == logging.ERROR and "\n" not in line
    if variable is None:
        assert version in line
    else:
        assert variable in line and repr(value) in line
    assert not vllm_plugin.installed() and sys.modules.keys() == before.keys()


def test_unsupported_release_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_plugin, "_vllm_version", lambda: "0.99.0")
    before = dict(sys.modules)
    with pytest.raises(vllm_plugin.UnsupportedVllmVersion) as refused:
        vllm_plugin.install()
    message = str(refused.value)
    assert "\n" not in message and "0.13.x" in message and "0.99.0" in message
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
                            text=True, timeout=900, check=False)
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
                            text=True, timeout=900, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


# -- the plugin's line in vLLM's log, in each process, under each release --------------------

# vLLM's own default format: 0.33 puts "(process name pid=N) " first; the level, date and time,
# [file:line], then the message.
VLLM_LINE = re.compile(r"^(?:\(\S+ pid=(?P<pid>\d+)\) )?(?P<level>[A-Z]+) \d\d-\d\d "
                       r"\d\d:\d\d:\d\d \[vllm_plugin\.py:\d+\] (?P<message>.*)$")

# As vLLM starts: general plugins run in the process that reads the arguments before vLLM 0.33
# configures its logging (the front end, argv[1] == "front-end"), after it in the engine-core
# and worker processes it starts ("engine"); vLLM 0.13 configures it when vllm.logger is
# imported. Then a forked child, as vLLM forks its engine core and workers by default.
LOG_SCRIPT = """
import multiprocessing, os, sys
from vllm.plugins import load_general_plugins
from vllm.logger import init_logger


def configure_logging():
    try:  # vLLM 0.33: from the parsed arguments or the engine's config
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging
    except ImportError:  # vLLM 0.13: configured when vllm.logger was imported
        return
    configure_logging(LoggingConfig())


if sys.argv[1] == "engine":
    configure_logging()
load_general_plugins()
load_general_plugins()
if sys.argv[1] == "front-end":
    configure_logging()
init_logger("vllm.kvspec_test").info("vLLM's own line")
child = multiprocessing.get_context("fork").Process(target=sys.stdout.flush)
child.start()
child.join()
sys.stdout.flush()
print("pids", os.getpid(), child.pid, child.exitcode, flush=True)
"""


def _kvspec_lines(output: str) -> list[re.Match[str]]:
    lines = [line for line in output.splitlines() if "kvspec" in line and "pids" not in line]
    matches = [VLLM_LINE.match(line) for line in lines]
    assert all(matches), f"a kvspec line not in vLLM's format: {lines}"
    return [m for m in matches if m is not None]


@pytest.mark.parametrize("series", sorted(VLLM_PYTHONS))
@pytest.mark.parametrize("order", ["front-end", "engine"])
def test_plugin_line_in_every_process(series: str, order: str) -> None:
    """One INFO line per process, in vLLM's format, under vLLM 0.13 and 0.33: vLLM 0.33 runs
    general plugins before it configures its logging in the front end (the line was lost
    there), and a forked engine core inherits kvspec without running the plugin again."""
    python = VLLM_PYTHONS[series]
    if not python.exists():
        pytest.skip(f"no vLLM {series} environment (make vllm-env)")
    env = dict(os.environ, VLLM_USE_KVSPEC="1", HF_HUB_OFFLINE="1")
    for name in ("VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH"):
        env.pop(name, None)
    result = subprocess.run([str(python), "-c", LOG_SCRIPT, order], env=env, cwd="/",
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    parent, child, exitcode = (int(n) for n in output.split("pids")[-1].split())
    assert exitcode == 0, output
    lines = _kvspec_lines(output)
    said = sorted(int(re.findall(r"in process (\d+):", m["message"])[0]) for m in lines)
    assert said == sorted([parent, child]), output
    for match in lines:
        assert match["level"] == "INFO" and f"vLLM {series}." in match["message"], output
        assert f"profile vllm-{series}" in match["message"], output
        assert match["pid"] is None or int(match["pid"]) in (parent, child), output
    assert "vLLM's own line" in output


@pytest.mark.parametrize("series", sorted(VLLM_PYTHONS))
def test_plugin_refusal_is_one_vllm_line(series: str) -> None:
    """A switch value not understood: one ERROR line in vLLM's format (vLLM 0.33 wrote it bare,
    through Python's last-resort handler) and exit status 1, no traceback."""
    python = VLLM_PYTHONS[series]
    if not python.exists():
        pytest.skip(f"no vLLM {series} environment (make vllm-env)")
    env = dict(os.environ, VLLM_USE_KVSPEC="2", HF_HUB_OFFLINE="1")
    script = "from vllm.plugins import load_general_plugins; load_general_plugins()"
    result = subprocess.run([str(python), "-c", script], env=env, cwd="/",
                            capture_output=True, text=True, timeout=600, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output, output
    (line,) = _kvspec_lines(output)
    assert line["level"] == "ERROR", output
    assert line["message"].startswith("kvspec: VLLM_USE_KVSPEC='2' is not understood"), output


# -- the host profile: impl behaves as the vLLM of its Python, with or without install() ---


@pytest.fixture
def fresh_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """impl's host choices undone: no profile chosen, no key format chosen, host_types unbound;
    all put back afterwards."""
    monkeypatch.setattr(host_profile, "_chosen", None)
    monkeypatch.setattr(hashing, "_FORMAT_CHOSEN", False)
    monkeypatch.setattr(hashing, "EXTRA_KEY_FORMAT", hashing.ExtraKeyFormat.TAGGED)
    names = ["_bound_to", *sorted(host_types._HOST_NAMES)]
    saved = {name: vars(host_types)[name] for name in names if name in vars(host_types)}
    for name in names[1:]:
        vars(host_types).pop(name, None)
    host_types._bound_to = None
    yield
    for name in names:
        vars(host_types).pop(name, None)
    vars(host_types).update(saved)


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, version: str) -> dict[str, type]:
    """A stand-in vLLM of ``version`` in sys.modules, with the classes impl binds."""
    classes = {name: type(name, (), {}) for name in host_types._VLLM_CLASSES}
    modules: dict[str, dict[str, object]] = {"vllm": {"__version__": version},
                                             "vllm.distributed": {},
               "vllm.distributed.kv_events": {}, "vllm.v1": {}, "vllm.v1.metrics": {},
               "vllm.v1.metrics.stats": {}}
    for name, (module, attr) in host_types._VLLM_CLASSES.items():
        modules[module][attr] = classes[name]
    for name, attrs in modules.items():
        monkeypatch.setitem(sys.modules, name, _module(name, **attrs))
    return classes


@pytest.mark.parametrize(("version", "profile", "key_format", "vllm_classes"), [
    ("0.13.0", "vllm-0.13", "untagged", True),
    ("0.13.2.dev7+gabc", "vllm-0.13", "untagged", True),
    ("0.33.0", "vllm-0.33", "tagged", True),
    ("0.20.1", "kvspec", "tagged", False),
    (None, "kvspec", "tagged", False),
])
def test_profile_follows_the_vllm_of_this_python(
        monkeypatch: pytest.MonkeyPatch, fresh_host: None, version: str | None, profile: str,
        key_format: str, vllm_classes: bool) -> None:
    """Without install(): the key format and the classes impl builds are chosen at first use
    from the vLLM in this process (impl/host_profile.py's table)."""
    classes: dict[str, type] = {}
    if version is not None:
        classes = _fake_vllm(monkeypatch, version)
    else:
        monkeypatch.delitem(sys.modules, "vllm", raising=False)
        monkeypatch.setattr(host_profile, "host_vllm_version", lambda: None)
    assert host_profile.current() == host_profile.HostProfile(
        version, profile, key_format, vllm_classes)
    assert hashing.extra_key_format() is hashing.ExtraKeyFormat(key_format)
    assert host_types.BlockStored is (classes["BlockStored"] if vllm_classes
                                      else kv_events.BlockStored)
    assert host_types.bound_to() == ("vllm" if vllm_classes else "kvspec")


def test_hasher_made_inside_vllm_0_13_writes_untagged_keys(
        monkeypatch: pytest.MonkeyPatch, fresh_host: None) -> None:
    """The request block hasher takes the host's format when it is made, before any request."""
    _fake_vllm(monkeypatch, "0.13.0")
    from kvspec.impl.request import Request

    hasher = hashing.get_request_block_hasher(2, hashing.sha256)
    assert hashing.EXTRA_KEY_FORMAT is hashing.ExtraKeyFormat.UNTAGGED
    request = Request("r", [1, 2], cache_salt="salt", block_hasher=hasher)
    assert request.block_hashes == [hashing.hash_block_tokens(
        hashing.sha256, None, [1, 2], ("salt",))]


def test_explicit_format_overrides_the_host(monkeypatch: pytest.MonkeyPatch,
                                            fresh_host: None) -> None:
    _fake_vllm(monkeypatch, "0.13.0")
    assert hashing.set_extra_key_format("tagged") is hashing.ExtraKeyFormat.UNTAGGED
    assert hashing.extra_key_format() is hashing.ExtraKeyFormat.TAGGED


def test_profile_tables_agree() -> None:
    """impl's table of vLLM releases says what the plugin's and the spec's say of each."""
    for series, served in vllm_plugin.SUPPORTED_VLLM.items():
        chosen = host_profile.profile_for(f"{series}.0")
        assert chosen.profile == served.profile
        assert chosen.extra_keys == ("tagged" if served.tagged_keys else "untagged")
    for series, (profile, extra_keys) in host_profile.VLLM_PROFILES.items():
        spec_profile = Profile(profile)
        assert spec_hashing.key_format(spec_profile).value == extra_keys, series


def test_install_records_the_profile_and_says_so_once(
        monkeypatch: pytest.MonkeyPatch, fresh_host: None,
        caplog: pytest.LogCaptureFixture) -> None:
    """install() forces the same profile the host rule picks, and vLLM's log gets one INFO line
    naming kvspec's version and build, the profile and vLLM's version."""
    monkeypatch.setattr(vllm_plugin, "_vllm_version", lambda: "0.13.0")
    monkeypatch.setattr(vllm_plugin, "_installed", {})
    monkeypatch.setitem(vllm_plugin.SUPPORTED_VLLM, "0.13",
                        vllm_plugin.SUPPORTED_VLLM["0.13"]._replace(replaced={}))
    monkeypatch.setattr(host_types, "bind_vllm", lambda: None)
    monkeypatch.setattr(block_pool, "set_default_pool_api", lambda api: None)
    monkeypatch.setattr(vllm_plugin, "_log_through_vllm", lambda: None)
    monkeypatch.delenv(vllm_plugin.TAGGED_KEYS_SWITCH, raising=False)
    with caplog.at_level(logging.INFO, logger="vllm.kvspec"):
        vllm_plugin.install()
        vllm_plugin.install()
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.kvspec"]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    from kvspec import __version__, impl
    for part in (__version__, "compiled" if impl.COMPILED else "pure-Python", "vllm-0.13",
                 "0.13.0"):
        assert part in lines[0], (part, lines[0])
    assert host_profile.current().profile == "vllm-0.13"
    assert hashing.EXTRA_KEY_FORMAT is hashing.ExtraKeyFormat.UNTAGGED


# What plain import aliasing gets inside real vLLM 0.13, without install(): vLLM's hash bytes
# for a request with a LoRA adapter and a cache salt, and vLLM's BlockStored.
ALIASING_SCRIPT = """
import vllm.v1.core.kv_cache_utils as theirs
from vllm.distributed.kv_events import BlockStored
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.request import Request

from kvspec import vllm_plugin
from kvspec.impl import block_pool, hashing, host_profile, kv_cache_utils as ours

fn = get_hash_fn_by_name("sha256")
theirs.init_none_hash(fn)
ours.init_none_hash(hashing.sha256)


def request(hasher):
    return Request("r", list(range(12)), SamplingParams(max_tokens=4), None, None,
                   lora_request=LoRARequest("adapter", 1, "/p"), cache_salt="salt",
                   block_hasher=hasher)


theirs_request = request(theirs.get_request_block_hasher(4, fn))
ours_request = request(ours.get_request_block_hasher(4, hashing.sha256))
assert ours_request.block_hashes == theirs_request.block_hashes, "hash bytes differ"
pool = block_pool.BlockPool(8, True, 4, enable_kv_cache_events=True)
pool.cache_full_blocks(ours_request, pool.get_new_blocks(3), 0, 3, 4, 0)
events = pool.take_events()
assert events and all(type(e) is BlockStored for e in events), [type(e) for e in events]
assert not vllm_plugin.installed()
print("ok", host_profile.current().profile)
"""


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm-0.13.0 (make vllm-env)")
def test_impl_without_install_is_vllm_0_13_inside_it() -> None:
    env = {k: v for k, v in os.environ.items() if k != vllm_plugin.ENV_SWITCH}
    env.update(PYTHONHASHSEED="0", HF_HUB_OFFLINE="1")
    result = subprocess.run([str(VLLM_PYTHON), "-c", ALIASING_SCRIPT], env=env, cwd="/",
                            capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0 and "ok vllm-0.13" in result.stdout, result.stderr[-3000:]
