"""The codec interface, the registry, and the bounded reading of untrusted descriptions.

A codec turns one fp32 tensor into an `Encoded`: a small `description` dict of plain types
(msgpack-able: codec name, shape, bits, block, rank) and a `payload` of bytes. Decoding takes
the pair back to an fp32 tensor. The pair comes off the network, so decoding treats both as
hostile (docs/architecture.md "Identity and trust"):

- every field's type, range, the payload's exact length and the element count are checked
  BEFORE anything is allocated, and the output never exceeds `max_elements` elements;
- the only error raised for any bytes and any description is `CodecError`, whose message is one
  sentence naming what is wrong;
- a decoded tensor holding NaN or ±inf is refused.

Wire byte order is little-endian (fp32/fp16/bf16 scales and values).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import torch

from protocol.errors import CodecError

if sys.byteorder != "little":  # payloads are raw little-endian machine bytes
    raise ImportError("protocol.codecs supports little-endian machines only.")

DEFAULT_MAX_ELEMENTS = 1 << 28
"""Default cap on decoded elements (1 GiB of fp32); callers pass the expected size when known."""
MAX_DIMS = 8
"""Largest number of dimensions a description may declare."""


@dataclass(frozen=True)
class Encoded:
    """One encoded tensor: what goes on the wire, plus a local measurement that does not."""

    description: dict[str, Any]
    payload: bytes
    energy_kept: float | None = field(default=None, compare=False)
    """Low-rank only: ε = ‖P·Qᵀ‖²/‖M‖² measured at encode time; never sent."""

    @property
    def size_bytes(self) -> int:
        """Exact bytes on the wire: the payload plus the msgpack-encoded description."""
        return len(self.payload) + description_size(self.description)


def description_size(description: Mapping[str, Any]) -> int:
    """Bytes of the description once msgpack-encoded, as the wire header carries it."""
    return len(msgpack.packb(dict(description), use_bin_type=True))


# ------------------------------------------------------------------ bounded reading of descriptions
class DescriptionReader:
    """Typed access to an untrusted description; every failure is a one-sentence CodecError."""

    def __init__(self, description: Any, codec_names: tuple[str, ...], keys: frozenset[str]) -> None:
        if not isinstance(description, dict):
            raise CodecError(f"description must be a dict, got {type(description).__name__}.")
        if not all(isinstance(key, str) for key in description):
            raise CodecError("description keys must all be strings.")
        codec = description.get("codec")
        if not isinstance(codec, str) or codec not in codec_names:
            raise CodecError(f"description names codec {_short(codec)}, "
                             f"expected one of {list(codec_names)}.")
        if description.keys() != keys:
            missing = sorted(keys - description.keys())
            extra = sorted(description.keys() - keys)
            raise CodecError(f"{codec} description has missing fields {missing} "
                             f"and unknown fields {[_short(k) for k in extra[:5]]}.")
        self.codec = codec
        self._description = description

    def integer(self, key: str, minimum: int, maximum: int) -> int:
        """An int in [minimum, maximum]; bools and floats are refused."""
        value = self._description[key]
        if type(value) is not int:
            raise CodecError(f"{self.codec} description field {key!r} must be an int, "
                             f"got {type(value).__name__}.")
        if not minimum <= value <= maximum:
            raise CodecError(f"{self.codec} description field {key!r} = {_short(value)} "
                             f"is outside [{minimum}, {maximum}].")
        return value

    def choice(self, key: str, choices: tuple[int, ...]) -> int:
        """An int that must be one of `choices` (e.g. bits)."""
        value = self.integer(key, min(choices), max(choices))
        if value not in choices:
            raise CodecError(f"{self.codec} description field {key!r} = {value} "
                             f"is not one of {list(choices)}.")
        return value

    def shape(self, max_elements: int) -> tuple[int, ...]:
        """The declared shape; its element count must not exceed `max_elements`."""
        shape = self._description["shape"]
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS:
            raise CodecError(f"{self.codec} description shape must be a list of at most "
                             f"{MAX_DIMS} ints.")
        count = 1
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise CodecError(f"{self.codec} description shape holds {_short(dim)}, "
                                 "not a non-negative int.")
            count *= dim  # Python ints: no overflow; bounded below since each dim is checked
            if count > max_elements:
                raise CodecError(f"{self.codec} description shape {_short(shape)} exceeds the cap "
                                 f"of {max_elements} elements.")
        return tuple(shape)


def _short(value: Any) -> str:
    """repr cut to 60 characters, so that a hostile value cannot flood an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def payload_view(payload: Any, expected_length: int, codec: str) -> memoryview:
    """The payload as a byte view, refused unless exactly `expected_length` bytes long."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CodecError(f"{codec} payload must be bytes, got {type(payload).__name__}.")
    view = memoryview(payload)
    if not view.c_contiguous:
        raise CodecError(f"{codec} payload must be a contiguous buffer.")
    view = view.cast("B")
    if view.nbytes != expected_length:
        raise CodecError(f"{codec} payload is {view.nbytes} bytes, the description implies "
                         f"{expected_length}.")
    return view


def tensor_from_bytes(view: memoryview, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """A fresh 1-D tensor of `dtype` holding a copy of `view` (length already validated), on
    `device` (default the host)."""
    if view.nbytes == 0:
        return torch.empty(0, dtype=dtype, device=device)
    tensor = torch.frombuffer(bytearray(view), dtype=dtype)
    return tensor if device is None else tensor.to(device)


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """The raw little-endian bytes of a tensor's elements."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def check_max_elements(max_elements: Any) -> int:
    """`max_elements` must be a positive int (a caller error, still a CodecError)."""
    if type(max_elements) is not int or max_elements < 1:
        raise CodecError(f"max_elements must be a positive int, got {_short(max_elements)}.")
    return max_elements


