"""models/: the shipped layouts, vLLM 0.13's grouping and page-size arithmetic, the bridge to
impl's KVCacheConfig, and the ``plan`` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, strategies as st

from kvspec import cli, models
from kvspec.impl.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kvspec.models import plan_report
from kvspec.models.bridge import to_kv_cache_config
from kvspec.models.layout import (
    InvalidLayout,
    ModelLayout,
    UnknownModelError,
    get_layout,
    layout_from_dict,
    list_models,
)
from kvspec.models.plan import (
    InvalidMemorySize,
    InvalidPlanArgument,
    kv_cache_groups,
    max_context_tokens,
    parse_memory,
    plan_memory,
)

GIB = 1024**3
REQUIRED = {
    "Llama-3.1-8B",
    "Llama-3.1-70B",
    "Qwen3-8B",
    "Mistral-7B-v0.1",
    "Gemma-3-27B",
    "Llama-4-Scout",
    "Jamba-v0.1",
    "Whisper-large-v3",
    "DeepSeek-V3",
}
SOURCE_PREFIXES = ("config.json: ", "derived: ", "vLLM", "transformers ", "unverified: ")
IMPL_SPEC_OF_KIND: dict[str, type] = {
    "full": FullAttentionSpec,
    "sliding_window": SlidingWindowSpec,
    "chunked_local": ChunkedLocalAttentionSpec,
    "mla": MLAAttentionSpec,
    "cross_attention": CrossAttentionSpec,
    "mamba": MambaSpec,
}
ALL = list_models()


def test_every_required_model_ships() -> None:
    assert set(ALL) >= REQUIRED
    assert len(ALL) == len(set(ALL))


@pytest.mark.parametrize("name", ALL)
def test_layout_figures_are_sourced_and_positive(name: str) -> None:
    layout = get_layout(name)
    assert layout.config_url == f"https://huggingface.co/{layout.hf_repo}/blob/main/config.json"
    assert layout.checked_against, "say which copies of the config were read"
    for figure in layout.figures:
        assert figure.source.startswith(SOURCE_PREFIXES), figure
        if isinstance(figure.value, int):
            assert figure.value > 0, figure
    for layer in layout.layers:
        if layer.is_attention:
            assert layer.num_kv_heads > 0 and layer.head_size > 0
            assert layer.bytes_per_token > 0
        else:
            assert layer.state_bytes > 0


@pytest.mark.parametrize("name", ALL)
def test_layout_figures_are_consistent(name: str) -> None:
    layout = get_layout(name)
    values = {f.name: f.value for f in layout.figures}
    heads, kv_heads = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int):
        assert heads % kv_heads == 0, "query heads are shared evenly among KV heads"
    for layer in layout.layers:
        if layer.sliding_window is not None:
            assert layer.sliding_window < layout.max_model_len
        if layer.attention_chunk_size is not None:
            assert layer.attention_chunk_size < layout.max_model_len
    blocks = next(v for k, v in values.items() if k in ("num_hidden_layers", "decoder_layers"))
    assert isinstance(blocks, int)
    per_block = 2 if name == "Whisper-large-v3" else 1
    assert len(layout.layers) == blocks * per_block


@pytest.mark.parametrize(
    ("name", "kinds"),
    [
        ("Llama-3.1-8B", {"full": 32}),
        ("Llama-3.1-70B", {"full": 80}),
        ("Qwen3-8B", {"full": 36}),
        ("Mistral-7B-v0.1", {"sliding_window": 32}),
        ("Gemma-3-27B", {"sliding_window": 52, "full": 10}),
        ("Llama-4-Scout", {"chunked_local": 36, "full": 12}),
        ("Jamba-v0.1", {"mamba": 28, "full": 4}),
        ("Whisper-large-v3", {"full": 32, "cross_attention": 32}),
        ("DeepSeek-V3", {"mla": 61}),
    ],
)
def test_layer_kinds(name: str, kinds: dict[str, int]) -> None:
    assert get_layout(name).kind_counts() == kinds


def test_interleaving_patterns() -> None:
    gemma = get_layout("Gemma-3-27B")
    assert [i for i, layer in enumerate(gemma.layers) if layer.kind == "full"] == list(
        range(5, 62, 6)
    )
    assert {layer.sliding_window for layer in gemma.layers if layer.kind != "full"} == {1024}
    scout = get_layout("Llama-4-Scout")
    assert [i for i, layer in enumerate(scout.layers) if layer.kind == "full"] == list(
        range(3, 48, 4)
    )
    jamba = get_layout("Jamba-v0.1")
    assert [i for i, layer in enumerate(jamba.layers) if layer.kind == "full"] == [4, 12, 20, 28]


def test_lookup_by_alias_repo_and_case() -> None:
    assert get_layout("llama-3.1-8b").name == "Llama-3.1-8B"
    assert get_layout("meta-llama/Llama-3.1-8B").name == "Llama-3.1-8B"
    assert get_layout("  GEMMA-3-27B-IT ").name == "Gemma-3-27B"


def test_unknown_model_is_a_lookup_error_naming_it() -> None:
    with pytest.raises(UnknownModelError, match="'gpt-zero'") as info:
        get_layout("gpt-zero")
    assert isinstance(info.value, LookupError)
    assert "Llama-3.1-8B" in str(info.value)


# --- page sizes and block counts, by hand ------------------------------------------------


def test_llama_3_1_8b_page_size_by_hand() -> None:
    groups = kv_cache_groups(get_layout("Llama-3.1-8B"), 16)
    assert len(groups.groups) == 1 and groups.groups[0].spec.kind == "full"
    assert groups.page_size_bytes == 16 * 8 * 128 * 2 * 2
    assert groups.bytes_per_block == 16 * 8 * 128 * 2 * 2 * 32 == 2 * 1024**2
    plan = plan_memory(get_layout("Llama-3.1-8B"), memory_bytes=80 * GIB)
    assert plan.num_blocks == 80 * GIB // (2 * 1024**2) == 40960
    assert plan.pool_tokens == 40959 * 16
    assert plan.max_context_tokens == 131072 and plan.context_limited_by == "model"
    assert plan.blocks_per_max_request == 131072 // 16


def test_deepseek_v3_mla_page_size_by_hand() -> None:
    groups = kv_cache_groups(get_layout("DeepSeek-V3"), 64)
    spec = groups.groups[0].spec
    assert spec.kind == "mla" and spec.num_kv_heads == 1 and spec.head_size == 512 + 64
    assert groups.page_size_bytes == 64 * 576 * 2  # one latent vector per token: no K/V pair
    assert groups.bytes_per_block == 64 * 576 * 2 * 61
    assert plan_memory(get_layout("DeepSeek-V3"), memory_bytes=80 * GIB).num_blocks == (
        80 * GIB // (16 * 576 * 2 * 61)
    )


def test_jamba_mamba_hybrid_page_size_by_hand() -> None:
    groups = kv_cache_groups(get_layout("Jamba-v0.1"), 16)
    state = (3 * 8192 + 8192 * 16) * 2  # conv (d_conv-1, d_inner) + SSM (d_inner, d_state), bf16
    assert state == 311_296
    attention_per_token = 2 * 8 * 128 * 2
    block_size = 16 * -(-state // (16 * attention_per_token))  # 16-token steps up to a state
    assert block_size == 80
    assert groups.page_size_bytes == 80 * attention_per_token == 327_680
    kinds = [g.spec.kind for g in groups.groups]
    assert kinds == ["mamba"] * 7 + ["full"]
    for g in groups.groups:
        assert len(g.layer_names) == 4
        assert g.spec.block_size == 80
        assert g.spec.page_size_bytes == 327_680
    assert groups.groups[0].spec.real_page_size_bytes == state
    assert groups.bytes_per_block == 4 * 327_680
    plan = plan_memory(get_layout("Jamba-v0.1"), memory_bytes=80 * GIB)
    assert plan.num_blocks == 80 * GIB // (4 * 327_680) == 65536
    # a full-length request: one attention block per 80 tokens, one block per Mamba group
    assert plan.blocks_per_max_request == -(-262144 // 80) + 7
    # a larger requested block size is kept
    assert kv_cache_groups(get_layout("Jamba-v0.1"), 96).groups[-1].spec.block_size == 96


def test_gemma_groups_follow_vllm_bucketing() -> None:
    layout = get_layout("Gemma-3-27B")
    groups = kv_cache_groups(layout, 16)
    assert [len(g.layer_names) for g in groups.groups] == [9, 9, 9, 9, 8, 8, 10]
    assert groups.layers_per_block == 10 and groups.padding_layers == 8
    sliding = [layer.name for layer in layout.layers if layer.kind == "sliding_window"]
    for k, g in enumerate(groups.groups[:6]):
        assert g.layer_names == tuple(sliding[k::6])  # strided, as vLLM splits a bucket
    assert groups.bytes_per_block == 16 * 16 * 128 * 2 * 2 * 10


def test_whisper_groups_self_and_cross_attention() -> None:
    groups = kv_cache_groups(get_layout("Whisper-large-v3"), 16)
    assert [(g.spec.kind, len(g.layer_names)) for g in groups.groups] == [
        ("full", 32),
        ("cross_attention", 32),
    ]
    assert groups.page_size_bytes == 16 * 20 * 64 * 2 * 2
    # 448 decoder tokens and the 1500 encoder tokens the cross-attention caches
    assert groups.blocks_per_request(448, 8192, 1500) == 28 + 94


def test_scout_groups_and_memory_limited_context() -> None:
    plan = plan_memory(get_layout("Llama-4-Scout"), memory_bytes=80 * GIB)
    kinds = [g.spec.kind for g in plan.groups.groups]
    assert kinds == ["chunked_local"] * 3 + ["full"]
    assert plan.groups.bytes_per_block == 65536 * 12
    assert plan.num_blocks == 80 * GIB // (65536 * 12)
    chunked_blocks = 3 * (8192 + 8192) // 16
    assert plan.max_context_tokens == (plan.usable_blocks - chunked_blocks) * 16
    assert plan.context_limited_by == "memory"


def test_unequal_pages_are_unified_by_block_size() -> None:
    data = _tiny_layout()
    data["figures"]["local_heads"] = {"value": 2, "source": "config.json: local_heads"}
    data["layers"][0]["num_kv_heads"] = "local_heads"  # the sliding layers get a smaller page
    groups = kv_cache_groups(layout_from_dict(data), 4)
    sliding = [g for g in groups.groups if g.spec.kind == "sliding_window"]
    assert sliding and all(g.spec.block_size == 8 for g in sliding)
    assert len({g.spec.page_size_bytes for g in groups.groups}) == 1
    assert groups.adjustments


# --- planning every model ------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_plan_every_model_at_80_gib(name: str) -> None:
    plan = plan_memory(get_layout(name), memory_bytes=80 * GIB)
    assert plan.num_blocks * plan.groups.bytes_per_block <= 80 * GIB
    assert (plan.num_blocks + 1) * plan.groups.bytes_per_block > 80 * GIB
    assert 0 < plan.max_context_tokens <= plan.max_model_len
    assert plan.max_concurrency > 0
    text = plan_report.render_plan(plan)
    assert name in text and "KV-cache groups" in text
    json.dumps(plan_report.plan_to_dict(plan))


@pytest.mark.parametrize("name", ALL)
def test_bridge_builds_impl_config(name: str) -> None:
    layout = get_layout(name)
    groups = kv_cache_groups(layout, 16)
    config = to_kv_cache_config(layout, memory_bytes=80 * GIB)
    assert config.num_blocks == plan_memory(layout, memory_bytes=80 * GIB).num_blocks
    assert len(config.kv_cache_groups) == len(groups.groups)
    for ours, theirs in zip(groups.groups, config.kv_cache_groups, strict=True):
        assert type(theirs.kv_cache_spec) is IMPL_SPEC_OF_KIND[ours.spec.kind]
        assert theirs.kv_cache_spec.page_size_bytes == ours.spec.page_size_bytes
        assert theirs.kv_cache_spec.block_size == ours.spec.block_size
        assert theirs.layer_names == ours.layer_names
    every_layer = sorted(layer.name for layer in layout.layers)
    grouped = sorted(n for g in config.kv_cache_groups for n in g.layer_names)
    shared = sorted(n for t in config.kv_cache_tensors for n in t.shared_by)
    assert grouped == shared == every_layer
    assert sum(t.size for t in config.kv_cache_tensors) <= 80 * GIB
    assert len(config.kv_cache_tensors) == groups.layers_per_block


def test_bridge_by_block_count_and_bad_arguments() -> None:
    layout = get_layout("Mistral-7B-v0.1")
    config = to_kv_cache_config(layout, num_blocks=12, block_size=4)
    spec = config.kv_cache_groups[0].kv_cache_spec
    assert isinstance(spec, SlidingWindowSpec) and spec.sliding_window == 4096
    assert config.num_blocks == 12 and config.kv_cache_tensors[0].size == 12 * spec.page_size_bytes
    assert models.to_kv_cache_config is to_kv_cache_config
    with pytest.raises(InvalidPlanArgument):
        to_kv_cache_config(layout)
    with pytest.raises(InvalidPlanArgument):
        to_kv_cache_config(layout, memory_bytes=GIB, num_blocks=3)
    with pytest.raises(InvalidPlanArgument, match="num_blocks"):
        to_kv_cache_config(layout, num_blocks=0)
    with pytest.raises(InvalidPlanArgument, match="holds no block"):
        to_kv_cache_config(layout, memory_bytes=1024)
    with pytest.raises(InvalidPlanArgument, match="block_size"):
        to_kv_cache_config(layout, num_blocks=4, block_size=0)


def test_plan_arguments_are_checked() -> None:
    layout = get_layout("Qwen3-8B")
    with pytest.raises(InvalidPlanArgument, match="exactly one"):
        plan_memory(layout)
    with pytest.raises(InvalidPlanArgument, match="block_size"):
        plan_memory(layout, num_blocks=10, block_size=-16)
    with pytest.raises(InvalidPlanArgument, match="max_num_batched_tokens"):
        plan_memory(layout, num_blocks=10, max_num_batched_tokens=0)
    small = plan_memory(layout, num_blocks=11)  # 10 usable blocks of 16 tokens
    assert small.max_context_tokens == 160 and small.context_limited_by == "memory"
    assert plan_memory(layout, num_blocks=1).max_context_tokens == 0


@given(
    name=st.sampled_from(ALL),
    usable=st.integers(min_value=0, max_value=5000),
    batched=st.sampled_from([512, 2048, 8192]),
)
def test_max_context_is_the_longest_request_that_fits(name: str, usable: int, batched: int) -> None:
    layout = get_layout(name)
    groups = kv_cache_groups(layout, 16)
    encoder = layout.max_encoder_len or 0
    found = max_context_tokens(groups, usable, layout.max_model_len, batched, encoder)

    def fits(n: int) -> bool:
        return groups.blocks_per_request(n, batched, encoder) <= usable

    event("fits nothing" if found == 0 else "model-limited" if found == layout.max_model_len
          else "memory-limited")
    if found == 0:
        assert not fits(1)
    else:
        assert fits(found)
        assert found == layout.max_model_len or not fits(found + 1)


# --- memory strings ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * GIB),
        ("80 GiB", 80 * GIB),
        ("80G", 80 * GIB),
        ("80gb", 80 * 10**9),
        ("1.5TiB", 3 * 1024**4 // 2),
        ("0.1GiB", GIB // 10),
        ("512MiB", 512 * 1024**2),
        ("123456", 123456),
        ("7B", 7),
    ],
)
def test_parse_memory(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "0GiB", "80 GiBs", "eighty", "1e9", "80PiB"])
def test_parse_memory_rejects(text: str) -> None:
    with pytest.raises(InvalidMemorySize, match="memory size"):
        parse_memory(text)


# --- malformed data ------------------------------------------------------------------------


def _tiny_layout() -> dict[str, Any]:
    return {
        "name": "Tiny",
        "figures": {
            "layers": {"value": 4, "source": "config.json: layers"},
            "heads": {"value": 4, "source": "config.json: heads"},
            "head": {"value": 8, "source": "config.json: head"},
            "window": {"value": 16, "source": "config.json: window"},
            "period": {"value": 2, "source": "config.json: period"},
            "max_len": {"value": 256, "source": "config.json: max_len"},
            "dtype": {"value": "float16", "source": "config.json: torch_dtype"},
        },
        "blocks": "layers",
        "max_model_len": "max_len",
        "layers": [
            {"name": "l{i}", "kind": "sliding_window", "where": {"period": "period", "at": [0]},
             "num_kv_heads": "heads", "head_size": "head", "dtype": "dtype",
             "sliding_window": "window"},
            {"name": "l{i}", "kind": "full", "where": {"period": "period", "not_at": [0]},
             "num_kv_heads": "heads", "head_size": "head", "dtype": "dtype"},
        ],
    }


def test_tiny_layout_builds() -> None:
    layout = layout_from_dict(_tiny_layout())
    assert isinstance(layout, ModelLayout)
    assert [layer.kind for layer in layout.layers] == ["sliding_window", "full"] * 2
    groups = kv_cache_groups(layout, 4)
    assert [g.spec.kind for g in groups.groups] == ["sliding_window", "full"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["figures"]["heads"].pop("source"), "'heads'"),
        (lambda d: d["figures"]["heads"].update(value=0), "'heads'"),
        (lambda d: d["figures"]["head"].update(derive="heads * heads"), "'head'"),
        (lambda d: d["layers"][1].update(num_kv_heads="nope"), "num_kv_heads"),
        (lambda d: d["layers"][1].update(kind="linear"), "'linear'"),
        (lambda d: d["layers"][0].pop("sliding_window"), "sliding_window"),
        (lambda d: d["layers"][1].update(where=None), "'l0'"),
        (lambda d: d["figures"]["dtype"].update(value="float12"), "'float12'"),
        (lambda d: d.pop("blocks"), "blocks"),
    ],
)
def test_malformed_layouts_are_rejected(mutate: Any, message: str) -> None:
    data = _tiny_layout()
    mutate(data)
    with pytest.raises(InvalidLayout, match=message):
        layout_from_dict(data)


# --- the command ---------------------------------------------------------------------------


def test_plan_command_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "Llama-3.1-8B", "--memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "40,960 blocks" in out and "2,097,152 B" in out and "131,072 tokens" in out
    assert cli.main(["plan", "jamba", "--memory", "80GiB", "--block-size", "16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "Jamba-v0.1" and data["num_blocks"] == 65536
    assert [g["kind"] for g in data["groups"]] == ["mamba"] * 7 + ["full"]
    assert cli.main(["plan", "Qwen3-8B", "--num-blocks", "11"]) == 0
    assert "160 tokens" in capsys.readouterr().out


def test_plan_command_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "gpt-zero", "--memory", "80GiB"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'gpt-zero'" in err and "DeepSeek-V3" in err
    assert cli.main(["plan", "Qwen3-8B", "--memory", "lots"]) == 2
    assert "'lots'" in capsys.readouterr().err
    assert cli.main(["plan", "Qwen3-8B", "--memory", "1GiB", "--block-size", "0"]) == 2
    assert "block_size" in capsys.readouterr().err
    assert cli.main(["plan", "Qwen3-8B"]) == 2  # neither --memory nor --num-blocks
    assert "one of the arguments --memory --num-blocks is required" in capsys.readouterr().err


def test_plan_command_takes_only_vllms_block_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM 0.13 takes ``--block-size`` from 1, 8, 16, 32, 64, 128, 256 (vllm/config/cache.py,
    ``BlockSize``); any other is a one-line usage error, exit status 2."""
    for size in plan_report.VLLM_BLOCK_SIZES:
        assert cli.main(["plan", "Qwen3-8B", "--num-blocks", "11", "--block-size", str(size)]) == 0
    capsys.readouterr()
    for refused in ("15", "2", "512", "17"):
        assert cli.main(["plan", "Llama-3.1-8B", "--memory", "80GiB", "--block-size", refused]) == 2
        captured = capsys.readouterr()
        lines = captured.err.splitlines()
        assert captured.out == "" and len(lines) == 1, captured
        assert lines[0].startswith("kvspec plan: error: --block-size") and repr(refused) in lines[0]


def test_plan_command_refuses_a_budget_that_holds_no_block(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """vLLM refuses a KV-cache budget with no room for a block; so does ``kvspec plan``, with
    one line naming the budget and what one block takes, and exit status 2 (not "0 blocks")."""
    assert cli.main(["plan", "Llama-3.1-8B", "--memory", "1KiB"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert "1 KiB (1,024 B) holds no block of Llama-3.1-8B" in captured.err
    assert "2,097,152 B" in captured.err  # one block: 64 KiB pages x 32 layers
    # One block's worth is a plan (the null block only), as --num-blocks 1 is.
    assert cli.main(["plan", "Llama-3.1-8B", "--memory", "2MiB"]) == 0
    assert "1 blocks (0 usable" in capsys.readouterr().out
    with pytest.raises(InvalidMemorySize, match="1,024 B"):
        plan_memory(get_layout("Llama-3.1-8B"), memory_bytes=1024)


def test_plan_runs_as_a_module() -> None:
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-m", "kvspec.cli", "plan", "DeepSeek-V3", "--memory", "80GiB",
         "--block-size", "64"],
        cwd=root, capture_output=True, text=True, check=False, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "DeepSeek-V3" in result.stdout and "mla(latent x 576" in result.stdout
