"""Training: data formats and stored training files, shared by reception (which validates uploads)
and the trainer (which reads them)."""
