"""`.expert` packages: a signed round trip for each adapter kind, and a refusal that names the
problem for every way a package can be damaged, forged or malformed."""

from __future__ import annotations

import base64
import gzip
import io
import json
import tarfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import load as load_safetensors

from libs.experts.integrity import format_checksums, sha256_hex
from libs.experts.jsonio import dumps_canonical
from libs.experts.manifest import BaseModelIdentity
from libs.experts.package import (
    PACKAGE_FILES,
    PackageError,
    build_package,
    inspect_package,
    read_package,
    write_package,
)
from libs.experts.peft_adapter import PeftAdapter, read_peft_adapter
from libs.experts.signing import Keyring, key_id
from tests.helpers.manifests import manifest_for
from tests.helpers.peft_adapters import write_all_adapters

KEY = Ed25519PrivateKey.generate()
OTHER_KEY = Ed25519PrivateKey.generate()
TRUSTED = Keyring.of(KEY.public_key())
KINDS = ("lora", "ia3", "soft_prompt")


@pytest.fixture(scope="module")
def base(tiny_llama) -> BaseModelIdentity:
    return BaseModelIdentity.from_dir(tiny_llama)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, PeftAdapter]:
    directories = write_all_adapters(tiny_llama, tmp_path_factory.mktemp("peft"))
    return {kind: read_peft_adapter(path) for kind, path in directories.items()}


@pytest.fixture(scope="module")
def lora_package(adapters, base) -> bytes:
    adapter = adapters["lora"]
    return build_package(manifest_for(adapter, base), adapter.config, adapter.weights, KEY)


