"""A node's identity: one Ed25519 key, used as the libp2p identity and to sign messages.

The key lives in the node's data directory as a libp2p `crypto.pb.PrivateKey` protobuf
(key_type = Ed25519, data = 32-byte seed + 32-byte public key), which is exactly what p2pd
reads from its `-id` flag. Because an Ed25519 libp2p peer id is the *identity multihash* of
the public key, any peer recovers our public key from the peer id it authenticated on a stream
and checks our signatures with it: no key record or certificate is needed.

The file is created with mode 0600; an existing file that group or others may read is
refused, since whoever reads it can impersonate the node.
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

from p2p.errors import IdentityError

IDENTITY_FILENAME = "identity.key"
SIGNATURE_BYTES = 64
PUBLIC_KEY_BYTES = 32

# An Ed25519 peer id is: multihash code 0x00 (identity), length 36, then the deterministic
# protobuf PublicKey {field 1 = 1 (Ed25519), field 2 = 32 bytes}. go-libp2p always encodes it
# this way, so a strict prefix comparison is both exact and cheap.
_ED25519_PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
_MAX_KEY_FILE_BYTES = 16 * 1024  # an RSA-4096 key file is ~2.4 KB; anything larger is not a key


def identity_path(data_dir: str | os.PathLike) -> Path:
    """Where a node keeps its key inside its data directory."""
    return Path(data_dir) / IDENTITY_FILENAME


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def peer_id_from_public_key(public_key: bytes) -> PeerID:
    """The libp2p peer id (12D3KooW...) of a raw 32-byte Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise IdentityError(f"an Ed25519 public key has {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}.")
    return PeerID(_ED25519_PEER_ID_PREFIX + bytes(public_key))


def peer_id_bytes(peer_id: PeerID | bytes | str) -> bytes:
    if isinstance(peer_id, PeerID):
        return peer_id.to_bytes()
    if isinstance(peer_id, str):
        try:
            return PeerID.from_base58(peer_id).to_bytes()
        except ValueError as error:
            raise IdentityError(f"{peer_id!r} is not a base58 peer id ({error}).") from None
    return bytes(peer_id)


@functools.lru_cache(maxsize=4096)
def _public_key_from_id_bytes(raw: bytes) -> Ed25519PublicKey:
    if len(raw) != len(_ED25519_PEER_ID_PREFIX) + PUBLIC_KEY_BYTES or not raw.startswith(_ED25519_PEER_ID_PREFIX):
        raise IdentityError("this peer id does not embed an Ed25519 public key (an RSA or hashed id); "
                            "lowcomm peers must run with an Ed25519 identity.")
    return Ed25519PublicKey.from_public_bytes(raw[len(_ED25519_PEER_ID_PREFIX):])


def public_key_from_peer_id(peer_id: PeerID | bytes | str) -> Ed25519PublicKey:
    """Recover a peer's Ed25519 public key from its peer id (identity multihash); cached."""
    return _public_key_from_id_bytes(peer_id_bytes(peer_id))


def verify_signature(peer_id: PeerID | bytes | str, data: bytes, signature: bytes) -> bool:
    """True when `signature` over `data` was made by the key that `peer_id` names."""
    if len(signature) != SIGNATURE_BYTES:
        return False
    try:
        public_key_from_peer_id(peer_id).verify(bytes(signature), data)
        return True
    except (InvalidSignature, IdentityError):
        return False


