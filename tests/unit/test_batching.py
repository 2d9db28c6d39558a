"""libs.batching.Coalescer: a lone item goes out at once; items that arrive while a flush is in
flight go out together in the next one; a failed flush fails each of its submitters."""

from __future__ import annotations

import asyncio

import pytest

from libs.batching import Coalescer


class Recorder:
    def __init__(self, fail_on: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.fail_on = fail_on
        self.release = asyncio.Event()

    async def flush(self, items: list[int]) -> None:
        self.batches.append(items)
        await self.release.wait()
        if self.fail_on in items:
            raise RuntimeError(f"flush of {items} failed")


def test_a_lone_item_is_flushed_at_once():
    async def main():
        recorder = Recorder()
        recorder.release.set()
        await asyncio.wait_for(Coalescer(recorder.flush).submit(7), 1.0)
        assert recorder.batches == [[7]]

    asyncio.run(main())


def test_items_arriving_during_a_flush_go_out_together_next():
    async def main():
        recorder = Recorder()
        coalescer = Coalescer(recorder.flush)
        first = asyncio.create_task(coalescer.submit(0))
        await asyncio.sleep(0)  # the first flush starts and waits
        rest = [asyncio.create_task(coalescer.submit(i)) for i in range(1, 6)]
        await asyncio.sleep(0)
        assert recorder.batches == [[0]] and not first.done()
        recorder.release.set()
        await asyncio.wait_for(asyncio.gather(first, *rest), 1.0)
        assert recorder.batches == [[0], [1, 2, 3, 4, 5]]

    asyncio.run(main())


def test_batches_are_at_most_max_batch_items():
    async def main():
        recorder = Recorder()
        coalescer = Coalescer(recorder.flush, max_batch=2)
        tasks = [asyncio.create_task(coalescer.submit(i)) for i in range(5)]
        await asyncio.sleep(0)
        recorder.release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
        assert recorder.batches == [[0, 1], [2, 3], [4]]

    asyncio.run(main())


def test_a_failed_flush_fails_its_own_submitters_only():
    async def main():
        recorder = Recorder(fail_on=2)
        coalescer = Coalescer(recorder.flush)
        first = asyncio.create_task(coalescer.submit(0))
        await asyncio.sleep(0)
        failing = [asyncio.create_task(coalescer.submit(i)) for i in (1, 2)]
        await asyncio.sleep(0)
        recorder.release.set()
        await asyncio.wait_for(first, 1.0)
        for task in failing:
            with pytest.raises(RuntimeError, match="failed"):
                await asyncio.wait_for(task, 1.0)
        await asyncio.wait_for(coalescer.submit(3), 1.0)  # the coalescer still works afterwards
        assert recorder.batches == [[0], [1, 2], [3]]

    asyncio.run(main())


def test_a_cancelled_submitter_does_not_cancel_the_flush_of_the_others():
    async def main():
        recorder = Recorder()
        coalescer = Coalescer(recorder.flush)
        first = asyncio.create_task(coalescer.submit(0))
        second = asyncio.create_task(coalescer.submit(1))
        await asyncio.sleep(0)
        first.cancel()
        recorder.release.set()
        await asyncio.wait_for(second, 1.0)
        assert recorder.batches == [[0, 1]]

    asyncio.run(main())


def test_max_batch_must_be_positive():
    with pytest.raises(ValueError, match="max_batch"):
        Coalescer(lambda items: asyncio.sleep(0), max_batch=0)
