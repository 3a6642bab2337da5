"""The offload conformance machine: a target's offloading manager against `spec.offload`.

The machine plays vLLM's offloading connector over a tiny CPU tier (2 to 8 keys), so that
stores evict, loads pin what a store would take, and a full tier refuses a store. Requests
are prefix chains of keys from three conversations (so requests share prefixes); each rule
is one thing the connector does (vLLM 0.13's offloading_connector.py, 0.33's
offloading/scheduler.py):

- ``admit_request``: a waiting request looks its chain up and pins its hit for a load
  (0.13 touches the chain first). Lookup and pin are one step, as the connector's lock makes
  them (vLLM #42289: blocks evicted between the lookup and the pin).
- ``store_new_blocks``: the request's newly computed blocks are offered for storing (0.13
  then touches the chain).
- ``store_finishes`` / ``load_finishes``: a worker reports a transfer done (a store may fail).
- ``request_finishes`` (0.33 commits the request's recency), ``take_events``, ``reset``
  (0.33: jobs issued before it are stale, and the connector drops their completions).

Bad calls, one rule each, are refused by the spec and must be refused by the target with its
state unchanged: a load of a pending key, of an unknown key, of a ready and a pending key
together (the refusal must not leave the first pinned), an unpin below zero, a second
completion of a store, a key listed twice, and a completion from before a reset.

Every step compares outputs and refusals, the target's lists, ref counts, ARC ghosts and
target, and its pending events; every named invariant of `spec.offload` is checked on the
target's state, and each store is judged by `spec.offload.store_violations` (by name).

`machine_for(make_adapter, profile)` builds the machine; `adapter_for(target, profile)`
makes adapters for ``"impl"`` (kvspec.impl.kv_offload: vLLM 0.13's API, or 0.33's
``CPUOffloadingManager`` under the vllm-0.33 profile) or ``"vllm"`` (the
vLLM this interpreter imports: 0.13's LRU and ARC managers, or 0.33's CPUOffloadingManager
with its LRU and ARC policies).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import event, strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvspec.conformance import vllm_internals
from kvspec.conformance.lockstep import (
    NOTHING,
    Adapter,
    Arg,
    Call,
    Discrepancy,
    Reader,
    Unsupported,
    method,
)
from kvspec.conformance.machine import ComponentMachine, bad_call
from kvspec.conformance.vllm_targets import LayerUnavailable, TargetError
from kvspec.spec import offload as model
from kvspec.spec.offload import (
    CompleteLoad,
    CompleteStore,
    Lookup,
    NewOffload,
    OffloadEvent,
    OffloadState,
    OffloadView,
    PrepareLoad,
    PrepareStore,
    RequestFinished,
    Reset,
    TakeEvents,
    Touch,
)
from kvspec.spec.pool import Profile

CONVERSATIONS = 3
CHAIN = 4  # keys per conversation: conversation c's chain is 4c, 4c + 1, 4c + 2, 4c + 3


# --- A backend for vLLM 0.13's API without vLLM --------------------------------------------------


@dataclass
class BlockStatus:
    block_id: int
    ref_cnt: int = -1


@dataclass
class ListBackend:
    """vLLM 0.13's ``Backend`` duck-typed: ``num_blocks`` CPU block ids and a free list."""

    block_size: int
    num_blocks: int
    medium: str = "CPU"
    free_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free_ids = list(range(self.num_blocks))

    def get_num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate_blocks(self, block_hashes: list[Any]) -> list[BlockStatus]:
        return [BlockStatus(self.free_ids.pop(0)) for _ in block_hashes]

    def free(self, block: BlockStatus) -> None:
        self.free_ids.append(block.block_id)

    def get_load_store_spec(self, block_hashes: Any, blocks: Any) -> list[int]:
        return [block.block_id for block in blocks]


# --- Adapters ------------------------------------------------------------------------------------


def _events_013(events: Any) -> tuple[OffloadEvent, ...]:
    return tuple(OffloadEvent(tuple(e.block_hashes), e.removed) for e in events or ())


