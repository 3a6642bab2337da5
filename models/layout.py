"""KV-cache layouts of real models, as data.

A layout lists the layers that keep a KV cache (or a Mamba state), in the order vLLM registers
them, with each layer's kind and shape. Every number comes from a named *figure* whose
``source`` says where it was read: ``"config.json: <field>"`` (the model's published
config.json), ``"derived: ..."`` (computed from other figures; the loader checks the
arithmetic), ``"vLLM..."`` / ``"transformers ..."`` (a library default), or
``"unverified: ..."`` when it could not be confirmed.

The layouts ship as JSON files in ``models/data/``; ``get_layout`` and ``list_models`` read them.
``layout_from_dict`` builds a layout from the same structure (for tests and custom layouts).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

__all__ = [
    "ATTENTION_KINDS",
    "DTYPE_BYTES",
    "LAYER_KINDS",
    "Figure",
    "InvalidLayout",
    "LayerKind",
    "LayerLayout",
    "ModelLayout",
    "UnknownModelError",
    "all_layouts",
    "get_layout",
    "layout_from_dict",
    "list_models",
]

LayerKind = Literal["full", "sliding_window", "chunked_local", "mamba", "cross_attention", "mla"]
LAYER_KINDS: tuple[LayerKind, ...] = (
    "full",
    "sliding_window",
    "chunked_local",
    "mamba",
    "cross_attention",
    "mla",
)
ATTENTION_KINDS: frozenset[str] = frozenset(LAYER_KINDS) - {"mamba"}

# Bytes per element, by the canonical dtype names impl.kv_cache_interface uses.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


class InvalidLayout(ValueError):
    """A layout (or its data file) is malformed, or uses a shape the planner does not model."""


class UnknownModelError(LookupError):
    """No layout has the requested name."""


@dataclass(frozen=True)
class Figure:
    """One number (or dtype name) of a model's config, and where it comes from."""

    name: str
    value: int | str
    source: str

    @property
    def verified(self) -> bool:
        return not self.source.startswith("unverified")


@dataclass(frozen=True)
class LayerLayout:
    """One layer that keeps per-request KV-cache (or state) memory.

    Attention kinds use ``num_kv_heads``, ``head_size`` and ``dtype``; ``sliding_window`` and
    ``attention_chunk_size`` belong to their kinds. ``mla`` stores one latent vector of
    ``head_size`` per token (``num_kv_heads`` is 1). ``mamba`` uses ``mamba_shapes`` and
    ``mamba_dtypes`` (one entry per state tensor) instead.
    """

    name: str
    kind: LayerKind
    dtype: str
    num_kv_heads: int = 0
    head_size: int = 0
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    mamba_shapes: tuple[tuple[int, ...], ...] = ()
    mamba_dtypes: tuple[str, ...] = ()
    mamba_type: str | None = None

    def __post_init__(self) -> None:
        where = f"layer {self.name!r}"
        if self.kind not in LAYER_KINDS:
            raise InvalidLayout(f"{where}: unknown kind {self.kind!r}; known: {LAYER_KINDS}")
        if self.dtype not in DTYPE_BYTES:
            raise InvalidLayout(
                f"{where}: unknown dtype {self.dtype!r}; known: {sorted(DTYPE_BYTES)}"
            )
        if self.kind == "mamba":
            if not self.mamba_shapes or len(self.mamba_shapes) != len(self.mamba_dtypes):
                raise InvalidLayout(
                    f"{where}: a mamba layer needs as many state shapes as dtypes, got "
                    f"{self.mamba_shapes!r} and {self.mamba_dtypes!r}"
                )
            for shape in self.mamba_shapes:
                if not shape or any(type(d) is not int or d <= 0 for d in shape):
                    raise InvalidLayout(f"{where}: bad mamba state shape {shape!r}")
            for dtype in self.mamba_dtypes:
                if dtype not in DTYPE_BYTES:
                    raise InvalidLayout(f"{where}: unknown mamba state dtype {dtype!r}")
            return
        for field_name in ("num_kv_heads", "head_size"):
            value = getattr(self, field_name)
            if type(value) is not int or value <= 0:
                raise InvalidLayout(f"{where}: {field_name} must be a positive int, got {value!r}")
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise InvalidLayout(
                f"{where}: an mla layer caches one latent head, not {self.num_kv_heads}"
            )
        for field_name, owner_kind in (
            ("sliding_window", "sliding_window"),
            ("attention_chunk_size", "chunked_local"),
        ):
            value = getattr(self, field_name)
            if self.kind == owner_kind:
                if type(value) is not int or value <= 0:
                    raise InvalidLayout(
                        f"{where}: {field_name} must be a positive int, got {value!r}"
                    )
            elif value is not None:
                raise InvalidLayout(f"{where}: a {self.kind} layer has no {field_name}")

    @property
    def is_attention(self) -> bool:
        return self.kind in ATTENTION_KINDS

    @property
    def bytes_per_token(self) -> int:
        """KV-cache bytes one token takes in this layer (attention kinds only)."""
        if not self.is_attention:
            raise InvalidLayout(f"layer {self.name!r} is a {self.kind} layer: no per-token size")
        per_vector = self.num_kv_heads * self.head_size * DTYPE_BYTES[self.dtype]
        return per_vector if self.kind == "mla" else 2 * per_vector  # K and V

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's recurrent state (mamba only)."""
        if self.kind != "mamba":
            raise InvalidLayout(f"layer {self.name!r} is a {self.kind} layer: no state")
        total = 0
        for shape, dtype in zip(self.mamba_shapes, self.mamba_dtypes, strict=True):
            elements = 1
            for size in shape:
                elements *= size
            total += elements * DTYPE_BYTES[dtype]
        return total


