"""The reception service: the public API (gRPC `InferenceService` and `SessionService`, the HTTP
front), admission and validation, the job queue on Redis streams, and the dispatcher."""
