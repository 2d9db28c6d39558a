"""The router's feedback learning against a real redis-server and embedded Qdrant: postproc-style
records move an expert's success rate (completed and validated = success), every record counts
once across routers sharing the consumer group, and a malformed record is skipped, not retried."""

from __future__ import annotations

import asyncio

import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis

from libs.experts.manifest import BaseModelIdentity
from libs.experts.peft_adapter import read_peft_adapter
from libs.feedback import FEEDBACK_STREAM, entry_fields
from libs.gen.expert.v1 import common_pb2
from services.router.embedding import SentenceEncoder
from services.router.feedback import GROUP, FeedbackLearner
from services.router.index import ExpertIndex
from services.router.stats import ExpertStats
from tests.helpers.manifests import manifest_for
from tests.helpers.peft_adapters import write_all_adapters


@pytest.fixture(scope="module")
def manifest(tiny_llama, tmp_path_factory):
    lora = read_peft_adapter(write_all_adapters(tiny_llama, tmp_path_factory.mktemp("peft"))["lora"])
    return manifest_for(lora, BaseModelIdentity.from_dir(tiny_llama), name="json-parser")


def record(experts, success: bool, valid: bool) -> dict:
    return entry_fields(
        common_pb2.FeedbackRecord(job_id="j", experts=experts, success=success, validation_passed=valid)
    )


def test_feedback_moves_the_success_rate_once_per_record(clean_redis_url, tmp_path, manifest):
    async def main():
        redis = Redis.from_url(clean_redis_url)
        client = ExpertIndex.connect(data_dir=tmp_path)
        stats_client = SyncRedis.from_url(clean_redis_url)
        index = ExpertIndex(client, SentenceEncoder.from_package(), ExpertStats(stats_client, prior=0.5))
        index.register(manifest, content_hash="a" * 64, weight_bytes=10)
        learners = [FeedbackLearner(redis, index, alpha=0.5) for _ in range(2)]
        tasks = [asyncio.create_task(learner.run()) for learner in learners]
        try:
            await asyncio.sleep(0.3)  # the group exists before the records come

            # The two learners share a consumer group, so records in flight at once may be applied
            # in either order, and the moving average depends on order. The second record for the
            # expert goes out only after the first is applied, so the expected value is exact.
            async def add_and_wait(records, applied):
                for fields in records:
                    await redis.xadd(FEEDBACK_STREAM, fields)
                for _ in range(100):
                    if sum(learner.applied for learner in learners) == applied:
                        return
                    await asyncio.sleep(0.05)

            await add_and_wait([record(["json-parser"], True, False)], applied=1)  # invalid output: a failure
            await add_and_wait(
                [
                    {"record": b"\xff not a record"},
                    record(["json-parser", "nobody"], True, True),
                    record([], True, True),
                ],
                applied=3,
            )
            await asyncio.sleep(0.2)
            expert = index.get("json-parser")
            assert expert.uses == 2
            assert expert.success_rate == pytest.approx(0.625)  # 0.5 -> failure 0.25 -> success 0.625
            assert sum(learner.applied for learner in learners) == 3
            pending = await redis.xpending(FEEDBACK_STREAM, GROUP)
            assert pending["pending"] == 0  # every record acknowledged, the malformed one too
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await redis.aclose()
            stats_client.close()
            client.close()

    asyncio.run(main())