@dataclass(frozen=True)
class ModelLayout:
    """A model's KV-cache layout: its layers in vLLM's registration order, and their sources."""

    name: str
    hf_repo: str
    config_url: str
    architecture: str
    max_model_len: int
    layers: tuple[LayerLayout, ...]
    figures: tuple[Figure, ...]
    max_encoder_len: int | None = None
    aliases: tuple[str, ...] = ()
    checked_against: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            raise InvalidLayout(f"model {self.name!r} has no KV-cache layers")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            duplicate = next(n for n in names if names.count(n) > 1)
            raise InvalidLayout(f"model {self.name!r} names layer {duplicate!r} twice")
        if type(self.max_model_len) is not int or self.max_model_len <= 0:
            raise InvalidLayout(
                f"model {self.name!r}: max_model_len must be a positive int, "
                f"got {self.max_model_len!r}"
            )
        if any(layer.kind == "cross_attention" for layer in self.layers) and (
            type(self.max_encoder_len) is not int or self.max_encoder_len <= 0
        ):
            raise InvalidLayout(
                f"model {self.name!r} has cross-attention layers but max_encoder_len "
                f"{self.max_encoder_len!r}"
            )

    def figure(self, name: str) -> Figure:
        for figure in self.figures:
            if figure.name == name:
                return figure
        raise LookupError(f"model {self.name!r} has no figure {name!r}")

    @property
    def unverified_figures(self) -> tuple[Figure, ...]:
        return tuple(f for f in self.figures if not f.verified)

    def kind_counts(self) -> dict[str, int]:
        """Number of layers of each kind, in order of first appearance."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.kind] = counts.get(layer.kind, 0) + 1
        return counts


# --- building a layout from its data -------------------------------------------------------


def _evaluate(expression: str, values: Mapping[str, int | str], where: str) -> int:
    """Value of ``"a"`` or ``"a <op> b"`` (op one of + - * /) over figure names and ints."""
    tokens = expression.split()

    def operand(token: str) -> int:
        if token.lstrip("-").isdigit():
            return int(token)
        value = values.get(token)
        if type(value) is not int:
            raise InvalidLayout(f"{where}: {token!r} in {expression!r} is not a numeric figure")
        return value

    if len(tokens) == 1:
        return operand(tokens[0])
    if len(tokens) != 3 or tokens[1] not in {"+", "-", "*", "/"}:
        raise InvalidLayout(f"{where}: cannot evaluate {expression!r} (want 'a op b')")
    left, op, right = operand(tokens[0]), tokens[1], operand(tokens[2])
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    if right == 0 or left % right:
        raise InvalidLayout(f"{where}: {expression!r} is not an exact division")
    return left // right


def _figures(data: Mapping[str, Any], where: str) -> tuple[Figure, ...]:
    raw = data.get("figures")
    if not isinstance(raw, Mapping) or not raw:
        raise InvalidLayout(f"{where}: 'figures' must be a non-empty object")
    figures: list[Figure] = []
    values: dict[str, int | str] = {}
    for name, entry in raw.items():
        if not isinstance(entry, Mapping) or "value" not in entry or "source" not in entry:
            raise InvalidLayout(f"{where}: figure {name!r} needs a 'value' and a 'source'")
        value, source = entry["value"], entry["source"]
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise InvalidLayout(f"{where}: figure {name!r} has value {value!r}")
        if isinstance(value, int) and value <= 0:
            raise InvalidLayout(f"{where}: figure {name!r} must be positive, got {value!r}")
        if not isinstance(source, str) or not source.strip():
            raise InvalidLayout(f"{where}: figure {name!r} has no source")
        values[name] = value
        figures.append(Figure(name, value, source))
    for name, entry in raw.items():
        formula = entry.get("derive")
        if formula is not None:
            expected = _evaluate(str(formula), values, f"{where}: figure {name!r}")
            if values[name] != expected:
                raise InvalidLayout(
                    f"{where}: figure {name!r} is {values[name]!r} but {formula} = {expected}"
                )
    return tuple(figures)


def _ref(entry: Mapping[str, Any], key: str, values: Mapping[str, int | str], where: str) -> Any:
    ref = entry.get(key)
    if ref is None:
        return None
    if not isinstance(ref, str) or ref not in values:
        raise InvalidLayout(f"{where}: {key} must name a figure, got {ref!r}")
    return values[ref]


def _int_ref(
    entry: Mapping[str, Any], key: str, values: Mapping[str, int | str], where: str
) -> Any:
    value = _ref(entry, key, values, where)
    if value is not None and type(value) is not int:
        raise InvalidLayout(f"{where}: {key} names a figure that is not a number: {value!r}")
    return value


def _matches(where_clause: Any, index: int, values: Mapping[str, int | str], where: str) -> bool:
    """Whether block ``index`` has this layer. ``{"period": p, "at": [r...]}`` selects blocks
    with ``index % p`` in the residues (negative ones count from ``p``); ``"not_at"`` the rest."""
    if where_clause is None:
        return True
    if not isinstance(where_clause, Mapping) or "period" not in where_clause:
        raise InvalidLayout(f"{where}: 'where' needs a 'period', got {where_clause!r}")
    period = _evaluate(str(where_clause["period"]), values, where)
    if period <= 0:
        raise InvalidLayout(f"{where}: period must be positive, got {period}")
    selecting = "at" in where_clause
    residues_raw = where_clause.get("at" if selecting else "not_at")
    if not isinstance(residues_raw, Sequence) or isinstance(residues_raw, str):
        raise InvalidLayout(f"{where}: 'where' needs a list 'at' or 'not_at'")
    residues = {_evaluate(str(r), values, where) % period for r in residues_raw}
    return (index % period in residues) == selecting


def layout_from_dict(data: Mapping[str, Any], origin: str = "<dict>") -> ModelLayout:
    """Build a ``ModelLayout`` from the structure of a ``models/data/*.json`` file.

    Every layer field that is a number or a dtype names a figure. ``layers`` entries are
    expanded for each block ``i`` in ``range(figures[blocks])`` in order, ``{i}`` in the name
    replaced by the block index; an entry with a ``where`` clause applies to some blocks only.
    """
    name = data.get("name")
    where = f"{origin} ({name!r})"
    if not isinstance(name, str) or not name:
        raise InvalidLayout(f"{origin}: a layout needs a 'name'")
    figures = _figures(data, where)
    values = {figure.name: figure.value for figure in figures}
    num_blocks = _evaluate(str(data.get("blocks", "")), values, f"{where}: blocks")
    entries = data.get("layers")
    if not isinstance(entries, Sequence) or not entries:
        raise InvalidLayout(f"{where}: 'layers' must be a non-empty list")
    layers: list[LayerLayout] = []
    for block in range(num_blocks):
        for position, entry in enumerate(entries):
            entry_where = f"{where}: layers[{position}]"
            if not isinstance(entry, Mapping):
                raise InvalidLayout(f"{entry_where} must be an object")
            if not _matches(entry.get("where"), block, values, entry_where):
                continue
            shapes_raw = entry.get("mamba_shapes", ())
            dtypes_raw = entry.get("mamba_dtypes", ())
            try:
                shapes = tuple(
                    tuple(_evaluate(str(dim), values, entry_where) for dim in shape)
                    for shape in shapes_raw
                )
                state_dtypes = tuple(str(values[ref]) for ref in dtypes_raw)
            except (KeyError, TypeError) as error:
                raise InvalidLayout(f"{entry_where}: bad mamba state reference: {error}") from None
            dtype_ref = entry.get("dtype")
            dtype = state_dtypes[0] if dtype_ref is None and state_dtypes else None
            if dtype is None:
                dtype = _ref(entry, "dtype", values, entry_where)
            layers.append(
                LayerLayout(
                    name=str(entry.get("name", "")).format(i=block),
                    kind=entry.get("kind"),  # type: ignore[arg-type]  # checked by LayerLayout
                    dtype=str(dtype),
                    num_kv_heads=_int_ref(entry, "num_kv_heads", values, entry_where) or 0,
                    head_size=_int_ref(entry, "head_size", values, entry_where) or 0,
                    sliding_window=_int_ref(entry, "sliding_window", values, entry_where),
                    attention_chunk_size=_int_ref(
                        entry, "attention_chunk_size", values, entry_where
                    ),
                    mamba_shapes=shapes,
                    mamba_dtypes=state_dtypes,
                    mamba_type=entry.get("mamba_type"),
                )
            )
    encoder_ref = data.get("max_encoder_len")
    return ModelLayout(
        name=name,
        hf_repo=str(data.get("hf_repo", "")),
        config_url=str(data.get("config_url", "")),
        architecture=str(data.get("architecture", "")),
        max_model_len=_evaluate(
            str(data.get("max_model_len", "")), values, f"{where}: max_model_len"
        ),
        layers=tuple(layers),
        figures=figures,
        max_encoder_len=(
            None
            if encoder_ref is None
            else _evaluate(str(encoder_ref), values, f"{where}: max_encoder_len")
        ),
        aliases=tuple(str(a) for a in data.get("aliases", ())),
        checked_against=tuple(str(c) for c in data.get("checked_against", ())),
        notes=tuple(str(n) for n in data.get("notes", ())),
    )


# --- the shipped layouts -------------------------------------------------------------------


@cache
def _shipped() -> tuple[ModelLayout, ...]:
    data_dir = resources.files(__package__ or "models").joinpath("data")
    loaded: list[tuple[int, ModelLayout]] = []
    for item in data_dir.iterdir():
        if not item.name.endswith(".json"):
            continue
        try:
            data = json.loads(item.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise InvalidLayout(f"models/data/{item.name}: not valid JSON: {error}") from None
        order = data.get("order", 1_000_000)
        loaded.append((order, layout_from_dict(data, f"models/data/{item.name}")))
    loaded.sort(key=lambda pair: (pair[0], pair[1].name))
    return tuple(layout for _, layout in loaded)


def all_layouts() -> tuple[ModelLayout, ...]:
    """Every shipped layout, in a fixed order."""
    return _shipped()


def list_models() -> tuple[str, ...]:
    """Names of the shipped layouts, in a fixed order."""
    return tuple(layout.name for layout in _shipped())


def _key(name: str) -> str:
    return name.strip().casefold()


def get_layout(name: str) -> ModelLayout:
    """The shipped layout called ``name`` (case-insensitive; aliases and the Hugging Face repo
    id, with or without its owner, work too). Raises ``UnknownModelError`` otherwise."""
    if not isinstance(name, str):
        raise UnknownModelError(f"model name must be a string, got {name!r}")
    wanted = _key(name)
    for layout in _shipped():
        keys = {layout.name, layout.hf_repo, layout.hf_repo.rsplit("/", 1)[-1], *layout.aliases}
        if wanted in {_key(k) for k in keys if k}:
            return layout
    raise UnknownModelError(
        f"unknown model {name!r}; known models: {', '.join(list_models())}"
    )
