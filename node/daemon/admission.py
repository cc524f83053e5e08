"""Who may be in the swarm: admission by key, and telling apart peers on another manifest.

- Admission: in an allowlist swarm a node whose key is not listed stops at once with a sentence
  that names its peer id; members refuse its messages (the transport's `admit`, wired in
  node/daemon/join.py connect).
- Manifests: each node stores its agreed manifest in the DHT under its digest. When a member
  announces another digest, we fetch that manifest, check it hashes to the digest, and log which
  fields differ; such peers are never eligible (node/daemon/members.py), and the transport
  refuses their messages.
"""

from __future__ import annotations

import json
import logging
import time

from node.config.manifest import Manifest, canonical_json, differences, digest_of

log = logging.getLogger("lowcomm.admission")
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
