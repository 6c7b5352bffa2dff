"""A node's identity: an Ed25519 key pair kept in a file, and the signatures it puts on tracker messages.

A named node's key (``--node-id``, or an explicit ``--identity`` file) is generated on its first start and
stored as unencrypted PKCS#8 PEM with mode 0600 (like an SSH host key: whoever can read it can act as the
node); an unnamed node takes a fresh key per process (:func:`node_identity`). The node id derives from the public key
(:func:`node_id_for`), so an id cannot be claimed without the key; tests and ``meshnet up`` may still pick
readable ids, which the tracker then binds to the first key that registers them.

Signing: the signer fills ``public_key`` and ``timestamp``, clears ``signature``, serializes the message
deterministically and signs that, prefixed with a domain string and the message's type name (so a
signature made for one kind of message never verifies as another). Every signed message type has the
three fields ``public_key`` (bytes), ``signature`` (bytes) and ``timestamp`` (double, Unix seconds).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

# Bumped if the signed bytes ever change meaning; a v1 signature then fails to verify as v2.
_DOMAIN = b"meshnet-membership-v1\0"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


class IdentityError(ValueError):
    """A key file that cannot be used: unreadable, not an Ed25519 key, or readable by others."""


class SignatureError(Exception):
    """A signed message that does not verify; ``message`` says why in words an operator can act on."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def node_id_for(public_key: bytes) -> str:
    """The node id a public key stands for: hex of the first 16 bytes of its SHA-256 (32 characters)."""
    return hashlib.sha256(public_key).digest()[:16].hex()


def config_dir() -> Path:
    """``$XDG_CONFIG_HOME/meshnet``, by default ``~/.config/meshnet``."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "meshnet"


# What a node id may hold (``--node-id``): it names the node's key file (``node-<id>.key``), so ids that
# differ must not map to one file name, and file names stop at 255 bytes on common file systems.
NODE_ID_CHARS = "A-Za-z0-9._-"
NODE_ID_MAX_CHARS = 128


def default_identity_path(name: str) -> Path:
    """Where a node named ``name`` (its ``--node-id``) keeps its key when ``--identity`` is not given:
    ``<config_dir>/node-<name>.key``, so a named node keeps its id and key across restarts.

    Characters other than letters, digits, ``.``, ``_`` and ``-`` become ``_``.

    Raises:
        ValueError: ``name`` is empty (an unnamed node takes a fresh key instead, see :func:`node_identity`).
    """
    if not name:
        raise ValueError("a key file is named after a node id; an unnamed node has no default key file")
    safe = re.sub(f"[^{NODE_ID_CHARS}]", "_", name)
    return config_dir() / f"node-{safe}.key"


def node_identity(node_id: str | None, identity_path: str | os.PathLike | None) -> "NodeIdentity":
    """The identity a node process starts with.

    Args:
        node_id: the node's ``--node-id``, or None.
        identity_path: the node's ``--identity`` key file, or None.

    Returns:
        The key in ``identity_path`` when given (created on first use); else, for a named node, the key in
        :func:`default_identity_path` (stable across restarts); else a fresh in-memory key, so every
        unnamed node process has an id of its own: two spares for one range never share one, and a
        restarted unnamed node registers as a new node.

    Raises:
        IdentityError: the key file cannot be used or created (see :func:`load_or_create_identity`).
    """
    if identity_path:
        return load_or_create_identity(identity_path)
    if node_id:
        return load_or_create_identity(default_identity_path(node_id))
    return NodeIdentity.generate()


def canonical_bytes(message) -> bytes:
    """The bytes a signature covers: domain, message type name, and the message serialized
    deterministically with ``signature`` cleared (``public_key`` and ``timestamp`` are included)."""
    copy = type(message)()
    copy.CopyFrom(message)
    copy.ClearField("signature")
    return _DOMAIN + copy.DESCRIPTOR.full_name.encode() + b"\0" + copy.SerializeToString(deterministic=True)


@dataclass(frozen=True)
class NodeIdentity:
    """An Ed25519 private key and what derives from it.

    Attributes:
        private_key: the signing key.
        path: the file it was loaded from or saved to (None: in memory only).
    """

    private_key: Ed25519PrivateKey
    path: Path | None = None

    @classmethod
    def generate(cls) -> "NodeIdentity":
        """A fresh in-memory identity (tests; nodes use :func:`load_or_create_identity`)."""
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte public key."""
        return self.private_key.public_key().public_bytes(serialization.Encoding.Raw,
                                                          serialization.PublicFormat.Raw)

    @property
    def node_id(self) -> str:
        """:func:`node_id_for` of the public key."""
        return node_id_for(self.public_key)

    def sign(self, message, timestamp: float | None = None):
        """Sign ``message`` in place (fills ``public_key``, ``timestamp``, ``signature``) and return it.

        Args:
            message: a protobuf message with the three signing fields (NodeInfo, HeartbeatRequest,
                NodeRef, WorkReport).
            timestamp: Unix seconds to sign with; default now (tests pass old ones).
        """
        message.public_key = self.public_key
        message.timestamp = time.time() if timestamp is None else float(timestamp)
        message.signature = self.private_key.sign(canonical_bytes(message))
        return message


