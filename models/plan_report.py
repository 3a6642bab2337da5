"""A memory plan from ``kvspec plan``'s option texts, and the plan shown as text or JSON.

`plan_from_options` reads the options as the user typed them (an unknown model, a memory size
or count that cannot be read or is out of range raises a typed error naming it: the command
prints it on one line, exit status 2); numbers are read here, not by argparse, so that its
usage text does not bury the error. `render_plan` is the text ``kvspec plan`` prints,
`plan_to_dict` its ``--json``.
"""

from __future__ import annotations

import re
from typing import Any

from kvspec.models.layout import ModelLayout, get_layout
from kvspec.models.plan import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    InvalidPlanArgument,
    MemoryPlan,
    format_bytes,
    parse_memory,
    plan_memory,
    shown,
)

__all__ = ["VLLM_BLOCK_SIZES", "plan_from_options", "plan_to_dict", "render_plan"]


def plan_to_dict(plan: MemoryPlan) -> dict[str, Any]:
    """The plan as plain JSON-ready data."""
    layout = plan.layout
    groups = plan.groups
    return {
        "model": layout.name,
        "hf_repo": layout.hf_repo,
        "config_url": layout.config_url,
        "layers": len(layout.layers),
        "layer_kinds": layout.kind_counts(),
        "requested_block_size": groups.requested_block_size,
        "adjustments": list(groups.adjustments),
        "groups": [
            {
                "group_id": g.group_id,
                "kind": g.spec.kind,
                "num_layers": len(g.layer_names),
                "layer_names": list(g.layer_names),
                "spec": g.spec.describe(),
                "block_size": g.spec.block_size,
                "page_size_bytes": g.spec.page_size_bytes,
            }
            for g in groups.groups
        ],
        "page_size_bytes": groups.page_size_bytes,
        "layers_per_block": groups.layers_per_block,
        "padding_layers": groups.padding_layers,
        "bytes_per_block": groups.bytes_per_block,
        "memory_bytes": plan.memory_bytes,
        "num_blocks": plan.num_blocks,
        "usable_blocks": plan.usable_blocks,
        "pool_tokens": plan.pool_tokens,
        "kv_cache_tokens": plan.kv_cache_tokens,
        "max_model_len": plan.max_model_len,
        "max_num_batched_tokens": plan.max_num_batched_tokens,
        "max_context_tokens": plan.max_context_tokens,
        "context_limited_by": plan.context_limited_by,
        "blocks_per_max_request": plan.blocks_per_max_request,
        "max_concurrency": round(plan.max_concurrency, 4),
        "unverified_figures": {f.name: f.source for f in layout.unverified_figures},
        "notes": list(layout.notes),
    }


def _kinds(layout: ModelLayout) -> str:
    return ", ".join(f"{count} {kind}" for kind, count in layout.kind_counts().items())


def render_plan(plan: MemoryPlan) -> str:
    """The plan as the text ``kvspec plan`` prints."""
    layout = plan.layout
    groups = plan.groups
    lines = [
        f"{layout.name}  ({layout.hf_repo})",
        f"  config: {layout.config_url}",
        f"  KV-cache layers: {len(layout.layers)} ({_kinds(layout)})",
    ]
    lines += [f"  note: {adjustment}" for adjustment in groups.adjustments]
    lines.append(f"KV-cache groups: {len(groups.groups)}")
    for g in groups.groups:
        lines.append(
            f"  group {g.group_id}: {len(g.layer_names):>3} x {g.spec.describe()}, "
            f"block_size {g.spec.block_size}, page {g.spec.page_size_bytes:,} B"
        )
    padding = f", {groups.padding_layers} padding slots" if groups.padding_layers else ""
    lines += [
        f"page size per block: {groups.bytes_per_block:,} B "
        f"({groups.page_size_bytes:,} B x {groups.layers_per_block} layers sharing a block id"
        f"{padding})",
        f"memory: {format_bytes(plan.memory_bytes)} ({plan.memory_bytes:,} B) -> "
        f"{plan.num_blocks:,} blocks ({plan.usable_blocks:,} usable; block 0 is the null block)",
        f"tokens that fit: {plan.pool_tokens:,} token slots in the pool; "
        f"{plan.kv_cache_tokens:,} by vLLM's KV-cache-size log (num_blocks // groups x block_size)",
        f"max context per request: {plan.max_context_tokens:,} tokens "
        f"(model limit {plan.max_model_len:,}; limited by {plan.context_limited_by}; "
        f"prefill chunk {plan.max_num_batched_tokens:,})",
        f"max concurrency at {plan.max_model_len:,} tokens: {plan.max_concurrency:.2f}x "
        f"({plan.blocks_per_max_request:,} blocks per request)",
    ]
    lines += [f"note: {note}" for note in layout.notes]
    for figure in layout.unverified_figures:
        lines.append(f"unverified: {figure.name} = {figure.value} ({figure.source})")
    return "\n".join(lines)


# The block sizes vLLM 0.13 takes for ``--block-size``: ``BlockSize = Literal[1, 8, 16, 32, 64,
# 128, 256]`` in vllm/config/cache.py (vLLM 0.13.0), the type of ``CacheConfig.block_size``
# and of ``EngineArgs.block_size`` (vllm/engine/arg_utils.py), whose ``--block-size`` option
# offers these choices.
VLLM_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)

_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)
# Far more digits than 2**63 - 1 has; int() is not asked to read more (past 4,300 digits it
# raises a bare ValueError).
_MAX_DIGITS = 40


def _integer(option: str, value: object) -> int | None:
    """An integer option's value: None or an int (a default) as it is, else its text read as
    an ASCII integer (the planner checks the range)."""
    if value is None or type(value) is int:
        return value
    text = value.strip() if isinstance(value, str) else ""
    if _INTEGER.fullmatch(text) is None:
        raise InvalidPlanArgument(f"{option} must be an integer, got {shown(value)}")
    if len(text) > _MAX_DIGITS:
        raise InvalidPlanArgument(f"{option} must be at most 2**63 - 1, got {shown(value)}")
    return int(text)


def plan_from_options(model: str, *, memory: str | None, num_blocks: str | None,
                      block_size: str | int | None, max_num_batched_tokens: str | int | None,
                      max_model_len: str | None) -> MemoryPlan:
    """The plan for ``model`` (a name from models/data) and the options' texts (an int where
    the option's default is one): ``memory`` (e.g. ``80GiB``) or ``num_blocks``, and the block
    size, prefill chunk and longest request.

    raises: UnknownModelError (the model), InvalidMemorySize, InvalidPlanArgument,
    InvalidLayout (a value, named in the message)
    """
    layout = get_layout(model)
    memory_bytes = None if memory is None else parse_memory(memory)
    size = _integer("--block-size", block_size)
    if size is not None and size not in VLLM_BLOCK_SIZES:
        raise InvalidPlanArgument(
            f"--block-size must be one of the block sizes vLLM takes (its "
            f"CacheConfig.block_size: {', '.join(map(str, VLLM_BLOCK_SIZES))}), got "
            f"{shown(block_size)}")
    batched = _integer("--max-num-batched-tokens", max_num_batched_tokens)
    return plan_memory(
        layout,
        memory_bytes=memory_bytes,
        num_blocks=_integer("--num-blocks", num_blocks),
        block_size=16 if size is None else size,
        max_model_len=_integer("--max-model-len", max_model_len),
        max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS if batched is None else batched,
    )
