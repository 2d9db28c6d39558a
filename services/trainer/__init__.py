"""The trainer worker: takes training jobs from Redis, trains their adapters with peft, checkpoints
them, and installs the experts they produce (docs/operations.md#the-trainer)."""
