"""A service's Redis client serves more blocking reads at once than redis-py's default pool allows
(100 in redis-py 8, past which a command fails at once with MaxConnectionsError): reception holds
one per job it follows, and the soak (bench/soak.py) saw UNAVAILABLE answers past 100 jobs in flight.
"""

from __future__ import annotations

import asyncio

from libs.redis_client import connect


def test_more_blocking_reads_at_once_than_the_default_pool_holds(clean_redis_url):
    async def main():
        redis = connect(clean_redis_url)
        try:
            # 150 followers blocked on their job's events, and a write that wakes them all.
            readers = [
                asyncio.create_task(redis.xread({"soak:events": "0-0"}, block=20_000)) for _ in range(150)
            ]
            await asyncio.sleep(0.5)  # let them all block (each holds a connection)
            await redis.xadd("soak:events", {"k": "v"})
            results = await asyncio.wait_for(asyncio.gather(*readers), timeout=30)
            assert all(r and r[0][1][0][1] == {b"k": b"v"} for r in results)
        finally:
            await redis.aclose()

    asyncio.run(main())
