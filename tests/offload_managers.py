"""What the tests of kvspec's offloading managers share. The vLLM 0.13 managers' tests
(tests/test_abstract.py, tests/test_lru_manager.py, tests/test_arc_manager.py): the backends they
run on, the fixtures that build managers over them, and readers of a manager's state. vLLM
0.33's (tests/test_base.py, tests/test_cpu_manager.py): its keys, made from small numbers.

Every test runs against a toy backend of its own and, under a vLLM 0.13 interpreter
(.venv-vllm-0.13.0), against vLLM's real ``CPUBackend``. A test module binds a fixture by
assignment (``backend_factory = offload_managers.backend_factory``), so that pytest finds it
there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvspec.impl.kv_offload import ARCOffloadingManager, LRUOffloadingManager, make_offload_key
from kvspec.impl.kv_offload.base import OffloadKey

Manager = LRUOffloadingManager | ARCOffloadingManager


@dataclass
class ToyBlock:
    block_id: int
    ref_cnt: int = -1


@dataclass
class ToySpec:
    block_ids: list[int]

    @staticmethod
    def medium() -> str:
        return "TOY"


@dataclass
class ToyBackend:
    """vLLM's Backend, duck-typed, that refuses a double free and an over-allocation."""

    num_blocks: int
    block_size: int = 16
    medium: str = "TOY"
    free_ids: list[int] = field(default_factory=list)
    live: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.free_ids = list(range(self.num_blocks - 1, -1, -1))

    def get_num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate_blocks(self, block_hashes: list[Any]) -> list[ToyBlock]:
        if len(block_hashes) > len(self.free_ids):
            raise AssertionError("allocation beyond the free blocks")
        blocks = [ToyBlock(self.free_ids.pop()) for _ in block_hashes]
        self.live.update(b.block_id for b in blocks)
        return blocks

    def free(self, block: ToyBlock) -> None:
        if block.block_id not in self.live:
            raise AssertionError(f"block {block.block_id} freed twice")
        self.live.remove(block.block_id)
        self.free_ids.append(block.block_id)

    def get_load_store_spec(self, block_hashes: Any, blocks: Any) -> ToySpec:
        return ToySpec([b.block_id for b in blocks])


def _vllm_cpu_backend() -> Callable[[int], Any] | None:
    try:
        import vllm
        from vllm.v1.kv_offload.backends.cpu import CPUBackend
    except ImportError:
        return None
    if not str(getattr(vllm, "__version__", "")).startswith("0.13"):
        return None
    return lambda n: CPUBackend(block_size=16, num_blocks=n)


BACKENDS: dict[str, Callable[[int], Any] | None] = {
    "toy": ToyBackend,
    "vllm-cpu": _vllm_cpu_backend(),
}


@pytest.fixture(params=sorted(BACKENDS))
def backend_factory(request: pytest.FixtureRequest) -> Callable[[int], Any]:
    factory = BACKENDS[request.param]
    if factory is None:
        pytest.skip("vLLM 0.13's CPUBackend is not importable here")
    return factory


@pytest.fixture(params=["lru", "arc"])
def make(request: pytest.FixtureRequest,
         backend_factory: Callable[[int], Any]) -> Callable[[int], Manager]:
    cls = LRUOffloadingManager if request.param == "lru" else ARCOffloadingManager

    def build(capacity: int) -> Manager:
        return cls(backend_factory(capacity), enable_events=True)

    return build


def ids(spec: Any) -> list[int]:
    """The backend block ids a load or store spec names."""
    return [int(i) for i in spec.block_ids]


def snapshot(m: Manager) -> tuple[Any, ...]:
    events = list(m.events or [])
    free = m.backend.get_num_free_blocks()
    if isinstance(m, LRUOffloadingManager):
        return (m.ordered_entries(), events, free)
    return (m.t1_entries(), m.t2_entries(), m.b1_keys(), m.b2_keys(), m.target_t1_size,
            events, free)


def stored(m: Manager, keys: list[Any]) -> None:
    out = m.prepare_store(keys)
    assert out is not None
    m.complete_store(out.block_hashes_to_store)
    m.check_representation()


def held(m: Manager) -> list[tuple[Any, int]]:
    if isinstance(m, LRUOffloadingManager):
        return m.ordered_entries()
    return m.t1_entries() + m.t2_entries()


# --- vLLM 0.33's keys ---------------------------------------------------------------------------


def key(n: int) -> OffloadKey:
    return make_offload_key(n.to_bytes(8, "big"), 0)


def keys(*ns: int) -> list[OffloadKey]:
    return [key(n) for n in ns]
