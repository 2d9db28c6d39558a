"""The import rules that keep the layers apart: shared code never depends on a service, the engine
library never depends on gRPC, Redis or a service, and inside the engine library no module imports
one above it (the order below is the design; a new module takes its place in it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "libs/engine"

# Lowest first. A unit may import units of lower layers only. Subpackages that are one piece
# (kernels, tokenizer, the GGUF importer) are one unit each.
LAYERS: list[set[str]] = [
    {"errors", "sampler", "tokenizer", "models.errors", "adapters", "models", "host_memory", "staging"},
    {"graph_tables"},
    {"beam_params", "speculative_sampling"},
    {"sampling_params", "config", "models.rope", "models.generation_config", "grammar", "cuda_graphs"},
    {"models.config", "quant"},
    {"adapters.weights", "kv_cache", "models.loader", "kernels", "models.gguf"},
    {"adapters.registry"},
    {"sequence", "adapters.device"},
    {"block_manager", "adapters.batch", "step_inputs", "beam_search"},
    {"sessions", "models.decoder", "drafters.draft_cache", "drafters.verification"},
    {"outputs", "drafters.model_drafter"},
    {"speculative", "drafters.loading"},
    {"scheduler", "adapters.manager", "info", "streams"},
    {"runner", "request"},
    {"request_builder"},
    {"llm_engine"},
    {"async_engine"},
    {""},  # the package's public names
]
LAYER_OF = {unit: level for level, units in enumerate(LAYERS) for unit in units}
# What the engine library may use from the rest of libs/: settings, the limits of a request it
# shares with the API, the expert package format and the projections adapters act on, the
# structured output formats, and the one rule for text UTF-8 cannot hold.
ENGINE_MAY_IMPORT = (
    "libs.config",
    "libs.limits",
    "libs.experts.manifest",
    "libs.experts.package",
    "libs.experts.projections",
    "libs.experts.signing",
    "libs.structured_output",
    "libs.utf8",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """Every module the file imports, at any depth (function-level and TYPE_CHECKING ones too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from package import module` imports the module
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            found.update({name for name in submodules if _is_module(name)} or {node.module})
    return found


def _unit(module: str) -> str:
    rest = module.removeprefix("libs.engine").lstrip(".")
    parts = rest.split(".") if rest else []
    for depth in (2, 1, 0):
        candidate = ".".join(parts[:depth])
        if len(parts) >= depth and candidate in LAYER_OF:
            return candidate
    raise AssertionError(f"{module} has no place in LAYERS")


SHARED = sorted(p for p in (REPO / "libs").rglob("*.py") if "gen" not in p.relative_to(REPO).parts)
ENGINE_FILES = sorted(ENGINE.rglob("*.py"))


def test_the_files_were_found():
    assert len(SHARED) > 60 and len(ENGINE_FILES) > 30


@pytest.mark.parametrize("path", SHARED, ids=lambda p: str(p.relative_to(REPO)))
def test_shared_code_never_imports_a_service(path):
    assert not {m for m in _imports(path) if m == "services" or m.startswith("services.")}


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_engine_library_uses_no_transport_and_only_the_shared_code_it_needs(path):
    outside = {
        m
        for m in _imports(path)
        if (m.startswith("libs.") and not m.startswith("libs.engine")) or m.split(".")[0] in {"grpc", "redis"}
    }
    assert all(m.startswith(ENGINE_MAY_IMPORT) for m in outside), sorted(outside)


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_engine_module_imports_one_above_it(path):
    own = _unit(_module_name(path))
    above = {
        module
        for module in _imports(path)
        if module == "libs.engine" or module.startswith("libs.engine.")
        if _unit(module) != own and LAYER_OF[_unit(module)] >= LAYER_OF[own]
    }
    assert not above, f"{own} (layer {LAYER_OF[own]}) imports {sorted(above)}"
