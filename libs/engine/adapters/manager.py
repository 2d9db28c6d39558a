"""The engine's expert API in one place: load (verify, convert), unload, list, resolve a request's
expert list, pin for the request's lifetime, and the figures for metrics."""

from __future__ import annotations

import hashlib
import math
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from libs.engine.adapters.device import DeviceAdapters
from libs.engine.adapters.registry import (
    ExpertError,
    ExpertNotFoundError,
    ExpertRefusedError,
    ExpertRegistry,
    ExpertUse,
    LoadedExpert,
)
from libs.engine.config import AdapterConfig
from libs.engine.errors import InvalidRequestError
from libs.engine.models.config import ModelConfig
from libs.engine.outputs import ExpertStats
from libs.experts.package import PackageError, read_package
from libs.experts.signing import Keyring, SigningError
from libs.limits import MAX_EXPERTS

MAX_WEIGHT = 10.0

# A request's expert list: ("name", weight) pairs or bare names (weight 1); "name@version" pins a version.
ExpertSpec = Sequence[tuple[str, float] | str]


@dataclass(frozen=True)
class ExpertInfo:
    """What `list_experts()` reports for one held version."""

    name: str
    version: str
    adapter_type: str
    content_hash: str
    current: bool
    host_bytes: int
    device_bytes: int  # 0 when not resident
    footprint_bytes: int  # what it occupies on the device once resident
    resident: bool
    active_requests: int
    description: str


@dataclass(frozen=True)
class ResolvedExperts:
    uses: tuple[ExpertUse, ...]
    adapter_key: bytes  # empty without experts
    num_virtual_tokens: int


@dataclass(frozen=True)
class ExpertHoldings:
    """What the engine holds, for the fleet's control plane: `epoch` grows with every change (it
    starts from the clock, so that a restarted engine's reports are never taken for old ones)."""

    epoch: int
    host_budget_bytes: int
    device_budget_bytes: int
    experts: tuple[ExpertInfo, ...]


