"""`python -m services.reception`: the public API and the dispatcher."""

from __future__ import annotations

import asyncio

import grpc

from libs.auth.keys import KeyStore
from libs.auth.limits import KeyLimiter
from libs.auth.policy import Authenticator
from libs.grpc_server import Health, run, serve
from libs.logging import configure_logging
from libs.redis_client import connect, map_redis_error
from libs.redis_watch import watch_redis
from services.reception import keys
from services.reception.audit import AuditLog
from services.reception.capacity import Capacity
from services.reception.config import ReceptionConfig
from services.reception.dispatcher import Dispatcher
from services.reception.http import HttpServer, ServedModels, create_app
from services.reception.jobs import JobStore
from services.reception.metrics import ReceptionMetrics
from services.reception.peers import Peers
from services.reception.pipeline import Pipeline
from services.reception.queue import JobQueue
from services.reception.server import ACCESS, ReceptionServicer, add_to_server
from services.reception.session_server import ACCESS as SESSION_ACCESS
from services.reception.session_server import SessionServicer
from services.reception.session_server import add_to_server as add_sessions_to_server
from services.reception.sessions import SessionStore
from services.reception.stages import GrpcStages


async def main() -> None:
    config = ReceptionConfig.from_env()
    configure_logging("reception", config.server.log_level)
    health = Health()
    redis = connect(config.redis_url)
    peers = Peers(
        config.router_target, config.preparation_target, config.postproc_target, config.auth.internal_token
    )
    key_store, limiter = KeyStore(redis), KeyLimiter(redis)
    # One check of the credentials for both fronts: the gRPC interceptor and the HTTP dependency.
    auth = Authenticator(config.auth, {**ACCESS, **SESSION_ACCESS, **keys.ACCESS}, key_store)
    queue, metrics = JobQueue(redis), ReceptionMetrics()
    audit = AuditLog(config.audit_log, clear_text=config.audit_clear_text)
    jobs = JobStore(
        redis,
        config.job_ttl_s,
        config.dispatch.default_timeout_s,
        on_finished=metrics.finished,
        store_text=config.store_text,
        audit=audit,
        limiter=limiter,
    )
    capacity = Capacity(peers.preparation)
    served = ServedModels(capacity, peers.router)
    servicer = ReceptionServicer(jobs, queue, capacity, metrics, limiter=limiter)
    stages, sessions = GrpcStages(peers), SessionStore(redis, config.sessions)
    session_servicer = SessionServicer(servicer, sessions, stages, config.session_stream_buffer)
    pipeline = Pipeline(
        jobs,
        stages,
        config.engine_retries,
        lambda: capacity.last,
        stream_interval=config.stream_interval,
        sessions=sessions,
    )
    dispatcher = Dispatcher(redis, jobs, queue, pipeline, capacity, config.dispatch, metrics)
    dispatcher.on_finished = servicer.observe_job

    # The HTTP front (OpenAI's API, the probes) calls the same servicer: one admission path.
    http = None
    if config.http_port:
        app = create_app(servicer, capacity, served, map_redis_error, auth=auth)
        http = HttpServer(app, config.server, config.http_port, grace_s=config.drain_s + 1.0)
        http.bind()  # a taken port fails the start at once, like the gRPC port

    def register(server: grpc.aio.Server) -> list[str]:
        return [
            add_to_server(servicer, server),
            add_sessions_to_server(session_servicer, server),
            keys.add_to_server(keys.KeyServicer(key_store), server),
        ]

    watch: asyncio.Task | None = None

    async def on_start() -> None:
        nonlocal watch
        await redis.ping()  # jobs live in Redis: not ready without it
        await queue.setup()
        if config.dispatch_enabled:
            await dispatcher.start()
        if http is not None:
            await http.start()
        await health.set_serving(True)
        watch = asyncio.create_task(watch_redis(redis, health, restore=queue.setup))

    async def drain() -> None:
        # Jobs that end within the drain answer their callers; the rest are handed back.
        servicer.stop_following()
        await asyncio.gather(
            dispatcher.drain(config.drain_s), http.stop() if http is not None else asyncio.sleep(0)
        )

    async def on_stop() -> None:
        if watch is not None:
            watch.cancel()
        if http is not None:
            await http.stop()  # after a failed start (the drain stopped it otherwise)
        await dispatcher.stop()
        await peers.close()
        await redis.aclose()
        audit.close()

    await serve(
        "reception",
        config.server,
        register,
        health=health,
        on_start=on_start,
        drain=drain,
        error_mapper=map_redis_error,
        auth=auth,
        on_stop=on_stop,
        grace=config.drain_s + 1.0,  # the callers of the jobs that end in the drain get their answer
    )


if __name__ == "__main__":
    run(main(), service="reception")
