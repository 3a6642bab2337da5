"""What impl takes from its host (impl/host_types.py): the classes it builds for its callers and
the context-parallel layout, bound to impl's own (``bind_kvspec``) or to vLLM's (``bind_vllm``,
here against stand-in vLLM modules). Which binding a process gets at first use, with and
without the plugin: tests/test_vllm_plugin.py.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import pytest

from kvspec.impl import host_types, kv_events, stats

NAMES = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "KVCacheEvictionEvent",
         "PrefixCacheStats")


@pytest.fixture(autouse=True)
def bound_again() -> Iterator[None]:
    """This process's binding, put back after the test bound others."""
    before = host_types.bound_to()
    yield
    if before == "vllm":
        host_types.bind_vllm()
    else:
        host_types.bind_kvspec()


def _module(name: str, **attributes: object) -> ModuleType:
    module = ModuleType(name)
    vars(module).update(attributes)
    return module


def test_bind_kvspec_builds_impls_classes_for_one_rank() -> None:
    host_types.bind_kvspec()
    assert host_types.bound_to() == "kvspec"
    for name in NAMES[:3]:
        assert getattr(host_types, name) is getattr(kv_events, name)
    for name in NAMES[3:]:
        assert getattr(host_types, name) is getattr(stats, name)
    assert host_types.context_parallel_layout() == (1, 0, 1, 0)


def test_bind_vllm_builds_vllms_classes_and_reads_its_process_groups(
        monkeypatch: pytest.MonkeyPatch) -> None:
    classes = {name: type(name, (), {}) for name in NAMES}

    def uninitialised() -> object:
        raise AssertionError("group is not initialized")  # what vLLM's getters raise

    modules: dict[str, dict[str, object]] = {
        "vllm": {}, "vllm.v1": {}, "vllm.v1.metrics": {},
        "vllm.distributed": {"get_pcp_group": uninitialised,
                             "get_dcp_group": lambda: SimpleNamespace(world_size=4,
                                                                      rank_in_group=3)},
        "vllm.distributed.kv_events": {name: classes[name] for name in NAMES[:3]},
        "vllm.v1.metrics.stats": {name: classes[name] for name in NAMES[3:]},
    }
    for name, attributes in modules.items():
        monkeypatch.setitem(sys.modules, name, _module(name, **attributes))
    host_types.bind_vllm()
    assert host_types.bound_to() == "vllm"
    for name in NAMES:
        assert getattr(host_types, name) is classes[name]
    assert host_types.context_parallel_layout() == (1, 0, 4, 3)


def test_a_name_it_does_not_have_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'BlockEvicted'"):
        host_types.BlockEvicted  # noqa: B018
