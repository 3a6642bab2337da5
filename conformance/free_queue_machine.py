"""The free-queue conformance machine: a target's FreeKVCacheBlockQueue against `spec.free_queue`.

The pool calls its free queue only with calls it has already checked, so a queue that
corrupts its count on a refused ``popleft_n``, or takes a negative count, passes every
pool-level check. This layer drives the queue on its own, through vLLM's API, one command at
a time in lock step with the spec (`lockstep.Lockstep`): outputs, refusals (and the state
left unchanged by them), the target's view and its own representation check (impl's
``_check()``) after every step, and every named invariant of `spec.free_queue` on the
target's state.

Rules are what a pool does with its queue (pop blocks for a request, take a hit block out,
put a finished request's blocks back) and one rule per kind of bad call. Blocks out of the
queue flow through the ``popped`` bundle: popping produces them, appending consumes them.
Queues are tiny (2-16 blocks), so emptying and refilling happen all the time.

`machine_for(make_adapter)` builds the machine for a target; `adapter_for(target)` makes the
adapter for ``"impl"``, ``"vllm"`` (the vLLM this interpreter imports) or
``"package.module:Class"`` (a queue class with vLLM's API, beside a ``KVCacheBlock``).
"""

from __future__ import annotations

import importlib
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
    precondition,
    rule,
)

from kvspec.conformance.deadline import BoundedSteps
from kvspec.conformance.lockstep import Discrepancy, Lockstep, Refused, add_named_invariants
from kvspec.conformance.vllm_targets import TargetError, load_class
from kvspec.spec import free_queue as model
from kvspec.spec.free_queue import (
    Append,
    AppendN,
    Command,
    GetAllFreeBlocks,
    NewQueue,
    NumFreeBlocks,
    PopLeft,
    PopLeftN,
    QueueState,
    QueueView,
    Remove,
)

IMPL_MODULE = "kvspec.impl.kv_cache_utils"
VLLM_MODULE = "vllm.v1.core.kv_cache_utils"
NOT_INTS: tuple[float | str, ...] = (0.5, 1.0, "1", True)  # counts popleft_n must refuse


# --- Loading a target's classes ------------------------------------------------------------------


@dataclass(frozen=True)
class TargetClasses:
    """A component class of a target and the block class its blocks are made of."""

    component: Any
    block: Any
    api: str  # "vllm-0.13" or "vllm-0.33": which API the classes have (by features)

    def imports(self) -> list[str]:
        """Import lines for both classes, by the names the counterexample uses."""
        names: dict[str, list[str]] = {}
        for cls in (self.component, self.block):
            listed = names.setdefault(cls.__module__, [])
            if cls.__name__ not in listed:
                listed.append(cls.__name__)
        lines = []
        if any(module.split(".")[0] == "vllm" for module in names):
            lines += ["import os", "", 'os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")',
                      ""]
        lines += [f"from {module} import {', '.join(sorted(listed))}"
                  for module, listed in names.items()]
        return lines


def load_classes(target: str, impl_module: str, vllm_module: str, class_name: str,
                 api_of: Callable[[Any], str]) -> TargetClasses:
    """The classes of ``target`` (``impl``, ``vllm`` or ``package.module:Class``), the block
    class from the component's module (``KVCacheBlock``, as vLLM's modules import it)."""
    if target == "impl":
        path = f"{impl_module}:{class_name}"
    elif target == "vllm":
        path = f"{vllm_module}:{class_name}"
    else:
        path = target
    component = load_class(path)
    module = importlib.import_module(path.partition(":")[0])
    block = getattr(module, "KVCacheBlock", None)
    if block is None:
        raise TargetError(f"module {module.__name__!r} of target {target!r} has no KVCacheBlock "
                          f"to build the blocks from")
    return TargetClasses(component, block, api_of(component))


def queue_api(queue_class: Any) -> str:
    """vLLM 0.33's free queue can put blocks at the head (``prepend_n``); 0.13's cannot."""
    return "vllm-0.33" if hasattr(queue_class, "prepend_n") else "vllm-0.13"


