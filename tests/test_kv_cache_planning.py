"""KV-cache planning (impl/kv_cache_planning.py): vLLM 0.13's grouping, block counts and memory
checks, with impl's own spec classes, with a foreign family of classes, and against vLLM 0.13
itself when its environment is at hand.

The expected values below are worked out by hand from vLLM 0.13's rules (models/plan.py says
them in one place); the last test runs the same inputs through vLLM's functions and impl's in
vLLM's interpreter and compares every result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvspec.impl.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    InvalidKVCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpecMismatch,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    WindowSizeMismatch,
)
from kvspec.impl.kv_cache_planning import (
    EmptyKVCacheGroups,
    HybridKVCacheSpecsNotUnifiable,
    InconsistentLayerSpec,
    InconsistentNumBlocks,
    InsufficientKVCacheMemory,
    InvalidPlanArgument,
    NonUniformPageSize,
    PageSizeNotUnifiable,
    UnknownLayerError,
    check_enough_kv_cache_memory,
    create_kv_cache_group_specs,
    estimate_max_model_len,
    generate_scheduler_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_configs,
    get_kv_cache_groups,
    get_max_concurrency_for_kv_cache_config,
    get_num_blocks,
    get_uniform_page_size,
    is_kv_cache_page_size_uniform,
    is_kv_cache_spec_uniform,
    max_memory_usage_bytes,
    unify_hybrid_kv_cache_specs,
    unify_kv_cache_spec_page_size,
)
from kvspec.models.bridge import to_kv_cache_config, to_kv_cache_specs
from kvspec.models.layout import get_layout, list_models

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO_ROOT / ".venv-vllm-0.13.0" / "bin" / "python"
GIB = 1 << 30


def vllm_config(
    max_model_len: int = 16,
    max_num_batched_tokens: int = 2048,
    num_gpu_blocks_override: int | None = None,
    disable_hybrid_kv_cache_manager: bool = False,
    dcp: int = 1,
    pcp: int = 1,
) -> Any:
    """The parts of vLLM's VllmConfig that planning reads."""
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_encoder_input_tokens=max_num_batched_tokens,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
        ),
        cache_config=SimpleNamespace(num_gpu_blocks_override=num_gpu_blocks_override),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp
        ),
    )


def full(block_size: int = 16, head_size: int = 64, **kwargs: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 2, head_size, "float32", **kwargs)


def sliding(block_size: int = 16, head_size: int = 64, window: int = 1) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size, 2, head_size, "float32", sliding_window=window)


PAGE = full().page_size_bytes  # 16 tokens x 2 heads x 64 x 4 bytes x (K, V) = 16 KiB


def one_worker(specs: dict[str, Any], memory: int, **config: Any) -> KVCacheConfig:
    result = get_kv_cache_configs(vllm_config(**config), [specs], [memory])
    assert len(result) == 1
    config_out: KVCacheConfig = result[0]
    return config_out


def tensors(size: int, *layer_lists: list[str]) -> tuple[KVCacheTensor, ...]:
    return tuple(KVCacheTensor(size, tuple(names)) for names in layer_lists)


# --- one worker: grouping and sizing ------------------------------------------------------


def test_one_spec_is_one_group_with_a_tensor_per_layer() -> None:
    config = one_worker({"a": full(), "b": full()}, PAGE * 2 * 32)
    assert config == KVCacheConfig(
        32, tensors(PAGE * 32, ["a"], ["b"]), (KVCacheGroupSpec(("a", "b"), full()),)
    )
    assert type(config) is KVCacheConfig
    windows = one_worker({"a": sliding(), "b": sliding()}, PAGE * 2 * 32)
    assert windows.kv_cache_groups == (KVCacheGroupSpec(("a", "b"), sliding()),)


def test_hybrid_layers_share_tensors_across_groups() -> None:
    config = one_worker({"a": full(), "b": sliding()}, PAGE * 2 * 32)
    assert config == KVCacheConfig(
        64,
        tensors(PAGE * 64, ["a", "b"]),
        (KVCacheGroupSpec(("a",), full()), KVCacheGroupSpec(("b",), sliding())),
    )
    specs = {"f1": full(), "f2": full(), "s1": sliding(), "s2": sliding(), "s3": sliding(),
             "s4": sliding()}
    config = one_worker(specs, PAGE * 2 * 32)
    assert config.num_blocks == 32
    assert [g.layer_names for g in config.kv_cache_groups] == [
        ("f1", "f2"), ("s1", "s3"), ("s2", "s4")  # strided, as vLLM cuts a bucket
    ]
    assert config.kv_cache_tensors == tensors(PAGE * 32, ["f1", "s1", "s2"], ["f2", "s3", "s4"])


