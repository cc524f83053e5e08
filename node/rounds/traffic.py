"""What one node's round moves over its link, and the link rate that needs, from the swarm's
manifest before anything is sent (`doctor`, the start of `join`, benchmarks/link_table.py).

A message's bytes are what the transport counts for its tensors and their manifest (the frame
header's list of them): the NoLoCo snapshot exactly as message_sizes.py bounds it, a DiLoCoX
message from its codec's layout (`Codec.layout`, payload.py `message_entries`) at the
manifest's codec, rank and bits. Frame headers and signatures add a few hundred bytes a frame.

Per round, per node, in a swarm of N members (M: one message's bytes):

    NoLoCo    a round that pairs swaps one snapshot each way (exchange.py): M up, M down. A node
              whose swaps outlast its rounds pairs once every k rounds, k at most
              protocol.max_swap_rounds (pacing.py): the least it moves is M / max_swap_rounds.
    DiLoCoX   a round it sends in (committee share p = send_share(senders, N),
              protocol/committee.py): its message to min(N − 1, fan_out) members (sending.py),
              plus, beyond the fan-out, its share p · (N − 1 − fan_out) of the copies members
              fetch from holders (relay.py); down: the messages of the others that send,
              p · (N − 1) on average, pushed or relayed. With protocol.controller on, the least
              is the same count of messages at the controller's floor strength and bits
              (adapt.py `controller_config`); without it, the message as configured.
    join      the state a late joiner downloads once: φ and outer momentum in fp32, 8 bytes a
              parameter (node/rounds/state.py).

The rate a round needs is its bytes over its length, H × a step's seconds: what the link must
carry for the exchange to keep up with training (NoLoCo's swap and DiLoCoX's push overlap the
next round's compute; a DiLoCoX member with the controller aims at protocol.controller_send_budget
of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from node.config.manifest import Manifest
from node.rounds.message_sizes import message_bounds, parameter_shapes
from p2p.sizing import MessageBound
from protocol.committee import send_share

DEFAULT_MEMBERS = 8  # the largest swarm where every DiLoCoX member sends every round (senders = 8)


@dataclass(frozen=True)
class RoundTraffic:
    """One node's bytes per round for a manifest; `what` and `least_how` say how, for people."""

    protocol: str
    members: int
    message_bytes: int     # one snapshot or message as configured, on the wire
    up_bytes: float        # a round that exchanges (NoLoCo: pairs; DiLoCoX: sends)
    down_bytes: float
    least_up_bytes: float  # per round, at the most the protocol can save
    least_down_bytes: float
    join_bytes: int        # the late joiner's state download
    what: str              # "one int4 theta snapshot each way"
    least_how: str         # "pairing once every 4 rounds"; "" when nothing can be saved


@dataclass(frozen=True)
class LinkNeed:
    """The rates (bit/s) a round of `round_seconds` needs, and the join's download time."""

    round_seconds: float
    up_bps: float
    down_bps: float
    least_up_bps: float
    least_down_bps: float
    join_bps: float        # the join's download within one round


def wire_bytes(bound: MessageBound) -> int:
    """A message's tensors and the manifest that lists them in its first frame's header."""
    return bound.total_bytes + bound.manifest_bytes()


def round_traffic(manifest: Manifest, vocab_size: int, members: int = DEFAULT_MEMBERS) -> RoundTraffic:
    """The bytes one node of a swarm of `members` moves per round under `manifest`."""
    if type(members) is not int or members < 2:
        raise ValueError(f"a swarm that exchanges has at least 2 members, got {members!r}")
    shapes = parameter_shapes(manifest, vocab_size)
    bounds = message_bounds(manifest, shapes)
    join = wire_bytes(next(b for b in bounds if b.what.startswith("the late-join state")))
    protocol = manifest.protocol
    if protocol.name == "noloco":
        snapshot = wire_bytes(next(b for b in bounds if b.what.startswith("a NoLoCo snapshot")))
        spread = protocol.max_swap_rounds
        return RoundTraffic("noloco", members, snapshot, snapshot, snapshot, snapshot / spread,
                            snapshot / spread, join,
                            f"one {protocol.wire_dtype} {protocol.snapshot} snapshot each way",
                            f"pairing once every {spread} rounds" if spread > 1 else "")
    message, configured = dilocox_message_bytes(manifest, shapes, least=False)
    least, floor = dilocox_message_bytes(manifest, shapes, least=True)
    share = send_share(protocol.senders, members)
    pushes = min(members - 1, protocol.fan_out) + share * max(0, members - 1 - protocol.fan_out)
    incoming = share * (members - 1)
    return RoundTraffic("dilocox", members, message, pushes * message, incoming * message,
                        pushes * least, incoming * least, join,
                        f"its message, {configured}, to {pushes:g} members and {incoming:g} "
                        f"members' messages in", f"compressing to {floor}" if least < message else "")


