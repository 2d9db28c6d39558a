"""`python -m services.reception`: the public API (the gRPC and HTTP fronts over the admission core)
and the dispatcher, wired from the configuration and served."""

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
from libs.training.files import TrainingFiles
from libs.training.jobs import TrainingJobs
from services.reception import keys
from services.reception.admission.core import Admission
from services.reception.admission.sessions import SessionAdmission
from services.reception.audit import AuditLog
from services.reception.capacity import Capacity
from services.reception.config import ReceptionConfig
from services.reception.dispatch.dispatcher import Dispatcher
from services.reception.dispatch.pipeline import Pipeline
from services.reception.dispatch.stages import GrpcStages
from services.reception.dispatch.turns import Turns
from services.reception.file_server import ACCESS as FILE_ACCESS
from services.reception.file_server import TrainingFileServicer
from services.reception.file_server import add_to_server as add_files_to_server
from services.reception.http import HttpServer, ServedModels, create_app
from services.reception.http.files import FileUploads
from services.reception.http.response_store import ResponseStore
from services.reception.jobs import JobStore
from services.reception.metrics import ReceptionMetrics
from services.reception.peers import Peers
from services.reception.queue import JobQueue
from services.reception.redis_compaction import Compactor
from services.reception.server import ACCESS, ReceptionServicer, add_to_server
from services.reception.session_server import ACCESS as SESSION_ACCESS
from services.reception.session_server import SessionServicer
from services.reception.session_server import add_to_server as add_sessions_to_server
from services.reception.sessions import SessionStore
from services.reception.training import grpc_api as training_api
from services.reception.training.admission import TrainingAdmission

# Seconds the HTTP server waits, after the drain, for the answers of the calls handed back.
HAND_BACK_S = 4.0


