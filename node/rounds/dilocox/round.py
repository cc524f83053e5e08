"""DiLoCoX's end of a round in the training thread (PROTOCOLS.md §3; the math is protocol/dilocox.py).

At the end of round r: Δ = (round start) − θ, c = C(Δ + e) (error feedback inside protocol/dilocox.py), hand
c to the exchange, which sends it to the round's group in the background; then take the group's
messages of round r − delay (with delay = 1 they travelled during round r, so this rarely waits),
check each, apply the outer step, and publish the digest of the new φ. Every node applies the
same messages in the same order, so φ stays identical; a node whose digest disagrees with the
majority re-downloads φ and m from a majority peer (the exchange arranges it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import numpy as np

from node.rounds.contributions import ContributionRefused, check_contribution, global_norm
from node.train.trainer import InnerTrainer
from p2p.messages import OutgoingTensor
from protocol.codecs.base import Codec, Encoded
from protocol.dilocox import DiLoCoX, DiLoCoXHyperParameters, PseudoGradientMessage, ReceiveOutcome
from protocol.errors import ProtocolError
from protocol.tensors import weights_digest

DESCRIPTIONS = "descriptions"
PAYLOAD = "c/"
MAX_DESCRIPTIONS_BYTES = 1 << 20


@dataclass
class GroupMessage:
    peer: str
    round_index: int
    message: Any  # p2p ReceivedMessage


class DiLoCoXLink(Protocol):
    def send_round(self, round_index: int, tensors: list, wait_s: float) -> None:
        """Sends this node's compressed message of the round to the group (in the background)."""

    def collect(self, round_index: int, wait_s: float) -> list[GroupMessage]:
        """The group's messages of `round_index` that arrived, waiting at most `wait_s`."""

    def publish_digest(self, round_index: int, digest: str) -> None:
        """Announces φ's digest after the round (the exchange compares it with the majority)."""

    def take_resync(self, round_index: int) -> dict | None:
        """A majority peer's verified state after `round_index`, if ours disagreed; else None."""

    def refused(self, peer: str, reason: str, sentence: str) -> None: ...


def encode_message(message: PseudoGradientMessage) -> list[OutgoingTensor]:
    """The codec descriptions as one msgpack blob, then each tensor's payload as raw bytes."""
    names = sorted(message.tensors)
    descriptions = msgpack.packb([[n, message.tensors[n].description] for n in names])
    out = [OutgoingTensor(DESCRIPTIONS, "uint8", (len(descriptions),),
                          np.frombuffer(descriptions, dtype=np.uint8))]
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
    return PseudoGradientMessage(peer, round_index, tensors)


class DiLoCoXRound:
    def __init__(self, trainer: InnerTrainer, hyper: DiLoCoXHyperParameters, codec: Codec,
                 node_id: str, link: DiLoCoXLink, max_norm_ratio: float, collect_wait_s: float):
        self.trainer, self.link, self.codec = trainer, link, codec
        self.outer = DiLoCoX({k: v.detach() for k, v in trainer.named_parameters().items()},
                             codec, node_id, hyper)
        self.max_norm_ratio, self.collect_wait_s = max_norm_ratio, collect_wait_s
        self.resyncs = 0
        self.lock = threading.Lock()  # held while φ and m change; exports take it too
        self.state_round, self.phi_digest = -1, weights_digest(self.outer.slow_weights)
        # The last two post-step states: a diverged peer asks for the round it compared, and we
        # may have finished another round by the time its request arrives.
        self.history: deque = deque(maxlen=2)

    def between_steps(self, round_index: int) -> None:
        """Nothing to do mid-round: the group's messages are applied at the round's end."""
        return None

    def end_round(self, round_index: int) -> dict[str, Any]:
        delta = self.outer.pseudo_gradient(self.trainer.named_parameters())
        own = self.outer.compress(delta, round_index)
        waited = time.monotonic()  # what the training thread waits on the network this round
        self.link.send_round(round_index, encode_message(own),
                             self.collect_wait_s if self.outer.hyper.delay == 0 else 0.0)
        target = round_index - self.outer.hyper.delay
        arrived = self.link.collect(target, self.collect_wait_s) if target >= 0 else []
        waited = time.monotonic() - waited
        accepted, refused = [], []
        own_norm = global_norm(delta)
        for item in arrived:
            outcome = self._admit(item, own_norm, refused)
            if outcome is ReceiveOutcome.ACCEPTED:
                accepted.append(item.peer)
        with self.lock:
            resync = self.link.take_resync(round_index - 1)
            if resync is not None:  # our φ of the last round disagreed with the majority's
                self.outer.adopt_outer_state(resync)
                self.resyncs += 1
            phi = self.outer.outer_step(round_index)
            digest = weights_digest(phi)
            self.state_round, self.phi_digest = round_index, digest
            self.history.append((round_index, {"phi": phi, "momentum": self.outer.momentum},
                                 digest))
        self.link.publish_digest(round_index, digest)
        # φ minus our own round still in flight (delay 1): see protocol/dilocox.py
        self.trainer.load_parameters(self.outer.round_start_weights())
        step = self.outer.last_step
        return {"applied_round": step.applied_round if step else None,
                "group": list(step.senders) if step else [], "refused": refused,
                "sent_bytes": own.size_bytes, "phi_digest": digest, "resyncs": self.resyncs,
                "network_wait_seconds": waited,
                "energy_kept": own.energy_kept, "late": self.outer.counters.late}

    def _admit(self, item: GroupMessage, own_norm: float, refused: list) -> ReceiveOutcome | None:
        try:
            message = decode_message(item.peer, item.round_index, item.message)
            params = self.trainer.named_parameters()  # names and shapes only
            decoded = {n: self.codec.decode(e.description, e.payload,
                                            max_elements=max(params[n].numel(), 1))
                       for n, e in message.tensors.items() if n in params}
            check_contribution(item.peer, decoded, params, own_norm, self.max_norm_ratio,
                               "DiLoCoX pseudo-gradient")
            return self.outer.receive(message)
        except (ContributionRefused, ProtocolError, ValueError) as exc:
            reason = getattr(exc, "reason", "malformed")
            refused.append(f"{item.peer}: {exc}")
            self.link.refused(item.peer, reason, str(exc))
            return None

    def export_state(self, round_index: int | None = None) -> tuple[int, dict, str]:
        """(round, {"phi": φ, "momentum": m}, digest of φ) after `round_index` if still held,
        else the latest: for a late joiner or a diverged peer's resync."""
        with self.lock:
            for held_round, groups, digest in self.history:
                if held_round == round_index:
                    return held_round, groups, digest
            return (self.state_round, {"phi": self.outer.slow_weights,
                                       "momentum": self.outer.momentum}, self.phi_digest)

    def adopt(self, groups: dict) -> None:
        """A late joiner takes the swarm's φ and m, and θ = φ."""
        with self.lock:
            self.outer.adopt_outer_state({"slow_weights": groups["phi"],
                                          "momentum": groups["momentum"]}, rejoin=True)
            self.phi_digest = weights_digest(groups["phi"])
        self.trainer.load_parameters(groups["phi"])

    def state_dict(self) -> dict[str, Any]:
        return {"dilocox": self.outer.state_dict(), "resyncs": self.resyncs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state["dilocox"])
        self.resyncs = int(state["resyncs"])
