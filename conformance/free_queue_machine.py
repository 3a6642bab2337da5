"""The free-queue conformance machine: a target's FreeKVCacheBlockQueue against `spec.free_queue`.

The pool calls its free queue only with calls it has already checked, so a queue that
corrupts its count on a refused ``popleft_n``, or takes a negative count, passes every
pool-level check. This layer drives the queue on its own, through vLLM's API, one command at
a time in lock step with the spec (`lockstep.Lockstep`): outputs, refusals (and the state
left unchanged by them), the target's view and its own representation check (impl's
``check_representation()``) after every step, and every named invariant of `spec.free_queue`
on the target's state.

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

from kvspec.conformance.lockstep import Adapter, Arg, Call, Reader, attribute, method
from kvspec.conformance.machine import ComponentMachine, bad_call
from kvspec.conformance.vllm_targets import TargetError, load_class
from kvspec.spec import free_queue as model
from kvspec.spec.free_queue import (
    Append,
    AppendN,
    GetAllFreeBlocks,
    NewQueue,
    NumFreeBlocks,
    PopLeft,
    PopLeftN,
    PrependN,
    QueueState,
    QueueView,
    Remove,
)
from kvspec.spec.pool import Profile

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
    path = {"impl": f"{impl_module}:{class_name}",
            "vllm": f"{vllm_module}:{class_name}"}.get(target, target)
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


def block_arg(adapter: Any, block_id: int) -> Arg:
    """Block ``block_id`` of the program's blocks, as an argument."""
    return Arg(f"blocks[{block_id}]", lambda: adapter.blocks[block_id])


def blocks_arg(adapter: Any, block_ids: tuple[int, ...]) -> Arg:
    return Arg(blocks_source(block_ids), lambda: [adapter.blocks[b] for b in block_ids])


BLOCK_ID = Reader(lambda block: block.block_id, "{}.block_id")
BLOCK_IDS = Reader(lambda blocks: tuple(b.block_id for b in blocks),
                   "tuple(b.block_id for b in {})")


# --- The adapter -------------------------------------------------------------------------------


def _new_queue(adapter: QueueAdapter, command: NewQueue) -> None:
    blocks = [adapter.classes.block(i) for i in range(command.num_blocks)]
    adapter.queue = adapter.classes.component([blocks[i] for i in command.initial])
    adapter.blocks = blocks


def _new_queue_source(adapter: QueueAdapter, command: NewQueue) -> str:
    made = f"{adapter.classes.component.__name__}({blocks_source(command.initial)})"
    return build_source(adapter.classes.block, command.num_blocks, made)


@dataclass
class QueueAdapter(Adapter):
    """Drives a FreeKVCacheBlockQueue with vLLM's API over a list of block objects."""

    classes: TargetClasses
    variable: str = "queue"
    blocks: list[Any] = field(default_factory=list)
    queue: Any = None

    calls: ClassVar[dict[type, Call]] = {
        NewQueue: Call(_new_queue, _new_queue_source),
        PopLeft: method("popleft", read=BLOCK_ID),
        PopLeftN: method("popleft_n", lambda a, c: (c.n,), BLOCK_IDS),
        Remove: method("remove", lambda a, c: (block_arg(a, c.block_id),)),
        Append: method("append", lambda a, c: (block_arg(a, c.block_id),)),
        AppendN: method("append_n", lambda a, c: (blocks_arg(a, c.block_ids),)),
        GetAllFreeBlocks: method("get_all_free_blocks", read=BLOCK_IDS),
        PrependN: method("prepend_n", lambda a, c: (blocks_arg(a, c.block_ids),)),
        NumFreeBlocks: attribute("num_free_blocks"),
    }

    def view(self) -> QueueView | None:
        if self.queue is None:
            return None
        return (tuple(b.block_id for b in self.queue.get_all_free_blocks()),
                self.queue.num_free_blocks)

    def imports(self) -> list[str]:
        return self.classes.imports()

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