class Reception:
    """Reception's parts, built once from `config`, and the hooks `serve` calls: admission (with
    its stores), the dispatcher, and the fronts over admission."""

    def __init__(self, config: ReceptionConfig) -> None:
        self.config = config
        self.health = Health()
        self.redis = connect(config.redis_url)
        self.peers = Peers(
            config.router_target,
            config.preparation_target,
            config.postproc_target,
            config.auth.internal_token,
            config.auth.tls,
        )
        self.key_store, limiter = KeyStore(self.redis), KeyLimiter(self.redis)
        self.training_files = TrainingFiles(self.redis)  # uploaded through HTTP and gRPC alike
        # One check of the credentials for both fronts: the gRPC interceptor and the HTTP dependency.
        self.auth = Authenticator(
            config.auth,
            {**ACCESS, **SESSION_ACCESS, **keys.ACCESS, **training_api.ACCESS, **FILE_ACCESS},
            self.key_store,
        )
        self.queue = JobQueue(self.redis, lease_ms=config.dispatch.reclaim_idle_ms)
        self.metrics = ReceptionMetrics()
        self.audit = AuditLog(config.audit_log, clear_text=config.audit_clear_text)
        self.jobs = JobStore(
            self.redis,
            config.job_ttl_s,
            config.dispatch.default_timeout_s,
            on_finished=self.metrics.finished,
            store_text=config.store_text,
            audit=self.audit,
            limiter=limiter,
        )
        self.capacity = Capacity(self.peers.preparation)
        self.admission = Admission(self.jobs, self.queue, self.capacity, self.metrics, limiter=limiter)
        stages, session_store = GrpcStages(self.peers), SessionStore(self.redis, config.sessions)
        self.sessions = SessionAdmission(self.admission, session_store, stages.release_session)
        self.training = TrainingAdmission(
            TrainingJobs(self.redis, config.training_retention_s), TrainingFiles(self.redis), config.training
        )
        self.dispatcher = self._dispatcher(stages, session_store)
        self.http = self._http()
        self._watch: asyncio.Task | None = None
        # Without the texts kept, their bytes also leave the append-only file (redis_compaction).
        self.compactor = (
            None
            if config.store_text
            else Compactor(
                self.redis,
                config.redis_compact_s,
                on_outcome=lambda outcome: self.metrics.redis_compactions.labels(outcome).inc(),
            )
        )
        self._compact: asyncio.Task | None = None

    def _dispatcher(self, stages: GrpcStages, sessions: SessionStore) -> Dispatcher:
        config = self.config
        pipeline = Pipeline(
            self.jobs,
            stages,
            config.engine_retries,
            lambda: self.capacity.last,
            stream_interval=config.stream_interval,
            turns=Turns(sessions),
        )
        dispatcher = Dispatcher(
            self.redis, self.jobs, self.queue, pipeline, self.capacity, config.dispatch, self.metrics
        )
        dispatcher.on_finished = self.admission.observe_job
        return dispatcher

    def _http(self) -> HttpServer | None:
        """The HTTP front (OpenAI's API, the REST API, the probes) over the same admission as the
        gRPC API; None when EXPERT_RECEPTION_HTTP_PORT is 0."""
        config = self.config
        if not config.http_port:
            return None
        served = ServedModels(self.capacity, self.peers.router)
        app = create_app(
            self.admission,
            self.capacity,
            served,
            map_redis_error,
            auth=self.auth,
            max_body_bytes=config.http_max_body_bytes,
            serving=lambda: self.health.serving,  # /readyz and gRPC health: one flag (Redis, stopping)
            metrics=self.metrics,
            # Without store_text no response is kept: its conversation would outlive its job.
            responses=ResponseStore(self.redis, config.job_ttl_s) if config.store_text else None,
            sessions=self.sessions,
            training=self.training,
            files=FileUploads(self.training_files, config.training_files),
        )
        # The HTTP server's grace starts at the stop, with the drain: it must outlast the drain and
        # then the hand-back, whose answers (a 503, a stream's last event) are written after it. One
        # second was once too little on a loaded 2-core machine (a stream cut without its event);
        # a stop with no call in flight still ends at once.
        http = HttpServer(app, config.server, config.http_port, grace_s=config.drain_s + HAND_BACK_S)
        http.bind()  # a taken port fails the start at once, like the gRPC port
        return http

    def register(self, server: grpc.aio.Server) -> list[str]:
        return [
            add_to_server(ReceptionServicer(self.admission), server),
            add_sessions_to_server(SessionServicer(self.sessions, self.config.session_stream_buffer), server),
            keys.add_to_server(keys.KeyServicer(self.key_store), server),
            training_api.add_to_server(training_api.TrainingServicer(self.training), server),
            add_files_to_server(
                TrainingFileServicer(self.training_files, self.config.training_files), server
            ),
        ]

    async def start(self) -> None:
        await self.redis.ping()  # jobs live in Redis: not ready without it
        await self.queue.setup()
        if self.config.dispatch_enabled:
            await self.dispatcher.start()
        if self.http is not None:
            await self.http.start()
        await self.health.set_serving(True)
        self._watch = asyncio.create_task(watch_redis(self.redis, self.health, restore=self.queue.setup))
        if self.compactor is not None:
            self._compact = asyncio.create_task(self.compactor.run())

    async def drain(self) -> None:
        # Jobs that end within the drain answer their callers; the rest are handed back, and so are
        # their callers: each gets its job's id (HTTP: a JSON 503 with Retry-After) before the
        # servers close, the HTTP one last (it waits for the answers).
        self.admission.stop_following()

        async def dispatcher_then_callers() -> None:
            await self.dispatcher.drain(self.config.drain_s)
            # The callers before the dispatcher's stop, which waits for its tasks to unwind: once
            # that took longer than the HTTP server's grace, and the calls were cut off unanswered.
            self.admission.hand_back_followers()
            await self.dispatcher.stop()

        await asyncio.gather(
            dispatcher_then_callers(),
            self.http.stop() if self.http is not None else asyncio.sleep(0),
        )

    async def stop(self) -> None:
        for task in (self._watch, self._compact):
            if task is not None:
                task.cancel()
        if self.http is not None:
            await self.http.stop()  # after a failed start (the drain stopped it otherwise)
        await self.dispatcher.stop()
        await self.peers.close()
        await self.redis.aclose()
        self.audit.close()


async def main() -> None:
    config = ReceptionConfig.from_env()
    configure_logging("reception", config.server.log_level)
    reception = Reception(config)
    await serve(
        "reception",
        config.server,
        reception.register,
        health=reception.health,
        on_start=reception.start,
        drain=reception.drain,
        error_mapper=map_redis_error,
        auth=reception.auth,
        on_stop=reception.stop,
        public=True,  # clients call it with API keys, not certificates
        grace=config.drain_s + 1.0,  # the callers of the jobs that end in the drain get their answer
    )


if __name__ == "__main__":
    run(main(), service="reception")
