"""Reception's admission core, which knows no gRPC: a request becomes a job (`core.py`: the job id,
the per-key limits, validation (`validation.py`), the record and the enqueue), is followed as typed
events and cancelled; a session's calls (`sessions.py`) admit each turn the same way. The gRPC
servicers and the HTTP routes are adapters over it."""
