"""Engine configuration: frozen dataclasses, built from keyword arguments or from EXPERT_* variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from libs.config import ConfigError, EnvReader

DEFAULT_MODEL = "data/models/SmolLM2-135M-Instruct"
QUANTIZATIONS = ("int8", "int4")  # libs/engine/quant.py; kept here so config needs no torch
# libs/engine/speculative.py and libs/engine/drafters/: "draft:<path>" names a draft checkpoint.
SPECULATIVE_DRAFTERS = ("off", "ngram", "base", "int4", "draft:<path>")
DRAFT_PREFIX = "draft:"


def valid_drafter(name: str) -> bool:
    """Whether `name` is a drafter setting: one of SPECULATIVE_DRAFTERS, or draft: and a path."""
    if name.startswith(DRAFT_PREFIX):
        return bool(name[len(DRAFT_PREFIX) :].strip())
    return name in SPECULATIVE_DRAFTERS


# dtype names as vLLM accepts them, to the canonical name the engine keeps ("auto" picks per device).
DTYPE_NAMES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


def canonical_dtype(value: Any) -> str:
    """The canonical name ("auto", "float32", "bfloat16", "float16") of a dtype given by name (vLLM's
    "float" and "half" too) or as a torch.dtype of those three; ConfigError naming `dtype` otherwise."""
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":  # no torch import here
        name = str(value).removeprefix("torch.")
        if name in ("float32", "bfloat16", "float16"):
            return name
    elif isinstance(value, str) and value in DTYPE_NAMES:
        return DTYPE_NAMES[value]
    raise ConfigError(
        "dtype: expected auto, float32 (float), bfloat16, float16 (half) or one of torch.float32, "
        f"torch.bfloat16, torch.float16, got {value!r}"
    )


KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and how much memory to give it.

    Sizing precedence: an explicit `num_blocks`, else `kv_cache_bytes`, else `memory_fraction` of the
    memory available after the weights are loaded.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    memory_fraction: float = 0.2
    enable_prefix_caching: bool = True
    # "auto": K and V in the model's dtype; "int8": 8-bit codes with a float32 scale per token and
    # KV head (CPU only; libs/engine/kernels/csrc/kv_int8.h).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size: must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks: must be at least 2, got {self.num_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ConfigError(f"kv_cache_bytes: must be positive, got {self.kv_cache_bytes}")
        if not 0.0 < self.memory_fraction <= 0.95:
            raise ConfigError(f"memory_fraction: must be in (0, 0.95], got {self.memory_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: tokens per step (the prefill chunk size), sequences at once, aging."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    aging_seconds: float = 2.0  # one priority level gained per this many seconds of waiting
    max_sessions: int = 256  # sessions whose KV the engine keeps between turns (sessions.py)
    # Speculative decoding (speculative.py): the drafter ("off", "ngram", "base", "int4" or
    # "draft:<checkpoint path>") and the most tokens a sequence drafts per step.
    speculative: str = "off"
    speculative_k: int = 4
    # A step carries drafts only up to this many rows, its decodes counted first: few rows cost
    # one pass over the weights whatever their number; many make the step compute-bound.
    speculative_max_rows: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.speculative, str) or not valid_drafter(self.speculative):
            raise ConfigError(
                f"speculative: expected one of {', '.join(SPECULATIVE_DRAFTERS)}, got {self.speculative!r}"
            )
        if not 1 <= self.speculative_k <= 16:
            raise ConfigError(f"speculative_k: must be in [1, 16], got {self.speculative_k}")
        if self.speculative_max_rows < 1:
            raise ConfigError(f"speculative_max_rows: must be at least 1, got {self.speculative_max_rows}")
        if self.max_sessions < 0:
            raise ConfigError(f"max_sessions: must be >= 0 (0 refuses sessions), got {self.max_sessions}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs: must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens: must be at least max_num_seqs ({self.max_num_seqs}), "
                f"got {self.max_num_batched_tokens}"
            )
        if self.aging_seconds < 0:
            raise ConfigError(f"aging_seconds: must be >= 0 (0 disables aging), got {self.aging_seconds}")


@dataclass(frozen=True)
class AdapterConfig:
    """Experts: byte budgets of the host tier (verified weights in memory) and the device tier (the
    kernels' pools), and the directory of public keys whose packages are trusted."""

    host_bytes: int = 2 << 30
    device_bytes: int = 1 << 30
    trusted_keys_dir: str = "data/keys/trusted"

    def __post_init__(self) -> None:
        for name in ("host_bytes", "device_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start: the checkpoint, where to run, cache and scheduling.

    device / dtype "auto": CUDA with bfloat16 when a GPU is present, else the CPU with float32. dtype
    may be given as a torch.dtype or by vLLM's names ("float", "half"); it is kept as its canonical
    name ("float32", "bfloat16", "float16" or "auto").
    kernels "auto": the native CPU kernels when they apply (CPU, float32), the Triton kernels on
    CUDA, else torch operators.
    cuda_graphs: decode steps padded to fixed sizes and replayed from CUDA graphs captured at
    start-up. "auto" captures them on CUDA with graph-safe kernels (Triton); "on" also runs the same
    padded steps eagerly on a CPU (where padding costs compute and buys nothing: for tests); "off"
    runs every step eagerly.
    async_scheduling: a step is queued on the device before the previous step's tokens are read
    back, its inputs taking them from the device ("auto": on CUDA; "on" also on the CPU, where it
    overlaps nothing: for tests; "off" runs the steps in series).
    """

    model: str = DEFAULT_MODEL
    # The name clients ask for the model by (vLLM's served_model_name); None: the model directory's name.
    served_model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"  # also accepted: a torch.dtype or vLLM's names ("float", "half"), kept canonical
    kernels: str = "auto"
    # Weight-only quantization applied at load: "int8", "int4", or None for the checkpoint's own
    # dtype ("none" and "" are accepted for None). See docs/engine.md#quantized-weights.
    quantization: str | None = None
    num_threads: int | None = None
    max_model_len: int | None = None
    seed: int | None = None
    cuda_graphs: str = "auto"
    async_scheduling: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    adapters: AdapterConfig = field(default_factory=AdapterConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.quantization in ("", "none"):
            object.__setattr__(self, "quantization", None)
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ConfigError(
                f"quantization: expected one of {', '.join(QUANTIZATIONS)} or none, got {self.quantization!r}"
            )
        choices = {
            "kernels": ("auto", "native", "triton", "torch"),
            "cuda_graphs": ("auto", "on", "off"),
            "async_scheduling": ("auto", "on", "off"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"{name}: expected one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ConfigError(f"device: expected auto, cpu or cuda[:N], got {self.device!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads: must be at least 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len: must be at least 2, got {self.max_model_len}")
        if self.served_model_name is not None and (
            not self.served_model_name.strip() or ":" in self.served_model_name
        ):
            # `<model>:<expert>` names an expert of a model, so a model's own name has no colon.
            raise ConfigError(
                f"served_model_name: must be non-empty and without ':', got {self.served_model_name!r}"
            )

    @property
    def model_name(self) -> str:
        """The name the model is served under: served_model_name, else its directory's name."""
        return self.served_model_name or self.model.rstrip("/").rsplit("/", 1)[-1]

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """A copy with top-level, cache, scheduler or adapter fields replaced by keyword (unknown names
        rejected)."""
        sections = {"cache": CacheConfig, "scheduler": SchedulerConfig, "adapters": AdapterConfig}
        top = {f.name for f in fields(self)} - set(sections)
        changes: dict[str, dict[str, Any]] = {"": {}} | {section: {} for section in sections}
        for name, value in overrides.items():
            section = (
                ""
                if name in top
                else next((s for s, cls in sections.items() if name in {f.name for f in fields(cls)}), None)
            )
            if section is None:
                raise ConfigError(f"{name}: not an engine setting")
            changes[section][name] = value
        config = replace(self, **changes[""])
        for section in sections:
            if changes[section]:
                config = replace(config, **{section: replace(getattr(config, section), **changes[section])})
        return config

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EngineConfig:
        """Read EXPERT_* variables (see docs/configuration.md); unset ones keep their defaults."""
        try:
            return cls._from_env(EnvReader(env))
        except ConfigError as exc:
            field_name, _, message = str(exc).partition(": ")
            variable = ENV_VARIABLES.get(field_name)
            if variable is None:
                raise
            raise ConfigError(f"{variable}: {message}") from None

    @classmethod
    def _from_env(cls, reader: EnvReader) -> EngineConfig:
        return cls(
            model=reader.text("EXPERT_MODEL_PATH", DEFAULT_MODEL),
            served_model_name=reader.text("EXPERT_SERVED_MODEL_NAME", "") or None,
            device=reader.text("EXPERT_DEVICE", "auto"),
            dtype=reader.text("EXPERT_DTYPE", "auto"),
            kernels=reader.text("EXPERT_KERNELS", "auto"),
            quantization=reader.text("EXPERT_QUANTIZATION", "") or None,
            num_threads=reader.integer("EXPERT_NUM_THREADS"),
            max_model_len=reader.integer("EXPERT_MAX_MODEL_LEN"),
            seed=reader.integer("EXPERT_SEED"),
            cuda_graphs=reader.text("EXPERT_CUDA_GRAPHS", "auto"),
            async_scheduling=reader.text("EXPERT_ASYNC_SCHEDULING", "auto"),
            cache=CacheConfig(
                block_size=reader.integer("EXPERT_KV_BLOCK_SIZE", 16),
                num_blocks=reader.integer("EXPERT_KV_NUM_BLOCKS"),
                kv_cache_bytes=reader.integer("EXPERT_KV_CACHE_BYTES"),
                memory_fraction=reader.number("EXPERT_KV_CACHE_MEMORY_FRACTION", 0.2),
                enable_prefix_caching=reader.boolean("EXPERT_PREFIX_CACHING", True),
                kv_cache_dtype=reader.text("EXPERT_KV_CACHE_DTYPE", "auto"),
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=reader.integer("EXPERT_MAX_NUM_SEQS", 64),
                max_num_batched_tokens=reader.integer("EXPERT_MAX_NUM_BATCHED_TOKENS", 2048),
                aging_seconds=reader.number("EXPERT_SCHEDULER_AGING_SECONDS", 2.0),
                max_sessions=reader.integer("EXPERT_MAX_SESSIONS", 256),
                speculative=reader.text("EXPERT_SPECULATIVE", "off"),
                speculative_k=reader.integer("EXPERT_SPECULATIVE_K", 4),
                speculative_max_rows=reader.integer("EXPERT_SPECULATIVE_MAX_ROWS", 16),
            ),
            adapters=AdapterConfig(
                host_bytes=reader.integer("EXPERT_ADAPTER_HOST_BYTES", 2 << 30),
                device_bytes=reader.integer("EXPERT_ADAPTER_DEVICE_BYTES", 1 << 30),
                trusted_keys_dir=reader.text("EXPERT_TRUSTED_KEYS", "data/keys/trusted"),
            ),
        )


# Field name -> environment variable, for error messages about values read from the environment.
ENV_VARIABLES = {
    "model": "EXPERT_MODEL_PATH",
    "served_model_name": "EXPERT_SERVED_MODEL_NAME",
    "device": "EXPERT_DEVICE",
    "dtype": "EXPERT_DTYPE",
    "kernels": "EXPERT_KERNELS",
    "quantization": "EXPERT_QUANTIZATION",
    "num_threads": "EXPERT_NUM_THREADS",
    "max_model_len": "EXPERT_MAX_MODEL_LEN",
    "seed": "EXPERT_SEED",
    "cuda_graphs": "EXPERT_CUDA_GRAPHS",
    "async_scheduling": "EXPERT_ASYNC_SCHEDULING",
    "block_size": "EXPERT_KV_BLOCK_SIZE",
    "num_blocks": "EXPERT_KV_NUM_BLOCKS",
    "kv_cache_bytes": "EXPERT_KV_CACHE_BYTES",
    "memory_fraction": "EXPERT_KV_CACHE_MEMORY_FRACTION",
    "enable_prefix_caching": "EXPERT_PREFIX_CACHING",
    "kv_cache_dtype": "EXPERT_KV_CACHE_DTYPE",
    "max_num_seqs": "EXPERT_MAX_NUM_SEQS",
    "max_num_batched_tokens": "EXPERT_MAX_NUM_BATCHED_TOKENS",
    "aging_seconds": "EXPERT_SCHEDULER_AGING_SECONDS",
    "max_sessions": "EXPERT_MAX_SESSIONS",
    "speculative": "EXPERT_SPECULATIVE",
    "speculative_k": "EXPERT_SPECULATIVE_K",
    "speculative_max_rows": "EXPERT_SPECULATIVE_MAX_ROWS",
    "host_bytes": "EXPERT_ADAPTER_HOST_BYTES",
    "device_bytes": "EXPERT_ADAPTER_DEVICE_BYTES",
    "trusted_keys_dir": "EXPERT_TRUSTED_KEYS",
}