def test_group_size_and_padding() -> None:
    # 3 full + 7 sliding: groups of 3, the sliding layers padded to 9.
    specs = {f"f{i}": full() for i in range(3)} | {f"s{i}": sliding() for i in range(7)}
    config = one_worker(specs, PAGE * 3 * 32)
    assert [g.layer_names for g in config.kv_cache_groups] == [
        ("f0", "f1", "f2"), ("s0", "s3", "s6"), ("s1", "s4"), ("s2", "s5")
    ]
    assert len(config.kv_cache_tensors) == 3 and config.num_blocks == 32
    # 6 full + 5 sliding: 6 < 5 * 1.25, so one group of each (one padding slot).
    specs = {f"f{i}": full() for i in range(6)} | {f"s{i}": sliding() for i in range(5)}
    config = one_worker(specs, PAGE * 6 * 32)
    assert [len(g.layer_names) for g in config.kv_cache_groups] == [6, 5]
    assert config.kv_cache_tensors[-1] == KVCacheTensor(PAGE * 32, ("f5",))
    # 4 full + 5 sliding: 5 is not below 4 * 1.25, so groups of 4 and the sliding layers in two.
    specs = {f"f{i}": full() for i in range(4)} | {f"s{i}": sliding() for i in range(5)}
    config = one_worker(specs, PAGE * 4 * 32)
    assert [g.layer_names for g in config.kv_cache_groups] == [
        ("f0", "f1", "f2", "f3"), ("s0", "s2", "s4"), ("s1", "s3")
    ]


def test_hybrid_allocator_off_stores_windows_as_full_attention() -> None:
    config = one_worker({"a": full(), "b": sliding()}, PAGE * 2 * 32,
                        disable_hybrid_kv_cache_manager=True)
    assert config.kv_cache_groups == (KVCacheGroupSpec(("a", "b"), full(sliding_window=1)),)
    specs: dict[str, Any] = {"a": full(), "b": ChunkedLocalAttentionSpec(16, 2, 64, "float32", 8)}
    unify_hybrid_kv_cache_specs(specs)  # in place, as vLLM's
    assert specs["b"] == full(attention_chunk_size=8)
    with pytest.raises(HybridKVCacheSpecsNotUnifiable, match="one unified type"):
        unify_hybrid_kv_cache_specs({"a": sliding(window=1), "b": sliding(window=2)})


def test_same_kind_different_shapes_is_one_uniform_type_group() -> None:
    specs = {"a": full(head_size=128), "b": full(head_size=64)}
    config = one_worker(specs, PAGE * 3 * 32)
    assert config == KVCacheConfig(
        32,
        tensors(PAGE * 2 * 32, ["a"]) + tensors(PAGE * 32, ["b"]),
        (KVCacheGroupSpec(("a", "b"), UniformTypeKVCacheSpecs(16, specs)),),
    )
    scheduler = generate_scheduler_kv_cache_config([config])
    assert scheduler.kv_cache_groups == (KVCacheGroupSpec(("a", "b"), full(head_size=128)),)


def test_smaller_pages_grow_their_block_size() -> None:
    config = one_worker({"a": full(head_size=64), "b": sliding(head_size=32)}, PAGE * 32)
    assert config.kv_cache_groups == (
        KVCacheGroupSpec(("a",), full(head_size=64)),
        KVCacheGroupSpec(("b",), sliding(block_size=32, head_size=32)),
    )
    with pytest.raises(PageSizeNotUnifiable, match="'a'") as info:  # 16 KiB into 24 KiB
        one_worker({"a": full(head_size=64), "b": sliding(head_size=96)}, PAGE * 2 * 32)
    assert isinstance(info.value, NotImplementedError)  # as vLLM raises


