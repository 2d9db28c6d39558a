"""Signing keys and the trusted keyring: files, modes, ids, and errors that name the file."""

from __future__ import annotations

import hashlib
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from libs.experts.signing import (
    Keyring,
    SigningError,
    generate_keypair,
    key_id,
    load_private_key,
    load_public_key,
)


def test_keygen_writes_a_private_key_only_its_owner_can_read(tmp_path):
    private_path, public_path = generate_keypair(tmp_path / "keys")
    assert (private_path.name, public_path.name) == ("signing.key", "signing.pub")
    assert stat.S_IMODE(private_path.stat().st_mode) == 0o600
    assert private_path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert public_path.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")


def test_the_two_files_are_one_key_pair(tmp_path):
    private_path, public_path = generate_keypair(tmp_path)
    signature = load_private_key(private_path).sign(b"checksums")
    load_public_key(public_path).verify(signature, b"checksums")


def test_keygen_refuses_to_overwrite_a_key(tmp_path):
    private_path, _ = generate_keypair(tmp_path)
    before = private_path.read_bytes()
    with pytest.raises(SigningError, match="already exists"):
        generate_keypair(tmp_path)
    assert private_path.read_bytes() == before


def test_the_key_id_is_the_start_of_the_sha256_of_the_raw_public_key():
    public_key = Ed25519PrivateKey.generate().public_key()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert key_id(public_key) == hashlib.sha256(raw).hexdigest()[:16]


def test_a_missing_key_file_is_named(tmp_path):
    with pytest.raises(SigningError, match=r"absent\.key: no such private key file"):
        load_private_key(tmp_path / "absent.key")
    with pytest.raises(SigningError, match=r"absent\.pub: no such public key file"):
        load_public_key(tmp_path / "absent.pub")


def test_a_file_that_is_not_a_pem_key_is_named(tmp_path):
    (tmp_path / "junk.pub").write_text("not a key")
    with pytest.raises(SigningError, match=r"junk\.pub: not a PEM public key"):
        load_public_key(tmp_path / "junk.pub")
    with pytest.raises(SigningError, match=r"junk\.pub: not a PEM private key"):
        load_private_key(tmp_path / "junk.pub")


def test_keys_of_other_algorithms_are_refused(tmp_path):
    other = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ec.key").write_bytes(
        other.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    (tmp_path / "ec.pub").write_bytes(
        other.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    with pytest.raises(SigningError, match="not an ed25519 key"):
        load_private_key(tmp_path / "ec.key")
    with pytest.raises(SigningError, match="not an ed25519 key"):
        load_public_key(tmp_path / "ec.pub")


def test_an_encrypted_private_key_is_refused_with_a_reason(tmp_path):
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    (tmp_path / "enc.key").write_bytes(pem)
    with pytest.raises(SigningError, match="encrypted"):
        load_private_key(tmp_path / "enc.key")


# -- keyring ----------------------------------------------------------------------------------------


def test_the_keyring_loads_every_pub_file_of_a_directory(tmp_path):
    _, first = generate_keypair(tmp_path / "a")
    _, second = generate_keypair(tmp_path / "b")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / "alice.pub").write_bytes(first.read_bytes())
    (trusted / "bob.pub").write_bytes(second.read_bytes())
    (trusted / "README").write_text("not a key, not a .pub")
    keyring = Keyring.from_dir(trusted)
    ids = sorted(key_id(load_public_key(p)) for p in (first, second))
    assert len(keyring) == 2 and keyring.key_ids == tuple(ids)
    assert keyring.get(ids[0]) is not None and keyring.get("0" * 16) is None
    assert keyring.source == str(trusted)


def test_a_missing_keyring_directory_is_named(tmp_path):
    with pytest.raises(SigningError, match=f"trusted keys directory {tmp_path / 'nowhere'} does not exist"):
        Keyring.from_dir(tmp_path / "nowhere")


def test_an_invalid_key_in_the_keyring_is_named(tmp_path):
    (tmp_path / "broken.pub").write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    with pytest.raises(SigningError, match=r"broken\.pub"):
        Keyring.from_dir(tmp_path)


def test_an_empty_directory_is_an_empty_keyring(tmp_path):
    assert len(Keyring.from_dir(tmp_path)) == 0


def test_a_keyring_of_keys_in_code():
    public_key = Ed25519PrivateKey.generate().public_key()
    keyring = Keyring.of(public_key)
    assert keyring.get(key_id(public_key)) is public_key and len(keyring) == 1
