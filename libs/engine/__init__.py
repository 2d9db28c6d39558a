"""The engine library: a paged-KV, continuous-batching model runner for HF decoder checkpoints.

The engine service (`services/engine`) puts it behind gRPC; `expertctl chat`, the expert trainer
and the benchmarks import it directly. Nothing here imports a service.

from libs.engine import LLMEngine, SamplingParams
engine = LLMEngine.from_pretrained("data/models/SmolLM2-135M-Instruct")
outs = engine.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=32))
"""

from libs.engine.async_engine import AsyncLLMEngine, EngineDeadError
from libs.engine.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from libs.engine.errors import InvalidRequestError
from libs.engine.info import EngineLoad, ModelInfo
from libs.engine.llm_engine import LLMEngine
from libs.engine.outputs import CompletionOutput, EngineStats, Logprob, RequestMetrics, RequestOutput
from libs.engine.sampling_params import OutputKind, SamplingParams
from libs.engine.streams import RequestStream

__all__ = [
    "AsyncLLMEngine",
    "CacheConfig",
    "CompletionOutput",
    "ConfigError",
    "EngineConfig",
    "EngineDeadError",
    "EngineLoad",
    "EngineStats",
    "InvalidRequestError",
    "LLMEngine",
    "Logprob",
    "ModelInfo",
    "OutputKind",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "SchedulerConfig",
]