class FreeQueueMachine(ComponentMachine[QueueState]):
    """Runs a queue adapter against `spec.free_queue`; ``machine_for`` sets the adapter."""

    spec_step = staticmethod(model.step)
    view_of = staticmethod(model.view_of)
    from_view = staticmethod(model.from_view)
    shown = "free order, num_free_blocks"
    popped = Bundle("popped")  # block ids out of the queue: what append may put back

    # -- set-up --------------------------------------------------------------------------

    @initialize(target=popped, num_blocks=st.integers(2, 16), data=st.data())
    def build(self, num_blocks: int, data: st.DataObject) -> object:
        """A queue built from some of the blocks, in any order (vLLM's pool: all, id order)."""
        order = data.draw(st.permutations(range(num_blocks)), label="order")
        queued = data.draw(st.sampled_from([num_blocks, num_blocks, 0,
                                            data.draw(st.integers(0, num_blocks))]))
        self.run(NewQueue(num_blocks, tuple(order[:queued])))
        event(f"queue of {'<=4' if num_blocks <= 4 else '5-8' if num_blocks <= 8 else '9-16'}"
              f" blocks, {'all' if queued == num_blocks else 'none' if not queued else 'some'}"
              f" queued")
        return multiple(*order[queued:])

    # -- rules: what a pool does with its queue -----------------------------------------

    @precondition(lambda self: self.spec.free)
    @rule(target=popped)
    def popleft(self) -> object:
        block = self.run(PopLeft())
        if not self.spec.free:
            event("popleft emptied the queue")
        return block

    @rule(target=popped, data=st.data())
    def popleft_n(self, data: st.DataObject) -> object:
        n = data.draw(st.integers(0, len(self.spec.free)), label="n")
        taken = self.run(PopLeftN(n))
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
        self.run(Remove(block))
        return block

    @rule(block=consumes(popped))
    def append(self, block: int) -> None:
        self.run(Append(block))

    @precondition(lambda self: self.bundle("popped"))
    @rule(blocks=st.lists(consumes(popped), max_size=4, unique=True))
    def append_n(self, blocks: list[int]) -> None:
        """A finished request's blocks go back to the tail, in the order given."""
        self.run(AppendN(tuple(blocks)))
        if not blocks:
            event("append_n of no blocks")

    @rule()
    def get_all_free_blocks(self) -> None:
        self.run(GetAllFreeBlocks())

    @rule()
    def num_free_blocks(self) -> None:
        self.run(NumFreeBlocks())

    # -- rules: bad calls, one per kind -----------------------------------------------------

    @bad_call(lambda self: not self.spec.free)
    def popleft_empty(self) -> None:
        self.refuse(PopLeft())

    @bad_call(extra=st.integers(1, 3))
    def popleft_n_more_than_free(self, extra: int) -> None:
        self.refuse(PopLeftN(len(self.spec.free) + extra))

    @bad_call(n=st.integers(-3, -1))
    def popleft_n_negative(self, n: int) -> None:
        self.refuse(PopLeftN(n))

    @bad_call(n=st.sampled_from(NOT_INTS))
    def popleft_n_not_an_int(self, n: float | str) -> None:
        self.refuse(PopLeftN(n))

    @bad_call(block=popped)
    def remove_unqueued(self, block: int) -> None:
        self.refuse(Remove(block))

    @bad_call(lambda self: self.spec.free, data=st.data())
    def append_queued(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.spec.free), label="queued block")
        self.refuse(Append(block))

    @bad_call(lambda self: self.spec.free and self.bundle("popped"), data=st.data(),
              blocks=st.lists(popped, max_size=3, unique=True))
    def append_n_with_a_queued_block(self, data: st.DataObject, blocks: list[int]) -> None:
        queued = data.draw(st.sampled_from(self.spec.free), label="queued block")
        at = data.draw(st.integers(0, len(blocks)), label="at")
        self.refuse(AppendN((*blocks[:at], queued, *blocks[at:])))

    @bad_call(block=popped, others=st.lists(popped, max_size=2, unique=True))
    def append_n_listing_a_block_twice(self, block: int, others: list[int]) -> None:
        listed = tuple(b for b in others if b != block)
        self.refuse(AppendN((block, *listed, block)))


FreeQueueMachine.add_invariants(model.ALL)


class FreeQueueMachine033(FreeQueueMachine):
    """The queue under the vllm-0.33 profile: `FreeQueueMachine` plus ``prepend_n`` (0.33's
    pool puts blocks freed without a key at the head), where the target has it; the 0.13
    machine is left as it was."""

    @precondition(lambda self: self.built and self.adapter.classes.api == "vllm-0.33"
                  and self.bundle("popped"))
    @rule(blocks=st.lists(consumes(FreeQueueMachine.popped), max_size=4, unique=True))
    def prepend_n(self, blocks: list[int]) -> None:
        """A finished request's unkeyed blocks go to the head, to be reused first."""
        self.run(PrependN(tuple(blocks)))
        event("prepend_n onto an empty queue" if len(self.spec.free) == len(blocks)
              else "prepend_n")

    @bad_call(lambda self: self.adapter.classes.api == "vllm-0.33" and self.spec.free,
              data=st.data(), blocks=st.lists(FreeQueueMachine.popped, max_size=2, unique=True))
    def prepend_n_with_a_queued_block(self, data: st.DataObject, blocks: list[int]) -> None:
        queued = data.draw(st.sampled_from(self.spec.free), label="queued block")
        self.refuse(PrependN((*blocks, queued)))


# Calls no caller within vLLM's contract makes: `kvspec audit --scope contract` leaves them out.
OUT_OF_CONTRACT = FreeQueueMachine033.bad_call_rules


def machine_for(make_adapter: Callable[[], QueueAdapter],
                excluded: frozenset[str] = frozenset(),
                profile: Profile = Profile.V0_13) -> type[FreeQueueMachine]:
    """A FreeQueueMachine subclass that checks the targets make_adapter makes (with 0.33's
    ``prepend_n`` under vllm-0.33, where the target has it)."""
    base = FreeQueueMachine033 if profile is Profile.V0_33 else FreeQueueMachine
    return base.for_target(make_adapter, excluded=excluded)
