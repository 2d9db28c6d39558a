"""Sessions per API key (or, with auth off, per client address) are capped and rate-limited
(services/reception/sessions.py): SessionService over a real gRPC server, with real auth and keys,
against a real redis-server. Issue 34: CreateSession took 3,000 sessions from one key."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from redis.asyncio import Redis

from libs.auth.config import AuthConfig
from libs.auth.keys import INFER, KeyStore
from libs.auth.limits import LimitOwner, peer_host
from libs.auth.policy import Authenticator, Caller
from libs.errors import retry_delay
from libs.gen.expert.v1 import session_pb2, session_pb2_grpc
from services.reception.admission.sessions import SessionAdmission
from services.reception.session_server import ACCESS, SessionServicer, add_to_server
from services.reception.sessions import SessionLimits, SessionStore, session_key
from tests.helpers.in_process import serving

TOKEN = "internal-token-for-tests-0123456789"
REQUIRED = AuthConfig(mode="required", internal_token=TOKEN)


@contextlib.asynccontextmanager
async def session_service(redis_url: str, limits: SessionLimits, auth: AuthConfig = REQUIRED):
    """SessionService on a free port over Redis at `redis_url`; yields (stub, key store, redis)."""
    redis = Redis.from_url(redis_url)
    keys = KeyStore(redis)

    async def release_session(address: str, session_id: str) -> None:
        raise AssertionError("no session here reaches an engine")

    # Creating and ending a session that never ran a turn do not reach the admission core.
    sessions = SessionAdmission(None, SessionStore(redis, limits), release_session)
    authenticator = Authenticator(auth, ACCESS, keys)
    try:
        async with (
            serving(
                lambda server: [add_to_server(SessionServicer(sessions), server)], auth=authenticator
            ) as target,
            grpc.aio.insecure_channel(target) as channel,
        ):
            yield session_pb2_grpc.SessionServiceStub(channel), keys, redis
    finally:
        await redis.aclose()


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


async def create(stub, key: str | None) -> str:
    metadata = bearer(key) if key else None
    response = await stub.CreateSession(session_pb2.CreateSessionRequest(), metadata=metadata)
    return response.session.session_id


async def refusal(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    return refused.value


def test_a_key_holds_at_most_its_cap_and_an_ended_session_frees_its_place(clean_redis_url):
    async def main():
        limits = SessionLimits(idle_seconds=600.0, max_tokens=0, max_per_key=3, create_per_minute=0)
        async with session_service(clean_redis_url, limits) as (stub, keys, _):
            first, key = await keys.create("app", INFER, 0, 0)
            _, other = await keys.create("other", INFER, 0, 0)
            ids = [await create(stub, key) for _ in range(3)]
            refused = await refusal(create(stub, key))
            assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"API key {first.key_id} holds 3 sessions" in refused.details()
            assert "EXPERT_SESSION_MAX_PER_KEY" in refused.details() and retry_delay(refused) is None
            await create(stub, other)  # another key has its own count
            await stub.EndSession(session_pb2.EndSessionRequest(session_id=ids[0]), metadata=bearer(key))
            await create(stub, key)  # the ended session's place
            assert (await refusal(create(stub, key))).code() is grpc.StatusCode.RESOURCE_EXHAUSTED

    asyncio.run(main())


def test_concurrent_creations_never_pass_the_cap(clean_redis_url):
    async def main():
        limits = SessionLimits(idle_seconds=600.0, max_tokens=0, max_per_key=5, create_per_minute=0)
        async with session_service(clean_redis_url, limits) as (stub, keys, redis):
            _, key = await keys.create("app", INFER, 0, 0)
            outcomes = await asyncio.gather(*(create(stub, key) for _ in range(40)), return_exceptions=True)
            created = [o for o in outcomes if isinstance(o, str)]
            refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
            assert len(created) == 5 and len(refused) == 35
            assert {r.code() for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert len(await redis.keys(session_key("*"))) == 5

    asyncio.run(main())


def test_an_expired_session_frees_its_place(clean_redis_url):
    async def main():
        limits = SessionLimits(idle_seconds=1.0, max_tokens=0, max_per_key=1, create_per_minute=0)
        async with session_service(clean_redis_url, limits) as (stub, keys, redis):
            _, key = await keys.create("app", INFER, 0, 0)
            session_id = await create(stub, key)
            assert (await refusal(create(stub, key))).code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            deadline = time.monotonic() + 30
            while await redis.exists(session_key(session_id)):  # Redis expires it after 1 s idle
                assert time.monotonic() < deadline, "the idle session did not expire"
                await asyncio.sleep(0.1)
            await create(stub, key)

    asyncio.run(main())


def test_a_key_over_its_creation_rate_is_told_when_to_retry(clean_redis_url):
    async def main():
        limits = SessionLimits(idle_seconds=600.0, max_tokens=0, max_per_key=0, create_per_minute=2)
        async with session_service(clean_redis_url, limits) as (stub, keys, _):
            record, key = await keys.create("app", INFER, 0, 0)
            _, other = await keys.create("other", INFER, 0, 0)
            for _ in range(2):  # a minute's creations at once
                await create(stub, key)
            refused = await refusal(create(stub, key))
            assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (
                f"API key {record.key_id} is over its limit of 2 new sessions per minute" in refused.details()
            )
            assert "EXPERT_SESSION_CREATE_PER_MINUTE" in refused.details()
            assert 1 <= retry_delay(refused) <= 30  # one creation's share of the minute
            await create(stub, other)

    asyncio.run(main())


def test_with_auth_off_sessions_are_counted_per_client_address(clean_redis_url):
    async def main():
        limits = SessionLimits(idle_seconds=600.0, max_tokens=0, max_per_key=2, create_per_minute=0)
        async with session_service(clean_redis_url, limits, auth=AuthConfig()) as (stub, _, redis):
            for _ in range(2):
                await create(stub, None)
            refused = await refusal(create(stub, None))
            assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "client 127.0.0.1 holds 2 sessions" in refused.details()
            assert await redis.scard("expert:peer:127.0.0.1:sessions") == 2

    asyncio.run(main())


def test_the_owner_of_a_call_is_its_key_else_its_address():
    assert LimitOwner.of(Caller("k1", INFER), "ipv4:10.0.0.5:41234").name == "API key k1"
    assert LimitOwner.of(None, "ipv4:10.0.0.5:41234").redis_prefix == "expert:peer:10.0.0.5"
    assert LimitOwner.of(Caller(None, "internal"), "ipv6:[::1]:41234").name == "client ::1"
    assert peer_host("ipv6:[2001:db8::7]:50051") == "2001:db8::7"
    assert peer_host("unix:/tmp/reception.sock") == "unix:/tmp/reception.sock"
    assert peer_host("") == "unknown"