def test_num_gpu_blocks_override_and_attention_free() -> None:
    config = one_worker({"a": full(), "b": full()}, PAGE * 2 * 32, num_gpu_blocks_override=16)
    assert config.num_blocks == 16
    assert config.kv_cache_tensors == tensors(PAGE * 16, ["a"], ["b"])
    assert get_kv_cache_configs(vllm_config(), [{}], [0]) == [KVCacheConfig(1, (), ())]


# --- several workers ------------------------------------------------------------------------


def test_workers_get_the_fewest_blocks_and_their_own_layers() -> None:
    specs = [{"a": full(), "b": full()}] * 2
    configs = get_kv_cache_configs(vllm_config(), specs, [PAGE * 2 * 10, PAGE * 2 * 20])
    assert [c.num_blocks for c in configs] == [10, 10]
    assert configs[1].kv_cache_tensors == tensors(PAGE * 10, ["a"], ["b"])
    # pipeline stages of a hybrid model: every stage keeps every group, some of them empty
    stages: list[dict[str, Any]] = [{"a": full(), "b": full()}, {"c": sliding(), "d": sliding()}]
    configs = get_kv_cache_configs(vllm_config(), stages, [PAGE * 2 * 10] * 2)
    assert configs[0].kv_cache_groups == (KVCacheGroupSpec(("a", "b"), full()),
                                          KVCacheGroupSpec((), sliding()))
    assert configs[1].kv_cache_tensors == tensors(PAGE * 10, ["c"], ["d"])


def test_workers_disagreeing_on_a_layer_are_refused() -> None:
    with pytest.raises(InconsistentLayerSpec, match="'x'"):
        get_kv_cache_configs(vllm_config(), [{"x": full()}, {"x": sliding()}], [PAGE * 20] * 2)
    with pytest.raises(InvalidPlanArgument, match="2 workers"):
        get_kv_cache_configs(vllm_config(), [{"x": full()}] * 2, [PAGE * 20])


def test_scheduler_config_needs_one_block_count() -> None:
    configs = [KVCacheConfig(10, (), ()), KVCacheConfig(11, (), ())]
    with pytest.raises(InconsistentNumBlocks, match=r"\[10, 11\]"):
        generate_scheduler_kv_cache_config(configs)


# --- memory ---------------------------------------------------------------------------------

# A 7B model's attention: 32 layers of 32 heads x 128, float16; 16384 tokens take 8 GiB.
SEVEN_B = {f"l{i}": FullAttentionSpec(16, 32, 128, "float16") for i in range(32)}


@pytest.mark.parametrize(("max_model_len", "expected"), [(16385, 16384), (16383, 16383)])
def test_estimate_max_model_len(max_model_len: int, expected: int) -> None:
    config = vllm_config(max_model_len=max_model_len, max_num_batched_tokens=32768)
    assert estimate_max_model_len(config, SEVEN_B, 8 * GIB) == expected
    assert config.model_config.max_model_len == max_model_len  # left as it was


def test_not_enough_memory_names_the_longest_request_that_fits() -> None:
    config = vllm_config(max_model_len=16385)
    with pytest.raises(InsufficientKVCacheMemory, match="estimated maximum model length is 16384"):
        check_enough_kv_cache_memory(config, SEVEN_B, 8 * GIB)
    with pytest.raises(InsufficientKVCacheMemory, match="No available memory") as info:
        check_enough_kv_cache_memory(config, SEVEN_B, 0)
    assert info.value.needed_bytes is None
    check_enough_kv_cache_memory(config, {}, 0)  # no layers, nothing to hold
    assert estimate_max_model_len(config, SEVEN_B, 1) == 0


def test_max_concurrency() -> None:
    config = vllm_config(max_model_len=16384, max_num_batched_tokens=1024)
    full_spec = FullAttentionSpec(16, 32, 128, "float16")
    window_spec = SlidingWindowSpec(16, 32, 128, "float16", sliding_window=1024)
    layers = tuple(f"l{i}" for i in range(32))
    others = tuple(f"l{i}" for i in range(32, 64))

    def concurrency(num_blocks: int, *groups: KVCacheGroupSpec) -> float:
        kv_config = KVCacheConfig(num_blocks, (), groups)
        return get_max_concurrency_for_kv_cache_config(config, kv_config)

    assert concurrency(1536, KVCacheGroupSpec(layers, full_spec)) == 1.5
    # a window of 1024 with 1024-token steps: cdiv(2047, 16) + 1 = 129 blocks
    assert concurrency(129 * 3, KVCacheGroupSpec(layers, window_spec)) == 3
    assert concurrency((1024 + 129) * 3, KVCacheGroupSpec(layers, full_spec),
                       KVCacheGroupSpec(others, window_spec)) == 3
    with pytest.raises(EmptyKVCacheGroups):
        concurrency(10)