def unpack(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {member.name: tar.extractfile(member).read() for member in tar}


def repack(files: dict[str, bytes], *, extra: tuple[tarfile.TarInfo, ...] = ()) -> bytes:
    """A package of `files` as they are (no new checksums or signature), plus raw `extra` members."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isreg() else None)
    return gzip.compress(raw.getvalue())


def resign(
    files: dict[str, bytes], key: Ed25519PrivateKey = KEY, *, claimed_key_id: str | None = None
) -> bytes:
    """A package of `files` with fresh checksums, signed by `key` (under `claimed_key_id` if given)."""
    payload = {
        name: files[name] for name in ("manifest.json", "adapter_config.json", "adapter_model.safetensors")
    }
    checksums = format_checksums(payload)
    signature = {
        "algorithm": "ed25519",
        "key_id": claimed_key_id or key_id(key.public_key()),
        "signature": base64.b64encode(key.sign(checksums)).decode(),
    }
    return repack(payload | {"checksums.sha256": checksums, "signature.json": dumps_canonical(signature)})


def refusal(data: bytes, keyring: Keyring = TRUSTED, **kwargs) -> str:
    with pytest.raises(PackageError) as info:
        read_package(data, keyring, **kwargs)
    return str(info.value)


def edited_json(data: bytes, **changes) -> bytes:
    return dumps_canonical(json.loads(data) | changes)


# -- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_package_reads_back_what_was_packed(adapters, base, kind):
    adapter = adapters[kind]
    manifest = manifest_for(adapter, base)
    data = build_package(manifest, adapter.config, adapter.weights, KEY)
    package = read_package(data, TRUSTED)
    assert package.manifest == manifest and package.adapter_config == adapter.config
    assert package.weights == adapter.weights
    assert package.key_id == key_id(KEY.public_key()) and package.size == len(data)
    assert package.content_hash == sha256_hex(unpack(data)["checksums.sha256"])
    expected = load_safetensors(adapter.weights)
    tensors = package.tensors()
    assert tensors.keys() == expected.keys() and all(tensors[k].equal(expected[k]) for k in expected)


@pytest.mark.parametrize("kind", KINDS)
def test_packing_is_deterministic(adapters, base, kind):
    adapter = adapters[kind]
    manifest = manifest_for(adapter, base)
    first = build_package(manifest, adapter.config, adapter.weights, KEY)
    assert build_package(manifest, adapter.config, adapter.weights, KEY) == first


def test_the_content_hash_depends_on_the_content_not_the_signer(adapters, base):
    adapter = adapters["lora"]
    manifest = manifest_for(adapter, base)
    mine = read_package(build_package(manifest, adapter.config, adapter.weights, KEY), TRUSTED)
    theirs = read_package(
        build_package(manifest, adapter.config, adapter.weights, OTHER_KEY),
        Keyring.of(OTHER_KEY.public_key()),
    )
    newer = build_package(manifest_for(adapter, base, version="1.0.1"), adapter.config, adapter.weights, KEY)
    assert mine.content_hash == theirs.content_hash != read_package(newer, TRUSTED).content_hash


def test_the_package_holds_exactly_the_five_files_in_order(lora_package):
    with tarfile.open(fileobj=io.BytesIO(lora_package), mode="r:gz") as tar:
        members = tar.getmembers()
    assert tuple(m.name for m in members) == PACKAGE_FILES
    assert all(m.isreg() and m.mtime == 0 and m.uid == 0 and m.mode == 0o644 for m in members)


def test_the_checksum_file_is_sha256sum_format_sorted_by_path(lora_package):
    files = unpack(lora_package)
    lines = files["checksums.sha256"].decode().splitlines()
    names = ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    assert lines == [f"{sha256_hex(files[name])}  {name}" for name in names]


def test_a_written_package_reads_from_its_path(lora_package, tmp_path):
    path = write_package(tmp_path / "sql.expert", lora_package)
    assert path.read_bytes() == lora_package and read_package(path, TRUSTED).size == len(lora_package)
    assert [p.name for p in tmp_path.iterdir()] == ["sql.expert"]


# -- refusals: integrity ----------------------------------------------------------------------------


def test_a_flipped_byte_in_the_weights_is_a_checksum_mismatch(lora_package):
    files = unpack(lora_package)
    weights = bytearray(files["adapter_model.safetensors"])
    weights[-1] ^= 0x01
    assert refusal(repack(files | {"adapter_model.safetensors": bytes(weights)})) == (
        "adapter_model.safetensors: checksum mismatch"
    )


def test_a_modified_manifest_is_a_checksum_mismatch(lora_package):
    files = unpack(lora_package)
    tampered = edited_json(files["manifest.json"], priority=1000)
    assert refusal(repack(files | {"manifest.json": tampered})) == "manifest.json: checksum mismatch"


def test_a_modified_manifest_with_new_checksums_breaks_the_signature(lora_package):
    files = unpack(lora_package)
    payload = files | {"manifest.json": edited_json(files["manifest.json"], priority=1000)}
    checksums = format_checksums(
        {k: payload[k] for k in ("manifest.json", "adapter_config.json", "adapter_model.safetensors")}
    )
    message = refusal(repack(payload | {"checksums.sha256": checksums}))
    assert message == f"signature.json: signature does not verify with key {key_id(KEY.public_key())}"


def test_a_signature_by_another_key_claiming_the_trusted_key_id_does_not_verify(lora_package):
    forged = resign(unpack(lora_package), OTHER_KEY, claimed_key_id=key_id(KEY.public_key()))
    assert refusal(forged) == f"signature.json: signature does not verify with key {key_id(KEY.public_key())}"


def test_a_package_signed_by_an_unknown_key_is_refused(lora_package, tmp_path):
    other_id = key_id(OTHER_KEY.public_key())
    message = refusal(resign(unpack(lora_package), OTHER_KEY), Keyring.from_dir(tmp_path))
    assert message == (
        f"signature.json: signed by key {other_id} which is not in the trusted keyring {tmp_path} "
        "(which holds no keys)"
    )


@pytest.mark.parametrize(
    ("signature", "message"),
    [
        (b"{}", "signature.json: must be an object with exactly"),
        (b'{"algorithm": "rsa", "key_id": "0123456789abcdef", "signature": ""}', "algorithm 'rsa'"),
        (b'{"algorithm": "ed25519", "key_id": "xyz", "signature": ""}', "key_id 'xyz'"),
        (b'{"algorithm": "ed25519", "key_id": "0123456789abcdef", "signature": "!!"}', "not base64"),
    ],
)
def test_a_malformed_signature_file_is_refused(lora_package, signature, message):
    assert message in refusal(repack(unpack(lora_package) | {"signature.json": signature}))


def test_a_checksum_file_that_does_not_list_every_payload_file_is_refused(lora_package):
    files = unpack(lora_package)
    short = b"".join(files["checksums.sha256"].splitlines(keepends=True)[:2])
    assert (
        refusal(repack(files | {"checksums.sha256": short}))
        == "checksums.sha256: does not list 'manifest.json'"
    )


def test_a_checksum_file_listing_another_file_is_refused(lora_package):
    files = unpack(lora_package)
    extra = files["checksums.sha256"] + f"{'0' * 64}  extra.txt\n".encode()
    assert "lists 'extra.txt', which is not a payload file" in refusal(
        repack(files | {"checksums.sha256": extra})
    )


# -- refusals: signed but invalid content -----------------------------------------------------------


def test_a_properly_signed_manifest_named_dotdot_is_refused(lora_package):
    files = unpack(lora_package)
    message = refusal(resign(files | {"manifest.json": edited_json(files["manifest.json"], name="../x")}))
    assert message == "manifest.json: manifest.name: '../x' does not match [a-z0-9][a-z0-9-]{1,63}"


def test_a_peft_type_that_disagrees_with_the_adapter_type_is_refused(lora_package):
    files = unpack(lora_package)
    config = edited_json(files["adapter_config.json"], peft_type="IA3")
    message = refusal(resign(files | {"adapter_config.json": config}))
    assert message == "adapter_config.json: peft_type 'IA3' does not match the manifest's adapter_type 'lora'"


def test_a_rank_that_disagrees_with_the_manifest_is_refused(lora_package):
    files = unpack(lora_package)
    config = edited_json(files["adapter_config.json"], r=4)
    assert "adapter_config.json: r 4 does not match the manifest's rank 8" in refusal(
        resign(files | {"adapter_config.json": config})
    )


def test_a_signed_safetensors_file_whose_header_does_not_parse_is_refused(lora_package):
    files = unpack(lora_package)
    broken = b"\xff" * 8 + files["adapter_model.safetensors"][8:]
    message = refusal(resign(files | {"adapter_model.safetensors": broken}))
    assert message.startswith("adapter_model.safetensors: invalid safetensors header")


def test_build_refuses_what_read_would_refuse(adapters, base):
    adapter = adapters["lora"]
    with pytest.raises(PackageError, match="does not match the manifest's adapter_type"):
        build_package(manifest_for(adapters["ia3"], base), adapter.config, adapter.weights, KEY)
    too_small = BaseModelIdentity.from_hf_config(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 384, "hidden_size": 64}
        | {"intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4}
    )
    with pytest.raises(PackageError, match="layer 1 but the base model has 1"):
        build_package(manifest_for(adapter, too_small), adapter.config, adapter.weights, KEY)


# -- refusals: the container ------------------------------------------------------------------------


def test_an_extra_file_is_refused(lora_package):
    assert refusal(repack(unpack(lora_package) | {"extra.txt": b"hi"})) == "unexpected file 'extra.txt'"


def test_a_missing_file_is_refused(lora_package):
    files = unpack(lora_package)
    del files["checksums.sha256"]
    assert refusal(repack(files)) == "missing file 'checksums.sha256'"


def test_a_member_outside_the_package_is_refused(lora_package):
    evil = tarfile.TarInfo("../evil")
    evil.size = 4
    assert refusal(repack(unpack(lora_package), extra=(evil,))).startswith(
        "tar member '../evil': not allowed"
    )


def test_an_absolute_member_is_refused(lora_package):
    evil = tarfile.TarInfo("/etc/evil")
    evil.size = 4
    assert refusal(repack(unpack(lora_package), extra=(evil,))).startswith(
        "tar member '/etc/evil': not allowed"
    )


def test_a_symlink_member_is_refused(lora_package):
    files = unpack(lora_package)
    del files["adapter_model.safetensors"]
    link = tarfile.TarInfo("adapter_model.safetensors")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    message = refusal(repack(files, extra=(link,)))
    assert message.startswith("tar member 'adapter_model.safetensors': not allowed (a symbolic link")


@pytest.mark.parametrize("kind", [tarfile.LNKTYPE, tarfile.DIRTYPE, tarfile.CHRTYPE, tarfile.FIFOTYPE])
def test_other_non_regular_members_are_refused(lora_package, kind):
    member = tarfile.TarInfo("manifest.json")
    member.type, member.linkname = kind, "checksums.sha256"
    files = unpack(lora_package)
    del files["manifest.json"]
    assert "tar member 'manifest.json': not allowed" in refusal(repack(files, extra=(member,)))


def test_a_duplicated_member_is_refused(lora_package):
    again = tarfile.TarInfo("manifest.json")
    again.size = 4
    assert (
        refusal(repack(unpack(lora_package), extra=(again,))) == "tar member 'manifest.json': appears twice"
    )


def test_a_file_that_is_not_gzip_is_refused():
    assert refusal(b"PK\x03\x04 a zip file") == "not a .expert package: not a gzip-compressed tar"


def test_a_truncated_package_is_refused(lora_package):
    assert "truncated" in refusal(lora_package[: len(lora_package) // 2])


def test_gzip_that_does_not_hold_a_tar_is_refused():
    assert refusal(gzip.compress(b"hello" * 100)).startswith("not a .expert package: not a valid tar archive")


def test_data_after_the_gzip_stream_is_refused(lora_package):
    assert "bytes after the gzip stream" in refusal(lora_package + b"junk")


def test_packages_beyond_max_bytes_are_refused(lora_package):
    assert "more than the limit" in refusal(lora_package, max_bytes=20_000)


def test_a_gzip_bomb_stops_at_the_limit():
    bomb = gzip.compress(bytes(4 << 20))
    assert "decompresses to more than" in refusal(bomb, max_bytes=1000)


def test_a_missing_package_file_is_named(tmp_path):
    assert refusal(tmp_path / "absent.expert") == f"{tmp_path / 'absent.expert'}: no such file"


# -- inspect ----------------------------------------------------------------------------------------


def lora_parameters_by_hand() -> int:
    # The tiny Llama: hidden 64, 4 heads and 2 KV heads of 16, MLP 128, 2 layers; LoRA rank 8.
    hidden, q_out, kv_out, mlp = 64, 4 * 16, 2 * 16, 128
    in_out = [(hidden, q_out), (hidden, kv_out), (hidden, kv_out), (q_out, hidden)]
    in_out += [(hidden, mlp), (hidden, mlp), (mlp, hidden)]
    return 2 * sum(8 * (fan_in + fan_out) for fan_in, fan_out in in_out)


@pytest.mark.parametrize(("dtype", "bytes_per_parameter"), [("float32", 4), ("bfloat16", 2)])
def test_inspect_reports_vram_from_the_real_tensor_shapes(lora_package, dtype, bytes_per_parameter):
    info = inspect_package(lora_package, dtype=dtype)
    assert info.num_parameters == lora_parameters_by_hand()
    assert info.vram_mb == lora_parameters_by_hand() * bytes_per_parameter / 2**20
    assert len(info.tensors) == 28 and {t.dtype for t in info.tensors} == {"F32"}


def test_inspect_reports_the_package_without_a_keyring(lora_package):
    info = inspect_package(lora_package)
    assert info.manifest.name == "test-lora" and info.checksums_ok and info.size == len(lora_package)
    assert info.key_id == key_id(KEY.public_key())
    assert {f.name: f.size for f in info.files} == {k: len(v) for k, v in unpack(lora_package).items()}


def test_inspect_reports_a_checksum_mismatch_instead_of_refusing(lora_package):
    files = unpack(lora_package)
    weights = bytearray(files["adapter_model.safetensors"])
    weights[-1] ^= 0x01
    info = inspect_package(repack(files | {"adapter_model.safetensors": bytes(weights)}))
    assert not info.checksums_ok
    assert info.checksum_problems == ("adapter_model.safetensors: checksum mismatch",)


def test_inspect_refuses_an_unknown_dtype(lora_package):
    with pytest.raises(ValueError, match="dtype"):
        inspect_package(lora_package, dtype="int4")


def test_a_package_file_can_be_inspected(lora_package, tmp_path: Path):
    path = write_package(tmp_path / "x.expert", lora_package)
    assert inspect_package(path).to_dict()["num_parameters"] == lora_parameters_by_hand()