def _store_output_013(output: Any) -> object:
    if output is None:
        return None
    return tuple(output.block_hashes_to_store), tuple(output.block_hashes_evicted)


STORE_013 = Reader(_store_output_013, "_store_output({})")
EVENTS_013 = Reader(lambda events: _events_013(list(events)), "_events(list({}))")


def _new_013(adapter: Api013Adapter, command: NewOffload) -> None:
    adapter.manager = adapter.classes[command.policy](adapter.make_backend(command.capacity),
                                                      enable_events=True)
    adapter.policy = command.policy


def _keys(adapter: Any, command: Any) -> tuple[object, ...]:
    return (list(command.keys),)


@dataclass
class Api013Adapter(Adapter):
    """vLLM 0.13's ``OffloadingManager`` API: ``LRUOffloadingManager`` or
    ``ARCOffloadingManager`` over a backend; keys are the spec's ints."""

    classes: dict[str, Any]  # policy name -> manager class
    make_backend: Callable[[int], Any]
    backend_source: str  # how a counterexample builds the backend, "{}" the capacity
    import_lines: list[str]
    variable: str = "manager"
    manager: Any = None
    policy: str = "lru"

    calls: ClassVar[dict[type, Call]] = {
        NewOffload: Call(_new_013, lambda a, c: (
            f"{a.classes[c.policy].__name__}({a.backend_source.format(c.capacity)}, "
            f"enable_events=True)")),
        Lookup: method("lookup", _keys),
        PrepareLoad: method("prepare_load", _keys, NOTHING),
        Touch: method("touch", _keys),
        CompleteLoad: method("complete_load", _keys),
        PrepareStore: method("prepare_store", _keys, STORE_013),
        CompleteStore: method("complete_store", lambda a, c: (list(c.keys), c.success)),
        TakeEvents: method("take_events", read=EVENTS_013),
        RequestFinished: Call(lambda a, c: _unsupported(), lambda a, c: "pass"),
        Reset: Call(lambda a, c: _unsupported(), lambda a, c: "pass"),
    }

    def view(self) -> OffloadView | None:
        m = self.manager
        if m is None:
            return None
        events = _events_013(m.events)
        if hasattr(m, "ordered_entries"):  # kvspec's LRU
            return OffloadView(tuple(m.ordered_entries()), events=events)
        if hasattr(m, "t1_entries"):  # kvspec's ARC
            return OffloadView(tuple(m.t1_entries()), tuple(m.t2_entries()),
                               tuple(m.b1_keys()), tuple(m.b2_keys()), m.target_t1_size,
                               events)
        if self.policy == "lru":  # vLLM 0.13's: an OrderedDict of BlockStatus
            return OffloadView(tuple((k, b.ref_cnt) for k, b in m.blocks.items()),
                               events=events)
        return OffloadView(tuple((k, b.ref_cnt) for k, b in m.t1.items()),
                           tuple((k, b.ref_cnt) for k, b in m.t2.items()), tuple(m.b1),
                           tuple(m.b2), m.target_t1_size, events)

    def view_source(self) -> str:
        return f"_view({self.variable})"

    def imports(self) -> list[str]:
        return [*self.import_lines, *_HELPERS_013]


def _unsupported() -> None:
    raise Unsupported("not in vLLM 0.13's OffloadingManager API")


_HELPERS_013 = [
    "from kvspec.conformance.offload_machine import ListBackend, Api013Adapter",
    "from kvspec.spec.offload import OffloadEvent, OffloadView",
    "",
    "",
    "def _store_output(output):",
    "    if output is None:",
    "        return None",
    "    return tuple(output.block_hashes_to_store), tuple(output.block_hashes_evicted)",
    "",
    "",
    "def _events(events):",
    "    return tuple(OffloadEvent(tuple(e.block_hashes), e.removed) for e in events)",
    "",
    "",
    "def _view(manager):",
    "    adapter = Api013Adapter({}, ListBackend, '', [], manager=manager,",
    "                            policy='lru' if not hasattr(manager, 't1') and not hasattr(",
    "                                manager, 't1_entries') else 'arc')",
    "    return adapter.view()",
]


