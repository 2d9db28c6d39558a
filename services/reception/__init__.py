"""The reception service: the public API and the dispatcher. `admission/` is the core that knows no
gRPC (a request becomes a job: ids, limits, validation, the record and the enqueue; following and
cancelling it), `dispatch/` runs each job through the other stages, and the fronts (`server.py`,
`session_server.py`, `keys.py`, `http/`) adapt gRPC and HTTP to the core."""
