"""The SDK's distribution (sdk/python) and the stubs protos/generate.py shares between it and the
services: one module per .proto, the SDK's pins matching the code its build generates."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SDK = REPO / "sdk" / "python"
SDK_STUBS = SDK / "expert_system" / "_proto" / "expert" / "v1"
LIBS_STUBS = REPO / "libs" / "gen" / "expert" / "v1"


def _sdk_project() -> dict:
    return tomllib.loads((SDK / "pyproject.toml").read_text())


def _pins(requirements: list[str]) -> dict[str, str]:
    return {re.split(r"[<>=!~ ;]", r, maxsplit=1)[0]: r for r in requirements}


def test_every_proto_has_exactly_one_module():
    """A second module of a .proto would register its descriptors twice in the same pool."""
    protos = sorted(p.stem for p in (REPO / "protos" / "expert" / "v1").glob("*.proto"))
    sdk = {p.name.removesuffix("_pb2.py") for p in SDK_STUBS.glob("*_pb2.py")}
    internal = {p.name.removesuffix("_pb2.py") for p in LIBS_STUBS.glob("*_pb2.py")}
    assert sdk == {"common", "files", "inference", "keys", "session", "training"}
    assert not sdk & internal
    assert sorted(sdk | internal) == protos


def test_the_services_stubs_use_the_sdks_modules_of_the_public_protos():
    import expert_system._proto.expert.v1 as sdk
    from libs.gen.expert.v1 import common_pb2, engine_pb2, inference_pb2, inference_pb2_grpc, keys_pb2

    assert common_pb2 is sdk.common_pb2
    assert inference_pb2 is sdk.inference_pb2
    assert inference_pb2_grpc is sdk.inference_pb2_grpc
    assert keys_pb2 is sdk.keys_pb2
    assert engine_pb2.DESCRIPTOR.dependencies[0] is common_pb2.DESCRIPTOR
    for module in ("common_pb2", "inference_pb2", "inference_pb2_grpc", "keys_pb2", "keys_pb2_grpc"):
        assert f"libs.gen.expert.v1.{module}" not in sys.modules


def test_the_sdk_imports_nothing_of_the_project():
    sources = [p for p in (SDK / "expert_system").rglob("*.py*") if p.suffix in (".py", ".pyi")]
    assert sources
    for path in sources:
        imports = re.findall(r"^\s*(?:from|import) (\S+)", path.read_text(), re.MULTILINE)
        foreign = [i for i in imports if i.split(".")[0] in ("libs", "services", "tests")]
        assert not foreign, f"{path.relative_to(REPO)}: {foreign}"


def test_the_sdk_depends_on_grpc_and_protobuf_only():
    project = _sdk_project()
    assert sorted(_pins(project["project"]["dependencies"])) == ["grpcio", "grpcio-status", "protobuf"]
    assert project["project"]["requires-python"] == ">=3.11"


def test_the_sdks_build_generates_with_the_projects_grpcio_tools():
    main = _pins(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    build = _pins(_sdk_project()["build-system"]["requires"])
    assert build["grpcio-tools"] == main["grpcio-tools"]


def test_the_sdks_runtime_pins_admit_only_what_its_generated_code_accepts():
    """The stubs refuse an older protobuf runtime than the protoc that wrote them, and an older
    grpcio than the plugin's; the SDK's lower bounds say the same."""
    pins = _pins(_sdk_project()["project"]["dependencies"])
    gencode = re.search(
        r"^# Protobuf Python Version: (\S+)$", (SDK_STUBS / "common_pb2.py").read_text(), re.M
    )
    assert gencode
    major = gencode[1].split(".")[0]
    assert pins["protobuf"] == f"protobuf>={gencode[1]},<{int(major) + 1}"
    generated_grpc = re.search(
        r"^GRPC_GENERATED_VERSION = '(\S+)'$", (SDK_STUBS / "inference_pb2_grpc.py").read_text(), re.M
    )
    assert generated_grpc
    assert pins["grpcio"] == f"grpcio>={generated_grpc[1]}"
    assert pins["grpcio-status"] == f"grpcio-status>={generated_grpc[1]}"