# vLLM 0.33's CPUOffloadingManager: keys are bytes (a block hash and a group index), every
# call takes the request's context.


def _key_033(adapter: Api033Adapter, key: int) -> bytes:
    made: bytes = adapter.base.make_offload_key(key.to_bytes(8, "big"), 0)
    return made


def _int_key(key: bytes) -> int:
    return int.from_bytes(key[:-4], "big")


def _keys_033(adapter: Api033Adapter, keys: tuple[int, ...]) -> Arg:
    return Arg(f"[key({', '.join(map(str, keys))})]" if len(keys) == 1 else
               f"keys({', '.join(map(str, keys))})",
               lambda: [_key_033(adapter, k) for k in keys])


def _context(adapter: Api033Adapter, req: str) -> Arg:
    def get() -> object:
        if req not in adapter.contexts:
            context = adapter.base.ReqContext(req_id=req)
            adapter.manager.on_new_request(context)
            adapter.contexts[req] = context
        return adapter.contexts[req]
    return Arg(f"ctx({req!r})", get)


def _events_033(events: Any) -> tuple[OffloadEvent, ...]:
    return tuple(OffloadEvent(tuple(map(_int_key, e.keys)), e.removed, e.metadata_only)
                 for e in events or ())


def _new_033(adapter: Api033Adapter, command: NewOffload) -> None:
    adapter.manager = adapter.manager_class(num_chunks=command.capacity,
                                            cache_policy=command.policy, enable_events=True)
    adapter.policy = command.policy
    adapter.contexts = {}


def _lookup_033(adapter: Api033Adapter, command: Lookup) -> int:
    """0.33 answers per key; the connector counts the leading HITs (HIT_PENDING ends the
    hit: it defers)."""
    hit = adapter.base.LookupResult.HIT
    count = 0
    context = _context(adapter, "lookup").get()
    for key in command.keys:
        if adapter.manager.lookup(_key_033(adapter, key), context) != hit:
            break
        count += 1
    return count


def _store_output_033(output: Any) -> object:
    if output is None:
        return None
    return (tuple(map(_int_key, output.keys_to_store)),
            tuple(map(_int_key, output.evicted_keys)))


