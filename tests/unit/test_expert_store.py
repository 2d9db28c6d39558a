"""libs.experts.store: installing verified packages by content hash, versions side by side, the
refusals (another base model, other content under an installed version, an untrusted signer), SemVer
order, and removal."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import load as safetensors_load

from libs.experts.manifest import BaseModelIdentity
from libs.experts.package import build_package, read_package
from libs.experts.peft_adapter import read_peft_adapter
from libs.experts.signing import Keyring
from libs.experts.store import ExpertNotInstalledError, ExpertStore, PackageError, StoreError, version_key
from tests.helpers.manifests import manifest_for
from tests.helpers.peft_adapters import write_all_adapters

KEY = Ed25519PrivateKey.generate()
TRUSTED = Keyring.of(KEY.public_key())


@pytest.fixture(scope="module")
def base(tiny_llama) -> BaseModelIdentity:
    return BaseModelIdentity.from_dir(tiny_llama)


@pytest.fixture(scope="module")
def lora(tiny_llama, tmp_path_factory):
    return read_peft_adapter(write_all_adapters(tiny_llama, tmp_path_factory.mktemp("peft"))["lora"])


@pytest.fixture(scope="module")
def package(lora, base):
    def make(version: str = "1.0.0", key: Ed25519PrivateKey = KEY, **overrides) -> bytes:
        manifest = manifest_for(lora, base, name="json-parser", version=version, **overrides)
        return build_package(manifest, lora.config, lora.weights, key)

    return make


def test_an_installed_package_is_stored_under_its_content_hash(tmp_path, package, base):
    store, data = ExpertStore(tmp_path), package()
    entry, created = store.install(data, TRUSTED, base)
    assert created and (entry.name, entry.version, entry.size) == ("json-parser", "1.0.0", len(data))
    assert entry.weight_bytes == len(read_package(data, TRUSTED).weights)
    assert entry.content_hash == read_package(data, TRUSTED).content_hash
    assert store.blob_path(entry.content_hash).read_bytes() == data
    assert store.get("json-parser") == entry == store.get("json-parser", "1.0.0")
    assert read_package(store.read(entry), TRUSTED).manifest == entry.manifest


def test_an_entry_counts_the_numbers_of_its_tensors_even_in_the_first_format(tmp_path, package, base, lora):
    """weight_elements (what an engine holds as float32) is recorded at install; an entry written
    before the field existed gets it from its package when read."""
    store = ExpertStore(tmp_path)
    entry, _ = store.install(package(), TRUSTED, base)
    expected = sum(t.numel() for t in safetensors_load(lora.weights).values())
    assert entry.weight_elements == expected
    path = tmp_path / "index" / "json-parser" / "1.0.0.json"
    first_format = {k: v for k, v in json.loads(path.read_text()).items() if k != "weight_elements"}
    path.write_text(json.dumps(first_format))
    assert store.get("json-parser").weight_elements == expected
    assert store.install(package(), TRUSTED, base) == (entry, False)


def test_installing_the_same_package_again_changes_nothing(tmp_path, package, base):
    store = ExpertStore(tmp_path)
    first, _ = store.install(package(), TRUSTED, base)
    again, created = store.install(package(), TRUSTED, base)
    assert not created and again == first and len(store.list()) == 1


def test_other_content_under_an_installed_version_is_refused(tmp_path, package, base):
    store = ExpertStore(tmp_path)
    store.install(package(), TRUSTED, base)
    with pytest.raises(StoreError, match=r"json-parser@1\.0\.0 is already installed with other content"):
        store.install(package(description="Changed, same version."), TRUSTED, base)
    assert [e.manifest.description for e in store.list()] == ["A test expert."]


def test_versions_coexist_and_the_highest_by_semver_is_the_default(tmp_path, package, base):
    store = ExpertStore(tmp_path)
    for version in ("1.9.0", "1.10.0", "2.0.0-rc.1"):
        store.install(package(version), TRUSTED, base)
    assert [e.version for e in store.versions("json-parser")] == ["1.9.0", "1.10.0", "2.0.0-rc.1"]
    assert store.get("json-parser").version == "2.0.0-rc.1"
    assert len({e.content_hash for e in store.list()}) == 3


def test_a_package_for_another_base_model_is_refused_and_nothing_is_written(tmp_path, package, base):
    other = dataclasses.replace(base, vocab_size=base.vocab_size + 1)
    with pytest.raises(StoreError, match=r"another base model \(base_model\.vocab_size"):
        ExpertStore(tmp_path).install(package(), TRUSTED, other)
    assert not any(tmp_path.rglob("*.expert")) and not any(tmp_path.rglob("*.json"))


def test_a_package_from_an_untrusted_signer_is_refused(tmp_path, package, base):
    with pytest.raises(PackageError, match="signature"):
        ExpertStore(tmp_path).install(package(key=Ed25519PrivateKey.generate()), TRUSTED, base)
    assert not any(tmp_path.rglob("*.expert"))


def test_removing_a_version_or_every_version(tmp_path, package, base):
    store = ExpertStore(tmp_path)
    one, _ = store.install(package("1.0.0"), TRUSTED, base)
    two, _ = store.install(package("2.0.0"), TRUSTED, base)
    assert store.remove("json-parser", "1.0.0") == [one]
    assert not store.blob_path(one.content_hash).exists() and store.blob_path(two.content_hash).exists()
    assert store.remove("json-parser") == [two]
    assert store.list() == [] and not any(tmp_path.rglob("*.expert"))
    with pytest.raises(ExpertNotInstalledError, match="not installed"):
        store.remove("json-parser")
    with pytest.raises(ExpertNotInstalledError):
        store.get("json-parser", "1.0.0")


def test_names_that_would_leave_the_store_are_refused(tmp_path):
    store = ExpertStore(tmp_path)
    assert store.versions("..") == [] and store.versions("a/b") == []
    with pytest.raises(StoreError):
        store.get("..", "1.0.0")
    with pytest.raises(StoreError, match="content hash"):
        store.blob_path("../../etc/passwd")


def test_version_order_is_semver_precedence():
    ordered = [
        "1.0.0-alpha",
        "1.0.0-alpha.1",
        "1.0.0-alpha.beta",
        "1.0.0-beta",
        "1.0.0-beta.2",
        "1.0.0-beta.11",
        "1.0.0-rc.1",
        "1.0.0",
        "1.0.1+build.5",
        "1.2.0",
        "1.10.0",
        "2.0.0",
    ]
    shuffled = ordered[:]
    random.Random(7).shuffle(shuffled)
    assert sorted(shuffled, key=version_key) == ordered
    assert version_key("1.0.0+a") == version_key("1.0.0+b")  # build metadata does not count
