"""Training jobs on reception: one admission (`TrainingAdmission`) under the gRPC `TrainingService`
and the REST routes /v1/training/jobs (docs/api.md#training-jobs)."""
