"""Which vLLM impl serves in its process (impl/host_profile.py): a release's series, the profile
each release gets, the host's version read without importing vLLM, and a profile chosen once and
forced by ``choose``. What follows from the profile (key format, classes built), with and
without the plugin: tests/test_vllm_plugin.py.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

from kvspec.impl import host_profile
from kvspec.impl.host_profile import KVSPEC, HostProfile, profile_for, series


@pytest.fixture
def chosen_again() -> Iterator[None]:
    """This process's profile, put back after the test forced others."""
    previous = host_profile.current()
    yield
    host_profile.choose(previous)


def test_a_series_is_the_major_and_minor_version() -> None:
    assert series("0.13.0") == "0.13"
    assert series("0.33.1.dev4+g1234") == "0.33"
    assert series("1") == "1"


@pytest.mark.parametrize(("version", "expected"), [
    ("0.13.0", HostProfile("0.13.0", "vllm-0.13", "untagged", True)),
    ("0.13.2rc1", HostProfile("0.13.2rc1", "vllm-0.13", "untagged", True)),
    ("0.33.0", HostProfile("0.33.0", "vllm-0.33", "tagged", True)),
    ("0.20.1", HostProfile("0.20.1", "kvspec", "tagged", False)),
    ("1.13.0", HostProfile("1.13.0", "kvspec", "tagged", False)),
    (None, KVSPEC),
])
def test_each_release_gets_its_profile(version: str | None, expected: HostProfile) -> None:
    assert profile_for(version) == expected


def test_every_known_release_builds_vllms_classes() -> None:
    for known, (profile, extra_keys) in host_profile.VLLM_PROFILES.items():
        assert profile_for(f"{known}.0") == HostProfile(f"{known}.0", profile, extra_keys, True)


def test_the_host_version_is_the_imported_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = ModuleType("vllm")
    fake.__version__ = "0.33.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    assert host_profile.host_vllm_version() == "0.33.0"


def test_choose_forces_a_profile_and_returns_the_one_it_replaces(chosen_again: None) -> None:
    first = host_profile.current()
    assert host_profile.current() is first  # chosen once, then kept
    forced = profile_for("0.33.0")
    assert host_profile.choose(forced) is first
    assert host_profile.current() is forced
    assert host_profile.choose(KVSPEC) is forced
