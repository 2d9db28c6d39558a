"""The host tier: verified experts held in host memory, by name and version, under a byte budget.

Requests pin the experts they use from arrival to finish; an unpinned expert may be evicted (least
recently used first) to make room for a new one. Loading a new version of a name makes it the
current one for new requests; requests in flight keep the version they started with, and the old
version is dropped once they are done.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from libs.engine.adapters.weights import AdapterWeights, AdapterWeightsError, adapter_weights
from libs.engine.models.config import ModelConfig
from libs.experts.manifest import BaseModelIdentity, Manifest
from libs.experts.package import VerifiedPackage

_uids = itertools.count(1)


class ExpertError(ValueError):
    """Base of the engine's expert errors; the message names the expert or the field."""


class ExpertRefusedError(ExpertError):
    """A package that cannot be loaded: bad signature, another base model, unusable weights..."""


class ExpertNotFoundError(ExpertError):
    """A request or command names an expert that is not loaded."""


class ExpertInUseError(ExpertError):
    """An expert that live requests use cannot be unloaded."""


class ExpertCapacityError(ExpertError):
    """The host tier cannot make room: everything it holds is in use."""


@dataclass(eq=False)
class LoadedExpert:
    """One version of an expert in host memory."""

    manifest: Manifest
    content_hash: str
    weights: AdapterWeights
    uid: int = field(default_factory=lambda: next(_uids))
    pins: int = 0
    last_used: float = 0.0
    current: bool = True  # False once a newer version replaced it or it was unloaded

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def adapter_type(self) -> str:
        return self.manifest.adapter_type

    @property
    def host_bytes(self) -> int:
        return self.weights.nbytes

    @property
    def identity(self) -> bytes:
        """Name, version and content: what the prefix cache keys blocks on."""
        return hashlib.sha256(f"{self.name}\0{self.version}\0{self.content_hash}".encode()).digest()


@dataclass(frozen=True)
class ExpertUse:
    """An expert a request applies, with its weight (LoRA delta factor, IA³ strength)."""

    expert: LoadedExpert
    weight: float


@dataclass
class RegistryCounters:
    loads: int = 0  # packages converted and added
    load_hits: int = 0  # loads of a version already held, with the same content
    evictions: int = 0  # unpinned experts dropped to make room


class ExpertRegistry:
    def __init__(
        self,
        model: ModelConfig,
        budget_bytes: int,
        on_drop: Callable[[LoadedExpert], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.identity = BaseModelIdentity.from_hf_config(model.raw)
        self.budget_bytes = budget_bytes
        self.on_drop = on_drop
        self.clock = clock
        self.counters = RegistryCounters()
        self._current: dict[str, LoadedExpert] = {}
        self._held: dict[int, LoadedExpert] = {}  # every version still in memory, by uid

    @property
    def used_bytes(self) -> int:
        return sum(e.host_bytes for e in self._held.values())

    def experts(self) -> list[LoadedExpert]:
        """Every version held, current ones first."""
        return sorted(self._held.values(), key=lambda e: (not e.current, e.name, e.version))

    def load(self, package: VerifiedPackage) -> LoadedExpert:
        """Add a verified package (or find it already held). Nothing changes if it is refused."""
        manifest = package.manifest
        mismatch = manifest.base_model.mismatch(self.identity)
        if mismatch is not None:
            raise ExpertRefusedError(
                f"{manifest.name} {manifest.version}: manifest.base_model is for another "
                f"base model ({mismatch})"
            )
        existing = self._current.get(manifest.name)
        if existing is not None and existing.version == manifest.version:
            if existing.content_hash != package.content_hash:
                raise ExpertRefusedError(
                    f"{manifest.name} {manifest.version}: already loaded with different content "
                    f"(a changed expert needs a new version)"
                )
            self.counters.load_hits += 1
            existing.last_used = self.clock()
            return existing
        try:
            weights = adapter_weights(package, self.model)
        except AdapterWeightsError as exc:
            raise ExpertRefusedError(f"{manifest.name} {manifest.version}: {exc}") from None
        self._make_room(weights.nbytes, keep=existing)
        expert = LoadedExpert(manifest, package.content_hash, weights, last_used=self.clock())
        if existing is not None:
            existing.current = False
            self._drop_if_idle(existing)
        self._current[manifest.name] = expert
        self._held[expert.uid] = expert
        self.counters.loads += 1
        return expert

    def _make_room(self, nbytes: int, keep: LoadedExpert | None) -> None:
        if nbytes > self.budget_bytes:
            raise ExpertCapacityError(f"expert needs {nbytes} bytes, the host tier holds {self.budget_bytes}")
        # The version being replaced goes anyway once idle: count it as free if it is.
        replaced = keep.host_bytes if keep is not None and keep.pins == 0 else 0
        idle = sorted(
            (e for e in self._held.values() if e.pins == 0 and e is not keep), key=lambda e: e.last_used
        )
        free = self.budget_bytes - self.used_bytes + replaced
        victims = []
        for expert in idle:
            if free >= nbytes:
                break
            victims.append(expert)
            free += expert.host_bytes
        if free < nbytes:
            raise ExpertCapacityError(f"the host tier ({self.budget_bytes} bytes) is full of experts in use")
        for expert in victims:
            self._forget(expert)
            self.counters.evictions += 1

    def _forget(self, expert: LoadedExpert) -> None:
        self._held.pop(expert.uid, None)
        if self._current.get(expert.name) is expert:
            del self._current[expert.name]
        expert.current = False
        self.on_drop(expert)

    def _drop_if_idle(self, expert: LoadedExpert) -> None:
        if expert.pins == 0 and not expert.current:
            self._forget(expert)

    def holds(self, expert: LoadedExpert) -> bool:
        return expert.uid in self._held

    def get(self, name: str, version: str | None = None) -> LoadedExpert:
        """The current version of `name` (or that exact version, if still held)."""
        expert = self._current.get(name)
        if version is not None and (expert is None or expert.version != version):
            expert = next((e for e in self._held.values() if e.name == name and e.version == version), None)
        if expert is None:
            held = (
                f" (version {version} is not held)" if version is not None and name in self._current else ""
            )
            raise ExpertNotFoundError(f"expert {name!r} is not loaded{held}")
        return expert

    def unload(self, name: str) -> LoadedExpert:
        """Remove the current version of `name`; refused while requests use it."""
        expert = self.get(name)
        if expert.pins:
            raise ExpertInUseError(
                f"expert {name!r} is in use by {expert.pins} request(s); unload it when they finish"
            )
        self._forget(expert)
        return expert

    def pin(self, experts: list[LoadedExpert]) -> None:
        now = self.clock()
        for expert in experts:
            expert.pins += 1
            expert.last_used = now

    def unpin(self, experts: list[LoadedExpert]) -> None:
        now = self.clock()
        for expert in experts:
            expert.pins -= 1
            expert.last_used = now
            self._drop_if_idle(expert)