def is_signed(message) -> bool:
    """True when any of the signing fields is set (a message with only some set is still refused)."""
    return bool(message.public_key or message.signature or message.timestamp)


def verify_message(message, now: float | None = None, max_skew_s: float = 60.0) -> bytes:
    """Check ``message``'s signature and timestamp; return the public key that signed it.

    Args:
        message: a signed protobuf message (see :meth:`NodeIdentity.sign`).
        now: Unix seconds to judge the timestamp against; default the current time.
        max_skew_s: how far (seconds) the timestamp may lie before or after ``now``.

    Raises:
        SignatureError: a field is missing or malformed, the signature does not verify, or the timestamp
            is more than ``max_skew_s`` off (the message names how far, so clock skew is recognizable).
    """
    kind = message.DESCRIPTOR.name
    if len(message.public_key) != PUBLIC_KEY_BYTES:
        raise SignatureError(f"{kind}: public_key must be {PUBLIC_KEY_BYTES} bytes (Ed25519), "
                             f"got {len(message.public_key)}")
    if len(message.signature) != SIGNATURE_BYTES:
        raise SignatureError(f"{kind}: signature must be {SIGNATURE_BYTES} bytes (Ed25519), "
                             f"got {len(message.signature)}")
    try:
        Ed25519PublicKey.from_public_bytes(message.public_key).verify(message.signature, canonical_bytes(message))
    except (InvalidSignature, ValueError):
        raise SignatureError(f"{kind}: bad signature (the message was altered or signed with another "
                             "key)") from None
    now = time.time() if now is None else now
    age = now - message.timestamp
    if not abs(age) <= max_skew_s:  # also catches NaN
        when = f"{age:.0f} s old" if age > 0 else f"{-age:.0f} s in the future"
        raise SignatureError(f"{kind}: timestamp is {when}; messages more than {max_skew_s:.0f} s off the "
                             "tracker's clock are refused (replayed, or the clocks disagree: sync them with NTP)")
    return bytes(message.public_key)


def _check_permissions(path: Path) -> None:
    if os.name != "posix":
        return
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise IdentityError(f"identity file {path} has permissions {mode:04o}: anyone who can read it can act "
                            f"as this node; run: chmod 600 {path}")


def load_identity(path: str | os.PathLike) -> NodeIdentity:
    """Load the key in ``path``.

    Raises:
        IdentityError: unreadable, readable by group/others (POSIX), or not an Ed25519 PEM private key.
    """
    p = Path(path)
    if p.is_dir():
        raise IdentityError(f"identity file {p} is a directory; name a key file (it is created when missing)")
    _check_permissions(p)
    try:
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
    except OSError as e:
        raise IdentityError(f"cannot read identity file {p}: {e.strerror or e}") from None
    except (ValueError, TypeError) as e:
        raise IdentityError(f"identity file {p} is not an unencrypted PEM private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"identity file {p} holds a {type(key).__name__}, expected an Ed25519 key")
    return NodeIdentity(key, p)


def load_or_create_identity(path: str | os.PathLike) -> NodeIdentity:
    """The identity in ``path``, generating and saving a new key (mode 0600) when the file is missing.

    Creation is atomic: the key is written to a temporary file and hard-linked into place, so two
    processes starting at once end up with the same key rather than one overwriting the other's.

    Raises:
        IdentityError: the existing file cannot be used (see :func:`load_identity`), or the directory
            cannot be written.
    """
    p = Path(path).expanduser()
    if p.exists():
        return load_identity(p)
    if (above := next((d for d in p.parents if d.exists()), None)) is not None and not above.is_dir():
        raise IdentityError(f"cannot create identity file {p}: {above} is a file, not a directory")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    try:
        p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(prefix=".node-key-", dir=p.parent)  # mkstemp creates it 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
            try:
                os.link(tmp, p)
            except FileExistsError:
                return load_identity(p)  # another process won the race: use its key
            except OSError:
                # No hard links on this filesystem: exclusive create instead (a racing reader may then
                # briefly see a partial file, which only matters if two nodes share one key path).
                with os.fdopen(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                    f.write(pem)
        finally:
            os.unlink(tmp)
    except OSError as e:
        raise IdentityError(f"cannot create identity file {p}: {e.strerror or e}") from None
    return NodeIdentity(key, p)
