"""The device tier: experts' weights laid out for the batched kernels, on the model's device.

- LoRA: per projection, a pool of rank rows [layers, rows, in] for A and [layers, rows, out] for B
  transposed; an expert takes ceil(rank / 8) pages of 8 rows in the pools of the projections it
  targets (so untargeted projections cost nothing).
- IA³: per projection, a table [layers, slots, width]; an expert takes one slot.
- Soft prompts: a pool of embedding rows [rows, hidden], in pages of 8 rows.

Pools hold the engine's dtype (float32 on the CPU's native kernels, bfloat16 or float16 on a GPU):
half the bytes for a batched kernel to read, and the kernels compute every delta in float32.
Pools grow by doubling as experts arrive, so memory follows use; a byte budget bounds what is
resident. Running sequences pin their experts; when room is needed, unpinned residents are evicted
least recently used first. Nothing a running sequence uses is ever evicted. `storage_generation`
counts the times a pool was reallocated: a CUDA graph captured over the old tensors must be captured
again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from libs.engine.adapters.registry import LoadedExpert
from libs.engine.adapters.weights import INPUT_SCALABLE, PROJECTIONS, projection_shape
from libs.engine.models.config import ModelConfig

PAGE_ROWS = 8


def ia3_key(projection: str, scales_input: bool) -> str:
    """Name of the IA³ table for a projection's output (or input) scaling."""
    return projection + (":in" if scales_input else ":out")


class PagePool:
    """Fixed-size pages of rows in growable tensors that share one page allocator."""

    def __init__(
        self,
        widths: list[int],
        device: torch.device,
        layers: int | None,
        dtype: torch.dtype,
        on_grow: Callable[[], None],
    ) -> None:
        self.widths = widths  # row width of each tensor; a layer dimension goes in front when layers is set
        self.device = device
        self.dtype = dtype
        self.on_grow = on_grow
        self.layers = layers
        self.tensors: list[torch.Tensor] = []
        self.capacity = 0  # pages
        self.free: list[int] = []

    def _grow(self, pages: int) -> None:
        new_capacity = max(pages, 2 * self.capacity, 4)
        rows = new_capacity * PAGE_ROWS
        grown = []
        for i, width in enumerate(self.widths):
            shape = (self.layers, rows, width) if self.layers is not None else (rows, width)
            tensor = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if self.tensors:
                tensor[..., : self.capacity * PAGE_ROWS, :] = self.tensors[i]
            grown.append(tensor)
        self.tensors = grown
        self.on_grow()
        self.free.extend(range(self.capacity, new_capacity))
        self.capacity = new_capacity

    def allocate(self, pages: int) -> list[int]:
        if len(self.free) < pages:
            self._grow(self.capacity + pages - len(self.free))
        self.free.sort(reverse=True)
        return [self.free.pop() for _ in range(pages)]

    def release(self, pages: Iterable[int]) -> None:
        self.free.extend(pages)


@dataclass(eq=False)
class Residency:
    expert: LoadedExpert
    nbytes: int
    lora_pages: dict[str, list[int]] = field(default_factory=dict)
    ia3_slot: int | None = None
    soft_rows: list[int] = field(default_factory=list)
    pins: int = 0
    last_used: float = 0.0


@dataclass
class DeviceCounters:
    hits: int = 0  # an expert asked for was already resident
    loads: int = 0  # copied in from the host tier
    evictions: int = 0  # dropped to make room


