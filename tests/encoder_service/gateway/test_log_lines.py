"""The gateway's batched log lines (log_lines.py): an info line waits for its batch (at most
FLUSH_S), a warning goes out at once and takes the waiting lines with it, in order, with the
time stamp every line had."""

from __future__ import annotations

import io
import logging
import time

from encoder_service.gateway.telemetry import log_lines
from tests.helpers import wait_for


def handler_on(stream: io.StringIO) -> logging.Logger:
    h = log_lines.BatchedStreamHandler()
    h.setStream(stream)
    h.setFormatter(log_lines.SecondsFormatter(log_lines.FORMAT))
    log = logging.getLogger(f"epd.test.log_lines.{id(stream)}")
    log.propagate = False
    log.addHandler(h)
    log.setLevel(logging.INFO)
    return log


def test_info_lines_wait_for_their_batch_and_a_warning_flushes_them_in_order():
    out = io.StringIO()
    log = handler_on(out)
    log.info("request rid=a")
    log.info("request rid=b")
    assert out.getvalue() == ""  # batched
    log.warning("decoder down url=x")
    lines = out.getvalue().splitlines()
    assert [ln.split(" ", 2)[2] for ln in lines] == [
        "INFO epd.gateway request rid=a", "INFO epd.gateway request rid=b",
        "WARNING epd.gateway decoder down url=x"]
    log.info("request rid=c")
    t0 = time.monotonic()
    assert wait_for(lambda: "rid=c" in out.getvalue(), timeout=5)
    assert time.monotonic() - t0 < log_lines.FLUSH_S + 1


def test_the_stamp_is_the_records_own_to_the_millisecond():
    fmt = log_lines.SecondsFormatter(log_lines.FORMAT)
    plain = logging.Formatter(log_lines.FORMAT)
    for created in (1_700_000_000.001, 1_700_000_000.999, 1_700_000_001.5, 1_700_000_000.2):
        rec = logging.LogRecord("epd.gateway", logging.INFO, __file__, 1, "m", None, None)
        rec.created, rec.msecs = created, (created - int(created)) * 1000
        assert fmt.format(rec) == plain.format(rec)


def test_the_request_line_without_a_record_reads_as_log_info_would_write_it():
    out = io.StringIO()
    log = handler_on(out)
    log_lines.info_line(log, "request rid=z status=200")
    log.info("request rid=%s status=%d", "y", 200)
    log.warning("flush")
    fast, slow, _ = out.getvalue().splitlines()
    assert fast.split(" ", 2)[2] == "INFO epd.gateway request rid=z status=200"
    assert slow.split(" ", 2)[2] == "INFO epd.gateway request rid=y status=200"
    assert len(fast.split(" ", 2)[1]) == len(slow.split(" ", 2)[1])  # HH:MM:SS,mmm
    log.setLevel(logging.WARNING)
    log_lines.info_line(log, "request rid=x")
    log.warning("flush")
    assert "rid=x" not in out.getvalue()
