"""The prefix-cache map conformance machine: a target's BlockHashToBlockMap against `spec.hash_map`.

The pool keys a block only when it has none and evicts it before keying it again, so the map
never sees a block twice through the pool; on its own it must still keep its structure. This
layer drives the map through vLLM's API (``insert``, ``get_one_block``, ``pop``, ``len``) in
lock step with the spec (`lockstep.Lockstep`): outputs, refusals, the target's view (key ->
block ids) and its representation check (impl's ``_check()``) after every step, and every
named invariant of `spec.hash_map` on the target's state.

Keys are few (3 hashes x 2 groups) so that several blocks share a key and a pop leaves the
others behind. Blocks flow through bundles: ``unmapped`` blocks are inserted (consumed) and
come back when popped; ``mapped`` holds the (key, block) pairs a pop may take out.

`machine_for(make_adapter)` builds the machine for a target; `adapter_for(target)` makes the
adapter for ``"impl"``, ``"vllm"`` or ``"package.module:Class"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import event, note, strategies as st
from hypothesis.stateful import (
    Bundle,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from kvspec.conformance.deadline import BoundedSteps
from kvspec.conformance.free_queue_machine import (
    TargetClasses,
    build_source,
    load_classes,
    run_checked,
)
from kvspec.conformance.lockstep import Lockstep, Refused, add_named_invariants
from kvspec.spec import hash_map as model
from kvspec.spec.hash_map import Command, GetOneBlock, Insert, Len, MapState, MapView, NewMap, Pop

IMPL_MODULE = "kvspec.impl.block_pool"
VLLM_MODULE = "vllm.v1.core.block_pool"
HASHES = (b"\x11" * 4, b"\x22" * 4, b"\x33" * 4)
KEYS = tuple(h + group.to_bytes(4, "big") for h in HASHES for group in (0, 1))
NOT_KEYS: tuple[object, ...] = ("a key", b"\x00\x01", 12345, None)
NOT_BLOCK_IDS: tuple[object, ...] = ("1", 1.0, None)


def map_api(map_class: Any) -> str:
    """vLLM 0.33's map can ask whether a key holds a block (``contain``); 0.13's cannot."""
    return "vllm-0.33" if hasattr(map_class, "contain") else "vllm-0.13"


def _blocks_of(entry: Any) -> list[Any]:
    """A vLLM ``_cache`` value (one block, or a dict block id -> block) as a list."""
    return list(entry.values()) if isinstance(entry, dict) else [entry]


@dataclass
class MapAdapter:
    """Drives a BlockHashToBlockMap with vLLM's API over a list of block objects."""

    classes: TargetClasses
    variable: str = "cache"
    blocks: list[Any] = field(default_factory=list)
    map: Any = None

    def perform(self, command: Command) -> object:
        if isinstance(command, NewMap):
            self.blocks = [self.classes.block(i) for i in range(command.num_blocks)]
            self.map = self.classes.component()
            return None
        if isinstance(command, Insert):
            return self.map.insert(command.key, self.blocks[command.block_id])
        if isinstance(command, GetOneBlock):
            return getattr(self.map.get_one_block(command.key), "block_id", None)
        if isinstance(command, Pop):
            return getattr(self.map.pop(command.key, command.block_id), "block_id", None)
        if isinstance(command, Len):
            return len(self.map)
        raise TypeError(f"not a hash-map command: {command!r}")

    def view(self) -> MapView | None:
        """key -> block ids: through ``items()`` where the map has it (impl), else vLLM's
        ``_cache`` (a block, or a dict block id -> block, per key): vLLM has no public way to
        list the map."""
        if self.map is None:
            return None
        if self.lists_items():
            return {key: tuple(b.block_id for b in blocks) for key, blocks in self.map.items()}
        return {key: tuple(b.block_id for b in _blocks_of(entry))
                for key, entry in self.map._cache.items()}

    def lists_items(self) -> bool:
        """Whether the map class lists its keys with ``items()`` (impl) or only holds them in
        ``_cache`` (vLLM)."""
        return hasattr(self.classes.component, "items")

    def check_representation(self) -> None:
        check = getattr(self.map, "_check", None)
        if check is not None:
            check()

    def imports(self) -> list[str]:
        return self.classes.imports()

    def call_source(self, command: Command) -> str:
        m = self.variable
        if isinstance(command, NewMap):
            return build_source(self.classes.block, command.num_blocks,
                                f"{self.classes.component.__name__}()")
        if isinstance(command, Insert):
            return f"{m}.insert({command.key!r}, blocks[{command.block_id}])"
        if isinstance(command, GetOneBlock):
            return f"{m}.get_one_block({command.key!r})"
        if isinstance(command, Pop):
            return f"{m}.pop({command.key!r}, {command.block_id!r})"
        if isinstance(command, Len):
            return f"len({m})"
        raise TypeError(f"not a hash-map command: {command!r}")

    def output_source(self, command: Command, expression: str) -> str:
        if isinstance(command, GetOneBlock | Pop):
            return f'getattr({expression}, "block_id", None)'
        return expression

    def view_source(self) -> str:
        m = self.variable
        if self.lists_items():
            return f"{{key: tuple(b.block_id for b in blocks) for key, blocks in {m}.items()}}"
        return (f"{{key: tuple(b.block_id for b in (entry.values() if isinstance(entry, dict) "
                f"else [entry])) for key, entry in {m}._cache.items()}}")