def build_source(block_class: Any, num_blocks: int, made: str) -> str:
    """An expression that makes ``blocks`` (the program's block objects) and then ``made``:
    a program's first line is ``<variable> = <this>``."""
    return (f"((blocks := [{block_class.__name__}(i) for i in range({num_blocks})]), "
            f"{made})[1]")


def blocks_source(block_ids: tuple[int, ...] | list[int]) -> str:
    return f"[{', '.join(f'blocks[{b}]' for b in block_ids)}]"


def run_checked(lockstep: Lockstep[Any], command: Any) -> Any:
    """``lockstep(command)``, an exception the target raised that is no refusal (an
    ``AssertionError``, a ``RuntimeError``, its ``_check()`` failing) reported as a
    `Discrepancy` that names the command."""
    try:
        return lockstep(command)
    except Discrepancy:
        raise
    except Exception as error:
        raise Discrepancy(f"{command}: the target raised {type(error).__name__}: "
                          f"{error}") from error


# --- The adapter -------------------------------------------------------------------------------


@dataclass
class QueueAdapter:
    """Drives a FreeKVCacheBlockQueue with vLLM's API over a list of block objects."""

    classes: TargetClasses
    variable: str = "queue"
    blocks: list[Any] = field(default_factory=list)
    queue: Any = None

    def perform(self, command: Command) -> object:
        if isinstance(command, NewQueue):
            blocks = [self.classes.block(i) for i in range(command.num_blocks)]
            queue = self.classes.component([blocks[i] for i in command.initial])
            self.blocks, self.queue = blocks, queue
            return None
        queue, blocks = self.queue, self.blocks
        if isinstance(command, PopLeft):
            return queue.popleft().block_id
        if isinstance(command, PopLeftN):
            return tuple(b.block_id for b in queue.popleft_n(command.n))
        if isinstance(command, Remove):
            return queue.remove(blocks[command.block_id])
        if isinstance(command, Append):
            return queue.append(blocks[command.block_id])
        if isinstance(command, AppendN):
            return queue.append_n([blocks[b] for b in command.block_ids])
        if isinstance(command, GetAllFreeBlocks):
            return tuple(b.block_id for b in queue.get_all_free_blocks())
        if isinstance(command, NumFreeBlocks):
            return queue.num_free_blocks
        raise TypeError(f"not a free-queue command: {command!r}")

    def view(self) -> QueueView | None:
        if self.queue is None:
            return None
        return (tuple(b.block_id for b in self.queue.get_all_free_blocks()),
                self.queue.num_free_blocks)

    def check_representation(self) -> None:
        check = getattr(self.queue, "_check", None)
        if check is not None:
            check()

    def imports(self) -> list[str]:
        return self.classes.imports()

    def call_source(self, command: Command) -> str:
        q = self.variable
        if isinstance(command, NewQueue):
            made = f"{self.classes.component.__name__}({blocks_source(command.initial)})"
            return build_source(self.classes.block, command.num_blocks, made)
        if isinstance(command, PopLeft):
            return f"{q}.popleft()"
        if isinstance(command, PopLeftN):
            return f"{q}.popleft_n({command.n!r})"
        if isinstance(command, Remove):
            return f"{q}.remove(blocks[{command.block_id}])"
        if isinstance(command, Append):
            return f"{q}.append(blocks[{command.block_id}])"
        if isinstance(command, AppendN):
            return f"{q}.append_n({blocks_source(command.block_ids)})"
        if isinstance(command, GetAllFreeBlocks):
            return f"{q}.get_all_free_blocks()"
        if isinstance(command, NumFreeBlocks):
            return f"{q}.num_free_blocks"
        raise TypeError(f"not a free-queue command: {command!r}")

    def output_source(self, command: Command, expression: str) -> str:
        if isinstance(command, PopLeft):
            return f"{expression}.block_id"
        if isinstance(command, PopLeftN | GetAllFreeBlocks):
            return f"tuple(b.block_id for b in {expression})"
        return expression

    def view_source(self) -> str:
        q = self.variable
        return f"(tuple(b.block_id for b in {q}.get_all_free_blocks()), {q}.num_free_blocks)"