@dataclass
class Api033Adapter(Adapter):
    """vLLM 0.33's ``CPUOffloadingManager(num_chunks, cache_policy)``, one ``ReqContext``
    per request for its whole life, as the connector keeps them."""

    manager_class: Any
    base: Any  # vllm.v1.kv_offload.base
    variable: str = "manager"
    manager: Any = None
    policy: str = "lru"
    contexts: dict[str, Any] = field(default_factory=dict)

    calls: ClassVar[dict[type, Call]] = {
        NewOffload: Call(_new_033, lambda a, c: (
            f"CPUOffloadingManager(num_chunks={c.capacity}, cache_policy={c.policy!r}, "
            f"enable_events=True)")),
        Lookup: Call(_lookup_033, lambda a, c: f"hits({a.variable}, {list(c.keys)})"),
        PrepareLoad: method("prepare_load", lambda a, c: (
            _keys_033(a, c.keys), _context(a, c.req)), NOTHING),
        Touch: method("touch", lambda a, c: (_keys_033(a, c.keys), _context(a, c.req))),
        CompleteLoad: method("complete_load", lambda a, c: (
            _keys_033(a, c.keys), _context(a, c.req))),
        PrepareStore: method("prepare_store", lambda a, c: (
            _keys_033(a, c.keys), _context(a, c.req)),
            Reader(_store_output_033, "_store_output({})")),
        CompleteStore: method("complete_store", lambda a, c: (
            _keys_033(a, c.keys), _context(a, c.req), c.success)),
        RequestFinished: method("on_request_finished", lambda a, c: (_context(a, c.req),)),
        Reset: method("reset_cache"),
        TakeEvents: method("take_events", read=Reader(lambda e: _events_033(list(e)),
                                                      "_events(list({}))")),
    }

    def view(self) -> OffloadView | None:
        m = self.manager
        if m is None:
            return None
        events = _events_033(m.events)
        if hasattr(m, "t1_entries"):  # kvspec's CPUOffloadingManager (LRU: all in T1)
            return OffloadView(tuple((_int_key(k), r) for k, r in m.t1_entries()),
                               tuple((_int_key(k), r) for k, r in m.t2_entries()),
                               tuple(map(_int_key, m.b1_keys())),
                               tuple(map(_int_key, m.b2_keys())), m.target_t1_size, events)
        policy = vllm_internals.offload_policy(m)
        if self.policy == "lru":
            # Ranks are unique without key positions (the machine sets none): the rank order
            # is the recency order.
            order = sorted(policy.chunks, key=vllm_internals.lru_ranks(policy).__getitem__)
            return OffloadView(tuple((_int_key(k), policy.chunks[k].ref_cnt) for k in order),
                               events=events)
        return OffloadView(tuple((_int_key(k), c.ref_cnt) for k, c in policy.t1.items()),
                           tuple((_int_key(k), c.ref_cnt) for k, c in policy.t2.items()),
                           tuple(map(_int_key, policy.b1)), tuple(map(_int_key, policy.b2)),
                           policy.target_t1_size, events)

    def view_source(self) -> str:
        return f"_view({self.variable})"

    def check_representation(self) -> None:
        """vLLM 0.33 keeps two counters beside its chunks: they must count them."""
        m = self.manager
        if m is None:
            return
        if hasattr(m, "check_representation"):  # kvspec's: its own check
            m.check_representation()
            return
        refs = [c.ref_cnt for c in self._chunks()]
        evictable = vllm_internals.evictable_chunk_count(m)
        if evictable != refs.count(0):
            raise AssertionError(f"CPUOffloadingManager counts {evictable} "
                                 f"evictable chunks; {refs.count(0)} have ref count 0")
        pending = vllm_internals.write_pending_chunk_count(m)
        if pending != refs.count(-1):
            raise AssertionError(f"CPUOffloadingManager counts {pending} "
                                 f"pending chunks; {refs.count(-1)} have ref count -1")

    def _chunks(self) -> list[Any]:
        policy = vllm_internals.offload_policy(self.manager)
        if self.policy == "lru":
            return list(policy.chunks.values())
        return [*policy.t1.values(), *policy.t2.values()]

    def imports(self) -> list[str]:
        if self.base.__name__ == f"{IMPL_PACKAGE}.base":
            head = [f"from {IMPL_PACKAGE}.base import LookupResult, ReqContext, "
                    "make_offload_key",
                    f"from {IMPL_PACKAGE}.cpu_manager import CPUOffloadingManager",
                    "from kvspec.conformance.offload_machine import impl_033_view as _view"]
        else:
            head = ["import os", "", 'os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")', "",
                    "from vllm.v1.kv_offload.base import LookupResult, ReqContext, "
                    "make_offload_key",
                    "from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager",
                    "from kvspec.conformance.offload_machine import vllm_033_view as _view"]
        return [*head,
                "from kvspec.spec.offload import OffloadEvent, OffloadView",
                "", "_contexts = {}", "", "",
                "def key(k):", "    return make_offload_key(k.to_bytes(8, 'big'), 0)", "", "",
                "def keys(*ks):", "    return [key(k) for k in ks]", "", "",
                "def ctx(req):",
                "    return _contexts.setdefault(req, ReqContext(req_id=req))", "", "",
                "def hits(manager, ks):", "    n = 0", "    for k in ks:",
                "        if manager.lookup(key(k), ctx('lookup')) != LookupResult.HIT:",
                "            break", "        n += 1", "    return n", "", "",
                "def _store_output(output):", "    if output is None:", "        return None",
                "    return (tuple(int.from_bytes(k[:-4], 'big') for k in output.keys_to_store),",
                "            tuple(int.from_bytes(k[:-4], 'big') for k in output.evicted_keys))",
                "", "",
                "def _events(events):",
                "    return tuple(OffloadEvent(tuple(int.from_bytes(k[:-4], 'big')",
                "                                    for k in e.keys),",
                "                              e.removed, e.metadata_only) for e in events)"]


