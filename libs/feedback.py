"""The feedback stream postproc writes and the routers learn from (one Redis stream).

Each record: `job_id`, `experts` (a JSON list of the names the engine applied), `task_type`,
`success` and `validation_passed` ("1" or "0"), `validator`, `latency_ms`, `timestamp`.
"""

FEEDBACK_STREAM = "expert:feedback"
