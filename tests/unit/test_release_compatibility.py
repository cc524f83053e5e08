"""A node of this release reads what nodes of earlier releases sent and published
(tests/fixtures/releases/<release>/, each written by that release's own code with
write_fixtures.py): a compatible release's message passes every check a receiver runs and its
member joins the view; an incompatible one is refused with the sentence naming both versions,
and its member is left out of the view with that sentence logged once.

When a release ships, add its fixtures and its line to `EXPECTED`."""

import asyncio
import json
import logging
from pathlib import Path

import msgpack
import pytest

from node.config.manifest import load_manifest
from node.daemon.members import MemberCache
from node.loop import BackgroundTasks
from node.rounds.contributions import BanList
from p2p.errors import Reason, Refusal
from p2p.identity import peer_id_bytes
from p2p.records import MemberRecord
from p2p.version import WIRE_VERSION
from p2p.wire import Expectations, decode_frame

RELEASES = Path(__file__).resolve().parents[1] / "fixtures" / "releases"
OURS = load_manifest(Path(__file__).resolve().parents[2] / "configs" / "swarms" / "local.toml")
UPGRADE = "pip install -U lowcomm-node"
# release -> None where this release exchanges with it, else the sentence that refuses it
EXPECTED = {
    "0.1.0": ("peer 12D3KooWMAgQrQLgvwBnBQtLxM4nUodBwjaUTje9NN6eaJHRjYd6 speaks wire protocol 2, "
              f"this node 3: that peer must upgrade lowcomm-node ({UPGRADE}); see CHANGELOG.md"),
    "0.2.0": None,
}


def fixture(release: str) -> tuple[dict, Path]:
    folder = RELEASES / release
    return json.loads((folder / "release.json").read_text()), folder


def test_every_release_with_fixtures_has_an_expectation():
    assert sorted(p.name for p in RELEASES.iterdir() if p.is_dir()) == sorted(EXPECTED)


@pytest.mark.parametrize("release", sorted(EXPECTED))
def test_a_message_of_each_release_is_accepted_or_refused_with_its_sentence(release):
    meta, folder = fixture(release)
    frame = (folder / "push.frame").read_bytes()
    # the receiver of this release, on the manifest that release shipped, at the sender's clock
    expect = Expectations(OURS.swarm.id, load_manifest(folder / "local.toml").digest,
                          peer_id_bytes(meta["recipient"]))
    sender = peer_id_bytes(meta["sender"])
    if EXPECTED[release] is None:
        header, body = decode_frame(frame, sender, expect, meta["timestamp"])
        assert header.version == WIRE_VERSION and header.manifest == OURS.digest and len(body) == 1024
    else:
        with pytest.raises(Refusal) as refused:
            decode_frame(frame, sender, expect, meta["timestamp"])
        assert (refused.value.reason, refused.value.detail) == (Reason.WRONG_VERSION, EXPECTED[release])


def test_every_release_s_manifest_file_loads_to_the_digest_of_this_release():
    for release in EXPECTED:
        assert load_manifest(fixture(release)[1] / "local.toml").digest == OURS.digest, release


class PublishedRecords:
    """Stands in for p2p.membership.Membership (the DHT lookup): answers the fixtures' records,
    parsed as Membership parses what the DHT holds (MemberRecord.from_value)."""

    left: frozenset[str] = frozenset()

    def __init__(self, values: dict[str, dict], expires: float):
        self.values, self.expires = values, expires

    async def peers(self) -> dict[str, MemberRecord]:
        return {peer: MemberRecord.from_value(peer, value, self.expires) for peer, value in self.values.items()}


@pytest.mark.parametrize("release", sorted(EXPECTED))
def test_a_member_of_each_release_joins_the_view_or_is_left_out_once_with_its_sentence(release, caplog):
    meta, folder = fixture(release)
    value = msgpack.unpackb((folder / "member.msgpack").read_bytes(), raw=False)

    async def scenario():
        lookup = PublishedRecords({meta["sender"]: value}, meta["timestamp"] + 60)
        cache = MemberCache(lookup, BackgroundTasks(), manifest=OURS.digest, bans=BanList(2, 60.0),
                            refresh_s=60.0)
        for _ in range(3):
            await cache.refresh()
        return cache
    with caplog.at_level(logging.WARNING, logger="lowcomm.members"):
        cache = asyncio.run(scenario())
    told = [r.getMessage() for r in caplog.records if "wire protocol" in r.getMessage()]
    if EXPECTED[release] is None:
        assert set(cache.records) == {meta["sender"]} and told == []
        assert cache.records[meta["sender"]].manifest == OURS.digest
    else:
        assert cache.records == {}
        assert told == [f"{EXPECTED[release]}; it is left out of this node's member view"]


def test_version_names_pyprojects_release_and_the_wire_protocol(capsys):
    import tomllib

    from node.cli import main
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert capsys.readouterr().out.startswith(
        f"lowcomm-node {pyproject['project']['version']} (wire protocol {WIRE_VERSION}; manifest schemas: ")
