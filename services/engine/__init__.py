"""The engine: a paged-KV, continuous-batching model runner for HF decoder checkpoints.

from services.engine import LLMEngine, SamplingParams
engine = LLMEngine.from_pretrained("data/models/SmolLM2-135M-Instruct")
outs = engine.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=32))
"""

from services.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from services.engine.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from services.engine.errors import InvalidRequestError
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import CompletionOutput, EngineStats, Logprob, RequestMetrics, RequestOutput
from services.engine.sampling_params import OutputKind, SamplingParams

__all__ = [
    "AsyncLLMEngine",
    "CacheConfig",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "InvalidRequestError",
    "LLMEngine",
    "Logprob",
    "OutputKind",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "SchedulerConfig",
]
