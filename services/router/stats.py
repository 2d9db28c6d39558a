"""What feedback taught about each expert: its success rate and use count, kept in Redis.

Every router applies feedback, so an update must be atomic across routers: one Lua script reads the
expert's hash, folds the outcome into the exponential moving average and counts the use, and Redis
runs scripts one at a time, so two routers updating the same expert at once both count. The hash is
scoped to a version: an outcome for the version registered now continues its statistics, and a newly
registered version starts again from the prior (its hash still names the previous version).
"""

from __future__ import annotations

from dataclasses import dataclass

from redis import Redis

KEY_PREFIX = "expert:stats:"

# KEYS[1] the expert's hash; ARGV: version, outcome (0 or 1), alpha, prior. Returns {rate, uses}.
_RECORD = """
local stored = redis.call('HMGET', KEYS[1], 'version', 'success_rate', 'uses')
local rate, uses = tonumber(ARGV[4]), 0
if stored[1] == ARGV[1] then
  rate, uses = tonumber(stored[2]), tonumber(stored[3])
end
rate = rate + tonumber(ARGV[3]) * (tonumber(ARGV[2]) - rate)
uses = uses + 1
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'success_rate', string.format('%.17g', rate), 'uses', uses)
return {string.format('%.17g', rate), uses}
"""


@dataclass(frozen=True)
class Stats:
    success_rate: float
    uses: int


class ExpertStats:
    """Success rates and uses by expert name and version; `prior` for a version with no outcome yet."""

    def __init__(self, redis: Redis, prior: float = 0.5) -> None:
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {prior}")
        self.redis = redis
        self.prior = prior
        self._record = redis.register_script(_RECORD)

    def record(self, name: str, version: str, success: bool, alpha: float) -> Stats:
        """Fold one outcome into the version's statistics, atomically; the statistics after it."""
        rate, uses = self._record(keys=[KEY_PREFIX + name], args=[version, int(success), alpha, self.prior])
        return Stats(float(rate), int(uses))

    def read(self, experts: list[tuple[str, str]]) -> list[Stats]:
        """The statistics of each (name, version), in one round trip."""
        if not experts:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for name, _ in experts:
            pipe.hmget(KEY_PREFIX + name, "version", "success_rate", "uses")
        found = []
        for (_, version), (stored, rate, uses) in zip(experts, pipe.execute(), strict=True):
            same = stored is not None and stored.decode() == version
            found.append(Stats(float(rate), int(uses)) if same else Stats(self.prior, 0))
        return found

    def forget(self, name: str) -> None:
        self.redis.delete(KEY_PREFIX + name)
