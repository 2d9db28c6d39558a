"""How long a training job is kept once it has ended (EXPERT_TRAINING_JOB_RETENTION_SECONDS, read
by reception and by the trainers alike): its record and events expire that long after it reaches
COMPLETED, FAILED or CANCELLED (Redis TTLs, set by whoever ends it and dropped by a resume), and the
trainers remove its checkpoint directory then. The expert a job produced stays in the expert store.
"""

from __future__ import annotations

from collections.abc import Mapping

from libs.config import EnvReader

DEFAULT_RETENTION_S = 7 * 24 * 3600


def retention_from_env(env: Mapping[str, str] | None = None) -> int:
    """The retention in seconds, at least 1."""
    return EnvReader(env).integer("EXPERT_TRAINING_JOB_RETENTION_SECONDS", DEFAULT_RETENTION_S, minimum=1)
