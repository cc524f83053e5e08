"""Owner-only DHT records: under a protected key, subkey = a peer id, value signed by that peer.

The DHT hashes keys before records reach a validator, so `OwnerOnlyValidator` is told which
keys it protects (`protect(key)`); records under other keys pass untouched, so other uses of
the DHT keep working. Under a protected key every record must have, as its subkey, the base58
peer id of an Ed25519 peer, and its value must end with that peer's signature over the domain,
key, subkey, value and expiration time, followed by a 4-byte marker. Binding the expiration
means a captured record cannot be replayed with a later expiry: since the DHT keeps, per subkey,
the record that expires last, an old record can never displace a newer one or a tombstone.

`MemberRecord` is the schema of a swarm member's value (see membership.py).
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from p2p.identity import SIGNATURE_BYTES, NodeIdentity, verify_signature
from p2p.version import UNNAMED_RECORD_VERSION, WIRE_VERSION

RECORD_DOMAIN = b"lowcomm/dht-record/v1\x00"
SIGNED_MARKER = b"LCs1"
MAX_SUBKEY_BYTES = 128
MAX_VALUE_BYTES = 8192
# how far members' clocks may differ from each other (and from the DHT nodes storing their
# records) with membership unaffected: a record stays stored everywhere while the skew is below
# its lifetime minus one heartbeat (p2p/membership.py), and a DHT node bootstraps from peers
# whose clocks differ from its own by up to this (p2p/host.py)
CLOCK_SKEW_TOLERANCE_S = 90.0
# The peer whose DHT store request is being validated (set by P2PHost around hivemind's store
# handler): honest nodes store and relay only records that validate, so a forged one comes
# from the peer that sent it.
STORE_SENDER: contextvars.ContextVar[str | None] = contextvars.ContextVar("store_sender", default=None)


def _owner_of(subkey_bytes: bytes) -> str | None:
    """The peer id a protected subkey names, or None if it is not a short string."""
    if len(subkey_bytes) > MAX_SUBKEY_BYTES:
        return None
    try:
        subkey = msgpack.unpackb(subkey_bytes, raw=False)
    except Exception:  # any undecodable subkey simply names no owner
        return None
    return subkey if type(subkey) is str and subkey else None


def _record_signing_input(record: DHTRecord, body: bytes) -> bytes:
    return RECORD_DOMAIN + msgpack.packb([record.key, record.subkey, body, float(record.expiration_time)],
                                         use_bin_type=True)


class OwnerOnlyValidator(RecordValidatorBase):
    """A peer may write only its own subkey of a protected key, with a value it signed."""

    def __init__(self, identity: NodeIdentity, max_value_bytes: int = MAX_VALUE_BYTES):
        self._identity = identity
        self._own_subkey = identity.peer_id.to_base58()
        self._max_value_bytes = max_value_bytes
        self._protected: set[bytes] = set()
        # called with the sender's peer id when a store request carries a record that fails
        # validation under a protected key (the daemon strikes and bans that peer)
        self.on_forgery: Callable[[str], None] | None = None

    def protect(self, key: str) -> None:
        """Enforce ownership under `key` (as passed to DHTNode.store/get)."""
        self._protected.add(DHTID.generate(source=key).to_bytes())

    def is_protected(self, key_id: bytes) -> bool:
        return key_id in self._protected

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self._protected:
            return True
        valid = self._signed_by_owner(record)
        sender = STORE_SENDER.get()
        if not valid and sender is not None and self.on_forgery is not None:
            self.on_forgery(sender)
        return valid

    def _signed_by_owner(self, record: DHTRecord) -> bool:
        owner = _owner_of(record.subkey)
        value = record.value
        if owner is None or not (len(SIGNED_MARKER) + SIGNATURE_BYTES < len(value) <= self._max_value_bytes):
            return False
        if not value.endswith(SIGNED_MARKER) or not math.isfinite(record.expiration_time):
            return False
        body = value[:-len(SIGNED_MARKER) - SIGNATURE_BYTES]
        signature = value[-len(SIGNED_MARKER) - SIGNATURE_BYTES:-len(SIGNED_MARKER)]
        return verify_signature(owner, _record_signing_input(record, body), signature)

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._protected or _owner_of(record.subkey) != self._own_subkey:
            return record.value  # not ours to sign: peers will refuse it, as they should
        signature = self._identity.sign(_record_signing_input(record, record.value))
        return record.value + signature + SIGNED_MARKER

    def strip_value(self, record: DHTRecord) -> bytes:
        value = record.value
        if record.key in self._protected and value.endswith(SIGNED_MARKER) \
                and len(value) > len(SIGNED_MARKER) + SIGNATURE_BYTES:
            return value[:-len(SIGNED_MARKER) - SIGNATURE_BYTES]
        return value

    @property
    def priority(self) -> int:
        return 10  # validate signatures before any validator that would deserialize the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


STATUSES = ("joining", "training", "ready", "exchanging", "idle", "left")
_SCALAR_TYPES = (bool, int, float, str, bytes, type(None))


@dataclass(frozen=True)
class MemberRecord:
    """What a swarm member publishes about itself (the owner-signed value of its subkey).

    "v" is the value's layout, "wire" the member's wire protocol (p2p/version.py): a reader
    parses any member's record of layout 1 and leaves one of another wire version out of its
    view (node/daemon/members.py), naming both versions. A later layout keeps these keys
    readable by adding keys, never changing them, so that older nodes can name its version."""

    peer_id: str
    addrs: tuple[str, ...]
    protocol: str            # the outer protocol's name, e.g. "noloco"
    manifest: str            # swarm manifest digest
    round: int
    status: str              # one of STATUSES; "left" is a tombstone
    throughput: float        # measured by the node, in units its daemon documents (e.g. tokens/s)
    extra: dict[str, Any] = field(default_factory=dict)   # a few small fields, e.g. a state digest
    updated: float = 0.0     # the member's clock when it wrote the record
    expires: float = 0.0     # DHT expiration time of the record (filled in on reading)
    wire: int = WIRE_VERSION  # the member's wire protocol version
    # until when the reader counts the member alive, on the reader's monotonic clock (filled
    # in by Membership.peers; a record built by hand is alive)
    live_until: float = math.inf

    @property
    def left(self) -> bool:
        return self.status == "left"

    def to_value(self) -> dict:
        return {"v": 1, "addrs": list(self.addrs), "protocol": self.protocol, "manifest": self.manifest,
                "round": self.round, "status": self.status, "throughput": float(self.throughput),
                "extra": dict(self.extra), "updated": float(self.updated), "wire": self.wire}

    @classmethod
    def from_value(cls, peer_id: str, value: Any, expires: float) -> "MemberRecord | None":
        """Parse a stored value; None if it does not follow the schema (never raises)."""
        try:
            if type(value) is not dict or value.get("v") != 1:
                return None
            addrs, extra = value["addrs"], value["extra"]
            wire = value.get("wire", UNNAMED_RECORD_VERSION)
            ok = (type(addrs) is list and len(addrs) <= 16 and all(type(a) is str and len(a) <= 256 for a in addrs)
                  and type(value["protocol"]) is str and type(value["manifest"]) is str
                  and type(value["round"]) is int and value["round"] >= 0
                  and value["status"] in STATUSES and type(value["throughput"]) in (int, float)
                  and type(extra) is dict and len(extra) <= 16
                  and all(type(k) is str and type(v) in _SCALAR_TYPES for k, v in extra.items())
                  and type(value["updated"]) in (int, float) and type(wire) is int)
            if not ok:
                return None
            return cls(peer_id, tuple(addrs), value["protocol"], value["manifest"], value["round"], value["status"],
                       float(value["throughput"]), dict(extra), float(value["updated"]), float(expires), wire)
        except (KeyError, TypeError, ValueError):
            return None
