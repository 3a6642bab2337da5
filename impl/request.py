"""A vLLM 0.13-compatible ``Request``: the parts the KV-cache manager reads.

The request keeps its token ids (prompt then output) and the hashes of its full blocks; each
``append_output_token_ids`` extends ``block_hashes`` with the blocks it completed, so
``len(block_hashes) == num_tokens // block_size`` always holds when a hasher is attached.

Bad input is refused at the door with an ``InvalidRequestError`` naming the value, before
anything is stored: the constructor checks every field the KV-cache manager or the block
hasher reads (the checks of the extra-key sources are the hasher's own, from
``impl.hashing``), and ``append_output_token_ids`` leaves the request as it was when the
tokens or the hasher's result are bad. Fields the scheduler assigns every step
(``num_computed_tokens``, ``status``, ...) are plain attributes, as in vLLM.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, SupportsIndex, TypeVar

from kvspec.impl.checks import all_ints, as_int, first_non_int, shown
from kvspec.impl.errors import (
    InvalidMultiModalInputError,
    InvalidRequestError,
    ReadOnlyFieldError,
    ReadOnlyListError,
)
from kvspec.impl.hashing import (
    BlockHash,
    RequestLike,
    check_cache_salt,
    check_lora,
    check_mm_features,
    check_prompt_embeds,
)

__all__ = [
    "ConstantList",
    "InvalidMultiModalInputError",
    "InvalidRequestError",
    "LoRARequest",
    "MultiModalFeatureSpec",
    "PlaceholderRange",
    "ReadOnlyFieldError",
    "ReadOnlyListError",
    "Request",
    "RequestLike",
    "RequestStatus",
]

T = TypeVar("T")


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
        if not isinstance(status, RequestStatus):
            raise InvalidRequestError(f"status must be a RequestStatus, got {status!r}")
        return status > RequestStatus.PREEMPTED


def _typed_frozen(cls: type[T]) -> type[T]:
    """A frozen dataclass whose field assignments are refused with ``ReadOnlyFieldError`` (an
    ``AttributeError``, as dataclasses' own ``FrozenInstanceError``, and a ``ValueError``).
    The generated ``__init__`` of a frozen dataclass sets fields through ``object``, so it is
    unaffected."""

    def refuse_set(self: object, name: str, value: object) -> NoReturn:
        raise ReadOnlyFieldError(
            f"{type(self).__name__} is a frozen value: cannot set {name} to {value!r}")

    def refuse_delete(self: object, name: str) -> NoReturn:
        raise ReadOnlyFieldError(f"{type(self).__name__} is a frozen value: cannot delete {name}")

    type.__setattr__(cls, "__setattr__", refuse_set)
    type.__setattr__(cls, "__delattr__", refuse_delete)
    return cls


@_typed_frozen
@dataclass(frozen=True, slots=True)
class LoRARequest:
    """The LoRA adapter a request runs with; its name (and, with tagged keys, its path) goes
    into block hashes. As vLLM's, its id is an int from 1."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if type(self.lora_name) is not str or type(self.lora_path) is not str:
            raise InvalidRequestError(
                f"LoRA name and path must be str, got {self.lora_name!r} and {self.lora_path!r}")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise InvalidRequestError(f"LoRA id must be an int >= 1, got {self.lora_int_id!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


@_typed_frozen
@dataclass(frozen=True, slots=True)
class PlaceholderRange:
    """Where a multimodal input's tokens sit in the prompt: ``[offset, offset + length)``."""

    offset: int
    length: int

    def __post_init__(self) -> None:
        for name, value in (("offset", self.offset), ("length", self.length)):
            if type(value) is not int or value < 0:
                raise InvalidRequestError(f"placeholder {name} must be an int >= 0, got {value!r}")


@_typed_frozen
@dataclass(frozen=True, slots=True)
class MultiModalFeatureSpec:
    """One multimodal input: its content identifier (hashed into blocks) and position."""

    data: Any
    modality: str
    identifier: str
    mm_position: PlaceholderRange

    def __post_init__(self) -> None:
        if type(self.modality) is not str or type(self.identifier) is not str:
            raise InvalidRequestError(
                f"modality and identifier must be str, got {self.modality!r} and "
                f"{self.identifier!r}")
        if not isinstance(self.mm_position, PlaceholderRange):
            raise InvalidRequestError(
                f"mm_position must be a PlaceholderRange, got {self.mm_position!r}")


def _is_token_list(values: object) -> bool:
    """Whether ``values`` is a list or tuple of ints (checked at C speed: ``checks.all_ints``)."""
    return isinstance(values, list | tuple) and all_ints(values)


def _token_list_error(request_id: object, what: str, values: object) -> InvalidRequestError:
    if isinstance(values, list | tuple):
        return InvalidRequestError(
            f"{what} of request {request_id!r} must be ints, got "
            f"{first_non_int(values)!r} in {shown(values)}")
    return InvalidRequestError(
        f"{what} of request {request_id!r} must be a list of ints, got {shown(values)}")


def _check_int(request_id: str, name: str, value: object, low: int | None = None,
               optional: bool = False) -> int | None:
    """``value`` as a plain int (impl's integer rule: an int or a numpy integer, never a bool),
    or None when it is None and ``optional``."""
    if value is None and optional:
        return None
    number = as_int(value)
    if number is None or (low is not None and number < low):
        bound = "" if low is None else f" >= {low}"
        raise InvalidRequestError(
            f"{name} of request {request_id!r} must be an int{bound}, got {value!r}")
    return number


def _read_params(request_id: str, params: Any) -> tuple[int | None, bool | None]:
    """``max_tokens`` and ``skip_reading_prefix_cache`` of sampling or pooling params (any
    object; vLLM's or a stand-in), checked: an int from 1 and a bool, or absent."""
    max_tokens = getattr(params, "max_tokens", None)
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise InvalidRequestError(
            f"max_tokens of request {request_id!r} must be an int >= 1, got {max_tokens!r}")
    skip = getattr(params, "skip_reading_prefix_cache", None)
    if skip is not None and type(skip) is not bool:
        raise InvalidRequestError(
            f"skip_reading_prefix_cache of request {request_id!r} must be a bool, got {skip!r}")
    return max_tokens, skip


def _block_hashes_error(request_id: str, hashes: object) -> InvalidRequestError | None:
    """None if ``hashes`` (a block hasher's result) is a list of bytes or ints (the hashes of
    Python's ``hash``, which vLLM 0.13's tests use), else the refusal."""
    if type(hashes) is list and (not hashes or all(
            isinstance(h, bytes) or type(h) is int for h in hashes)):
        return None
    return InvalidRequestError(
        f"the block hasher of request {request_id!r} must return a list of block hashes, "
        f"got {shown(hashes)}")


class Request:
    """A request as the KV-cache manager sees it (vLLM 0.13 field names and meaning)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None,
        sampling_params: Any | None = None,
        pooling_params: Any | None = None,
        eos_token_id: SupportsIndex | None = None,
        client_index: SupportsIndex = 0,
        arrival_time: float | None = None,
        prompt_embeds: Any | None = None,
        mm_features: list[MultiModalFeatureSpec] | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        priority: SupportsIndex = 0,
        trace_headers: Any | None = None,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
        *,
        kv_retention: list[Any] | None = None,
    ) -> None:
        # Every check comes before the first assignment: a refused request is never half built.
        if type(request_id) is not str:
            raise InvalidRequestError(f"request_id must be a str, got {request_id!r}")
        check_prompt_embeds(prompt_embeds)
        if prompt_token_ids is None:
            if prompt_embeds is None:
                raise InvalidRequestError(
                    f"request {request_id!r} has neither prompt_token_ids nor prompt_embeds"
                )
            num_prompt_tokens = len(prompt_embeds)
            all_token_ids: ConstantList[int] = ConstantList([0] * num_prompt_tokens)
        else:
            if not _is_token_list(prompt_token_ids):
                raise _token_list_error(request_id, "prompt_token_ids", prompt_token_ids)
            num_prompt_tokens = len(prompt_token_ids)
            if prompt_embeds is not None and len(prompt_embeds) != num_prompt_tokens:
                raise InvalidRequestError(
                    f"request {request_id!r} has {num_prompt_tokens} prompt token ids but "
                    f"{len(prompt_embeds)} prompt embeddings")
            all_token_ids = ConstantList(prompt_token_ids)
        check_mm_features(mm_features)
        features = list(mm_features) if mm_features else []
        if lora_request is not None:
            check_lora(lora_request)
        check_cache_salt(cache_salt)
        eos_token_id = _check_int(request_id, "eos_token_id", eos_token_id, optional=True)
        client_index = _check_int(request_id, "client_index", client_index, low=0) or 0
        priority = _check_int(request_id, "priority", priority) or 0
        if arrival_time is not None and (type(arrival_time) not in (int, float)
                                         or arrival_time != arrival_time):
            raise InvalidRequestError(
                f"arrival_time of request {request_id!r} must be a number, got {arrival_time!r}")
        if trace_headers is not None and not isinstance(trace_headers, Mapping):
            raise InvalidRequestError(
                f"trace_headers of request {request_id!r} must be a mapping, got "
                f"{shown(trace_headers)}")
        max_tokens, skip_sampling = _read_params(request_id, sampling_params)
        _, skip_pooling = _read_params(request_id, pooling_params)
        if block_hasher is not None and not callable(block_hasher):
            raise InvalidRequestError(f"block_hasher must be callable, got {block_hasher!r}")

        self.request_id = request_id
        # Retention hints (impl/eviction.py TokenRangeRetention; kvspec's): a pool with the
        # priority policy reads them when it caches the request's blocks, and checks them.
        self.kv_retention: list[Any] = list(kv_retention or ())
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
        self.max_tokens: int | None = max_tokens
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
        self.skip_reading_prefix_cache = bool(
            skip_sampling if skip_sampling is not None else skip_pooling)

        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            hashes = block_hasher(self)
            refused = _block_hashes_error(request_id, hashes)
            if refused is not None:
                raise refused
            self.block_hashes = hashes

    # Fields computed from the token lists: reading is a property's speed; assigning one
    # would make it disagree with the lists, so it is refused.

    def _refuse_write(self, name: str, value: object) -> NoReturn:
        raise ReadOnlyFieldError(
            f"{name} of request {self.request_id!r} is computed from its tokens and cannot be "
            f"set (got {value!r})")

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        self._refuse_write("num_tokens", value)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @num_tokens_with_spec.setter
    def num_tokens_with_spec(self, value: int) -> None:
        self._refuse_write("num_tokens_with_spec", value)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @num_output_tokens.setter
    def num_output_tokens(self, value: int) -> None:
        self._refuse_write("num_output_tokens", value)

    @property
    def num_encoder_inputs(self) -> int:
        return len(self.mm_features)

    @num_encoder_inputs.setter
    def num_encoder_inputs(self, value: int) -> None:
        self._refuse_write("num_encoder_inputs", value)

    @property
    def has_encoder_inputs(self) -> bool:
        return len(self.mm_features) > 0

    @has_encoder_inputs.setter
    def has_encoder_inputs(self, value: bool) -> None:
        self._refuse_write("has_encoder_inputs", value)

    def get_num_encoder_embeds(self, input_id: SupportsIndex) -> int:
        count = len(self.mm_features)
        index = as_int(input_id)
        if index is None or not 0 <= index < count:
            raise InvalidMultiModalInputError(
                f"no multimodal input {input_id!r} in request {self.request_id!r} "
                f"({count} inputs)")
        return int(self.mm_features[index].mm_position.length)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append generated tokens and hash the blocks they complete; bad tokens, or a block
        hasher that fails or returns something other than hashes, leave the request as it
        was."""
        if type(token_ids) is int:
            list.append(self._output_token_ids, token_ids)
            list.append(self._all_token_ids, token_ids)
            added = 1
        elif _is_token_list(token_ids):
            if token_ids is self._output_token_ids or token_ids is self._all_token_ids:
                token_ids = list(token_ids)  # its own list: extending it would read it twice
            list.extend(self._output_token_ids, token_ids)  # type: ignore[arg-type]
            list.extend(self._all_token_ids, token_ids)  # type: ignore[arg-type]
            added = len(token_ids)  # type: ignore[arg-type]
        else:
            raise _token_list_error(self.request_id, "token ids appended", token_ids)
        hasher = self._block_hasher
        if hasher is None:
            return
        # The hasher reads the new tokens from the request, so they are in place when it runs;
        # if it fails, they come out again.
        try:
            new_hashes = hasher(self)
        except BaseException:
            self._drop_last_tokens(added)
            raise
        if type(new_hashes) is list and not new_hashes:
            return  # the common case: no block completed
        refused = _block_hashes_error(self.request_id, new_hashes)
        if refused is not None:
            self._drop_last_tokens(added)
            raise refused
        self.block_hashes.extend(new_hashes)

    def _drop_last_tokens(self, count: int) -> None:
        if count:
            list.__delitem__(self._output_token_ids, slice(-count, None))
            list.__delitem__(self._all_token_ids, slice(-count, None))

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def __repr__(self) -> str:
        return (
            f"Request(request_id={self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, status={self.status.name})"
        )