def adapter_for(target: str) -> Callable[[], QueueAdapter]:
    """A factory of adapters for ``"impl"``, ``"vllm"`` or ``"package.module:Class"``; raises
    `TargetError` at once when the target's classes cannot be loaded."""
    classes = load_classes(target, IMPL_MODULE, VLLM_MODULE, "FreeKVCacheBlockQueue",
                           queue_api)
    return lambda: QueueAdapter(classes)


# --- The machine -------------------------------------------------------------------------------


BAD_CALL_RULES = frozenset({
    "append_n_listing_a_block_twice",
    "append_n_with_a_queued_block",
    "append_queued",
    "popleft_empty",
    "popleft_n_more_than_free",
    "popleft_n_negative",
    "popleft_n_not_an_int",
    "remove_unqueued",
})
# Calls no caller within vLLM's contract makes: `kvspec audit --scope contract` leaves them out.
OUT_OF_CONTRACT = BAD_CALL_RULES


class FreeQueueMachine(BoundedSteps):
    """Runs a queue adapter against `spec.free_queue`; subclasses set ``make_adapter``."""

    bad_call_rules = BAD_CALL_RULES  # each must be refused; an audit may exclude one it reported

    make_adapter: Callable[[], QueueAdapter]
    excluded: frozenset[str] = frozenset()  # bad-call rules an audit has already reported
    popped = Bundle("popped")  # block ids out of the queue: what append may put back

    def __init__(self) -> None:
        super().__init__()
        self.adapter = type(self).make_adapter()
        self.lockstep: Lockstep[QueueState] = Lockstep(model.step, self.adapter)

    view_of = staticmethod(model.view_of)

    @property
    def spec(self) -> QueueState:
        state = self.lockstep.state
        assert state is not None, "the queue is built first"
        return state

    def _run(self, command: Command) -> Any:
        return run_checked(self.lockstep, command)

    def _refused(self, rule_name: str, command: Command) -> None:
        """A bad call: the spec refuses it, so the target must, changing nothing."""
        if rule_name in self.excluded:
            return
        output = self._run(command)
        if not isinstance(output, Refused):
            raise AssertionError(f"{rule_name}: the spec accepts {command}; not a bad call")
        event(f"refused: {rule_name}")

    # -- set-up --------------------------------------------------------------------------

    @initialize(target=popped, num_blocks=st.integers(2, 16), data=st.data())
    def build(self, num_blocks: int, data: st.DataObject) -> object:
        """A queue built from some of the blocks, in any order (vLLM's pool: all, id order)."""
        order = data.draw(st.permutations(range(num_blocks)), label="order")
        queued = data.draw(st.sampled_from([num_blocks, num_blocks, 0,
                                            data.draw(st.integers(0, num_blocks))]))
        self._run(NewQueue(num_blocks, tuple(order[:queued])))
        event(f"queue of {'<=4' if num_blocks <= 4 else '5-8' if num_blocks <= 8 else '9-16'}"
              f" blocks, {'all' if queued == num_blocks else 'none' if not queued else 'some'}"
              f" queued")
        return multiple(*order[queued:])

    # -- rules: what a pool does with its queue -----------------------------------------

    @precondition(lambda self: self.spec.free)
    @rule(target=popped)
    def popleft(self) -> object:
        block = self._run(PopLeft())
        if not self.spec.free:
            event("popleft emptied the queue")
        return block

    @rule(target=popped, data=st.data())
    def popleft_n(self, data: st.DataObject) -> object:
        n = data.draw(st.integers(0, len(self.spec.free)), label="n")
        taken = self._run(PopLeftN(n))
        if n and not self.spec.free:
            event("popleft_n took every free block")
        return multiple(*taken)

    @precondition(lambda self: self.spec.free)
    @rule(target=popped, data=st.data())
    def remove_queued(self, data: st.DataObject) -> object:
        """A prefix-cache hit on a free block takes it out of the queue, wherever it is."""
        block = data.draw(st.sampled_from(self.spec.free), label="block")
        position = self.spec.free.index(block)
        event("remove the head" if position == 0 else "remove the tail"
              if position == len(self.spec.free) - 1 else "remove from the middle")
        self._run(Remove(block))
        return block

    @rule(block=consumes(popped))
    def append(self, block: int) -> None:
        self._run(Append(block))

    @precondition(lambda self: self.bundle("popped"))
    @rule(blocks=st.lists(consumes(popped), max_size=4, unique=True))
    def append_n(self, blocks: list[int]) -> None:
        """A finished request's blocks go back to the tail, in the order given."""
        self._run(AppendN(tuple(blocks)))
        if not blocks:
            event("append_n of no blocks")

    @rule()
    def get_all_free_blocks(self) -> None:
        self._run(GetAllFreeBlocks())

    @rule()
    def num_free_blocks(self) -> None:
        self._run(NumFreeBlocks())

    # -- rules: bad calls, one per kind -----------------------------------------------------

    @precondition(lambda self: not self.spec.free)
    @rule()
    def popleft_empty(self) -> None:
        self._refused("popleft_empty", PopLeft())

    @rule(extra=st.integers(1, 3))
    def popleft_n_more_than_free(self, extra: int) -> None:
        self._refused("popleft_n_more_than_free", PopLeftN(len(self.spec.free) + extra))

    @rule(n=st.integers(-3, -1))
    def popleft_n_negative(self, n: int) -> None:
        self._refused("popleft_n_negative", PopLeftN(n))

    @rule(n=st.sampled_from(NOT_INTS))
    def popleft_n_not_an_int(self, n: float | str) -> None:
        self._refused("popleft_n_not_an_int", PopLeftN(n))

    @rule(block=popped)
    def remove_unqueued(self, block: int) -> None:
        self._refused("remove_unqueued", Remove(block))

    @precondition(lambda self: self.spec.free)
    @rule(data=st.data())
    def append_queued(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.spec.free), label="queued block")
        self._refused("append_queued", Append(block))

    @precondition(lambda self: self.spec.free and self.bundle("popped"))
    @rule(data=st.data(), blocks=st.lists(popped, max_size=3, unique=True))
    def append_n_with_a_queued_block(self, data: st.DataObject, blocks: list[int]) -> None:
        queued = data.draw(st.sampled_from(self.spec.free), label="queued block")
        at = data.draw(st.integers(0, len(blocks)), label="at")
        self._refused("append_n_with_a_queued_block",
                      AppendN((*blocks[:at], queued, *blocks[at:])))

    @rule(block=popped, others=st.lists(popped, max_size=2, unique=True))
    def append_n_listing_a_block_twice(self, block: int, others: list[int]) -> None:
        listed = tuple(b for b in others if b != block)
        self._refused("append_n_listing_a_block_twice", AppendN((block, *listed, block)))

    # -- checks after every step -----------------------------------------------------------
    # Hypothesis runs invariants in name order: the named invariants first (a broken one is
    # reported by name), then the representation check, then the whole view.

    def target_state(self) -> QueueState | None:
        """The target's state in the spec's terms (None before the queue is built)."""
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
            raise AssertionError(f"view_matches_spec: target (free order, num_free_blocks) "
                                 f"{actual}, spec {expected}")


add_named_invariants(FreeQueueMachine, model.ALL, lambda machine: machine.target_state())


def machine_for(make_adapter: Callable[[], QueueAdapter],
                excluded: frozenset[str] = frozenset()) -> type[FreeQueueMachine]:
    """A FreeQueueMachine subclass that checks the targets make_adapter makes."""
    return type("FreeQueueConformance", (FreeQueueMachine,),
                {"make_adapter": staticmethod(make_adapter), "excluded": excluded})
