"""The node's Ed25519 identity: key file creation, permissions, loading errors, peer-id keys."""

import os
import stat

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2

from p2p.errors import IdentityError
from p2p.identity import (NodeIdentity, identity_path, peer_id_from_public_key, public_key_from_peer_id,
                          verify_signature)


def test_created_key_is_private_and_reloads_to_the_same_peer_id(tmp_path):
    path = identity_path(tmp_path / "data")
    first = NodeIdentity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert first.peer_id.to_base58().startswith("12D3KooW")  # Ed25519 identity multihash
    again = NodeIdentity.load_or_create(path)
    assert again.peer_id == first.peer_id
    assert not list(path.parent.glob(".*.tmp"))


def test_key_file_is_a_libp2p_ed25519_private_key(tmp_path):
    identity = NodeIdentity.load_or_create(tmp_path / "identity.key")
    message = crypto_pb2.PrivateKey.FromString((tmp_path / "identity.key").read_bytes())
    assert message.key_type == crypto_pb2.KeyType.Ed25519
    assert message.data[32:] == identity.public_key_bytes


def test_public_key_recovered_from_peer_id_checks_signatures(tmp_path):
    identity = NodeIdentity.generate()
    other = NodeIdentity.generate()
    signature = identity.sign(b"hello")
    assert verify_signature(identity.peer_id, b"hello", signature)
    assert verify_signature(identity.peer_id.to_base58(), b"hello", signature)
    assert not verify_signature(identity.peer_id, b"hellO", signature)
    assert not verify_signature(other.peer_id, b"hello", signature)
    assert not verify_signature(identity.peer_id, b"hello", signature[:-1])
    assert peer_id_from_public_key(identity.public_key_bytes) == identity.peer_id
    raw = public_key_from_peer_id(identity.peer_id).public_bytes_raw()
    assert raw == identity.public_key_bytes


def test_hashed_peer_id_has_no_key_to_recover():
    rsa_style = PeerID.from_base58("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
    with pytest.raises(IdentityError, match="Ed25519"):
        public_key_from_peer_id(rsa_style)
    assert not verify_signature(rsa_style, b"x", b"\0" * 64)


def test_too_open_key_file_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "identity.key"
    NodeIdentity.load_or_create(path)
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError, match=r"chmod 600"):
        NodeIdentity.load_or_create(path)


def test_read_only_owner_key_is_accepted(tmp_path):
    path = tmp_path / "identity.key"
    created = NodeIdentity.load_or_create(path)
    os.chmod(path, 0o400)  # what hivemind's own generate_identity writes
    assert NodeIdentity.load(path).peer_id == created.peer_id


def test_rsa_key_file_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "identity.key"
    P2P.generate_identity(str(path))  # hivemind's RSA-2048 identity file
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match=r"RSA key.*Ed25519.*move it away"):
        NodeIdentity.load_or_create(path)


@pytest.mark.parametrize("content, message", [
    (b"not a key at all \xff\xfe", "not a libp2p private key"),
    (crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=b"\1" * 32).SerializeToString(),
     "32-byte Ed25519 key"),
    (crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=b"\1" * 64).SerializeToString(), "corrupt"),
])
def test_malformed_key_file_is_one_clear_sentence(tmp_path, content, message):
    path = tmp_path / "identity.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content)
    os.close(fd)
    with pytest.raises(IdentityError, match=message) as error:
        NodeIdentity.load(path)
    assert str(error.value).count(". ") == 0 and str(error.value).endswith(".")


def test_directory_in_place_of_key_file_is_refused(tmp_path):
    (tmp_path / "identity.key").mkdir()
    with pytest.raises(IdentityError, match="not a regular file"):
        NodeIdentity.load_or_create(tmp_path / "identity.key")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file, so permissions cannot make it unreadable")
def test_unreadable_key_file_is_reported(tmp_path):
    path = tmp_path / "identity.key"
    NodeIdentity.load_or_create(path)
    os.chmod(path, 0o000)
    with pytest.raises(IdentityError, match="cannot read"):
        NodeIdentity.load(path)


def test_existing_file_is_never_overwritten(tmp_path):
    path = tmp_path / "identity.key"
    NodeIdentity.load_or_create(path)
    with pytest.raises(IdentityError, match="appeared"):
        NodeIdentity.generate().save(path)
