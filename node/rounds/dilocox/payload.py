"""What a DiLoCoX round sends and receives: its compressed pseudo-gradient on the wire, in one place.

A message travels as one msgpack blob of the codec's descriptions ("descriptions": [[name,
description], ...]), the rounds of work it carries as one int32 ("rounds", absent: 1; more when
its sender sat out committees, protocol/committee.py) and each tensor's codec payload as raw
bytes ("c/<name>"). Decoding bounds the blob before unpacking it; any malformation is a
ValueError naming the sender.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from node.rounds.contributions import ContributionRefused
from p2p.messages import OutgoingTensor
from p2p.wire import TensorEntry
from protocol.codecs.base import Encoded
from protocol.dilocox import MAX_ROUNDS_CARRIED, PseudoGradientMessage

DESCRIPTIONS = "descriptions"
ROUNDS = "rounds"
PAYLOAD = "c/"
MAX_DESCRIPTIONS_BYTES = 1 << 20


def descriptions_blob(descriptions: Mapping[str, Any]) -> bytes:
    """The codec descriptions, name -> description, as the one msgpack blob a message carries."""
    return msgpack.packb([[n, descriptions[n]] for n in sorted(descriptions)])


def message_entries(layouts: Mapping[str, tuple[dict[str, Any], int]]) -> tuple[TensorEntry, ...]:
    """The tensors `encode_message` puts on the wire for a one-round message whose tensors have
    these codec layouts (name -> (description, payload bytes), `Codec.layout`), without
    encoding it."""
    blob = len(descriptions_blob({n: d for n, (d, _) in layouts.items()}))
    return (TensorEntry(DESCRIPTIONS, "uint8", (blob,), blob),
            *(TensorEntry(PAYLOAD + n, "uint8", (layouts[n][1],), layouts[n][1]) for n in sorted(layouts)))


def encode_message(message: PseudoGradientMessage) -> list[OutgoingTensor]:
    """The codec descriptions as one msgpack blob, then each tensor's payload as raw bytes."""
    names = sorted(message.tensors)
    descriptions = descriptions_blob({n: message.tensors[n].description for n in names})
    out = [OutgoingTensor(DESCRIPTIONS, "uint8", (len(descriptions),),
                          np.frombuffer(descriptions, dtype=np.uint8))]
    if message.rounds != 1:  # the common case costs no bytes
        out.append(OutgoingTensor(ROUNDS, "int32", (1,), np.array([message.rounds], dtype=np.int32)))
    for n in names:
        payload = bytes(message.tensors[n].payload)
        out.append(OutgoingTensor(PAYLOAD + n, "uint8", (len(payload),),
                                  np.frombuffer(payload, dtype=np.uint8)))
    return out


def decode_message(peer: str, round_index: int, received: Any) -> PseudoGradientMessage:
    """Rebuilds a peer's message; any malformation is a ValueError naming it."""
    views = received.tensor_views()
    if DESCRIPTIONS not in views:
        raise ValueError(f"DiLoCoX message from {peer} has no codec descriptions")
    blob = bytes(views[DESCRIPTIONS][1])
    if len(blob) > MAX_DESCRIPTIONS_BYTES:
        raise ValueError(f"DiLoCoX message from {peer} has {len(blob)} bytes of descriptions")
    try:
        entries = msgpack.unpackb(blob, max_bin_len=1 << 16, max_str_len=1 << 12,
                                  max_array_len=1 << 16, max_map_len=1 << 10, strict_map_key=True)
        tensors = {str(n): Encoded(d, bytes(views[PAYLOAD + n][1])) for n, d in entries}
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
        raise ValueError(f"DiLoCoX message from {peer} is malformed ({exc.__class__.__name__})") \
            from None
    rounds = 1
    if ROUNDS in views:
        entry, view = views[ROUNDS]
        if entry.dtype != "int32" or tuple(entry.shape) != (1,) or len(view) != 4:
            raise ValueError(f"DiLoCoX message from {peer} says the rounds it carries in a "
                             f"{entry.dtype} of shape {tuple(entry.shape)}, not one int32")
        rounds = int(np.frombuffer(view, dtype=np.int32)[0])
    if not 1 <= rounds <= MAX_ROUNDS_CARRIED:
        raise ValueError(f"DiLoCoX message from {peer} says it carries {rounds} rounds of work, "
                         f"outside 1 to {MAX_ROUNDS_CARRIED}")
    return PseudoGradientMessage(peer, round_index, tensors, rounds)


def check_density(message: PseudoGradientMessage, max_density: float) -> None:
    """A topk message may carry at most `max_density` of each chunk (the manifest's bound, so
    that no member sends more than every other budgets for); ContributionRefused("too_dense")."""
    for name, encoded in message.tensors.items():
        description = encoded.description
        if isinstance(description, dict) and description.get("codec") == "topk":
            k, chunk = description.get("k"), description.get("chunk")
            if type(k) is int and type(chunk) is int and chunk > 0 and k > max_density * chunk:
                raise ContributionRefused(
                    "too_dense", f"DiLoCoX message from {message.sender} sends {k} of every "
                    f"{chunk} entries of {name!r}, above the manifest's density bound "
                    f"{max_density:g}: its sender must lower topk_k")
