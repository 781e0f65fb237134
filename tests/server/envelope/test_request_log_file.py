"""The request log file: a write that fails (a full disk) is reported once, not per line."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest

from server.envelope.request_log import RequestLog, RequestLogSettings


def test_a_failing_log_file_is_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = RequestLog(RequestLogSettings(), tmp_path)
    log.start()
    assert log.path is not None
    handler = log._listener.handlers[0]
    assert isinstance(handler, logging.FileHandler)
    handler.stream.close()  # every write now fails, as on a full disk
    handler.stream = open(log.path, "rb")
    with caplog.at_level(logging.WARNING, logger="semcache.request_log"):
        for i in range(5):
            log.write({"request_id": str(i), "time": 0.0})
        log.stop()
    warnings = [r for r in caplog.records if "cannot write the request log" in r.getMessage()]
    assert len(warnings) == 1
    assert len(log.recent) == 5  # GET /admin/logs still answers


async def test_lines_written_from_the_loop_reach_the_file_in_order(tmp_path: Path) -> None:
    log = RequestLog(RequestLogSettings(), tmp_path)
    log.start()
    assert log.path is not None
    for i in range(2500):  # more than one batch, the last one still waiting for its timer
        log.write({"request_id": str(i), "time": 0.0})
    log.stop()
    lines = log.path.read_text().splitlines()
    assert [orjson.loads(line)["request_id"] for line in lines] == [str(i) for i in range(2500)]
