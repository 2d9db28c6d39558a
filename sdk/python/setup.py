"""Builds the SDK with its gRPC stubs (expert_system/_proto), which are generated, not committed.

When they are missing, or older than their .proto files, the build generates them with the
project's own generator, ../../protos/generate.py (its `generate_public`), loaded by path. A build
from an sdist has no protos/ but carries the stubs the sdist was made with.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.egg_info import egg_info
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
STUBS = HERE / "expert_system" / "_proto"
GENERATOR = HERE.parents[1] / "protos" / "generate.py"
MODULES = (
    "common_pb2.py",
    "inference_pb2.py",
    "inference_pb2_grpc.py",
    "keys_pb2.py",
    "keys_pb2_grpc.py",
    "session_pb2.py",
    "session_pb2_grpc.py",
)


def ensure_stubs() -> None:
    modules = [STUBS / "expert" / "v1" / name for name in MODULES]
    present = all(path.is_file() for path in modules)
    if not GENERATOR.is_file():
        if present:
            return
        raise SystemExit(
            f"expert-system-sdk: the gRPC stubs are missing from {STUBS} and there is no "
            f"generator at {GENERATOR} to make them: build the SDK from the Expert System's "
            "repository (pip install ./sdk/python), or from an sdist that includes them."
        )
    spec = importlib.util.spec_from_file_location("_expert_system_protos_generate", GENERATOR)
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    if present:
        built = min(path.stat().st_mtime for path in modules)
        if all((generator.PROTOS / proto).stat().st_mtime <= built for proto in generator.PUBLIC):
            return
    generator.generate_public(STUBS)
    print(f"expert-system-sdk: generated the gRPC stubs into {STUBS}")


class _BuildPy(build_py):
    def run(self) -> None:
        ensure_stubs()
        super().run()


class _EggInfo(egg_info):
    def run(self) -> None:
        ensure_stubs()
        super().run()


class _Sdist(sdist):
    def run(self) -> None:
        ensure_stubs()
        super().run()


setup(cmdclass={"build_py": _BuildPy, "egg_info": _EggInfo, "sdist": _Sdist})