def test_max_memory_usage_per_kind() -> None:
    config = vllm_config(max_model_len=100, max_num_batched_tokens=8)
    page = full(block_size=4).page_size_bytes
    assert full(block_size=4).max_memory_usage_bytes(config) == 25 * page
    assert full(block_size=4).max_memory_usage_bytes(100) == 25 * page  # the int form
    assert sliding(block_size=4, window=10).max_memory_usage_bytes(config) == (5 + 1) * page
    chunked = ChunkedLocalAttentionSpec(4, 2, 64, "float32", 16)
    assert chunked.max_memory_usage_bytes(config) == 6 * page
    assert CrossAttentionSpec(4, 2, 64, "float32").max_memory_usage_bytes(config) == 2 * page
    assert EncoderOnlyAttentionSpec(4, 2, 64, "float32").max_memory_usage_bytes(config) == 0
    mamba = MambaSpec(100, shapes=((4, 8),), dtypes=("float32",), num_speculative_blocks=2)
    assert mamba.max_memory_usage_bytes(config) == mamba.page_size_bytes  # vLLM 0.13: cdiv
    # context parallelism: each of 4 ranks keeps a quarter of the tokens
    cp = vllm_config(max_model_len=100, dcp=2, pcp=2)
    assert full(block_size=4).max_memory_usage_bytes(cp) == 7 * page
    with pytest.raises(InvalidKVCacheSpec, match="decode context parallel"):
        sliding().max_memory_usage_bytes(cp)
    uniform = UniformTypeKVCacheSpecs(4, {"a": full(4, 128), "b": full(4, 64)})
    assert uniform.max_memory_usage_bytes(config) == 25 * 3 * page
    assert max_memory_usage_bytes(config, [full(block_size=4), chunked]) == 31 * page
    with pytest.raises(InvalidKVCacheSpec, match="max_model_len"):
        full().max_memory_usage_bytes(SimpleNamespace())


# --- the building blocks --------------------------------------------------------------------


def test_merge_and_uniformity() -> None:
    assert is_kv_cache_spec_uniform({"a": full(), "b": full(sliding_window=1)})
    assert not is_kv_cache_spec_uniform({"a": full(), "b": sliding()})
    assert not is_kv_cache_spec_uniform({"a": sliding(window=1), "b": sliding(window=2)})
    assert is_kv_cache_spec_uniform({})
    with pytest.raises(WindowSizeMismatch):  # raised through, as vLLM's ValueError
        is_kv_cache_spec_uniform({"a": full(sliding_window=1), "b": full(sliding_window=2)})
    with pytest.raises(KVCacheSpecMismatch, match="both sliding-window"):
        full().merge([full(sliding_window=4), full(attention_chunk_size=8)])
    mla = MLAAttentionSpec(16, 1, 64, "float32", cache_dtype_str="fp8_ds_mla")
    assert mla.merge([mla, mla]) == mla
    with pytest.raises(KVCacheSpecMismatch):
        mla.merge([mla, dataclasses.replace(mla, cache_dtype_str=None)])
    with pytest.raises(KVCacheSpecMismatch):
        full().merge([full(), mla])
    # vLLM 0.13's MLA merge keeps the first spec and drops the other's shape; impl's refuses.
    with pytest.raises(KVCacheSpecMismatch):
        mla.merge([mla, dataclasses.replace(mla, head_size=32)])
    assert full().copy_with_new_block_size(32) == full(block_size=32)


