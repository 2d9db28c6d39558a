"""libs.logging: one JSON object per line on stdout with timestamp, level, event and service; stdlib
records rendered the same way; bound context on every line until reset."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from libs.logging import bind_context, configure_logging, get_logger


def _lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


@pytest.fixture(autouse=True)
def _restore_root_level():
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


def test_a_structlog_line_is_json_with_the_standard_keys(capsys):
    configure_logging("router")
    get_logger("tests.x").info("planned", experts=2)
    (line,) = _lines(capsys)
    assert line["event"] == "planned"
    assert line["level"] == "info"
    assert line["service"] == "router"
    assert line["experts"] == 2
    assert line["logger"] == "tests.x"
    assert line["timestamp"].endswith("Z") and "T" in line["timestamp"]


def test_stdlib_logging_renders_through_the_same_renderer(capsys):
    configure_logging("router")
    logging.getLogger("some.library").warning("disk %s is %d%% full", "/data", 93)
    (line,) = _lines(capsys)
    assert line["event"] == "disk /data is 93% full"
    assert line["level"] == "warning"
    assert line["service"] == "router"
    assert line["logger"] == "some.library"


def test_lines_below_the_level_are_dropped(capsys):
    configure_logging("router", "warning")
    log = get_logger("tests.x")
    log.info("hidden")
    logging.getLogger("lib").info("hidden too")
    log.warning("shown")
    assert [line["event"] for line in _lines(capsys)] == ["shown"]


def test_an_unknown_level_is_refused():
    with pytest.raises(ValueError, match="verbose"):
        configure_logging("router", "verbose")


def test_an_exception_stays_on_one_line(capsys):
    configure_logging("router")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        get_logger("tests.x").exception("failed")
    (line,) = _lines(capsys)
    assert "RuntimeError: boom" in line["exception"]


def test_bound_context_appears_on_every_line_until_reset(capsys):
    configure_logging("reception")
    log = get_logger("tests.x")
    with bind_context(job_id="j-1", request_id="r-1", skipped=None):
        log.info("inside")
        logging.getLogger("lib").info("library inside")
    log.info("after")
    inside, library, after = _lines(capsys)
    assert (inside["job_id"], inside["request_id"]) == ("j-1", "r-1")
    assert "skipped" not in inside
    assert library["job_id"] == "j-1"
    assert "job_id" not in after


def test_binding_follows_the_task_that_made_it(capsys):
    configure_logging("reception")
    log = get_logger("tests.x")

    async def step() -> None:
        await asyncio.sleep(0)
        log.info("step")

    async def job(job_id: str) -> None:
        token = bind_context(job_id=job_id)
        # A task created while bound inherits the binding; the two jobs interleave.
        await asyncio.create_task(step())
        token.reset()

    async def main() -> None:
        await asyncio.gather(job("a"), job("b"))

    asyncio.run(main())
    assert sorted(line["job_id"] for line in _lines(capsys)) == ["a", "b"]
