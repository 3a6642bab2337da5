"""The prefix-cache map conformance machine: a target's BlockHashToBlockMap against `spec.hash_map`.

The pool keys a block only when it has none and evicts it before keying it again, so the map
never sees a block twice through the pool; on its own it must still keep its structure. This
layer drives the map through vLLM's API (``insert``, ``get_one_block``, ``pop``, ``len``) in
lock step with the spec (`lockstep.Lockstep`): outputs, refusals, the target's view (key ->
block ids) and its representation check (impl's ``check_representation()``) after every
step, and every named invariant of `spec.hash_map` on the target's state.

Keys are few (3 hashes x 2 groups) so that several blocks share a key and a pop leaves the
others behind. Blocks flow through bundles: ``unmapped`` blocks are inserted (consumed) and
come back when popped; ``mapped`` holds the (key, block) pairs a pop may take out.

`machine_for(make_adapter)` builds the machine for a target; `adapter_for(target)` makes the
adapter for ``"impl"``, ``"vllm"`` or ``"package.module:Class"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import event, strategies as st
from hypothesis.stateful import (
    Bundle,
    consumes,
    initialize,
    multiple,
    precondition,
    rule,
)

from kvspec.conformance import vllm_internals
from kvspec.conformance.free_queue_machine import (
    TargetClasses,
    block_arg,
    build_source,
    load_classes,
)
from kvspec.conformance.lockstep import Adapter, Call, Reader, method
from kvspec.conformance.machine import ComponentMachine, bad_call
from kvspec.spec import hash_map as model
from kvspec.spec.hash_map import (
    Contain,
    GetOneBlock,
    Insert,
    Len,
    MapState,
    MapView,
    NewMap,
    Pop,
)
from kvspec.spec.pool import Profile

IMPL_MODULE = "kvspec.impl.block_pool"
VLLM_MODULE = "vllm.v1.core.block_pool"
HASHES = (b"\x11" * 4, b"\x22" * 4, b"\x33" * 4)
KEYS = tuple(h + group.to_bytes(4, "big") for h in HASHES for group in (0, 1))
NOT_KEYS: tuple[object, ...] = ("a key", b"\x00\x01", 12345, None)
NOT_BLOCK_IDS: tuple[object, ...] = ("1", 1.0, None)


def map_api(map_class: Any) -> str:
    """vLLM 0.33's map can ask whether a key holds a block (``contain``); 0.13's cannot."""
    return "vllm-0.33" if hasattr(map_class, "contain") else "vllm-0.13"


BLOCK_ID_OR_NONE = Reader(lambda block: getattr(block, "block_id", None),
                          'getattr({}, "block_id", None)')


def _new_map(adapter: MapAdapter, command: NewMap) -> None:
    adapter.blocks = [adapter.classes.block(i) for i in range(command.num_blocks)]
    adapter.cache = adapter.classes.component()


@dataclass
class MapAdapter(Adapter):
    """Drives a BlockHashToBlockMap with vLLM's API over a list of block objects."""

    classes: TargetClasses
    variable: str = "cache"
    blocks: list[Any] = field(default_factory=list)
    cache: Any = None  # the map

    calls: ClassVar[dict[type, Call]] = {
        NewMap: Call(_new_map, lambda a, c: build_source(
            a.classes.block, c.num_blocks, f"{a.classes.component.__name__}()")),
        Insert: method("insert", lambda a, c: (c.key, block_arg(a, c.block_id))),
        GetOneBlock: method("get_one_block", lambda a, c: (c.key,), BLOCK_ID_OR_NONE),
        Pop: method("pop", lambda a, c: (c.key, c.block_id), BLOCK_ID_OR_NONE),
        Len: Call(lambda a, c: len(a.cache), lambda a, c: f"len({a.variable})"),
        Contain: method("contain", lambda a, c: (c.key, c.block_id), Reader(bool)),
    }

    def view(self) -> MapView | None:
        """key -> block ids: through ``items()`` where the map has it (impl), else through
        `vllm_internals.block_hash_map_entries`: vLLM has no public way to list the map."""
        if self.cache is None:
            return None
        if self.lists_items():
            return {key: tuple(b.block_id for b in blocks)
                    for key, blocks in self.cache.items()}
        return {key: tuple(b.block_id for b in blocks)
                for key, blocks in vllm_internals.block_hash_map_entries(self.cache)}

    def lists_items(self) -> bool:
        """Whether the map class lists its keys with ``items()`` (impl) or not (vLLM)."""
        return hasattr(self.classes.component, "items")

    def imports(self) -> list[str]:
        return self.classes.imports()

    def view_source(self) -> str:
        m = self.variable
        if self.lists_items():
            return f"{{key: tuple(b.block_id for b in blocks) for key, blocks in {m}.items()}}"
        return vllm_internals.block_hash_map_ids_source(m)


def adapter_for(target: str) -> Callable[[], MapAdapter]:
    """A factory of adapters for ``"impl"``, ``"vllm"`` or ``"package.module:Class"``; raises
    `TargetError` at once when the target's classes cannot be loaded."""
    classes = load_classes(target, IMPL_MODULE, VLLM_MODULE, "BlockHashToBlockMap", map_api)
    return lambda: MapAdapter(classes)


