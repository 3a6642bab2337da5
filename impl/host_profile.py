"""Which vLLM impl serves in this process, and the choices that follow from it.

The rule: **impl behaves as the vLLM imported in its process.** Two things about impl depend on
its host: how extra keys are written (``hashing.EXTRA_KEY_FORMAT``: the bytes of every block
hash of a request with a LoRA adapter, a cache salt, multimodal input or prompt embeddings),
and whose classes impl builds for its callers (``host_types``: KV events, prefix-cache stats,
eviction samples). Neither may depend on whether ``kvspec.vllm_plugin.install()`` ran: code
that puts ``kvspec.impl``'s modules in place of vLLM's by plain import aliasing must get what
the plugin gives.

So each is chosen once, at its first use (the first request block hasher made or extra key
computed; the first event or stats object built), never at import: impl imports, and works,
without vLLM. At that moment ``current()`` takes the vLLM of this Python (the one imported, else
the one installed, from its package metadata; vLLM itself is never imported here, so the choice
does not depend on whether vLLM or kvspec was imported first) and picks the profile:

=================  =========================  ======================================
vLLM               extra keys                 classes built
=================  =========================  ======================================
0.13.x             untagged (0.13's bytes)    vLLM's
0.33.x             tagged (0.33's bytes)      vLLM's
another release    tagged (kvspec's own)      kvspec's own (vLLM's fields may differ)
none               tagged (kvspec's own)      kvspec's own
=================  =========================  ======================================

kvspec on its own keeps tagged keys, which keep requests that differ in salt or LoRA apart
(docs/findings.md, B10). ``choose()`` (the plugin's ``install``) forces a profile before first
use or after; an explicit ``hashing.set_extra_key_format`` overrides the key format of
whichever profile, and a test that rebinds ``host_types`` overrides the classes.

``VLLM_PROFILES`` is the one table of vLLM releases kvspec knows; the plugin serves the part of
it named in ``kvspec.vllm_plugin.SUPPORTED_VLLM``.
"""

from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import dataclass

__all__ = ["KVSPEC", "VLLM_PROFILES", "HostProfile", "choose", "current", "host_vllm_version",
           "profile_for", "series"]

# vLLM release series (major.minor) -> (spec profile, extra-key format). The format is a value
# of hashing.ExtraKeyFormat ("tagged", "untagged"); the spec's own table agrees
# (spec.hashing.key_format; tests/test_vllm_plugin.py checks it).
VLLM_PROFILES: dict[str, tuple[str, str]] = {
    "0.13": ("vllm-0.13", "untagged"),
    "0.33": ("vllm-0.33", "tagged"),
}


@dataclass(frozen=True)
class HostProfile:
    """What impl is in this process: the host's vLLM version (None when there is none), the
    spec profile it follows, how it writes extra keys, and whether it builds vLLM's classes."""

    vllm: str | None
    profile: str
    extra_keys: str
    vllm_classes: bool


# kvspec on its own (no vLLM, or a release without a profile).
KVSPEC = HostProfile(vllm=None, profile="kvspec", extra_keys="tagged", vllm_classes=False)


def series(version: str) -> str:
    """A release's series: ``"0.13"`` for ``"0.13.0"`` or ``"0.13.1.dev4+g1234"``."""
    return ".".join(version.split(".")[:2])


def profile_for(vllm_version: str | None) -> HostProfile:
    """The profile impl follows next to ``vllm_version`` (None: no vLLM)."""
    if vllm_version is None:
        return KVSPEC
    known = VLLM_PROFILES.get(series(vllm_version))
    if known is None:
        return HostProfile(vllm=vllm_version, profile="kvspec", extra_keys="tagged",
                           vllm_classes=False)
    profile, extra_keys = known
    return HostProfile(vllm=vllm_version, profile=profile, extra_keys=extra_keys,
                       vllm_classes=True)


def host_vllm_version() -> str | None:
    """The version of this Python's vLLM: the one imported (a source checkout has no package
    metadata), else the one installed; None without one. Never imports vLLM."""
    version = getattr(sys.modules.get("vllm"), "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


_chosen: HostProfile | None = None


def current() -> HostProfile:
    """The profile of this process: chosen from the host at the first call, then kept."""
    global _chosen
    if _chosen is None:
        _chosen = profile_for(host_vllm_version())
    return _chosen


def choose(profile: HostProfile) -> HostProfile:
    """Force ``profile`` from now on (the plugin's ``install``); returns the one it replaces
    (the host's, chosen now if it was not yet)."""
    global _chosen
    previous = current()
    _chosen = profile
    return previous
