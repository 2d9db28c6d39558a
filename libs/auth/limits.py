"""Per-key limits: requests per minute and generated tokens per minute, shared by every reception
replica through one Redis.

Both are GCRA (the generic cell rate algorithm): per key and limit, Redis holds one number, the
"theoretical arrival time" (TAT, in ms of Redis's clock). A request adds 60 000 / rate_limit ms
to it and is admitted while the TAT stays within a minute of now, so a key may spend its whole
minute's budget at once and then one request every 60 / rate_limit s. Generated tokens are charged
when a job ends (60 000 / token_limit ms each) and a key whose TAT is more than a minute ahead is
refused at admission until it is back within the minute. Admission is one atomic script (both
checks, then the request is counted), timed by Redis's own clock so that replicas agree.

Other per-caller limits (the sessions one may create, services/reception/sessions.py) count with
the same GCRA (`GCRA_LUA`) against the same owner (`LimitOwner`): the API key, or with auth off the
client's address.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from redis.asyncio import Redis

from libs.auth.keys import key_hash
from libs.auth.policy import Caller
from libs.errors import resource_exhausted

WINDOW_MS = 60_000

# Lua functions for scripts that count events at a rate: `now_ms()` is Redis's clock, and
# `gcra(key, now, rate, window)` counts one event against `key` (at most `rate` per `window` ms,
# all of them at once if need be), returning 0, or the ms to wait when over (nothing counted).
GCRA_LUA = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function gcra(key, now, rate, window)
  local tat = math.max(tonumber(redis.call('GET', key) or now), now) + window / rate
  if tat - now > window then return math.ceil(tat - now - window) end
  redis.call('SET', key, tostring(tat), 'PX', math.ceil(tat - now))
  return 0
end
"""

# KEYS: the key's requests TAT, its tokens TAT; ARGV: rate_limit, token_limit, window ms
# -> {1, 0} admitted (and counted), or {0, ms to wait, 1 for the requests limit or 2 for tokens}
_ADMIT = (
    GCRA_LUA
    + """
local now = now_ms()
local rate, tokens, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if tokens > 0 then
  local tat = tonumber(redis.call('GET', KEYS[2]) or now)
  if tat - now > window then return {0, math.ceil(tat - now - window), 2} end
end
if rate > 0 then
  local wait = gcra(KEYS[1], now, rate, window)
  if wait > 0 then return {0, wait, 1} end
end
return {1, 0, 0}
"""
)

# KEYS: the key's record, its tokens TAT; ARGV: tokens generated, window ms -> 1 charged, 0 no limit
# The limit is read from the key's record now, so a key's current limit is the one charged.
_CHARGE = """
local limit = tonumber(redis.call('HGET', KEYS[1], 'token_limit') or '0') or 0
if limit <= 0 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[2])
local tat = math.max(tonumber(redis.call('GET', KEYS[2]) or now), now) + tonumber(ARGV[1]) * window / limit
redis.call('SET', KEYS[2], tostring(tat), 'PX', math.ceil(tat - now))
return 1
"""


@dataclass(frozen=True)
class LimitOwner:
    """Whom a per-caller limit counts against: the API key the call proved, else (auth off, or the
    internal token) the client's address, so that with auth off each client host has its own
    count (behind a proxy, all of its clients share one)."""

    redis_prefix: str  # the owner's counters live under this prefix
    name: str  # how refusals name it

    @classmethod
    def of(cls, caller: Caller | None, peer: str) -> LimitOwner:
        """The owner of a call by `caller` (None with auth off) from gRPC peer `peer`."""
        if caller is not None and caller.key_id is not None:
            return cls(key_hash(caller.key_id), f"API key {caller.key_id}")
        host = peer_host(peer)
        return cls(f"expert:peer:{host}", f"client {host}")


def peer_host(peer: str) -> str:
    """The client's address in a gRPC peer string, without its port: "ipv4:10.0.0.5:41234" ->
    "10.0.0.5", "ipv6:[::1]:41234" -> "::1"; anything else (a Unix socket, none) as it is."""
    kind, _, address = peer.partition(":")
    if kind == "ipv4":
        return address.rpartition(":")[0] or address
    if kind == "ipv6":
        return address.rpartition(":")[0].strip("[]") or address
    return peer or "unknown"


def requests_key(key_id: str) -> str:
    return key_hash(key_id) + ":requests"


def tokens_key(key_id: str) -> str:
    return key_hash(key_id) + ":tokens"


class KeyLimiter:
    """Admits a key's requests within its limits and charges its generated tokens."""

    def __init__(self, redis: Redis, window_ms: int = WINDOW_MS) -> None:
        self.window_ms = window_ms
        self._admit = redis.register_script(_ADMIT)
        self._charge = redis.register_script(_CHARGE)

    async def admit(self, caller: Caller | None) -> None:
        """Counts a request of `caller`, or raises RESOURCE_EXHAUSTED with the seconds to wait
        (a RetryInfo) when the key is over a limit. Callers without a key or limits pass."""
        if caller is None or caller.key_id is None or not (caller.rate_limit or caller.token_limit):
            return
        admitted, wait_ms, which = await self._admit(
            keys=[requests_key(caller.key_id), tokens_key(caller.key_id)],
            args=[caller.rate_limit, caller.token_limit, self.window_ms],
        )
        if admitted:
            return
        wait_s = max(1, math.ceil(wait_ms / 1000))
        if which == 1:
            what = f"{caller.rate_limit} requests per minute"
        else:
            what = f"{caller.token_limit} generated tokens per minute"
        raise resource_exhausted(
            f"API key {caller.key_id} is over its limit of {what}; retry in {wait_s} s", retry_after_s=wait_s
        )

    async def charge(self, key_id: str, tokens: int) -> None:
        """Counts `tokens` generated for key `key_id` against its tokens-per-minute limit."""
        if tokens > 0:
            await self._charge(keys=[key_hash(key_id), tokens_key(key_id)], args=[tokens, self.window_ms])