class DeviceAdapters:
    """Resident experts, their pool positions, pins and the byte budget."""

    def __init__(
        self,
        model: ModelConfig,
        device: torch.device,
        budget_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.storage_generation = 0
        self.budget_bytes = budget_bytes
        self.clock = clock
        self.counters = DeviceCounters()
        layers = model.num_layers
        self.lora = {
            p: PagePool(list(projection_shape(model, p)), device, layers, dtype, self._grown)
            for p in PROJECTIONS
        }
        # IA³ tables by ia3_key(): output scaling for every projection, input scaling where supported
        self.ia3_width = {ia3_key(p, False): projection_shape(model, p)[1] for p in PROJECTIONS}
        self.ia3_width |= {ia3_key(p, True): projection_shape(model, p)[0] for p in INPUT_SCALABLE}
        self.ia3_tables: dict[str, torch.Tensor] = {}  # key -> [layers, slots, width]
        self.ia3_capacity = 0
        self.ia3_free: list[int] = []
        self.soft = PagePool([model.hidden_size], device, None, dtype, self._grown)
        self.resident: dict[int, Residency] = {}

    def _grown(self) -> None:
        self.storage_generation += 1

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def used_bytes(self) -> int:
        return sum(r.nbytes for r in self.resident.values())

    def residency(self, expert: LoadedExpert) -> Residency:
        return self.resident[expert.uid]

    def footprint(self, expert: LoadedExpert) -> int:
        """Bytes the expert occupies once resident (whole pages for LoRA rows and soft prompts)."""
        w, layers, size = expert.weights, self.model.num_layers, self.element_size
        if w.lora is not None:
            pages = -(-w.lora.rank // PAGE_ROWS)
            return sum(
                pages * PAGE_ROWS * layers * sum(projection_shape(self.model, p)) * size for p in w.lora.a
            )
        if w.ia3 is not None:
            return sum(v.numel() * size for v in w.ia3.vectors.values())
        rows = w.soft_prompt.embeddings.shape[0]
        return -(-rows // PAGE_ROWS) * PAGE_ROWS * self.model.hidden_size * size

    def acquire(self, experts: list[LoadedExpert]) -> bool:
        """Make all `experts` resident and pin them, or change nothing and return False."""
        now = self.clock()
        missing = [e for e in dict.fromkeys(experts) if e.uid not in self.resident]
        need = sum(self.footprint(e) for e in missing)
        if need > self.budget_bytes - self.used_bytes:
            wanted = {e.uid for e in experts}
            idle = sorted(
                (r for r in self.resident.values() if r.pins == 0 and r.expert.uid not in wanted),
                key=lambda r: r.last_used,
            )
            room = self.budget_bytes - self.used_bytes
            victims = []
            for r in idle:
                if room >= need:
                    break
                victims.append(r)
                room += r.nbytes
            if room < need:
                return False
            for r in victims:
                self._evict(r)
                self.counters.evictions += 1
        self.counters.hits += len(experts) - len(missing)
        for expert in missing:
            self._load(expert)
            self.counters.loads += 1
        for expert in experts:
            r = self.resident[expert.uid]
            r.pins += 1
            r.last_used = now
        return True

    def release(self, experts: list[LoadedExpert]) -> None:
        now = self.clock()
        for expert in experts:
            r = self.resident.get(expert.uid)
            if r is not None:
                r.pins -= 1
                r.last_used = now

    def drop(self, expert: LoadedExpert) -> None:
        """Forget an expert the host tier dropped (it is never pinned then)."""
        r = self.resident.get(expert.uid)
        if r is not None and r.pins == 0:
            self._evict(r)

    def _evict(self, r: Residency) -> None:
        for projection, pages in r.lora_pages.items():
            self.lora[projection].release(pages)
        if r.ia3_slot is not None:
            self.ia3_free.append(r.ia3_slot)
        if r.soft_rows:
            self.soft.release(sorted({row // PAGE_ROWS for row in r.soft_rows}))
        del self.resident[r.expert.uid]

    def _load(self, expert: LoadedExpert) -> None:
        w = expert.weights
        r = Residency(expert, self.footprint(expert), last_used=self.clock())
        if w.lora is not None:
            pages = -(-w.lora.rank // PAGE_ROWS)
            for projection, a in w.lora.a.items():
                pool = self.lora[projection]
                got = pool.allocate(pages)
                r.lora_pages[projection] = got
                for i, page in enumerate(got):
                    lo, hi = i * PAGE_ROWS, min(w.lora.rank, (i + 1) * PAGE_ROWS)
                    rows = slice(page * PAGE_ROWS, page * PAGE_ROWS + hi - lo)
                    pool.tensors[0][:, rows] = a[:, lo:hi].to(self.device, self.dtype)
                    pool.tensors[1][:, rows] = w.lora.bt[projection][:, lo:hi].to(self.device, self.dtype)
        elif w.ia3 is not None:
            r.ia3_slot = self._ia3_slot()
            for projection, vectors in w.ia3.vectors.items():
                table = self.ia3_tables[ia3_key(projection, w.ia3.scales_input[projection])]
                table[:, r.ia3_slot] = vectors.to(self.device, self.dtype)
        else:
            rows = w.soft_prompt.embeddings.shape[0]
            pages = self.soft.allocate(-(-rows // PAGE_ROWS))
            r.soft_rows = [page * PAGE_ROWS + i for page in pages for i in range(PAGE_ROWS)][:rows]
            self.soft.tensors[0][r.soft_rows] = w.soft_prompt.embeddings.to(self.device, self.dtype)
        self.resident[expert.uid] = r

    def _ia3_slot(self) -> int:
        if not self.ia3_free:
            capacity = max(4, 2 * self.ia3_capacity)
            layers = self.model.num_layers
            for key, width in self.ia3_width.items():
                grown = torch.ones(layers, capacity, width, dtype=self.dtype, device=self.device)
                if key in self.ia3_tables:
                    grown[:, : self.ia3_capacity] = self.ia3_tables[key]
                self.ia3_tables[key] = grown
            self.ia3_free.extend(range(self.ia3_capacity, capacity))
            self.ia3_capacity = capacity
            self._grown()
        self.ia3_free.sort(reverse=True)
        return self.ia3_free.pop()