class ExpertManager:
    def __init__(
        self,
        model: ModelConfig,
        config: AdapterConfig,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.device_tier = DeviceAdapters(model, device, config.device_bytes, dtype=dtype)
        self.registry = ExpertRegistry(model, config.host_bytes, on_drop=self._dropped)
        self.epoch = time.time_ns()

    def _dropped(self, expert: LoadedExpert) -> None:
        self.device_tier.drop(expert)
        self.epoch += 1

    def load(
        self,
        source: bytes | str | os.PathLike[str],
        trusted_keys_dir: str | os.PathLike[str] | None = None,
    ) -> LoadedExpert:
        """Verify a package against the trusted keys and hold its weights; nothing changes on refusal."""
        try:
            keyring = Keyring.from_dir(Path(trusted_keys_dir or self.config.trusted_keys_dir))
            package = read_package(source, keyring)
        except (PackageError, SigningError) as exc:
            raise ExpertRefusedError(str(exc)) from None
        expert = self.registry.load(package)
        self.epoch += 1
        return expert

    def unload(self, name: str) -> None:
        self.registry.unload(name)  # the drop moves the epoch

    def holdings(self) -> ExpertHoldings:
        return ExpertHoldings(
            epoch=self.epoch,
            host_budget_bytes=self.registry.budget_bytes,
            device_budget_bytes=self.device_tier.budget_bytes,
            experts=tuple(self.experts()),
        )

    def experts(self) -> list[ExpertInfo]:
        out = []
        for e in self.registry.experts():
            residency = self.device_tier.resident.get(e.uid)
            out.append(
                ExpertInfo(
                    name=e.name,
                    version=e.version,
                    adapter_type=e.adapter_type,
                    content_hash=e.content_hash,
                    current=e.current,
                    host_bytes=e.host_bytes,
                    device_bytes=residency.nbytes if residency else 0,
                    footprint_bytes=self.device_tier.footprint(e),
                    resident=residency is not None,
                    active_requests=e.pins,
                    description=e.manifest.description,
                )
            )
        return out

    def resolve(self, spec: ExpertSpec | None) -> ResolvedExperts:
        """Check a request's expert list and find the experts; errors name the entry."""
        if spec is None or len(spec) == 0:
            return ResolvedExperts((), b"", 0)
        if isinstance(spec, str | bytes) or not isinstance(spec, Sequence):
            raise InvalidRequestError("experts", "expected a list of (name, weight) pairs")
        if len(spec) > MAX_EXPERTS:
            raise InvalidRequestError(
                "experts", f"at most {MAX_EXPERTS} experts per request, got {len(spec)}"
            )
        uses = self._find(spec)
        _check_compatible(uses)
        footprint = sum(self.device_tier.footprint(u.expert) for u in uses)
        if footprint > self.device_tier.budget_bytes:
            raise InvalidRequestError(
                "experts",
                f"these experts need {footprint} bytes on the device, more than "
                f"its whole budget ({self.device_tier.budget_bytes} bytes)",
            )
        key = hashlib.sha256()
        for use in uses:
            key.update(use.expert.identity + struct.pack("<d", use.weight))
        virtual = sum(
            u.expert.weights.soft_prompt.embeddings.shape[0]
            for u in uses
            if u.expert.weights.soft_prompt is not None
        )
        return ResolvedExperts(tuple(uses), key.digest(), virtual)

    def _find(self, spec: Sequence) -> list[ExpertUse]:
        """Each entry's expert (its current version unless `name@version`), each listed once."""
        uses: list[ExpertUse] = []
        for i, item in enumerate(spec):
            name, weight = _entry(i, item)
            name, _, version = name.partition("@")
            try:
                expert = self.registry.get(name, version or None)
            except ExpertNotFoundError as exc:
                raise ExpertNotFoundError(f"experts[{i}].name: {exc}") from None
            if any(u.expert.name == expert.name for u in uses):
                raise InvalidRequestError(f"experts[{i}].name", f"expert {name!r} is listed twice")
            uses.append(ExpertUse(expert, weight))
        return uses

    def pin(self, uses: Sequence[ExpertUse]) -> None:
        """Hold a request's experts in the host tier until `unpin` (raises if one was dropped meanwhile)."""
        for use in uses:
            if not self.registry.holds(use.expert):
                raise ExpertNotFoundError(f"experts: {use.expert.name!r} {use.expert.version} was unloaded")
        self.registry.pin([u.expert for u in uses])

    def unpin(self, uses: Sequence[ExpertUse]) -> None:
        self.registry.unpin([u.expert for u in uses])

    def stats(self) -> ExpertStats:
        device, registry = self.device_tier, self.registry
        return ExpertStats(
            experts_held=len(registry.experts()),
            host_bytes=registry.used_bytes,
            device_bytes=device.used_bytes,
            experts_resident=len(device.resident),
            experts_pinned_on_device=sum(1 for r in device.resident.values() if r.pins),
            loads_total=registry.counters.loads,
            load_hits_total=registry.counters.load_hits,
            host_evictions_total=registry.counters.evictions,
            device_loads_total=device.counters.loads,
            device_hits_total=device.counters.hits,
            device_evictions_total=device.counters.evictions,
        )


def _check_compatible(uses: list[ExpertUse]) -> None:
    """Refuses two experts either of which lists the other as incompatible."""
    for i, a in enumerate(uses):
        for b in uses[i + 1 :]:
            if (
                b.expert.name in a.expert.manifest.incompatible_with
                or a.expert.name in b.expert.manifest.incompatible_with
            ):
                raise InvalidRequestError(
                    "experts", f"{a.expert.name!r} is incompatible with {b.expert.name!r}"
                )


def _entry(i: int, item: object) -> tuple[str, float]:
    if isinstance(item, str):
        name, weight = item, 1.0
    elif isinstance(item, tuple | list) and len(item) == 2:
        name, weight = item
    else:
        raise InvalidRequestError(f"experts[{i}]", f"expected a name or a (name, weight) pair, got {item!r}")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"experts[{i}].name", f"expected an expert name, got {name!r}")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
        raise InvalidRequestError(f"experts[{i}].weight", f"expected a finite number, got {weight!r}")
    if not 0 < abs(weight) <= MAX_WEIGHT:
        raise InvalidRequestError(
            f"experts[{i}].weight", f"must be non-zero and within ±{MAX_WEIGHT}, got {weight}"
        )
    return name, float(weight)


__all__ = [
    "ExpertError",
    "ExpertHoldings",
    "ExpertInfo",
    "ExpertManager",
    "ExpertSpec",
    "ExpertStats",
    "ResolvedExperts",
]
