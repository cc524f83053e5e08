"""Joining a swarm: admission, telling apart peers on another manifest, and the late join.

- Admission: in an allowlist swarm a node whose key is not listed stops at once with a sentence
  that names its peer id; members refuse its messages (node/daemon/daemon.py wires the check).
- Manifests: each node stores its agreed manifest in the DHT under its digest. When a member
  announces another digest, we fetch that manifest, check it hashes to the digest, and log which
  fields differ; such peers are never paired with, and the transport refuses their messages.
- Late join: a node with no checkpoint, in a swarm already past round 0, downloads the outer
  state from a member over a signed stream, checks it against the digest that member announced
  (DiLoCoX: the digest a majority announced), and only then starts, at the swarm's round.
  Nothing is written until the state is complete and verified.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch

from node.config.manifest import Manifest, canonical_json, differences, digest_of
from node.rounds.wire_tensors import from_wire
from p2p.errors import P2PError, Reason, RemoteRefused
from protocol.dilocox import winning_digest
from protocol.tensors import weights_digest

log = logging.getLogger("lowcomm.join")
STATE_KIND = "state"
MANIFEST_TTL_S = 24 * 3600.0


class AdmissionError(RuntimeError):
    """This node may not join the swarm; the message says why and what to do."""


def check_admission(manifest: Manifest, peer_id: str) -> None:
    admission = manifest.admission
    if admission.mode == "allowlist" and peer_id not in admission.public_keys:
        raise AdmissionError(f"this node's key {peer_id} is not on swarm '{manifest.swarm.id}''s "
                             f"allowlist: send it to the swarm's operator to be added")


def refused_admission(swarm: str, peer_id: str, members: str) -> str:
    """The sentence of a node that members refused NOT_ADMITTED (it skipped check_admission,
    or its manifest is older than the members' allowlist)."""
    return (f"{members} of swarm '{swarm}' refused this node: its key {peer_id} is not on the "
            f"swarm's allowlist; send it to the swarm's operator to be added")


def manifest_key(swarm: str, digest: str) -> str:
    return f"lowcomm/swarm/{swarm}/manifest/{digest}"


async def publish_manifest(dht, manifest: Manifest) -> None:
    text = canonical_json(manifest.agreed())
    await dht.store(manifest_key(manifest.swarm.id, manifest.digest), text,
                    time.time() + MANIFEST_TTL_S)


class ManifestWatch:
    """Logs once per foreign digest which fields differ from ours."""

    def __init__(self, dht, manifest: Manifest):
        self.dht, self.manifest = dht, manifest
        self.explained: dict[str, str] = {}

    async def check(self, records) -> None:
        for record in records:
            digest = record.manifest
            if digest == self.manifest.digest or digest in self.explained:
                continue
            self.explained[digest] = await self._explain(record.peer_id, digest)
            log.warning("%s", self.explained[digest])

    async def _explain(self, peer: str, digest: str) -> str:
        found = await self.dht.get(manifest_key(self.manifest.swarm.id, digest), latest=True)
        head = (f"peer {peer} uses another manifest of swarm '{self.manifest.swarm.id}' "
                f"(digest {digest[:12]} vs ours {self.manifest.digest[:12]})")
        if found is None or not isinstance(found.value, str):
            return head + "; its manifest is not in the DHT, so the differing fields are unknown"
        try:
            theirs = json.loads(found.value)
            if not isinstance(theirs, dict) or digest_of(theirs) != digest:
                return head + "; the manifest stored under its digest does not match it"
        except (ValueError, TypeError):
            return head + "; its stored manifest is not valid JSON"
        fields = differences(self.manifest.agreed(), theirs)
        return head + f": it differs in {', '.join(fields[:6]) or 'nothing visible'}; it is ignored"


@dataclass
class JoinState:
    round_index: int
    tensors: dict[str, dict[str, torch.Tensor]]  # group -> name -> fp32 tensor
    meta: dict
    source: str


def swarm_round(records, manifest_digest: str) -> int:
    """The highest round a member on our manifest has reached (0 for a new swarm)."""
    return max((r.round for r in records if r.manifest == manifest_digest), default=0)


def expected_digest(records, source, protocol: str) -> tuple[str | None, int | None]:
    """The digest a joiner must find in the downloaded φ, and the round it belongs to.

    NoLoCo members each hold their own φ: trust the serving member's signed announcement.
    DiLoCoX members share φ: trust what the majority announced for the newest round.
    """
    if protocol == "noloco":
        return source.extra.get("phi"), source.extra.get("phi_round")
    announced = [(r.extra.get("phi_round"), r.extra["phi"]) for r in records
                 if r.extra.get("phi") and isinstance(r.extra.get("phi_round"), int)]
    if not announced:
        return None, None
    newest = max(rnd for rnd, _ in announced)
    return winning_digest(Counter(digest for rnd, digest in announced if rnd == newest)), newest


async def download_state(transport, cache, manifest: Manifest, attempts: int = 3,
                         timeout_s: float = 120.0, announce_wait_s: float = 10.0) -> JoinState | None:
    """The outer state of the most advanced member, verified; None when no member has one.

    The state is accepted only when its digest equals the digest announced (signed, in the DHT)
    for the same round; an announcement that lags the state is waited for, briefly.
    """
    candidates = sorted((r for r in cache.peers() if r.manifest == manifest.digest
                         and r.round > 0 and r.extra.get("phi")), key=lambda r: -r.round)
    errors, not_admitted = [], 0
    for source in candidates[:attempts]:
        try:
            received = await transport.request(source.peer_id, STATE_KIND, 0, timeout=timeout_s,
                                               streams=transport.limits.parallel_streams)
        except P2PError as exc:  # a member that failed mid-transfer: nothing of it is kept
            log.warning("the state from %s did not arrive (%s); asking the next member",
                        source.peer_id, exc)
            errors.append(f"{source.peer_id}: {exc}")
            not_admitted += isinstance(exc, RemoteRefused) and exc.reason == Reason.NOT_ADMITTED
            continue
        groups = {g: from_wire(received, f"{g}/") for g in ("phi", "momentum")}
        got, state_round = weights_digest(groups["phi"]), received.meta.get("phi_round")
        deadline = time.monotonic() + announce_wait_s
        while True:
            fresh = {r.peer_id: r for r in cache.peers()}
            if source.peer_id not in fresh:
                digest, digest_round = None, None
                break
            digest, digest_round = expected_digest(fresh.values(), fresh[source.peer_id],
                                                   manifest.protocol.name)
            # NoLoCo's overlap correction changes φ within a round: wait for its announcement
            if (digest_round == state_round and digest == got) or time.monotonic() > deadline:
                break
            cache.refreshed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(cache.refreshed.wait(), timeout=2.0)
        if digest is None or digest_round != state_round or got != digest:
            errors.append(f"{source.peer_id}: state of round {state_round} has digest {got[:12]}, "
                          f"the announced digest is {str(digest)[:12]} for round {digest_round}")
            continue
        return JoinState(int(received.meta.get("round", source.round)), groups,
                         dict(received.meta), source.peer_id)
    if errors and not_admitted == len(errors):
        raise AdmissionError(refused_admission(manifest.swarm.id,
                                               transport.identity.peer_id.to_base58(),
                                               f"all {not_admitted} members asked"))
    if errors:
        raise RuntimeError("late join failed: no member served a verifiable state ("
                           + "; ".join(errors[:3]) + "); retry later")
    return None


async def wait_for_members(cache, timeout_s: float) -> None:
    """Gives the DHT a moment to show existing members before deciding we are the first."""
    deadline = time.monotonic() + timeout_s
    while not cache.peers() and time.monotonic() < deadline:
        cache.refreshed.clear()
        try:
            await asyncio.wait_for(cache.refreshed.wait(), timeout=max(0.05, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            break