class NodeIdentity:
    """A node's Ed25519 key and the peer id that it implies.

    Create with `NodeIdentity.load_or_create(path)` (the daemon) or `NodeIdentity.generate()`
    (tests that need a key without a file). `path` is what `P2P.create(identity_path=...)` gets.
    """

    def __init__(self, private_key: Ed25519PrivateKey, path: Path | None = None):
        self._private_key = private_key
        self.path = path
        self.public_key_bytes = _raw_public(private_key.public_key())
        self.peer_id: PeerID = peer_id_from_public_key(self.public_key_bytes)

    @classmethod
    def generate(cls) -> "NodeIdentity":
        """A fresh key kept only in memory (use `save` to give it a file)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> "NodeIdentity":
        """Load the key at `path`, or create it (mode 0600, parent directories 0700) if absent."""
        path = Path(path)
        if not path.exists() and not path.is_symlink():
            identity = cls.generate()
            identity.save(path)
            return identity
        return cls.load(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "NodeIdentity":
        """Load an existing key file; every problem is one IdentityError sentence with the fix."""
        path = Path(path)
        try:
            info = path.stat()
        except FileNotFoundError:
            raise IdentityError(f"identity key file {path} does not exist; start the node once to create it.") from None
        except OSError as error:
            raise IdentityError(f"cannot access identity key file {path} ({error.strerror}); "
                                f"check the data directory's permissions.") from None
        if not stat.S_ISREG(info.st_mode):
            raise IdentityError(f"identity key file {path} is not a regular file; "
                                f"remove it so that the node can create a new key.")
        if info.st_mode & 0o077:
            raise IdentityError(f"identity key file {path} is readable or writable by group or others "
                                f"(mode {stat.S_IMODE(info.st_mode):04o}); run `chmod 600 {path}`.")
        if info.st_size > _MAX_KEY_FILE_BYTES:
            raise IdentityError(f"identity key file {path} is {info.st_size} bytes, too large to be a key; "
                                f"move it away so that the node can create a new key.")
        try:
            data = path.read_bytes()
        except OSError as error:
            raise IdentityError(f"cannot read identity key file {path} ({error.strerror}); "
                                f"check that it belongs to the user running the node.") from None
        return cls(_parse_key_file(data, path), path)

    def save(self, path: str | os.PathLike) -> None:
        """Write the key file with mode 0600, never replacing an existing file."""
        path = Path(path)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        seed = self._private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                               serialization.NoEncryption())
        blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519,
                                     data=seed + self.public_key_bytes).SerializeToString()
        # Write a private temporary file, then link it into place: a crash never leaves a half
        # key, and two nodes racing on one data directory cannot overwrite each other's key.
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, blob)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temporary, path)
        except FileExistsError:
            raise IdentityError(f"identity key file {path} appeared while this node was creating it; "
                                f"another node may be using the same data directory.") from None
        finally:
            os.unlink(temporary)
        self.path = path

    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature (64 bytes) of `data`."""
        return self._private_key.sign(data)

    def __repr__(self) -> str:
        return f"NodeIdentity({self.peer_id.to_base58()})"


def _parse_key_file(data: bytes, path: Path) -> Ed25519PrivateKey:
    try:
        message = crypto_pb2.PrivateKey.FromString(data)
    except Exception:  # protobuf's DecodeError, or anything a corrupt file provokes
        raise IdentityError(f"identity key file {path} is not a libp2p private key; "
                            f"move it away so that the node can create a new key.") from None
    if message.key_type != crypto_pb2.KeyType.Ed25519:
        type_name = crypto_pb2.KeyType.Name(message.key_type) if message.key_type in (0, 1, 2, 3) else "unknown"
        raise IdentityError(f"identity key file {path} holds an {type_name} key, but lowcomm needs Ed25519; "
                            f"move it away so that the node creates a new key (its peer id will change).")
    if len(message.data) != 64:
        raise IdentityError(f"identity key file {path} has a {len(message.data)}-byte Ed25519 key instead of 64; "
                            f"move it away so that the node can create a new key.")
    private_key = Ed25519PrivateKey.from_private_bytes(message.data[:32])
    if _raw_public(private_key.public_key()) != message.data[32:]:
        raise IdentityError(f"identity key file {path} is corrupt (its public half does not match its seed); "
                            f"move it away so that the node can create a new key.")
    return private_key
