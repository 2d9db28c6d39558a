"""The post-processing service (`PostprocService`): output validation by task type, metrics and
feedback."""
