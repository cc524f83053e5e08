"""DiLoCoXExchange on the event loop without a network, for the unit tests: member records as
the DHT cache would hold them, members holding relayed copies, and messages put in the inbox as
the transport's handler would after its checks."""

import random

import numpy as np

from node.config.manifest import ProtocolSection
from node.rounds.dilocox.exchange import DiLoCoXExchange
from node.rounds.dilocox.relay import AUTHOR, RELAY
from node.rounds.dilocox.sending import PGRAD
from p2p.limits import TransferLimits
from p2p.errors import Reason, RemoteRefused
from p2p.identity import NodeIdentity
from p2p.messages import OutgoingMessage, ReceivedMessage
from p2p.origin import sign_origin
from p2p.records import MemberRecord
from tests.p2p_helpers import MANIFEST, SWARM, as_received
from tests.swarm_parts import member as live_member
from tests.swarm_parts import unit_swarm


def member(peer_id: str, round_index: int) -> MemberRecord:
    return live_member(peer_id, round_index, "dilocox", "training", since=0)


class HoldingTransport:
    """Members holding copies of messages, served as node/rounds/dilocox/relay.py serves them;
    nothing arrives by push. `copies`: (holder, round, author) -> the copy it serves."""

    swarm, manifest = SWARM, MANIFEST

    limits = TransferLimits(parallel_streams=1)

    def __init__(self, copies: dict):
        self.copies, self.asked, self.banned, self.pushed = copies, [], [], []
        self.arriving: set[tuple[str, int]] = set()  # (peer, round): a push of it is coming in

    def receiving(self, peer, kind, round_index) -> bool:
        return (peer, round_index) in self.arriving

    def ban(self, peer, seconds) -> None:
        self.banned.append(peer)

    async def push(self, peer, message, *, need_by=None):
        self.pushed.append((peer, message))

    async def request(self, peer, kind, round_index, *, meta, streams, need_by=None, expected_reply_bytes=0):
        assert kind == RELAY
        self.asked.append(peer)
        copy = self.copies.get((peer, round_index, meta[AUTHOR]))
        if copy is None:
            raise RemoteRefused(peer, kind, Reason.REFUSED, "no message of that author here")
        return copy


def exchange(loop, records: list[MemberRecord]) -> DiLoCoXExchange:
    """Members hold no copies of what did not come: an ask for one is refused."""
    return DiLoCoXExchange(ProtocolSection(name="dilocox", fan_out=8, message_deadline_s=30.0),
                           unit_swarm(loop, records, transport=HoldingTransport({})),
                           random.Random(0))


def deliver(ex: DiLoCoXExchange, round_index: int, peer: str) -> None:
    ex.inbox.setdefault(round_index, {})[peer] = f"message of {peer}"
    ex.arrived.set()


def relayed_copy(author: NodeIdentity, holder: NodeIdentity, round_index: int,
                 tamper: bool = False, version: int = 0) -> ReceivedMessage:
    """`author`'s signed message of `round_index` as `holder` delivers it; another `version`
    is another content, signed all the same."""
    message = OutgoingMessage.from_arrays(PGRAD, round_index,
                                          {"c": np.arange(16, dtype=np.uint8) + version})
    sign_origin(author, SWARM, MANIFEST, message)
    message.meta[AUTHOR] = author.peer_id.to_base58()
    if tamper:
        message.tensors[0].data[0] = 99
    return as_received(message, delivered_by=holder)