def vllm_033_view(manager: Any) -> OffloadView | None:
    """A vLLM 0.33 manager's view (for written counterexamples)."""
    import vllm.v1.kv_offload.base as base

    policy = "lru" if hasattr(vllm_internals.offload_policy(manager), "chunks") else "arc"
    return Api033Adapter(type(manager), base, manager=manager, policy=policy).view()


def impl_033_view(manager: Any) -> OffloadView | None:
    """kvspec's 0.33-API manager's view (for written counterexamples)."""
    base = importlib.import_module(f"{IMPL_PACKAGE}.base")
    return Api033Adapter(type(manager), base, manager=manager,
                         policy=manager.cache_policy).view()


# --- Finding a target ----------------------------------------------------------------------------

IMPL_PACKAGE = "kvspec.impl.kv_offload"


def _impl_adapter() -> Callable[[], Api013Adapter]:
    try:
        lru = importlib.import_module(f"{IMPL_PACKAGE}.lru_manager").LRUOffloadingManager
        arc = importlib.import_module(f"{IMPL_PACKAGE}.arc_manager").ARCOffloadingManager
    except (ImportError, AttributeError) as error:
        raise LayerUnavailable(f"no offloading manager in impl ({error})") from error
    lines = [f"from {IMPL_PACKAGE}.lru_manager import LRUOffloadingManager",
             f"from {IMPL_PACKAGE}.arc_manager import ARCOffloadingManager"]
    return lambda: Api013Adapter({"lru": lru, "arc": arc}, lambda n: ListBackend(16, n),
                                 "ListBackend(16, {})", lines)


def _vllm_adapter(profile: Profile) -> Callable[[], Adapter]:
    try:
        importlib.import_module("vllm")
    except ImportError as error:
        raise TargetError(f"cannot import vllm ({error})") from error
    try:
        lru = importlib.import_module("vllm.v1.kv_offload.lru_manager").LRUOffloadingManager
        arc = importlib.import_module("vllm.v1.kv_offload.arc_manager").ARCOffloadingManager
        cpu = importlib.import_module("vllm.v1.kv_offload.backends.cpu").CPUBackend
        release = Profile.V0_13
    except (ImportError, AttributeError):
        release = Profile.V0_33
    if release is not profile:
        raise LayerUnavailable(f"the installed vLLM's offloading managers follow "
                               f"{release.value}, not --profile {profile.value}")
    if release is Profile.V0_13:
        lines = ["from vllm.v1.kv_offload.lru_manager import LRUOffloadingManager",
                 "from vllm.v1.kv_offload.arc_manager import ARCOffloadingManager",
                 "from vllm.v1.kv_offload.backends.cpu import CPUBackend"]
        return lambda: Api013Adapter(
            {"lru": lru, "arc": arc}, lambda n: cpu(block_size=16, num_blocks=n),
            "CPUBackend(block_size=16, num_blocks={})", lines)
    try:
        base = importlib.import_module("vllm.v1.kv_offload.base")
        manager = importlib.import_module("vllm.v1.kv_offload.cpu.manager").CPUOffloadingManager
    except (ImportError, AttributeError) as error:
        raise LayerUnavailable(f"this vLLM has no offloading manager kvspec drives "
                               f"({error})") from error
    return lambda: Api033Adapter(manager, base)


def _impl_033_adapter() -> Callable[[], Api033Adapter]:
    try:
        base = importlib.import_module(f"{IMPL_PACKAGE}.base")
        manager = importlib.import_module(f"{IMPL_PACKAGE}.cpu_manager").CPUOffloadingManager
    except (ImportError, AttributeError) as error:
        raise LayerUnavailable(f"no 0.33-API offloading manager in impl ({error})") from error
    return lambda: Api033Adapter(manager, base)


