"""Ed25519 keys for signing `.expert` packages, and the keyring of trusted public keys.

A publisher keeps `signing.key` (PEM PKCS#8, unencrypted, mode 0600) and hands out `signing.pub`
(PEM SubjectPublicKeyInfo). A server trusts a directory of `*.pub` files. Keys are named by their
`key_id`, the first 16 hex digits of the sha256 of the raw public key, which a package's
`signature.json` carries so that the verifier knows which trusted key to try.
"""

from __future__ import annotations

import hashlib
import os
from os import PathLike
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PRIVATE_KEY_FILE = "signing.key"
PUBLIC_KEY_FILE = "signing.pub"


class SigningError(ValueError):
    """A key could not be created, read or trusted; the message names the file."""


def generate_keypair(out_dir: str | PathLike[str]) -> tuple[Path, Path]:
    """Create a new ed25519 key pair in `out_dir` (made if missing) as `signing.key` (mode 0600) and
    `signing.pub`; refuses to overwrite either file. Returns (private path, public path)."""
    directory = Path(out_dir)
    private_path, public_path = directory / PRIVATE_KEY_FILE, directory / PUBLIC_KEY_FILE
    for path in (private_path, public_path):
        if path.exists():
            raise SigningError(f"{path} already exists; refusing to overwrite a key")
    directory.mkdir(parents=True, exist_ok=True)
    private_key = Ed25519PrivateKey.generate()
    private_pem = private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    # O_EXCL: never overwrite, even a file that appeared since the check above; 0600 from the start,
    # so the secret is never readable by others, not even briefly.
    _write_new(private_path, private_pem, 0o600)
    _write_new(public_path, public_pem, 0o644)
    return private_path, public_path


def load_private_key(path: str | PathLike[str]) -> Ed25519PrivateKey:
    """The ed25519 private key in the PEM file `path`; a `SigningError` names the file otherwise."""
    data = _read_key_file(path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise SigningError(f"{path}: the private key is encrypted; expertctl uses unencrypted keys") from None
    except (ValueError, UnsupportedAlgorithm):
        raise SigningError(f"{path}: not a PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningError(f"{path}: not an ed25519 key ({type(key).__name__})")
    return key


def load_public_key(path: str | PathLike[str]) -> Ed25519PublicKey:
    """The ed25519 public key in the PEM file `path`; a `SigningError` names the file otherwise."""
    data = _read_key_file(path, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise SigningError(f"{path}: not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningError(f"{path}: not an ed25519 key ({type(key).__name__})")
    return key


def key_id(public_key: Ed25519PublicKey) -> str:
    """The key's short name: the first 16 hex digits of the sha256 of its raw 32 bytes."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


class Keyring:
    """The public keys a verifier trusts, by key id. `source` says where they came from (the
    directory), for error messages."""

    def __init__(self, keys: dict[str, Ed25519PublicKey], source: str) -> None:
        self._keys = dict(keys)
        self.source = source

    @classmethod
    def from_dir(cls, path: str | PathLike[str]) -> Keyring:
        """Every `*.pub` file in the directory `path`; a missing directory or an invalid key file is a
        `SigningError` naming it. An empty directory gives an empty keyring (which trusts nothing)."""
        directory = Path(path)
        if not directory.is_dir():
            raise SigningError(f"trusted keys directory {directory} does not exist")
        keys = {}
        for key_path in sorted(directory.glob("*.pub")):
            key = load_public_key(key_path)
            keys[key_id(key)] = key
        return cls(keys, str(directory))

    @classmethod
    def of(cls, *public_keys: Ed25519PublicKey) -> Keyring:
        """A keyring of the given keys (for tests and embedding)."""
        return cls({key_id(key): key for key in public_keys}, "<keys given in code>")

    def get(self, key_id: str) -> Ed25519PublicKey | None:
        """The trusted key with this id, or None."""
        return self._keys.get(key_id)

    @property
    def key_ids(self) -> tuple[str, ...]:
        """The ids of the trusted keys, sorted."""
        return tuple(sorted(self._keys))

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"Keyring({self.source!r}, key_ids={list(self.key_ids)})"


def _read_key_file(path: str | PathLike[str], what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise SigningError(f"{path}: no such {what} file") from None
    except IsADirectoryError:
        raise SigningError(f"{path}: is a directory, not a {what} file") from None
    except OSError as exc:
        raise SigningError(f"{path}: cannot read the {what} ({exc.strerror})") from None


def _write_new(path: Path, data: bytes, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise SigningError(f"{path} already exists; refusing to overwrite a key") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
