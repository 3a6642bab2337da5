"""A vLLM 0.13-compatible ``Request``: the parts the KV-cache manager reads.

The request keeps its token ids (prompt then output) and the hashes of its full blocks; each
``append_output_token_ids`` extends ``block_hashes`` with the blocks it completed, so
``len(block_hashes) == num_tokens // block_size`` always holds when a hasher is attached.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, SupportsIndex, TypeVar

from kvspec.impl.hashing import BlockHash

__all__ = [
    "ConstantList",
    "InvalidRequestError",
    "LoRARequest",
    "MultiModalFeatureSpec",
    "PlaceholderRange",
    "ReadOnlyListError",
    "Request",
    "RequestLike",
    "RequestStatus",
]

T = TypeVar("T")


class InvalidRequestError(ValueError):
    """A request built or extended with malformed input (ids, tokens, hasher)."""


class ReadOnlyListError(TypeError, ValueError):
    """An attempt to mutate a request's token list other than through the request."""


class ConstantList(list[T]):
    """A list the request owns: reading is a plain list's speed, mutating it raises.

    The request itself extends it through ``list``'s own methods.
    """

    __slots__ = ()

    def __reduce__(self) -> tuple[type[ConstantList[T]], tuple[list[T]]]:
        # copy and pickle would rebuild the list through append/extend, which refuse.
        return (type(self), (list(self),))

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise ReadOnlyListError("a request's token list is read-only; use the request's methods")

    def append(self, item: T, /) -> NoReturn:
        self._refuse(item)

    def extend(self, items: Iterable[T], /) -> NoReturn:
        self._refuse(items)

    def insert(self, index: SupportsIndex, item: T, /) -> NoReturn:
        self._refuse(index, item)

    def pop(self, index: SupportsIndex = -1, /) -> NoReturn:
        self._refuse(index)

    def remove(self, item: T, /) -> NoReturn:
        self._refuse(item)

    def clear(self) -> NoReturn:
        self._refuse()

    def sort(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse()

    def reverse(self) -> NoReturn:
        self._refuse()

    def __setitem__(self, index: Any, value: Any) -> NoReturn:
        self._refuse(index, value)

    def __delitem__(self, index: Any) -> NoReturn:
        self._refuse(index)

    def __iadd__(self, items: Iterable[T]) -> NoReturn:  # type: ignore[override, misc]
        self._refuse(items)

    def __imul__(self, count: SupportsIndex) -> NoReturn:
        self._refuse(count)


class RequestLike(Protocol):
    """What impl reads of a request: this module's ``Request`` or vLLM's own
    (``vllm.v1.request.Request``), which has the same fields; impl never checks the class."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_preemptions(self) -> int: ...

    @property
    def skip_reading_prefix_cache(self) -> bool: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def block_hashes(self) -> list[BlockHash]: ...

    @property
    def lora_request(self) -> Any: ...

    @property
    def mm_features(self) -> Any: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def prompt_embeds(self) -> Any: ...


class RequestStatus(enum.IntEnum):
    """Where a request is in its life (vLLM 0.13's names; finished states come last)."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """The LoRA adapter a request runs with; its name goes into block hashes."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


@dataclass(frozen=True, slots=True)
class PlaceholderRange:
    """Where a multimodal input's tokens sit in the prompt: ``[offset, offset + length)``."""

    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class MultiModalFeatureSpec:
    """One multimodal input: its content identifier (hashed into blocks) and position."""

    data: Any
    modality: str
    identifier: str
    mm_position: PlaceholderRange


def _is_token_list(values: object) -> bool:
    """Whether ``values`` is a list or tuple of ints.

    ``sum`` does the check in C, several times faster than a Python loop: it raises on
    non-numbers, and its result is an ``int`` only if every element is one (a float or a
    numpy scalar anywhere makes it a float or a numpy scalar).
    """
    if not isinstance(values, list | tuple):
        return False
    try:
        total = sum(values)
    except TypeError:
        return False
    return type(total) is int


class Request:
    """A request as the KV-cache manager sees it (vLLM 0.13 field names and meaning)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None,
        sampling_params: Any | None = None,
        pooling_params: Any | None = None,
        eos_token_id: int | None = None,
        client_index: int = 0,
        arrival_time: float | None = None,
        prompt_embeds: Any | None = None,
        mm_features: list[MultiModalFeatureSpec] | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        trace_headers: Any | None = None,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
    ) -> None:
        if not isinstance(request_id, str):
            raise InvalidRequestError(f"request_id must be a str, got {request_id!r}")
        if prompt_token_ids is None:
            if prompt_embeds is None:
                raise InvalidRequestError(
                    f"request {request_id!r} has neither prompt_token_ids nor prompt_embeds"
                )
            num_prompt_tokens = len(prompt_embeds)
            all_token_ids: ConstantList[int] = ConstantList([0] * num_prompt_tokens)
        else:
            if not _is_token_list(prompt_token_ids):
                raise InvalidRequestError(
                    f"prompt_token_ids of request {request_id!r} must be a list of ints, "
                    f"got {prompt_token_ids!r}"
                )
            num_prompt_tokens = len(prompt_token_ids)
            all_token_ids = ConstantList(prompt_token_ids)
        if block_hasher is not None and not callable(block_hasher):
            raise InvalidRequestError(f"block_hasher must be callable, got {block_hasher!r}")
        features = list(mm_features) if mm_features else []
        for feature in features:
            position = feature.mm_position
            if position.offset < 0 or position.length < 0:
                raise InvalidRequestError(
                    f"multimodal feature {feature.identifier!r} has a negative position "
                    f"{position!r}"
                )
        if any(
            a.mm_position.offset > b.mm_position.offset
            for a, b in itertools.pairwise(features)
        ):
            raise InvalidRequestError(
                f"mm_features of request {request_id!r} must be sorted by offset"
            )

        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.eos_token_id = eos_token_id
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        self.trace_headers = trace_headers
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.max_tokens: int | None = getattr(sampling_params, "max_tokens", None)
        if sampling_params is None and pooling_params is not None:
            self.max_tokens = 1

        self.prompt_token_ids = prompt_token_ids
        self.prompt_embeds = prompt_embeds
        self.num_prompt_tokens = num_prompt_tokens
        self.mm_features = features
        self._output_token_ids: ConstantList[int] = ConstantList()
        self._all_token_ids: ConstantList[int] = all_token_ids
        self.output_token_ids = self._output_token_ids
        self.all_token_ids = self._all_token_ids
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.num_external_computed_tokens = 0
        self.skip_reading_prefix_cache = self._skip_reading_prefix_cache()

        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes = block_hasher(self)

    def _skip_reading_prefix_cache(self) -> bool:
        for params in (self.sampling_params, self.pooling_params):
            flag = getattr(params, "skip_reading_prefix_cache", None)
            if flag is not None:
                return bool(flag)
        return False

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def num_encoder_inputs(self) -> int:
        return len(self.mm_features)

    @property
    def has_encoder_inputs(self) -> bool:
        return len(self.mm_features) > 0

    def get_num_encoder_embeds(self, input_id: int) -> int:
        if not 0 <= input_id < len(self.mm_features):
            raise IndexError(f"no multimodal input {input_id} in request {self.request_id!r}")
        return self.mm_features[input_id].mm_position.length

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append generated tokens and hash the blocks they complete."""
        if type(token_ids) is int:
            list.append(self._output_token_ids, token_ids)
            list.append(self._all_token_ids, token_ids)
        elif _is_token_list(token_ids):
            list.extend(self._output_token_ids, token_ids)  # type: ignore[arg-type]
            list.extend(self._all_token_ids, token_ids)  # type: ignore[arg-type]
        else:
            raise InvalidRequestError(
                f"token ids appended to request {self.request_id!r} must be an int or a list "
                f"of ints, got {token_ids!r}"
            )
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def __repr__(self) -> str:
        return (
            f"Request(request_id={self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, status={self.status.name})"
        )
