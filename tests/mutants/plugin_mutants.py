"""Drop-in switch and profile mutants: the 0.13 drop-in as users meet it (issue 19). Each is
killed by tests/test_vllm_plugin.py: the switch parsed strictly, a refusal that is one line and
no traceback, and impl that behaves as the vLLM of its process without ``install()``.
"""

from __future__ import annotations

import os
from typing import Any

from kvspec import vllm_plugin
from kvspec.impl import host_profile, host_types
from tests.mutants import Mutant, replace

PLUGIN = "tests/test_vllm_plugin.py"
PROFILE_TEST = f"{PLUGIN}::test_profile_follows_the_vllm_of_this_python"


def switch_unknown_means_off() -> None:
    """A switch value that is neither on nor off silently means off (``VLLM_USE_KVSPEC=2``
    runs vLLM's own manager without a word), as before issue 19."""
    def switch(name: str) -> bool:
        return os.environ.get(name, "").strip().lower() in vllm_plugin.SWITCH_ON
    replace(vllm_plugin, "switch", switch)


def switch_is_case_sensitive() -> None:
    """``VLLM_USE_KVSPEC=YES`` or ``=On`` is refused: the values are compared with their case."""
    original = vllm_plugin.switch

    def switch(name: str) -> bool:
        value = os.environ.get(name)
        if value is not None and value.strip() != value.strip().lower():
            raise vllm_plugin.InvalidSwitchValue(f"{name}={value!r} is not understood")
        return original(name)
    replace(vllm_plugin, "switch", switch)


def refusal_is_a_traceback() -> None:
    """register() lets the refusal propagate: vLLM's unguarded plugin loop prints a traceback
    and aborts start-up mid-way."""
    def register() -> None:
        if vllm_plugin.enabled():
            vllm_plugin.tagged_keys_requested()
            vllm_plugin.install()
    replace(vllm_plugin, "register", register)


def profile_ignores_the_host() -> None:
    """impl ignores the vLLM in its process: without install() it writes tagged keys and builds
    its own event classes inside vLLM 0.13 (different hashes for a LoRA or salted request)."""
    replace(host_profile, "profile_for", lambda vllm_version: host_profile.KVSPEC)


def profile_by_major_only() -> None:
    """The release series is read as the major version alone, so vLLM 0.33 is taken for 0.13
    (untagged keys inside 0.33)."""
    def profile_for(vllm_version: str | None) -> host_profile.HostProfile:
        if vllm_version is None:
            return host_profile.KVSPEC
        profile, extra_keys = host_profile.VLLM_PROFILES["0.13"]
        if vllm_version.split(".")[0] != "0":
            return host_profile.HostProfile(vllm_version, "kvspec", "tagged", False)
        return host_profile.HostProfile(vllm_version, profile, extra_keys, True)
    replace(host_profile, "profile_for", profile_for)


def host_classes_never_bound() -> None:
    """host_types builds impl's own classes whatever the host: vLLM's event consumers get
    objects of kvspec's types unless the plugin ran."""
    replace(host_types, "_bind_for_host", host_types.bind_kvspec)


def install_forgets_profile() -> None:
    """install() sets the key format but does not record its profile, so impl's profile and
    the plugin's disagree."""
    def record(version: str, profile: str, extra_keys: str, replaced: int) -> None:
        vllm_plugin._VLLM_LOG.info("kvspec runs vLLM %s: profile %s", version, profile)
    replace(vllm_plugin, "_record_profile", record)


def _mutant(name: str, plant: Any, *checker: str) -> Mutant:
    description = " ".join((plant.__doc__ or "").split())
    return Mutant(name, description, plant, checker)


MUTANTS: list[Mutant] = [
    _mutant("plugin_switch_unknown_means_off", switch_unknown_means_off, PLUGIN),
    _mutant("plugin_switch_is_case_sensitive", switch_is_case_sensitive, PLUGIN),
    _mutant("plugin_refusal_is_a_traceback", refusal_is_a_traceback, PLUGIN),
    # Named by the tests that kill them: the file's tests before those start vLLM 0.13's
    # Python (where .venv-vllm-0.13.0 is built), some 15 s of every run.
    _mutant("plugin_profile_ignores_the_host", profile_ignores_the_host, PROFILE_TEST),
    _mutant("plugin_profile_by_major_only", profile_by_major_only, PROFILE_TEST),
    _mutant("plugin_host_classes_never_bound", host_classes_never_bound, PROFILE_TEST),
    _mutant("plugin_install_forgets_profile", install_forgets_profile,
            f"{PLUGIN}::test_install_records_the_profile_and_says_so_once"),
]
