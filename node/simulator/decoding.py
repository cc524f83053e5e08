"""DiLoCoX's decodings, computed once per message for every replica of a simulation.

Each DiLoCoX round decodes every message it receives more than once (to check it, to validate
it, to apply it), so N replicas would decode each of N messages about 2N times: at 64 replicas
that is most of a round's time. Decoding is a pure function of (description, payload)
(protocol/codecs/base.py), so one decoding per message gives the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch

from protocol.codecs import Codec, Encoded


class SharedDecoding(Codec):
    """One node's codec, whose decodings are shared by every node of the simulation.

    Each DiLoCoX node decodes every message it receives twice (to validate it, then to apply
    it), so N replicas would decode each of N messages 2N times: at 64 replicas that is most
    of a round's time. Decoding is a pure function of (description, payload) (protocol/codecs
    base.py), so one decoding per message gives the same numbers; each caller gets its own
    copy. Encoding stays with the node's own codec (the low-rank warm starts are per node).
    The cache keeps two rounds of messages: with delay 1 a message is applied a round after
    it arrives.
    """

    def __init__(self, inner: Codec, cache: DecodingCache) -> None:
        self.inner, self.cache = inner, cache
        self.name, self.decodes = inner.name, inner.decodes

    def encode(self, tensor: torch.Tensor, name: str = "") -> Encoded:
        return self.inner.encode(tensor, name)

    def decode(self, description: Any, payload: Any, max_elements: int = 1 << 28,
               device: torch.device | None = None) -> torch.Tensor:
        key = (bytes(payload), repr(description), max_elements)
        decoded = self.cache.get(key)
        if decoded is None:
            decoded = self.cache.put(key, self.inner.decode(description, payload, max_elements))
        return decoded.clone() if device is None else decoded.to(device, copy=True)

    def track(self, tensor: torch.Tensor, name: str = "") -> None:
        self.inner.track(tensor, name)

    def _encode(self, values: torch.Tensor, name: str) -> Encoded:  # encode() is delegated whole
        return self.inner.encode(values, name)

    def _decode(self, description: Any, payload: Any, max_elements: int) -> torch.Tensor:
        return self.inner.decode(description, payload, max_elements)

    def layout(self, shape: tuple[int, ...], name: str = "") -> tuple[dict[str, Any], int]:
        return self.inner.layout(shape, name)

    def params(self) -> dict[str, Any]:
        return self.inner.params()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state) -> None:
        self.inner.load_state_dict(state)


class DecodingCache:
    """Decoded tensors of this round's and last round's messages."""

    def __init__(self) -> None:
        self.current: dict = {}
        self.previous: dict = {}

    def get(self, key) -> torch.Tensor | None:
        found = self.current.get(key)
        return found if found is not None else self.previous.get(key)

    def put(self, key, tensor: torch.Tensor) -> torch.Tensor:
        self.current[key] = tensor
        return tensor

    def next_round(self) -> None:
        self.previous, self.current = self.current, {}