def dilocox_message_bytes(manifest: Manifest, shapes: dict[str, tuple[int, ...]], least: bool
                          ) -> tuple[int, str]:
    """(bytes on the wire, how it is encoded) of a DiLoCoX message at the manifest's codec
    settings, or with `least` at the adaptive controller's floor when protocol.controller is on."""
    from node.rounds.dilocox.adapt import controller_config
    from node.rounds.dilocox.payload import message_entries
    from node.rounds.dilocox.round import codec_for
    from protocol.codecs import LowRankCodec, TopKCodec
    from protocol.controller import CompressionSettings, apply_settings

    protocol = manifest.protocol
    codec = codec_for(protocol)
    bounds = controller_config(protocol, codec) if protocol.controller else None
    if least and bounds is not None:
        apply_settings(codec, CompressionSettings({n: bounds.min_rank for n in shapes},
                                                  bounds.bits_choices[0], protocol.inner_steps))
    if isinstance(codec, LowRankCodec):
        ranks = {codec.rank_of(n) for n in shapes}
        how = f"lowrank at rank {'/'.join(map(str, sorted(ranks)))} and {codec.bits} bits"
    elif isinstance(codec, TopKCodec):
        how = f"topk at {codec.k_of(next(iter(shapes)))} of {codec.chunk} and {codec.bits} bits"
    else:
        how = protocol.codec
    entries = message_entries({n: codec.layout(shape, n) for n, shape in shapes.items()})
    return wire_bytes(MessageBound("a DiLoCoX message", entries)), how


def link_need(traffic: RoundTraffic, round_seconds: float) -> LinkNeed:
    """The rates `traffic` needs at rounds of `round_seconds`."""
    if not (math.isfinite(round_seconds) and round_seconds > 0):
        raise ValueError(f"a round lasts a positive number of seconds, got {round_seconds!r}")
    rate = lambda nbytes: 8 * nbytes / round_seconds
    return LinkNeed(round_seconds, rate(traffic.up_bytes), rate(traffic.down_bytes),
                    rate(traffic.least_up_bytes), rate(traffic.least_down_bytes),
                    rate(traffic.join_bytes))


@dataclass(frozen=True)
class LinkVerdict:
    """Whether a link carries the swarm's rounds: "ok", "slower" (the protocol saves bytes:
    it pairs less often or compresses harder) or "too_slow" (not even then); one sentence."""

    level: str
    sentence: str


def judge_link(traffic: RoundTraffic, need: LinkNeed, up_bps: float, down_bps: float,
               swarm: str = "", link: str = "") -> LinkVerdict:
    """The verdict on a link of `up_bps` / `down_bps` (bit/s) for `traffic` at `need`; `link`
    names it in the sentence (default: its two rates)."""
    link = link or f"this link ({mbit(up_bps)} up, {mbit(down_bps)} down)"
    numbers = (f"a {traffic.protocol} round of {need.round_seconds:.1f} s moves "
               f"{traffic.up_bytes / 1e6:.1f} MB up and {traffic.down_bytes / 1e6:.1f} MB down per "
               f"node ({traffic.what}), which needs {mbit(need.up_bps)} up and {mbit(need.down_bps)} "
               f"down")
    of = f" swarm '{swarm}'" if swarm else " the swarm"
    exchange = f" the exchange of{of}"
    if up_bps >= need.up_bps and down_bps >= need.down_bps:
        return LinkVerdict("ok", f"{link} carries{exchange}: {numbers}.")
    least = (f"{traffic.least_how}, the least the protocol allows, needs {mbit(need.least_up_bps)} up "
             f"and {mbit(need.least_down_bps)} down") if traffic.least_how else \
        "and the protocol as configured cannot send less"
    if traffic.least_how and up_bps >= need.least_up_bps and down_bps >= need.least_down_bps:
        return LinkVerdict("slower", f"{link} is too slow for{of} as configured, so this node "
                                     f"will save bytes: {numbers}; {least}.")
    return LinkVerdict("too_slow", f"{link} cannot carry{exchange}: {numbers}; {least}.")


def mbit(bps: float) -> str:
    return f"{bps / 1e6:.1f} Mbit/s"
