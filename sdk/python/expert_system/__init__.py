"""The Expert System's Python SDK: a client of the reception's InferenceService.

```python
from expert_system import ExpertClient

with ExpertClient("127.0.0.1:50051") as client:  # default: $EXPERT_RECEPTION_TARGET or 127.0.0.1:50051
    result = client.infer(prompt="Parse this JSON and extract fields", body='{"name": "Alice"}')
    result.text, result.experts_used, result.latency_ms, result.finish_reason  # "stop", "length", ...

    stream = client.infer_stream(prompt="Write a story about a lighthouse")
    for chunk in stream:
        if chunk.restarted:  # the job started over: discard what was printed
            print("\\n[restarted]")
        print(chunk.text, end="", flush=True)
    stream.result

    with client.session(system_prompt="Be brief.", max_new_tokens=64) as session:  # multi-turn
        session.append("Hello")
        for chunk in session.generate():
            print(chunk.text, end="", flush=True)
```

`client.training` uploads training files and creates, watches, cancels and resumes training jobs
(see `expert_system.training`). `AsyncExpertClient` offers the same calls for asyncio. Results are
frozen dataclasses; a failed call raises an `ExpertSystemError` subclass.
"""

from .aio import AsyncExpertClient
from .client import ExpertClient
from .errors import (
    DeadlineExceeded,
    ExpertSystemError,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from .request import RequestFields
from .results import (
    AppliedExpert,
    Choice,
    InferenceMetrics,
    InferenceResult,
    Job,
    JobSubmission,
    StreamChunk,
    TokenLogprob,
    TopLogprob,
    ValidationResult,
)
from .session import (
    AsyncSession,
    AsyncTurnStream,
    ExpertRef,
    SamplingFields,
    Session,
    SessionFields,
    SessionInfo,
    TurnEnd,
    TurnFields,
    TurnStream,
    TurnUsage,
)
from .stream import AsyncInferStream, InferStream
from .tools import ToolCall, ToolCallDelta
from .training import AsyncTraining, Training
from .training_results import (
    TrainedExpert,
    TrainingCheckpoint,
    TrainingFile,
    TrainingJob,
    TrainingJobEvent,
    TrainingMetrics,
)

__all__ = [
    "AppliedExpert",
    "AsyncExpertClient",
    "AsyncInferStream",
    "AsyncSession",
    "AsyncTraining",
    "AsyncTurnStream",
    "Choice",
    "DeadlineExceeded",
    "ExpertClient",
    "ExpertRef",
    "ExpertSystemError",
    "FailedPrecondition",
    "InferStream",
    "InferenceMetrics",
    "InferenceResult",
    "InvalidRequest",
    "Job",
    "JobSubmission",
    "NotFound",
    "PermissionDenied",
    "RequestFields",
    "ResourceExhausted",
    "SamplingFields",
    "Session",
    "SessionFields",
    "SessionInfo",
    "StreamChunk",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
    "TrainedExpert",
    "Training",
    "TrainingCheckpoint",
    "TrainingFile",
    "TrainingJob",
    "TrainingJobEvent",
    "TrainingMetrics",
    "TurnEnd",
    "TurnFields",
    "TurnStream",
    "TurnUsage",
    "Unauthenticated",
    "Unavailable",
    "ValidationResult",
]