def adapter_for(target: str) -> Callable[[], MapAdapter]:
    """A factory of adapters for ``"impl"``, ``"vllm"`` or ``"package.module:Class"``; raises
    `TargetError` at once when the target's classes cannot be loaded."""
    classes = load_classes(target, IMPL_MODULE, VLLM_MODULE, "BlockHashToBlockMap", map_api)
    return lambda: MapAdapter(classes)


BAD_CALL_RULES = frozenset({
    "get_one_block_malformed_key",
    "insert_block_already_under_key",
    "insert_block_under_second_key",
    "insert_malformed_key",
    "pop_block_id_not_an_int",
    "pop_malformed_key",
})
# Calls no caller within vLLM's contract makes: `kvspec audit --scope contract` leaves them out.
OUT_OF_CONTRACT = BAD_CALL_RULES


class HashMapMachine(BoundedSteps):
    """Runs a map adapter against `spec.hash_map`; subclasses set ``make_adapter``."""

    bad_call_rules = BAD_CALL_RULES  # each must be refused; an audit may exclude one it reported

    make_adapter: Callable[[], MapAdapter]
    excluded: frozenset[str] = frozenset()  # bad-call rules an audit has already reported
    unmapped = Bundle("unmapped")  # block ids in no key: what insert may cache
    mapped = Bundle("mapped")  # (key, block id) pairs in the map: what pop may take out

    def __init__(self) -> None:
        super().__init__()
        self.adapter = type(self).make_adapter()
        self.lockstep: Lockstep[MapState] = Lockstep(model.step, self.adapter)

    view_of = staticmethod(model.view_of)

    @property
    def spec(self) -> MapState:
        state = self.lockstep.state
        assert state is not None, "the map is built first"
        return state

    def _run(self, command: Command) -> Any:
        return run_checked(self.lockstep, command)

    def _refused(self, rule_name: str, command: Command) -> None:
        if rule_name in self.excluded:
            return
        output = self._run(command)
        if not isinstance(output, Refused):
            raise AssertionError(f"{rule_name}: the spec accepts {command}; not a bad call")
        event(f"refused: {rule_name}")

    # -- set-up --------------------------------------------------------------------------

    @initialize(target=unmapped, num_blocks=st.integers(2, 16))
    def build(self, num_blocks: int) -> object:
        self._run(NewMap(num_blocks))
        return multiple(*range(num_blocks))

    # -- rules: what a pool does with its map ----------------------------------------------

    @rule(target=mapped, key=st.sampled_from(KEYS), block=consumes(unmapped))
    def insert(self, key: bytes, block: int) -> object:
        """A newly full block is cached under its key (after any block already there)."""
        before = len(model.blocks_under(self.spec, key))
        self._run(Insert(key, block))
        event("insert under a new key" if not before else "insert beside a cached block")
        return (key, block)

    @rule(target=unmapped, entry=consumes(mapped))
    def pop_cached(self, entry: tuple[bytes, int]) -> object:
        """An evicted block leaves its key (the key goes with its last block)."""
        key, block = entry
        blocks = model.blocks_under(self.spec, key)
        event("pop the first of several" if len(blocks) > 1 and blocks[0] == block
              else "pop a later block" if len(blocks) > 1 else "pop a key's only block")
        self._run(Pop(key, block))
        return block

    @rule(key=st.sampled_from(KEYS), block=unmapped)
    def pop_uncached(self, key: bytes, block: int) -> None:
        """pop of a block the key does not hold: None, nothing changes (not a refusal)."""
        self._run(Pop(key, block))

    @rule(entry=mapped, other=st.sampled_from(KEYS))
    def pop_under_another_key(self, entry: tuple[bytes, int], other: bytes) -> None:
        """pop names a cached block under a key that does not hold it: None, no change."""
        if other != entry[0] and entry[1] not in model.blocks_under(self.spec, other):
            self._run(Pop(other, entry[1]))

    @rule(key=st.sampled_from(KEYS))
    def get_one_block(self, key: bytes) -> None:
        self._run(GetOneBlock(key))

    @rule()
    def length(self) -> None:
        self._run(Len())

    # -- rules: bad calls, one per kind -----------------------------------------------------

    @rule(entry=mapped)
    def insert_block_already_under_key(self, entry: tuple[bytes, int]) -> None:
        self._refused("insert_block_already_under_key", Insert(*entry))

    @rule(entry=mapped, other=st.sampled_from(KEYS))
    def insert_block_under_second_key(self, entry: tuple[bytes, int], other: bytes) -> None:
        if other != entry[0]:
            self._refused("insert_block_under_second_key", Insert(other, entry[1]))

    @rule(key=st.sampled_from(NOT_KEYS), block=unmapped)
    def insert_malformed_key(self, key: object, block: int) -> None:
        self._refused("insert_malformed_key", Insert(key, block))

    @rule(key=st.sampled_from(NOT_KEYS))
    def get_one_block_malformed_key(self, key: object) -> None:
        self._refused("get_one_block_malformed_key", GetOneBlock(key))

    @rule(key=st.sampled_from(NOT_KEYS), block=st.integers(0, 3))
    def pop_malformed_key(self, key: object, block: int) -> None:
        self._refused("pop_malformed_key", Pop(key, block))

    @rule(key=st.sampled_from(KEYS), block=st.sampled_from(NOT_BLOCK_IDS))
    def pop_block_id_not_an_int(self, key: bytes, block: object) -> None:
        self._refused("pop_block_id_not_an_int", Pop(key, block))

    # -- checks after every step -----------------------------------------------------------

    def target_state(self) -> MapState | None:
        view = self.adapter.view()
        if view is None or self.lockstep.state is None:
            return None
        return model.from_view(self.spec.num_blocks, view)

    @invariant()
    def representation_check(self) -> None:
        """The target's own representation invariant (impl's ``_check()``)."""
        if self.lockstep.state is not None:
            self.adapter.check_representation()

    @invariant()
    def view_matches_spec(self) -> None:
        if self.lockstep.state is None:
            return
        actual, expected = self.adapter.view(), self.view_of(self.spec)
        if actual != expected:
            note(f"target: {actual}\nspec:   {expected}")
            raise AssertionError(f"view_matches_spec: target (key -> blocks) {actual}, spec "
                                 f"{expected}")


add_named_invariants(HashMapMachine, model.ALL, lambda machine: machine.target_state())


def machine_for(make_adapter: Callable[[], MapAdapter],
                excluded: frozenset[str] = frozenset()) -> type[HashMapMachine]:
    """A HashMapMachine subclass that checks the targets make_adapter makes."""
    return type("HashMapConformance", (HashMapMachine,),
                {"make_adapter": staticmethod(make_adapter), "excluded": excluded})