def adapter_for(target: str, profile: Profile = Profile.V0_13) -> Callable[[], Adapter]:
    """A factory of adapters for ``"impl"`` (vLLM 0.13's API: its LRU and ARC managers;
    vLLM 0.33's: its ``CPUOffloadingManager``) or ``"vllm"``."""
    if target == "impl":
        if profile is Profile.V0_33:
            return _impl_033_adapter()
        if profile is not Profile.V0_13:
            raise LayerUnavailable(f"impl has no offloading manager for --profile "
                                   f"{profile.value}")
        return _impl_adapter()
    if target == "vllm":
        return _vllm_adapter(profile)
    raise LayerUnavailable(f"no offloading-manager adapter for target {target!r}")


# --- The machine ---------------------------------------------------------------------------------


@dataclass
class Job:
    """A transfer the connector issued and a worker has not reported yet."""

    req: str
    keys: tuple[int, ...]
    generation: int


class OffloadMachine(ComponentMachine[OffloadState]):
    """Plays the connector against a target manager and `spec.offload`; ``machine_for``
    sets the adapter and the profile."""

    spec_step = staticmethod(model.step)
    view_of = staticmethod(model.view_of)
    shown = "lists with ref counts, ghosts, target, pending events"
    # The target's own representation check runs as an invariant, after the spec's named ones
    # (by name), so that a bug they see is reported by them.
    check_representation_each_step = False
    profile: ClassVar[Profile] = Profile.V0_13
    policies: ClassVar[tuple[str, ...]] = model.POLICIES

    def __init__(self) -> None:
        super().__init__()
        self.chains: dict[str, tuple[int, ...]] = {}  # live requests and their key chains
        self.stored_up_to: dict[str, int] = {}  # how much of its chain a request offered
        self.stores: list[Job] = []
        self.loads: list[Job] = []
        self.stale: list[Job] = []  # issued before a reset: their completions are late
        self.next_request = 0

    def state_from_view(self, view: Any) -> Any:
        return None if view is None else model.from_view(self.spec, view)

    def run(self, command: Any) -> Any:
        self._before = self.lockstep.state
        return super().run(command)

    def judge(self, command: Any, output: Any) -> None:
        """A store is judged by name before its output is compared with the spec's."""
        if isinstance(command, PrepareStore) and self._before is not None:
            after = model.from_view(self._before, self.adapter.view())
            broken = model.store_violations(self._before, command, output, after)
            if broken:
                raise Discrepancy(f"rule {broken[0]} violated by the target: {command} gave "
                                  f"{output!r}")

    # -- set-up ----------------------------------------------------------------------------------

    # Mostly tiny tiers, so that stores evict and fail for want of room.
    @initialize(capacity=st.sampled_from((2, 2, 3, 3, 4, 5, 8)), data=st.data())
    def build(self, capacity: int, data: st.DataObject) -> None:
        policy = data.draw(st.sampled_from(self.policies), label="policy")
        self.run(NewOffload(capacity, policy, self.profile))
        event(f"{policy} tier of {capacity} keys")

    # -- the connector's calls -------------------------------------------------------------------

    @precondition(lambda self: self.built and len(self.chains) < 3)
    @rule(conversation=st.integers(0, CONVERSATIONS), length=st.integers(1, CHAIN))
    def new_request(self, conversation: int, length: int) -> None:
        """A turn of one of three conversations (a prefix of its chain), or a one-off
        request whose keys no other request shares (so that evictions pile up ghosts)."""
        req = f"r{self.next_request}"
        self.next_request += 1
        first = CHAIN * (conversation if conversation < CONVERSATIONS
                         else CONVERSATIONS + self.next_request)
        self.chains[req] = tuple(range(first, first + length))
        self.stored_up_to[req] = 0
        if self.spec.policy == "arc" and max(len(self.spec.b1), len(self.spec.b2)) == (
                self.spec.capacity):
            event("arc: a ghost list is full")

    def _requests(self) -> list[str]:
        return sorted(self.chains)

    def _busy(self, req: str) -> bool:
        return any(job.req == req for job in self.stores + self.loads)

    @precondition(lambda self: self.built and self.chains)
    @rule(data=st.data())
    def admit_request(self, data: st.DataObject) -> None:
        """Look the chain up and pin the hit for a load, in one locked step."""
        req = data.draw(st.sampled_from(self._requests()), label="request")
        chain = self.chains[req]
        if not self.profile.offload_recency_from_requests:
            self._touch(req, chain)  # 0.13's get_num_new_matched_tokens touches first
        hits = self.run(Lookup(chain))
        event(f"lookup hit {'none' if not hits else 'all' if hits == len(chain) else 'part'}")
        if hits and not self._busy(req):
            self.run(PrepareLoad(req, chain[:hits]))
            self.loads.append(Job(req, chain[:hits], self.spec.generation))

    @precondition(lambda self: self.built and self.chains)
    @rule(data=st.data())
    def store_new_blocks(self, data: st.DataObject) -> None:
        """Offer the request's newly computed blocks (0.33 stores in batches, and a request
        may offer its chain again from the start after a preemption)."""
        req = data.draw(st.sampled_from(self._requests()), label="request")
        chain = self.chains[req]
        start = data.draw(st.sampled_from([self.stored_up_to[req], 0]), label="from")
        end = data.draw(st.integers(min(start + 1, len(chain)), len(chain)), label="to")
        keys = chain[start:end]
        # Named situations, so that an audit that has reported one looks further: a store
        # offering keys the tier holds (vLLM #35846), one that must evict while some key is
        # pinned or pending (vLLM #37874, #55461), one that cannot find room at all (#37874).
        if any(k in self.spec.ref for k in keys) and not self.allows("store_offers_held_keys"):
            return
        need = sum(k not in self.spec.ref for k in keys) - (self.spec.capacity
                                                            - len(self.spec.refs))
        if need > 0 and any(r != 0 for _, r in self.spec.refs) and not self.allows(
                "store_evicts_past_busy_keys"):
            return
        if need > len(model.evictable(self.spec, keys)) and not self.allows(
                "store_larger_than_room"):
            return  # refused for want of room: vLLM 0.13's ARC evicts some first
        output = self.run(PrepareStore(req, keys))
        self.stored_up_to[req] = max(self.stored_up_to[req], end)
        if output is None:
            event("store refused: no room")
        else:
            stored, evicted = output
            if stored:
                self.stores.append(Job(req, stored, self.spec.generation))
            if evicted:
                event("store evicted")
        if not self.profile.offload_recency_from_requests:
            self._touch(req, chain[:end])  # 0.13's build_connector_meta

    def _touch(self, req: str, keys: tuple[int, ...]) -> None:
        """0.13's connector touches a request's chain, pending keys included (vLLM 0.13's
        ARC lost a pending key here)."""
        if any(self.spec.ref.get(k) == -1 for k in keys) and not self.allows(
                "touch_of_a_pending_key"):
            return
        self.run(Touch(req, keys))

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), success=st.sampled_from([True, True, True, False]))
    def store_finishes(self, data: st.DataObject, success: bool) -> None:
        job = self.stores.pop(data.draw(st.integers(0, len(self.stores) - 1), label="store"))
        self.run(CompleteStore(job.req, job.keys, success, job.generation))
        event("store completed" if success else "store failed")

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def load_finishes(self, data: st.DataObject) -> None:
        job = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1), label="load"))
        self.run(CompleteLoad(job.req, job.keys))

    @precondition(lambda self: self.built and (len(self.chains) == 3 or (self.chains
                                               and self.every(4))))
    @rule(data=st.data())
    def request_finishes(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self._requests()), label="request")
        if self.profile.offload_recency_from_requests:
            self.run(RequestFinished(req))
        del self.chains[req]

    @precondition(lambda self: self.built and self.spec.events)
    @rule()
    def take_events(self) -> None:
        taken = self.run(TakeEvents())
        if any(e.removed and not e.metadata_only for e in taken):
            event("events: a removal taken")

    @precondition(lambda self: self.profile.offload_has_reset and self.every(8))
    @rule()
    def reset(self) -> None:
        """0.33's ``reset_cache``: the connector marks every job issued so far stale."""
        if model.ready_keys(self.spec) and not self.allows("reset_drops_ready_keys"):
            return
        self.run(Reset())
        self.stale += self.stores + self.loads
        self.stores, self.loads, self.chains = [], [], {}

    # -- bad calls, one rule each ----------------------------------------------------------------

    def _keys_where(self, wanted: Callable[[int], bool]) -> list[int]:
        return [k for k, r in self.spec.refs if wanted(r)]

    @bad_call(lambda self: self.built and self._keys_where(lambda r: r == -1),
              data=st.data())
    def load_pending_key(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self._keys_where(lambda r: r == -1)), label="key")
        self.refuse(PrepareLoad("bad", (key,)))

    @bad_call(lambda self: self.built and self._keys_where(lambda r: r >= 0)
              and self._keys_where(lambda r: r == -1), data=st.data())
    def load_ready_and_pending_keys(self, data: st.DataObject) -> None:
        """A refusal must leave the ready key unpinned (vLLM pins it, then asserts)."""
        ready = data.draw(st.sampled_from(self._keys_where(lambda r: r >= 0)), label="ready")
        pending = data.draw(st.sampled_from(self._keys_where(lambda r: r == -1)),
                            label="pending")
        self.refuse(PrepareLoad("bad", (ready, pending)))

    @bad_call(lambda self: self.every(5), key=st.integers(0, CONVERSATIONS * CHAIN - 1))
    def load_unknown_key(self, key: int) -> None:
        if key not in self.spec.ref:
            self.refuse(PrepareLoad("bad", (key,)))

    @bad_call(lambda self: self.built and self._keys_where(lambda r: r <= 0),
              data=st.data())
    def unpin_below_zero(self, data: st.DataObject) -> None:
        """An unpin of a key no load pins (a pending key, or a ready one unpinned)."""
        key = data.draw(st.sampled_from(self._keys_where(lambda r: r <= 0)), label="key")
        self.refuse(CompleteLoad("bad", (key,)))

    @bad_call(lambda self: self.built and self._keys_where(lambda r: r >= 0),
              data=st.data())
    def complete_store_twice(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self._keys_where(lambda r: r >= 0)), label="key")
        self.refuse(CompleteStore("bad", (key,)))

    @bad_call(lambda self: self.every(5), key=st.integers(0, CONVERSATIONS * CHAIN - 1))
    def complete_store_of_unknown_key(self, key: int) -> None:
        if key not in self.spec.ref:
            self.refuse(CompleteStore("bad", (key,)))

    @bad_call(lambda self: self.every(5), key=st.integers(0, CONVERSATIONS * CHAIN - 1))
    def store_key_listed_twice(self, key: int) -> None:
        self.refuse(PrepareStore("bad", (key, key)))

    @bad_call(lambda self: self.stale, data=st.data())
    def late_completion(self, data: st.DataObject) -> None:
        """A worker reports a transfer issued before the reset: 0.33's connector drops it
        (its job id is below the stale threshold); the manager itself cannot tell, so the
        spec ignores it only by its generation. Not refused: accepted and ignored."""
        job = self.stale.pop(data.draw(st.integers(0, len(self.stale) - 1), label="job"))
        self.run(CompleteStore(job.req, job.keys, True, job.generation))
        event("late completion after a reset")


OffloadMachine.add_invariants(model.ALL)

# Calls no caller within vLLM's contract makes: `kvspec audit --scope contract` leaves them out
# (the late completion too: 0.33's connector drops it before the manager sees it).
OUT_OF_CONTRACT = OffloadMachine.bad_call_rules


def machine_for(make_adapter: Callable[[], Adapter], profile: Profile = Profile.V0_13,
                excluded: frozenset[str] = frozenset(),
                policies: tuple[str, ...] = model.POLICIES) -> type[OffloadMachine]:
    """An OffloadMachine subclass that checks the targets make_adapter makes under profile,
    with tiers of the given policies."""
    machine: type[OffloadMachine] = OffloadMachine.for_target(
        make_adapter, profile=profile, excluded=excluded, policies=policies)
    return machine
