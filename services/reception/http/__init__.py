"""Reception's HTTP front: the probes, the Expert System's REST API (`/v1/infer`, `/v1/jobs`) and the
part of OpenAI's API that maps onto an InferenceRequest (docs/api.md#http-api), served by uvicorn
in reception's own process and event loop.

It is not a second pipeline: every request becomes an InferenceRequest and goes through the same
admission core as the gRPC API (admission/core.py: `infer` / `stream` / `submit` / `get_job` /
`cancel_job`: admission, validation, the job record, the queue and the job's events); a
ServiceError they raise becomes OpenAI's error body (errors.py).
"""

from services.reception.http.app import create_app
from services.reception.http.models import ServedModels
from services.reception.http.server import HttpServer

__all__ = ["HttpServer", "ServedModels", "create_app"]
