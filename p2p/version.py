"""Versions a peer can read: this release's wire protocol, and the sentence that refuses another.

`WIRE_VERSION` names, together, everything two nodes must read alike to exchange: the message
header (p2p/wire.py, its "v"), the member record (p2p/records.py, its "wire") and the manifest
digest rule (node/config/manifest.py), since every header carries that digest. A release that
changes any of them so that the last release cannot follow bumps it, and says so in
CHANGELOG.md ("swarms must upgrade together"). Two nodes exchange only when they speak the same
version; a node refuses every message of another version
(Reason.WRONG_VERSION, counted like every refusal, never a strike: the peer is honest, only old
or new) and leaves members of another version out of its member view.

The release (`lowcomm-node --version`) is the package's version (pyproject.toml); it changes
with every release, the wire version only with a change peers must share.
"""

from __future__ import annotations

from importlib import metadata

WIRE_VERSION = 3  # 3: manifest digest over the swarm protocol's own values (2: BLAKE3 payloads)
# Member records written before they named their version (release 0.1.0) spoke wire protocol 2.
UNNAMED_RECORD_VERSION = 2
UPGRADE = "pip install -U lowcomm-node"
PACKAGE = "lowcomm-node"


def incompatibility(peer: str, theirs: object) -> str | None:
    """None if a peer speaking wire protocol `theirs` can exchange with this node; else one
    sentence naming both versions and what to do."""
    if type(theirs) is int and theirs == WIRE_VERSION:
        return None
    if type(theirs) is not int:
        return (f"peer {peer} names no wire protocol version this node can read ({str(theirs)[:16]!r}), "
                f"this node speaks {WIRE_VERSION}: it runs another lowcomm-node release; run the "
                f"same release on both ({UPGRADE})")
    if theirs > WIRE_VERSION:
        advice = f"upgrade this node's lowcomm-node ({UPGRADE})"
    else:
        advice = f"that peer must upgrade lowcomm-node ({UPGRADE}); see CHANGELOG.md"
    return f"peer {peer} speaks wire protocol {theirs}, this node {WIRE_VERSION}: {advice}"


def release() -> str:
    """This installation's release, from the package metadata (pyproject.toml's version)."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"
