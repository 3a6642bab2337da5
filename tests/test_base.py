"""vLLM 0.33's offloading data (impl/kv_offload/base.py, named as vLLM 0.33's
``vllm.v1.kv_offload.base``): offload keys, a request's context, and the event's fields.
"""

from __future__ import annotations

from kvspec.impl.kv_offload import (
    CPUOffloadingManager,
    ReqContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from kvspec.impl.kv_offload.base import OffloadingEvent
from tests.offload_managers import key, keys


def test_keys_pack_a_hash_and_a_group() -> None:
    made = make_offload_key(b"\x01\x02", 7)
    assert made == b"\x01\x02\x00\x00\x00\x07"
    assert (get_offload_block_hash(made), get_offload_group_idx(made)) == (b"\x01\x02", 7)


def test_context_keeps_state_by_type() -> None:
    ctx = ReqContext(req_id="r")
    assert ctx.get_state(int) is None
    ctx.set_state(3)
    assert ctx.get_state(int) == 3
    ctx.set_offload_key_position(key(1), 16)
    assert ctx.get_offload_key_position(key(1)) == 16


def test_a_vllm_style_event_has_vllm_033_fields() -> None:
    event = OffloadingEvent(keys(1), CPUOffloadingManager(1).medium, removed=True)
    assert (event.metadata_only, event.removal_expected, event.ownership) == (False, False,
                                                                             None)