def test_page_sizes_and_block_counts() -> None:
    assert is_kv_cache_page_size_uniform({"a": full(), "b": sliding()})
    assert not is_kv_cache_page_size_uniform({"a": full(), "b": full(head_size=32)})
    same = {"a": full(), "b": sliding()}
    assert unify_kv_cache_spec_page_size(same) is same
    assert get_uniform_page_size([full(), sliding()]) == PAGE
    with pytest.raises(NonUniformPageSize, match=str(PAGE)):
        get_uniform_page_size([full(), full(head_size=32)])
    assert get_num_blocks(vllm_config(), 3, PAGE * 3 * 5 + 1, PAGE) == 5
    assert get_num_blocks(vllm_config(), 3, -1, PAGE) == 0
    assert get_num_blocks(vllm_config(num_gpu_blocks_override=7), 3, PAGE, PAGE) == 7
    with pytest.raises(InvalidPlanArgument, match="num_gpu_blocks_override"):
        get_num_blocks(vllm_config(num_gpu_blocks_override=-1), 3, PAGE, PAGE)


def test_groups_name_their_layers() -> None:
    with pytest.raises(UnknownLayerError, match="'zz'"):
        create_kv_cache_group_specs({"a": full()}, [["a", "zz"]])
    with pytest.raises(EmptyKVCacheGroups):
        create_kv_cache_group_specs({"a": full()}, [[]])
    with pytest.raises(EmptyKVCacheGroups):
        get_kv_cache_config_from_groups(vllm_config(), [KVCacheGroupSpec((), full())], PAGE)
    assert get_kv_cache_groups(vllm_config(), {}) == []


# --- a foreign family of classes ------------------------------------------------------------


def _foreign_interface() -> types.ModuleType:
    """A module standing in for vLLM's kv_cache_interface: its own config classes (mutable
    dataclasses of lists, as vLLM's) and spec classes of the names vLLM gives them."""
    module = types.ModuleType("foreign_kv_cache_interface")

    @dataclasses.dataclass
    class KVCacheTensor:
        size: int
        shared_by: list[str]

    @dataclasses.dataclass
    class KVCacheGroupSpec:
        layer_names: list[str]
        kv_cache_spec: Any

    @dataclasses.dataclass
    class KVCacheConfig:
        num_blocks: int
        kv_cache_tensors: list[Any]
        kv_cache_groups: list[Any]

    @dataclasses.dataclass(frozen=True)
    class ForeignFull(FullAttentionSpec):
        pass

    @dataclasses.dataclass(frozen=True)
    class ForeignSliding(SlidingWindowSpec):
        pass

    for name, cls in (("KVCacheTensor", KVCacheTensor), ("KVCacheGroupSpec", KVCacheGroupSpec),
                      ("KVCacheConfig", KVCacheConfig), ("FullAttentionSpec", ForeignFull),
                      ("SlidingWindowSpec", ForeignSliding)):
        cls.__module__ = module.__name__
        setattr(module, name, cls)
    return module


def test_results_are_of_the_callers_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    foreign = _foreign_interface()
    monkeypatch.setitem(sys.modules, foreign.__name__, foreign)
    spec = foreign.FullAttentionSpec(16, 2, 64, "float32")
    config = one_worker({"a": spec, "b": spec}, PAGE * 2 * 8)
    assert config == foreign.KVCacheConfig(
        8,
        [foreign.KVCacheTensor(PAGE * 8, ["a"]), foreign.KVCacheTensor(PAGE * 8, ["b"])],
        [foreign.KVCacheGroupSpec(["a", "b"], spec)],
    )
    window = foreign.SlidingWindowSpec(16, 2, 64, "float32", sliding_window=4)
    hybrid: Any = one_worker({"a": spec, "b": window}, PAGE * 2 * 8,
                             disable_hybrid_kv_cache_manager=True)
    assert hybrid.kv_cache_groups == [
        foreign.KVCacheGroupSpec(["a", "b"], foreign.FullAttentionSpec(16, 2, 64, "float32", 4))
    ]


# --- against vLLM 0.13 itself ---------------------------------------------------------------

