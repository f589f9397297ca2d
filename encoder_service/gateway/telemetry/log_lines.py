"""The gateway's log lines: key=value on stderr, written in batches.

A request's line costs it a formatted string in memory: lines are written together when a
warning or error comes (at once, so that nothing an operator acts on waits), when
`FLUSH_BYTES` have gathered, `FLUSH_S` after the first pending line (a timer on the event loop
that logs it, or a timer thread off one: no thread to start every `FLUSH_S` on a loop), and at
exit. This is nginx's buffered access log; the time stamp is formatted once per second."""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time

FLUSH_S = 0.2
FLUSH_BYTES = 64 << 10
FORMAT = "%(asctime)s %(levelname)s epd.gateway %(message)s"


class SecondsFormatter(logging.Formatter):
    """`logging.Formatter` whose date part is formatted once per second, not per line."""

    _second = -1
    _stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return self.stamp(record.created, record.msecs)

    def stamp(self, created: float, msecs: float) -> str:
        second = int(created)
        if second != self._second:
            self._stamp = time.strftime(self.default_time_format, self.converter(second))
            self._second = second
        return f"{self._stamp},{int(msecs):03d}"


class BatchedStreamHandler(logging.StreamHandler):
    """A StreamHandler that writes its lines in batches (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._pending: list[str] = []
        self._size = 0
        self._timer: threading.Timer | asyncio.TimerHandle | None = None
        self._timer_loop: asyncio.AbstractEventLoop | None = None  # a loop timer's loop

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)
            return
        self.add(line, record.levelno)

    def add(self, line: str, levelno: int) -> None:
        """Queue one formatted line (with its newline); written as `emit` says."""
        with self.lock:
            self._pending.append(line)
            self._size += len(line)
            urgent = levelno >= logging.WARNING or self._size >= FLUSH_BYTES
            if not urgent and (self._timer is None or self._timer_loop is not None
                               and self._timer_loop.is_closed()):  # its loop ended first
                self._timer, self._timer_loop = _flush_later(self.flush)
        if urgent:
            self.flush()

    def flush(self) -> None:
        with self.lock:
            lines, self._pending, self._size = self._pending, [], 0
            timer, self._timer, self._timer_loop = self._timer, None, None
            if timer is not None and timer is not threading.current_thread():
                timer.cancel()
            if lines and self.stream is not None:
                try:
                    self.stream.write("".join(lines))
                    self.stream.flush()
                except (OSError, ValueError):  # stderr closed at exit: nothing to write to
                    pass


def _flush_later(flush) -> tuple[threading.Timer | asyncio.TimerHandle,  # noqa: ANN001
                                  asyncio.AbstractEventLoop | None]:
    """`flush()` in `FLUSH_S`: on the caller's event loop, else on a timer thread.

    Returns the timer and its loop (None: a thread)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread
        timer = threading.Timer(FLUSH_S, flush)
        timer.daemon = True
        timer.start()
        return timer, None
    return loop.call_later(FLUSH_S, flush), loop


def info_line(log: logging.Logger, message: str) -> None:
    """`log.info(message)` for the per-request line, without a LogRecord.

    The same line `log.info` writes, straight into the batch where the gateway's own
    handler is the logger's only one (a record, its caller lookup and its formatting
    cost a request more than the rest of the line's path); `log.info` otherwise."""
    if not log.isEnabledFor(logging.INFO):
        return
    handlers = log.handlers
    if len(handlers) == 1 and isinstance(handlers[0], BatchedStreamHandler) and isinstance(
            handlers[0].formatter, SecondsFormatter) and not log.filters:
        now = time.time()
        stamp = handlers[0].formatter.stamp(now, (now - int(now)) * 1000)
        handlers[0].add(f"{stamp} INFO epd.gateway {message}\n", logging.INFO)
    else:
        log.info("%s", message)


def setup_logging(level: str = "info") -> None:
    """Structured key=value lines on stderr for the gateway logger (idempotent)."""
    log = logging.getLogger("epd.gateway")
    log.setLevel(level.upper())
    if not log.handlers:
        h = BatchedStreamHandler()
        h.setFormatter(SecondsFormatter(FORMAT))
        log.addHandler(h)
        atexit.register(h.flush)
        log.propagate = False