class HashMapMachine(ComponentMachine[MapState]):
    """Runs a map adapter against `spec.hash_map`; ``machine_for`` sets the adapter."""

    spec_step = staticmethod(model.step)
    view_of = staticmethod(model.view_of)
    from_view = staticmethod(model.from_view)
    shown = "key -> blocks"
    unmapped = Bundle("unmapped")  # block ids in no key: what insert may cache
    mapped = Bundle("mapped")  # (key, block id) pairs in the map: what pop may take out

    # -- set-up --------------------------------------------------------------------------

    @initialize(target=unmapped, num_blocks=st.integers(2, 16))
    def build(self, num_blocks: int) -> object:
        self.run(NewMap(num_blocks))
        return multiple(*range(num_blocks))

    # -- rules: what a pool does with its map ----------------------------------------------

    @rule(target=mapped, key=st.sampled_from(KEYS), block=consumes(unmapped))
    def insert(self, key: bytes, block: int) -> object:
        """A newly full block is cached under its key (after any block already there)."""
        before = len(model.blocks_under(self.spec, key))
        self.run(Insert(key, block))
        event("insert under a new key" if not before else "insert beside a cached block")
        return (key, block)

    @rule(target=unmapped, entry=consumes(mapped))
    def pop_cached(self, entry: tuple[bytes, int]) -> object:
        """An evicted block leaves its key (the key goes with its last block)."""
        key, block = entry
        blocks = model.blocks_under(self.spec, key)
        event("pop the first of several" if len(blocks) > 1 and blocks[0] == block
              else "pop a later block" if len(blocks) > 1 else "pop a key's only block")
        self.run(Pop(key, block))
        return block

    @rule(key=st.sampled_from(KEYS), block=unmapped)
    def pop_uncached(self, key: bytes, block: int) -> None:
        """pop of a block the key does not hold: None, nothing changes (not a refusal)."""
        self.run(Pop(key, block))

    @rule(entry=mapped, other=st.sampled_from(KEYS))
    def pop_under_another_key(self, entry: tuple[bytes, int], other: bytes) -> None:
        """pop names a cached block under a key that does not hold it: None, no change."""
        if other != entry[0] and entry[1] not in model.blocks_under(self.spec, other):
            self.run(Pop(other, entry[1]))

    @rule(key=st.sampled_from(KEYS))
    def get_one_block(self, key: bytes) -> None:
        self.run(GetOneBlock(key))

    @rule()
    def length(self) -> None:
        self.run(Len())

    # -- rules: bad calls, one per kind -----------------------------------------------------

    @bad_call(entry=mapped)
    def insert_block_already_under_key(self, entry: tuple[bytes, int]) -> None:
        self.refuse(Insert(*entry))

    @bad_call(entry=mapped, other=st.sampled_from(KEYS))
    def insert_block_under_second_key(self, entry: tuple[bytes, int], other: bytes) -> None:
        if other != entry[0]:
            self.refuse(Insert(other, entry[1]))

    @bad_call(key=st.sampled_from(NOT_KEYS), block=unmapped)
    def insert_malformed_key(self, key: object, block: int) -> None:
        self.refuse(Insert(key, block))

    @bad_call(key=st.sampled_from(NOT_KEYS))
    def get_one_block_malformed_key(self, key: object) -> None:
        self.refuse(GetOneBlock(key))

    @bad_call(key=st.sampled_from(NOT_KEYS), block=st.integers(0, 3))
    def pop_malformed_key(self, key: object, block: int) -> None:
        self.refuse(Pop(key, block))

    @bad_call(key=st.sampled_from(KEYS), block=st.sampled_from(NOT_BLOCK_IDS))
    def pop_block_id_not_an_int(self, key: bytes, block: object) -> None:
        self.refuse(Pop(key, block))


HashMapMachine.add_invariants(model.ALL)


class HashMapMachine033(HashMapMachine):
    """The map under the vllm-0.33 profile: `HashMapMachine` plus ``contain`` (asked for
    every key and block, cached or not); the 0.13 machine is left as it was."""

    @precondition(lambda self: self.built and self.adapter.classes.api == "vllm-0.33")
    @rule(key=st.sampled_from(KEYS), block=st.integers(0, 15))
    def contain(self, key: bytes, block: int) -> None:
        block %= self.spec.num_blocks
        if self.run(Contain(key, block)):
            event("contain: the key holds the block")


# Calls no caller within vLLM's contract makes: `kvspec audit --scope contract` leaves them out.
OUT_OF_CONTRACT = HashMapMachine.bad_call_rules


def machine_for(make_adapter: Callable[[], MapAdapter],
                excluded: frozenset[str] = frozenset(),
                profile: Profile = Profile.V0_13) -> type[HashMapMachine]:
    """A HashMapMachine subclass that checks the targets make_adapter makes (with 0.33's
    ``contain`` under vllm-0.33, where the target has it)."""
    base = HashMapMachine033 if profile is Profile.V0_33 else HashMapMachine
    return base.for_target(make_adapter, excluded=excluded)