# Runs under vLLM 0.13's interpreter. Each case goes through vLLM's function and impl's, first
# on vLLM's spec objects (results must be equal: same classes, same values), then impl's on
# impl's specs of the same fields (results must be equal field by field). Errors must agree:
# the same type, or impl's typed ValueError where vLLM asserts. Prints one JSON object.
VLLM_SIDE = r"""
import copy, dataclasses, json, logging, sys
from types import SimpleNamespace
import torch
logging.disable(logging.WARNING)
from vllm.config import DeviceConfig, VllmConfig
from vllm.v1 import kv_cache_interface as V
from vllm.v1.core import kv_cache_utils as theirs
from kvspec.impl import kv_cache_interface as K, kv_cache_planning as ours

DTYPES = {"float16": torch.float16, "float32": torch.float32}


def spec(family, desc):
    kind, bs, heads, head, dtype, extra = desc
    m = V if family == "vllm" else K
    d = DTYPES[dtype] if family == "vllm" else dtype
    attention = dict(block_size=bs, num_kv_heads=heads, head_size=head, dtype=d)
    if kind == "full":
        return m.FullAttentionSpec(**attention, sliding_window=extra)
    if kind == "sliding":
        return m.SlidingWindowSpec(**attention, sliding_window=extra)
    if kind == "chunked":
        return m.ChunkedLocalAttentionSpec(**attention, attention_chunk_size=extra)
    if kind == "mla":
        return m.MLAAttentionSpec(**attention, cache_dtype_str=extra)
    if kind == "cross":
        return m.CrossAttentionSpec(**attention)
    if kind == "encoder_only":
        return m.EncoderOnlyAttentionSpec(**attention)
    shapes, padded = extra
    return m.MambaSpec(block_size=bs, shapes=tuple(map(tuple, shapes)),
                       dtypes=(d,) * len(shapes), page_size_padded=padded)


VLLM_CONFIG = VllmConfig(device_config=DeviceConfig(device="cpu"))


def config(c):
    # vLLM's own VllmConfig (the attention-free case takes its classes from it), with a model
    # config of just the length: vLLM's ModelConfig would read the model from the hub.
    VLLM_CONFIG.model_config = SimpleNamespace(max_model_len=c["max_model_len"])
    scheduler = VLLM_CONFIG.scheduler_config
    scheduler.max_num_batched_tokens = scheduler.max_num_encoder_input_tokens = c["batched"]
    scheduler.disable_hybrid_kv_cache_manager = c["hybrid_off"]
    VLLM_CONFIG.cache_config.num_gpu_blocks_override = c["override"]
    VLLM_CONFIG.parallel_config.decode_context_parallel_size = c["dcp"]
    VLLM_CONFIG.parallel_config.prefill_context_parallel_size = c["pcp"]
    return VLLM_CONFIG


def plain(x):
    # A result as plain data: class names and field values (dtypes by canonical name).
    if isinstance(x, torch.dtype) or isinstance(x, str) and x in ("float16", "float32"):
        return K.canonical_dtype(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        values = {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        return [type(x).__name__, {k: v for k, v in values.items() if v is not None}]
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def run(fn):
    try:
        return "ok", fn()
    except Exception as error:  # compared below
        return "error", error


def errors_agree(theirs_error, our_error):
    if isinstance(our_error, type(theirs_error)):  # vLLM's spec methods raise their own
        return True
    # Where vLLM asserts, impl raises a typed ValueError.
    return isinstance(theirs_error, AssertionError) and isinstance(our_error, ValueError)


def agree(theirs_out, our_out, same_objects, chained=False):
    if theirs_out[0] != our_out[0]:
        return False
    if theirs_out[0] == "error":
        return errors_agree(theirs_out[1], our_out[1])
    if chained:  # configs, then their concurrency and the scheduler's config
        (theirs_value, *theirs_next), (our_value, *our_next) = theirs_out[1], our_out[1]
        if not all(agree(t, o, same_objects) for t, o in zip(theirs_next, our_next)):
            return False
    else:
        theirs_value, our_value = theirs_out[1], our_out[1]
    if same_objects and theirs_value != our_value:
        return False
    return plain(theirs_value) == plain(our_value)


CALLS = {
    "configs": lambda m, cfg, workers, arg: m.get_kv_cache_configs(cfg, workers, arg),
    "estimate": lambda m, cfg, workers, arg: m.estimate_max_model_len(cfg, workers[0], arg[0]),
    "usage": lambda m, cfg, workers, arg: m.max_memory_usage_bytes(cfg, workers[0].values()),
    "uniform": lambda m, cfg, workers, arg: m.is_kv_cache_spec_uniform(workers[0]),
    "groups": lambda m, cfg, workers, arg: m.get_kv_cache_groups(cfg, workers[0]),
}
checked, mismatches, errors = 0, [], 0
for case in json.load(sys.stdin):
    op = case["op"]
    outs = {}
    for who, module, family in (("vllm", theirs, "vllm"), ("impl on vllm", ours, "vllm"),
                                ("impl on impl", ours, "impl")):
        workers = [{n: spec(family, d) for n, d in w} for w in case["workers"]]
        out = run(lambda: CALLS[op](module, config(case["config"]), workers, case["memory"]))
        if op == "configs" and out[0] == "ok":
            configs = out[1]
            concurrency = run(lambda: [module.get_max_concurrency_for_kv_cache_config(
                config(case["config"]), c) for c in configs if c.kv_cache_groups])
            scheduler = run(lambda: module.generate_scheduler_kv_cache_config(configs))
            out = ("ok", (configs, concurrency, scheduler))
        outs[who] = out
    checked += 1
    errors += outs["vllm"][0] == "error"
    chained = op == "configs"
    if not (agree(outs["vllm"], outs["impl on vllm"], True, chained)
            and agree(outs["vllm"], outs["impl on impl"], False, chained)):
        mismatches.append({"case": case, "outs": {k: repr(v) for k, v in outs.items()}})
print(json.dumps({"checked": checked, "vllm_errors": errors, "mismatches": mismatches[:5],
                  "num_mismatches": len(mismatches)}))
"""


