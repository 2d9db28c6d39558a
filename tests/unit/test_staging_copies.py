"""The staging buffers never rewrite host bytes that a queued copy has yet to read.

No GPU here, so the device stream is one of the test's own (the only stand-in in this file): it
queues each copy and runs it only when the device "catches up" or when the host waits for it, which
is how a CUDA stream behind a busy device behaves. The bytes a copy delivers are the host buffer's
contents when the copy runs.
"""

from __future__ import annotations

import numpy as np
import torch

from libs.engine.staging import Layout, StagingBuffers


class LateStream:
    """Copies that run late: queued by `copy`, run by `wait` (up to the one waited for) or `catch_up`."""

    def __init__(self) -> None:
        self.queue: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.delivered: list[list[int]] = []  # token ids each copy carried, in the order they ran
        self.issued = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        self.issued += 1
        self.queue.append((self.issued, dst, src))
        return self.issued

    def wait(self, done: int) -> None:
        while self.queue and self.queue[0][0] <= done:
            self._run_one()

    def catch_up(self) -> None:
        while self.queue:
            self._run_one()

    def _run_one(self) -> None:
        _, dst, src = self.queue.pop(0)
        dst.copy_(src)
        self.delivered.append(dst[:16].view(torch.int32).tolist())


def _layout() -> Layout:
    layout = Layout()
    layout.add("input_ids", torch.int32, 4)
    return layout


def _stage_step(buffers: StagingBuffers, ids: list[int]) -> None:
    layout = _layout()
    buffers.stage(layout)["input_ids"][:] = np.array(ids, dtype=np.int32)
    buffers.send(layout)


def test_a_host_buffer_rewritten_under_a_queued_copy_sends_the_new_bytes():
    # The hazard itself, with one buffer and no waiting: what the copy carries is what the host
    # wrote after issuing it.
    stream = LateStream()
    host, dev = torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    host.view(torch.int32)[:] = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    stream.copy(dev, host)
    host.view(torch.int32)[:] = torch.tensor([5, 6, 7, 8], dtype=torch.int32)
    stream.catch_up()
    assert stream.delivered == [[5, 6, 7, 8]]


def test_steps_staged_before_the_device_catches_up_each_send_their_own_bytes():
    # Three prefill chunks in a row, none sampling, so the host never waits for the device.
    stream = LateStream()
    buffers = StagingBuffers(torch.device("cpu"), initial_bytes=64, copies=stream)
    for step in range(3):
        _stage_step(buffers, [10 * step + i for i in range(4)])
    stream.catch_up()
    assert stream.delivered == [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]]


def test_reusing_a_host_buffer_waits_for_its_copy_and_no_other():
    stream = LateStream()
    buffers = StagingBuffers(torch.device("cpu"), initial_bytes=64, copies=stream)
    _stage_step(buffers, [1, 1, 1, 1])
    _stage_step(buffers, [2, 2, 2, 2])
    assert stream.delivered == []  # two buffers: nothing to wait for yet
    _stage_step(buffers, [3, 3, 3, 3])  # the first buffer again: its copy must run first
    assert stream.delivered == [[1, 1, 1, 1]]
    stream.catch_up()
    assert stream.delivered[1:] == [[2, 2, 2, 2], [3, 3, 3, 3]]


def test_a_buffer_that_grows_keeps_its_queued_copy_intact():
    stream = LateStream()
    buffers = StagingBuffers(torch.device("cpu"), initial_bytes=64, copies=stream)
    _stage_step(buffers, [7, 7, 7, 7])
    _stage_step(buffers, [8, 8, 8, 8])
    big = Layout()
    big.add("input_ids", torch.int32, 4)
    big.add("block_tables", torch.int32, 64)  # past 64 bytes: the buffer is replaced
    buffers.stage(big)["input_ids"][:] = 9
    buffers.send(big)
    stream.catch_up()
    assert stream.delivered == [[7, 7, 7, 7], [8, 8, 8, 8], [9, 9, 9, 9]]
    assert buffers.dev.numel() >= big.nbytes


def test_on_the_cpu_the_host_buffer_is_the_device_buffer():
    buffers = StagingBuffers(torch.device("cpu"))
    layout = _layout()
    buffers.stage(layout)["input_ids"][:] = 5
    views = buffers.send(layout)
    assert buffers.dev is buffers.host
    assert views["input_ids"].tolist() == [5, 5, 5, 5]
