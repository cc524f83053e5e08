"""The manifest digest covers what a swarm's members agree on, and changes only with it
(node/config/manifest.py's rule): the shipped manifests' digests are pinned, each protocol's
defaults are pinned per schema version, and a manifest file of the last release still loads to
the same digest as the file shipped now."""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from node.config.manifest import (SCHEMA_VERSIONS, SWARM_DIR, Manifest, ProtocolSection, differences,
                                  find_manifest, load_manifest, read_by)
from node.config.schema import spec

GOLDEN_DEFAULTS = Path(__file__).resolve().parents[1] / "golden" / "manifest_defaults.json"
RELEASES = Path(__file__).resolve().parents[1] / "fixtures" / "releases"
# A change here splits every swarm on that manifest from its members of the last release: say
# so in CHANGELOG.md ("swarms must upgrade together"), and in each file's digest line.
SHIPPED_DIGESTS = {
    "local": "31c4440de59c618d2a881e09414c4cb2",
    "local-dilocox": "700a81f998202d7c47cdd5c1c3de75dc",
}


@pytest.mark.parametrize("swarm", sorted(SHIPPED_DIGESTS))
def test_shipped_manifests_keep_their_pinned_digest_and_say_it(swarm):
    path = find_manifest(swarm)
    assert load_manifest(path).digest == SHIPPED_DIGESTS[swarm]
    said = re.search(r"digest ([0-9a-f]{32})", path.read_text()).group(1)
    assert said == SHIPPED_DIGESTS[swarm], f"{path}'s digest line is stale"


def test_every_shipped_manifest_is_pinned():
    assert sorted(p.stem for p in SWARM_DIR.glob("*.toml")) == sorted(SHIPPED_DIGESTS)


@pytest.mark.parametrize("protocol", sorted(SCHEMA_VERSIONS))
def test_a_protocols_defaults_change_only_with_its_schema_version(protocol):
    version = str(SCHEMA_VERSIONS[protocol])
    pinned = json.loads(GOLDEN_DEFAULTS.read_text())[protocol].get(version)
    assert pinned is not None, (f"schema {protocol}/{version} has no pinned defaults in {GOLDEN_DEFAULTS}: "
                                f"add them (the defaults {protocol} reads now)")
    current = read_by(protocol, Manifest().defaults())
    for section in sorted(set(pinned) | set(current)):
        for key in sorted(set(pinned.get(section, {})) | set(current.get(section, {}))):
            name = f"{section}.{key}"
            if key not in pinned.get(section, {}):
                pytest.fail(f"{name} is new (default {current[section][key]!r}): add it to "
                            f"{protocol}/{version} in {GOLDEN_DEFAULTS.name}; digests stay as they were")
            if key not in current.get(section, {}):
                pytest.fail(f"{name} is gone or no longer read by {protocol}: manifests setting it "
                            f"change digest: bump SCHEMA_VERSIONS[{protocol!r}] and pin a new row")
            assert current[section][key] == pinned[section][key], (
                f"{name}'s default changed from {pinned[section][key]!r} to {current[section][key]!r} "
                f"within schema {protocol}/{version}: bump SCHEMA_VERSIONS[{protocol!r}], pin the new "
                f"defaults as a new row, and say in CHANGELOG.md that swarms must upgrade together")


def test_the_last_releases_manifest_file_is_accepted_with_the_digest_shipped_now():
    old = RELEASES / "0.1.0" / "local.toml"
    assert "digest e492e97405ad87aa65ff0a057849712a" in old.read_text()  # as 0.1.0 wrote it
    assert load_manifest(old).digest == SHIPPED_DIGESTS["local"]


def test_the_other_protocols_keys_never_enter_a_digest():
    noloco, dilocox = load_manifest(find_manifest("local")), load_manifest(find_manifest("local-dilocox"))
    before = noloco.digest, dilocox.digest
    noloco.protocol.outer_lr = dilocox.protocol.wire_dtype = None  # any value: unread
    noloco.protocol.codec, dilocox.contributions.min_alignment_sigmas = "topk", 5.0
    assert (noloco.digest, dilocox.digest) == before
    noloco.protocol.wire_dtype, dilocox.protocol.outer_lr = "int8", 0.5  # read: both change
    assert noloco.digest != before[0] and dilocox.digest != before[1]


def test_a_value_written_out_at_its_default_is_the_same_agreement():
    a, b = Manifest(), Manifest()
    b.protocol.inner_steps = ProtocolSection().inner_steps
    assert a.digest == b.digest
    b.swarm.description = "a line for humans, not agreed"
    assert a.digest == b.digest


@dataclass
class ProtocolWithANewKey(ProtocolSection):
    min_link_rate: float = spec(0.0, "a key a later release adds, with a default")


def test_adding_a_key_with_a_default_changes_no_digest_unless_a_file_sets_it():
    for swarm in SHIPPED_DIGESTS:
        shipped = load_manifest(find_manifest(swarm))
        extended = Manifest(**{**vars(shipped), "protocol": ProtocolWithANewKey(**vars(shipped.protocol))})
        assert extended.digest == SHIPPED_DIGESTS[swarm]
        extended.protocol.min_link_rate = 1e6
        assert extended.digest != SHIPPED_DIGESTS[swarm]


def test_differences_fill_in_defaults_and_name_another_schema():
    a, b = Manifest(), Manifest()
    b.protocol.inner_steps = 20
    assert differences(a.agreed(), b.agreed()) == ["protocol.inner_steps (50 here vs 20 there)"]
    newer = {**b.agreed(), "schema": "noloco/99"}
    assert differences(a.agreed(), newer)[0] == "schema ('noloco/1' here vs 'noloco/99' there)"