def _attention(kind: str, rng: random.Random, shape: tuple[int, int, str]) -> list[Any]:
    heads, head, dtype = shape
    extra: Any = None
    if kind == "sliding":
        extra = rng.choice([1, 4, 64, 1024])
    elif kind == "chunked":
        extra = rng.choice([8, 256])
    elif kind == "full" and rng.random() < 0.1:
        extra = rng.choice([4, 8])
    return [kind, rng.choice([4, 8, 16]) if rng.random() < 0.1 else 16, heads, head, dtype, extra]


def _random_case(rng: random.Random) -> dict[str, Any]:
    """A model of one to three layer kinds, split over one to three workers."""
    base = (rng.choice([1, 2, 4]), rng.choice([8, 16, 32]), rng.choice(["float16", "float32"]))
    kinds = rng.sample(["full", "sliding", "chunked", "mla", "mamba"], rng.randint(1, 3))
    layers: list[tuple[str, list[Any]]] = []
    for kind in kinds:
        for _ in range(rng.randint(1, 7)):
            shape = base if rng.random() < 0.85 else (2, rng.choice([8, 24, 64]), base[2])
            if kind == "mla":
                desc = ["mla", 16, 1, base[1] * 2, base[2], rng.choice([None, None, "auto"])]
            elif kind == "mamba":
                # a state padded to one attention page, or (rarely) not
                page = 2 * 16 * base[0] * base[1] * (2 if base[2] == "float16" else 4)
                padded = page if rng.random() < 0.8 else None
                desc = ["mamba", 16, 0, 0, base[2], [[[2, 4]], padded]]
            else:
                desc = _attention(kind, rng, shape)
            layers.append((f"layer.{len(layers)}", desc))
    rng.shuffle(layers)
    split = rng.choice(["one", "tp", "pp"])
    if split == "one":
        workers = [layers]
    elif split == "tp":
        workers = [layers, layers]
    else:
        cut = rng.randint(1, len(layers)) if len(layers) > 1 else 1
        workers = [layers[:cut], layers[cut:]] if cut < len(layers) else [layers]
    config = {
        "max_model_len": rng.choice([1, 7, 16, 64, 300]),
        "batched": rng.choice([8, 512, 2048]),
        "hybrid_off": rng.random() < 0.2,
        "override": rng.choice([None, None, None, 3]),
        "dcp": 1,
        "pcp": 1,
    }
    # A block of every layer at the largest page: most budgets hold a request, some do not.
    unit = 2 * 16 * 4 * 64 * 4 * len(layers)
    memory = [rng.choice([0, unit // 3] + [unit * rng.randint(8, 400) + rng.randint(0, unit)] * 8)
              for _ in workers]
    op = rng.choice(["configs"] * 6 + ["estimate", "usage", "uniform", "groups"])
    if op in ("configs", "groups"):
        memory = memory if op == "configs" else memory[:1]
    else:
        workers = workers[:1]
    return {"op": op, "config": config, "workers": workers, "memory": memory}


def _fixed_cases() -> list[dict[str, Any]]:
    """vLLM's own test scenarios, and each spec kind's request size with context parallelism."""
    f = ["full", 16, 2, 64, "float32", None]
    s = ["sliding", 16, 2, 64, "float32", 1]
    base = {"max_model_len": 16, "batched": 2048, "hybrid_off": False, "override": None,
            "dcp": 1, "pcp": 1}
    page = 16 * 2 * 64 * 4 * 2
    cases: list[dict[str, Any]] = []

    def add(op: str, workers: list[list[Any]], memory: list[int], **config: Any) -> None:
        cases.append({"op": op, "config": base | config, "workers": workers, "memory": memory})

    add("configs", [[["a", f], ["b", f]]], [page * 64])
    add("configs", [[["a", f], ["b", s]]], [page * 64], hybrid_off=True)
    add("configs", [[["a", f], ["b", s]]], [page * 64])
    add("configs", [[[f"f{i}", f] for i in range(3)] + [[f"s{i}", s] for i in range(7)]],
        [page * 96])
    add("configs", [[[f"f{i}", f] for i in range(6)] + [[f"s{i}", s] for i in range(5)]],
        [page * 192])
    add("configs", [[["a", ["full", 16, 2, 128, "float32", None]], ["b", f]]], [page * 96])
    add("configs", [[["a", f], ["b", ["sliding", 16, 2, 32, "float32", 1]]]], [page * 32])
    add("configs", [[["a", f], ["b", ["sliding", 16, 2, 96, "float32", 1]]]], [page * 64])
    add("configs", [[["a", f], ["b", f]]], [page * 64], override=16)
    add("configs", [[]], [0])
    add("configs", [[["a", f]], [["a", s]]], [page * 20] * 2)
    add("configs", [[["a", f], ["b", f]], [["c", s], ["d", s]]], [page * 20] * 2)
    seven_b = [[f"l{i}", ["full", 16, 32, 128, "float16", None]] for i in range(32)]
    for model_len in (16383, 16385):
        add("estimate", [seven_b], [8 * GIB], max_model_len=model_len, batched=32768)
    kinds = [f, s, ["chunked", 16, 2, 64, "float32", 8], ["mla", 16, 1, 64, "float32", None],
             ["cross", 16, 2, 64, "float32", None], ["encoder_only", 16, 2, 64, "float32", None],
             ["mamba", 4, 0, 0, "float32", [[[2, 4], [3]], None]]]
    for desc in kinds:
        for dcp, pcp in ((1, 1), (2, 1), (1, 3)):
            add("usage", [[["x", desc]]], [0], max_model_len=50, batched=8, dcp=dcp, pcp=pcp)
    return cases


def test_planning_matches_vllm_0_13_when_installed() -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip("no .venv-vllm-0.13.0 (make vllm-env VLLM=0.13.0 builds it)")
    rng = random.Random(2013)
    cases = _fixed_cases() + [_random_case(rng) for _ in range(300)]
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", KVSPEC_PURE_PYTHON="1")
    proc = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_SIDE], input=json.dumps(cases),
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["checked"] == len(cases)
    assert 0 < report["vllm_errors"] < len(cases) // 2  # refusals are compared too
    assert report["num_mismatches"] == 0, json.dumps(report["mismatches"], indent=1)[:6000]


# --- the same arithmetic as ``kvspec plan`` -------------------------------------------------


@pytest.mark.parametrize("name", list_models())
def test_planning_a_shipped_model_gives_the_plan_commands_config(name: str) -> None:
    """vLLM's planning functions, given each layer's spec, build the config ``kvspec plan``
    computes from the model's groups."""
    layout = get_layout(name)
    # The length only decides whether one request fits (Llama 4 Scout's 10M tokens do not).
    config = vllm_config(max_model_len=min(layout.max_model_len, 32768))
    ours = one_worker_config(config, to_kv_cache_specs(layout), 80 * GIB)
    assert ours == to_kv_cache_config(layout, memory_bytes=80 * GIB)


def one_worker_config(config: Any, specs: dict[str, Any], memory: int) -> Any:
    return get_kv_cache_configs(config, [specs], [memory])[0]