# ------------------------------------------------------------------ the interface
class Codec(ABC):
    """Encode fp32 tensors into `Encoded`; decode any description/payload pair safely.

    `decode` depends only on the description, never on this instance's settings or state, so
    a receiver can decode what a sender with other settings (another rank, bits) produced.
    """

    name: ClassVar[str]
    decodes: ClassVar[tuple[str, ...]]
    """Description codec names this codec's decode accepts."""

    def encode(self, tensor: torch.Tensor, name: str = "") -> Encoded:
        """Encode one tensor; `name` keys per-tensor state (low-rank warm start, rank)."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise CodecError(f"{self.name} encodes floating-point tensors only, got "
                             f"{getattr(tensor, 'dtype', type(tensor).__name__)}.")
        if tensor.dim() > MAX_DIMS:
            raise CodecError(f"{self.name} encodes tensors of at most {MAX_DIMS} dimensions.")
        values = tensor.detach().to(dtype=torch.float32).contiguous()  # on its device
        if not bool(torch.isfinite(values).all()):
            raise CodecError(f"tensor {name!r} holds NaN or infinite values and cannot be encoded.")
        return self._encode(values, name)

    def decode(self, description: Any, payload: Any, max_elements: int = DEFAULT_MAX_ELEMENTS,
               device: torch.device | None = None) -> torch.Tensor:
        """The fp32 tensor of an encoded pair, on `device` (default the host); CodecError for
        anything malformed."""
        max_elements = check_max_elements(max_elements)
        tensor = self._decode(description, payload, max_elements) if device is None else \
            self._decode_on(description, payload, max_elements, torch.device(device))
        if not bool(torch.isfinite(tensor).all()):
            raise CodecError(f"{self.name} payload decodes to NaN or infinite values.")
        return tensor

    @abstractmethod
    def _encode(self, values: torch.Tensor, name: str) -> Encoded:
        """Encode a finite, contiguous fp32 tensor (on any device; the payload's bytes are
        copied to the host)."""

    @abstractmethod
    def _decode(self, description: Any, payload: Any, max_elements: int) -> torch.Tensor:
        """Validate everything, then decode; allocate nothing before validation."""

    @abstractmethod
    def layout(self, shape: tuple[int, ...], name: str = "") -> tuple[dict[str, Any], int]:
        """(the description, the payload's length in bytes) that `encode` gives any finite
        tensor of `shape` named `name` with this codec's present settings, without encoding:
        a message's size before it exists (its bytes depend on the shape, never on the values).
        The payload's length is the one `decode` requires of that description."""

    def _decode_on(self, description: Any, payload: Any, max_elements: int,
                   device: torch.device) -> torch.Tensor:
        """`_decode` onto `device`: on the host, then moved, unless a codec does better."""
        return self._decode(description, payload, max_elements).to(device)

    def track(self, tensor: torch.Tensor, name: str = "") -> None:
        """Move the encoder's state as if `tensor` had been encoded, producing nothing: for a
        round whose message is not sent (a committee's). Stateless codecs have nothing to move."""

    def params(self) -> dict[str, Any]:
        """The keyword arguments that rebuild this codec with `get_codec(name, **params)`."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Encoder state worth keeping across restarts (empty for stateless codecs)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()` output."""
        if state:
            raise CodecError(f"{self.name} is stateless but was given state {sorted(state)[:5]}.")


# ------------------------------------------------------------------ registry
_REGISTRY: dict[str, type[Codec]] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make `cls` available as get_codec(cls.name)."""
    if cls.name in _REGISTRY:
        raise ValueError(f"codec name {cls.name!r} is registered twice.")
    _REGISTRY[cls.name] = cls
    return cls


def codec_names() -> list[str]:
    """Every registered codec name."""
    return sorted(_REGISTRY)


def get_codec(name: str, **params: Any) -> Codec:
    """A new codec by registry name, e.g. get_codec("blockwise", bits=4, block_size=64)."""
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CodecError(f"unknown codec {_short(name)}; known codecs are {codec_names()}.")
    try:
        return cls(**params)
    except TypeError as error:
        raise CodecError(f"codec {name!r} does not take parameters {sorted(params)}: {error}.") from None


def decode(description: Any, payload: Any, max_elements: int = DEFAULT_MAX_ELEMENTS) -> torch.Tensor:
    """Decode with whichever registered codec produced `description` (its "codec" field)."""
    name = description.get("codec") if isinstance(description, dict) else None
    for cls in _REGISTRY.values():
        if isinstance(name, str) and name == cls.name:
            return cls().decode(description, payload, max_elements)
    raise CodecError(f"description names unknown codec {_short(name)}; known codecs are {codec_names()}.")


def integer_parameter(value: Any, what: str, minimum: int, maximum: int) -> int:
    """A codec constructor's int parameter, checked against [minimum, maximum]."""
    if type(value) is not int or not minimum <= value <= maximum:
        raise CodecError(f"{what} must be an int in [{minimum}, {maximum}], got {_short(value)}.")
    return value
