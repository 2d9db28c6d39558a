"""libs.auth against a real redis-server: keys are stored as hashes only and verified in constant
time, the policy refuses what each credential may not call, and the GCRA limits hold across two
clients (two reception replicas) of one Redis."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from redis.asyncio import Redis

from libs.auth.config import AuthConfig
from libs.auth.keys import ADMIN, INFER, TRAIN, KeyStore
from libs.auth.limits import KeyLimiter
from libs.auth.policy import (
    INTERNAL_CALLER,
    NO_OWNER,
    Access,
    Authenticator,
    Caller,
    may_reach,
    owning_key,
)
from libs.errors import ServiceError
from libs.gen.expert.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2_grpc
from libs.grpc_client import Channels
from services.reception.audit import AuditLog
from services.reception.jobs import JobStore
from tests.helpers.grpc_services import plan_request, running

TOKEN = "internal-token-for-tests-0123456789"
REQUIRED = AuthConfig(mode="required", internal_token=TOKEN)


def _run(url: str, scenario) -> None:
    async def main():
        redis = Redis.from_url(url)
        try:
            await scenario(redis)
        finally:
            await redis.aclose()

    asyncio.run(main())


async def _refusal(call) -> ServiceError:
    with pytest.raises(ServiceError) as refused:
        await call
    return refused.value


def test_keys_are_stored_as_hashes_and_verified_until_revoked(clean_redis_url):
    async def scenario(redis):
        store = KeyStore(redis)
        record, key = await store.create("ci", INFER, rate_limit=5, token_limit=0)
        assert key.startswith(f"esk_{record.key_id}_") and len(record.key_id) == 12
        stored = b""  # every field of every hash in Redis
        for name in await redis.keys("*"):
            if await redis.type(name) == b"hash":
                stored += b"".join(k + v for k, v in (await redis.hgetall(name)).items())
        assert key.encode() not in stored and key.split("_", 2)[2].encode() not in stored
        assert (await store.verify(key)) == record
        wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
        assert await store.verify(wrong) is None  # the right id, another secret
        assert await store.verify("not-a-key") is None
        other, _ = await store.create("ops", ADMIN, 0, 0)
        assert [r.key_id for r in await store.list()] == [record.key_id, other.key_id]
        revoked = await store.revoke(record.key_id)
        assert revoked.revoked and (await store.verify(key)).revoked
        assert (await store.revoke(record.key_id)).revoked_at == revoked.revoked_at  # the first time stays
        assert await store.revoke("0123456789ab") is None

    _run(clean_redis_url, scenario)


def test_the_policy_refuses_what_each_credential_may_not_call(clean_redis_url):
    async def scenario(redis):
        store = KeyStore(redis)
        infer, infer_key = await store.create("app", INFER, 7, 11)
        _, admin_key = await store.create("ops", ADMIN, 0, 0)
        _, train_key = await store.create("trainer", TRAIN, 0, 0)
        auth = Authenticator(REQUIRED, {}, store)

        caller = await auth.authenticate(Access.INFER, infer_key, None)
        assert caller == Caller(infer.key_id, INFER, 7, 11)
        assert (await auth.authenticate(Access.ADMIN, admin_key, None)).scope == ADMIN
        # train: inference and training; admin: everything train allows too.
        for access in (Access.INFER, Access.TRAIN):
            assert (await auth.authenticate(access, train_key, None)).scope == TRAIN
        assert (await auth.authenticate(Access.TRAIN, admin_key, None)).scope == ADMIN
        for access in (Access.INFER, Access.ADMIN, Access.INTERNAL):
            assert await auth.authenticate(access, None, TOKEN) is INTERNAL_CALLER

        def code(error: ServiceError) -> grpc.StatusCode:
            return error.code

        for access, key in ((Access.ADMIN, infer_key), (Access.TRAIN, infer_key), (Access.ADMIN, train_key)):
            refusal = await _refusal(auth.authenticate(access, key, None))
            assert code(refusal) is grpc.StatusCode.PERMISSION_DENIED and access.value in refusal.message
        assert code(await _refusal(auth.authenticate(Access.INTERNAL, admin_key, None))) is (
            grpc.StatusCode.PERMISSION_DENIED
        )
        for bearer, token, access in (
            (None, None, Access.INFER),  # missing
            ("esk_000000000000_" + "x" * 43, None, Access.INFER),  # wrong
            (None, "wrong-token-wrong-token", Access.INFER),
            (None, None, Access.INTERNAL),
        ):
            assert (
                code(await _refusal(auth.authenticate(access, bearer, token)))
                is grpc.StatusCode.UNAUTHENTICATED
            )
        await store.revoke(infer.key_id)
        revoked = await _refusal(auth.authenticate(Access.INFER, infer_key, None))
        assert revoked.code is grpc.StatusCode.UNAUTHENTICATED and "revoked" in revoked.message

        # Without a key store (the engine, preparation) only the internal token gets in.
        keyless = Authenticator(REQUIRED, {"/expert.v1.X/Y": Access.INFER})
        assert code(await _refusal(keyless.authenticate(Access.INFER, admin_key, None))) is (
            grpc.StatusCode.UNAUTHENTICATED
        )
        assert keyless.access_of("/expert.v1.X/Y") is Access.INFER
        assert keyless.access_of("/expert.v1.X/Undeclared") is Access.INTERNAL
        assert keyless.access_of("/grpc.health.v1.Health/Check") is Access.PUBLIC
        # Auth off: nothing is checked.
        assert await Authenticator(AuthConfig(), {}, store).authenticate(Access.ADMIN, None, None) is None

    _run(clean_redis_url, scenario)


def test_with_auth_off_only_the_key_rpcs_are_checked_and_they_need_an_admin_key_or_the_token(
    clean_redis_url,
):
    async def scenario(redis):
        store = KeyStore(redis)
        _, admin_key = await store.create("ops", ADMIN, 0, 0)
        _, infer_key = await store.create("app", INFER, 0, 0)
        keys_access = {"/expert.v1.KeyService/CreateKey": Access.KEYS}
        off = Authenticator(AuthConfig(internal_token=TOKEN), keys_access, store)
        assert off.enabled  # its KeyService is checked, so its interceptor runs
        assert not Authenticator(AuthConfig(), {"/expert.v1.X/Y": Access.ADMIN}, store).enabled
        for access in (Access.INFER, Access.TRAIN, Access.ADMIN, Access.INTERNAL):
            assert await off.authenticate(access, None, None) is None  # open, as before
        missing = await _refusal(off.authenticate(Access.KEYS, None, None))
        assert missing.code is grpc.StatusCode.UNAUTHENTICATED and "internal token" in missing.message
        infer = await _refusal(off.authenticate(Access.KEYS, infer_key, None))
        assert infer.code is grpc.StatusCode.PERMISSION_DENIED
        assert (await off.authenticate(Access.KEYS, admin_key, None)).scope == ADMIN
        assert await off.authenticate(Access.KEYS, None, TOKEN) is INTERNAL_CALLER
        wrong = await _refusal(off.authenticate(Access.KEYS, None, "wrong-token-wrong-token"))
        assert wrong.code is grpc.StatusCode.UNAUTHENTICATED
        # A service given no token matches none, not even an empty one.
        tokenless = Authenticator(AuthConfig(), {}, store)
        for token in ("", "anything-at-all-0123"):
            refused = await _refusal(tokenless.authenticate(Access.KEYS, None, token))
            assert refused.code is grpc.StatusCode.UNAUTHENTICATED
            assert "EXPERT_INTERNAL_TOKEN" in refused.message

    _run(clean_redis_url, scenario)


def test_a_key_reaches_only_what_it_made_and_the_internal_token_everything():
    key_a, key_b = Caller("aaaaaaaaaaaa", INFER), Caller("bbbbbbbbbbbb", ADMIN)
    assert owning_key(key_a) == "aaaaaaaaaaaa"
    assert owning_key(INTERNAL_CALLER) == owning_key(None) == NO_OWNER
    assert may_reach(key_a, owning_key(key_a)) and not may_reach(key_b, owning_key(key_a))
    assert not may_reach(key_a, NO_OWNER)  # made without a key: no key's
    assert may_reach(INTERNAL_CALLER, owning_key(key_a)) and may_reach(None, owning_key(key_a))


def test_a_requests_limit_holds_across_two_replicas_and_says_when_to_retry(clean_redis_url):
    async def scenario(redis):
        other = Redis.from_url(clean_redis_url)  # a second reception's own client
        try:
            limiters = [KeyLimiter(redis), KeyLimiter(other)]
            caller = Caller("aaaaaaaaaaaa", INFER, rate_limit=5)
            for i in range(5):
                await limiters[i % 2].admit(caller)
            refused = await _refusal(limiters[1].admit(caller))
            assert (
                refused.code is grpc.StatusCode.RESOURCE_EXHAUSTED
                and "5 requests per minute" in refused.message
            )
            assert refused.retry_after_s == 12  # one request's share of the minute
            await limiters[0].admit(
                Caller("bbbbbbbbbbbb", INFER, rate_limit=5)
            )  # another key is not affected
            await limiters[0].admit(Caller("aaaaaaaaaaaa", INFER))  # no limits: nothing counted
        finally:
            await other.aclose()

    _run(clean_redis_url, scenario)


def test_generated_tokens_are_charged_when_a_job_ends_and_refuse_the_key_over_its_budget(
    clean_redis_url, tmp_path
):
    async def scenario(redis):
        store, limiter = KeyStore(redis), KeyLimiter(redis)
        record, _ = await store.create("app", INFER, rate_limit=0, token_limit=100)
        caller = Caller(record.key_id, INFER, 0, 100)
        audit = AuditLog(str(tmp_path / "audit.log"))
        jobs = JobStore(redis, ttl_s=60, audit=audit, limiter=limiter)

        async def job(job_id: str, tokens: int) -> None:
            await limiter.admit(caller)
            await jobs.create(job_id, common_pb2.InferenceRequest(prompt="hi"), 5, key_id=record.key_id)
            assert (await jobs.get(job_id)).key_id == record.key_id
            result = common_pb2.InferenceResult(
                job_id=job_id, status=common_pb2.JOB_STATUS_COMPLETED, tokens_generated=tokens
            )
            assert await jobs.finish(job_id, result)

        await job("a", 100)  # the whole minute's budget: still admitted after
        await job("b", 1)  # over it now
        refused = await _refusal(limiter.admit(caller))
        assert "100 generated tokens per minute" in refused.message and refused.retry_after_s == 1
        audit.close()
        lines = [json.loads(line) for line in (tmp_path / "audit.log").read_text().splitlines()]
        assert [(line["job_id"], line["key_id"]) for line in lines] == [
            ("a", record.key_id),
            ("b", record.key_id),
        ]

    _run(clean_redis_url, scenario)


def test_a_service_channel_sends_the_internal_token_on_every_kind_of_rpc():
    async def calls(channel) -> list[grpc.StatusCode]:
        """Plan (unary), Generate (server streaming), LoadExpert (client streaming)."""
        codes = []
        router, engine = (
            router_pb2_grpc.RouterServiceStub(channel),
            engine_pb2_grpc.EngineServiceStub(channel),
        )

        async def chunks():
            yield engine_pb2.LoadExpertRequest(chunk=b"abc")

        for make in (
            lambda: router.Plan(plan_request("j", "hi"), timeout=5),
            lambda: _drain(engine.Generate(engine_pb2.GenerateRequest(request_id="a b"), timeout=5)),
            lambda: engine.LoadExpert(chunks(), timeout=5),
        ):
            try:
                await make()
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as error:
                codes.append(error.code())
        return codes

    async def _drain(call) -> None:
        async for _ in call:
            pass

    async def main():
        async with running(auth=Authenticator(REQUIRED, {})) as server:
            with_token, without = Channels(TOKEN), Channels()
            try:
                assert await calls(with_token.service(server.target)) == [grpc.StatusCode.OK] * 3
                assert await calls(without.service(server.target)) == [grpc.StatusCode.UNAUTHENTICATED] * 3
            finally:
                await with_token.close()
                await without.close()

    asyncio.run(main())
