"""Why a vLLM server refused or failed a request, in OpenAI's error shape.

Why a vLLM server refused or failed a request, in OpenAI's error shape, and how the reason
of an engine-side failure reaches the HTTP answer.

vLLM fails a request whose embedding the connector cannot deliver (a metadata-only item in no
tier, a promise that never landed, a load that failed, a token count that does not match) by
finishing it with an error; its API server then answers `500 Internal server error` with no
reason, and the client cannot tell a lost item from a bug. The scheduler side runs in
EngineCore, the answer is made in the API server process: the scheduler posts the reason per
item on a `ReasonBoard` (a directory of small files beside the control sockets, written only
when a request fails), and the API server's guard (`server_guard.py`) reads it for the items
of a request the engine failed and answers with that reason instead: a 503 (the item is
lost, late or damaged: send the media), or a 400 when the stored item does not fit the part
that names it (`embedding_mismatch`: the request is wrong; `failure_status`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from ec_connectors.protocol.http_api import error_type

# Engine-side failures of one item: code -> what the client can do (docs/errors.md)
EMBEDDING_UNAVAILABLE = "embedding_unavailable"  # in no tier, and no media to encode it from
EMBEDDING_LOAD_FAILED = "embedding_load_failed"  # known, but its load failed (evicted since,
# lease lapsed, failed verification, transfer failed)
EMBEDDING_TIMEOUT = "embedding_timeout"  # promised as pending, or loading, past the deadline
EMBEDDING_MISMATCH = "embedding_mismatch"  # it does not fit the part naming it (rows, grid,
# modality: scheduler_hooks/fit.py)
_KEEP_S = 60.0  # a posted reason is kept this long (a request that fails reads it at once)


class Refusal(Exception):
    """A request a vLLM server refuses: HTTP `status`, a machine-readable `code`."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.code, self.message)


def error_body(status: int, code: str, message: str) -> dict[str, Any]:
    """A vLLM server's refusal in OpenAI's shape (a 5xx other than 503 is a `server_error`)."""
    return {"error": {"message": message, "type": error_type(status), "code": code}}


def classify(why: str) -> str:
    """The code of the scheduler side's reason for failing an item (`Unavailable.fail`)."""
    if why == "not in the transport":
        return EMBEDDING_UNAVAILABLE
    if why.startswith(("token count", "embedding mismatch")):  # (scheduler_hooks/fit.py)
        return EMBEDDING_MISMATCH
    if why.startswith("promised as pending") or why == "deadline passed":
        return EMBEDDING_TIMEOUT
    return EMBEDDING_LOAD_FAILED


def failure_status(code: str) -> int:
    """The HTTP status of an engine-side failure.

    The HTTP status of an engine-side failure: 400 when the request named an item that
    does not fit its part (retrying it as is fails again), else 503."""
    return 400 if code == EMBEDDING_MISMATCH else 503


def board_dir(control_dir: str | None, engine_id: str) -> Path:
    """The directory where one engine's failure reasons live.

    Where one engine's reasons live (`control_dir` of EPDConfig; both processes of a
    server know it and the engine id)."""
    base = control_dir or os.path.join(tempfile.gettempdir(), "epd-ctl")
    tag = hashlib.blake2b(engine_id.encode(), digest_size=10).hexdigest()
    return Path(base) / f"epd-reasons-{tag}"


def _name(item_id: str) -> str:
    return hashlib.blake2b(item_id.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class ReasonBoard:
    """Failure reasons per item id, shared by EngineCore and the API server.

    Reasons per item id: `post` (EngineCore, on a failure), `read` (API server, on a
    failed answer), `sweep` (EngineCore, drops what is older than a minute)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._posted: dict[str, float] = {}  # file name -> when (the poster's own files)

    def post(self, item_id: str, code: str, message: str) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            name = _name(item_id)
            tmp = self.dir / f".{name}.{os.getpid()}"
            tmp.write_text(json.dumps({"code": code, "message": message, "at": time.time()}))
            os.replace(tmp, self.dir / name)  # a reader never sees half a record
            self._posted[name] = time.monotonic()
        except OSError:
            pass  # the client then gets vLLM's own answer; the request fails either way

    def read(self, item_ids: list[str], since: float) -> tuple[str, str] | None:
        """The reason of the first of `item_ids` that failed since `since`.

        (code, message) of the first of `item_ids` that failed at or after `since`
        (time.time()), else None."""
        for item_id in item_ids:
            try:
                record = json.loads((self.dir / _name(item_id)).read_text())
            except (OSError, ValueError):
                continue
            if (isinstance(record, dict) and isinstance(record.get("at"), float)
                    and record["at"] >= since and isinstance(record.get("code"), str)):
                return record["code"], str(record.get("message", ""))
        return None

    def sweep(self, now: float | None = None, keep_s: float = _KEEP_S) -> None:
        now = time.monotonic() if now is None else now
        for name, at in list(self._posted.items()):
            if now - at > keep_s:
                del self._posted[name]
                with contextlib.suppress(OSError):
                    (self.dir / name).unlink()

    def close(self) -> None:
        """The engine stops: its reasons go, and the directory when nobody else's are left."""
        self.sweep(keep_s=-1.0)
        with contextlib.suppress(OSError):
            self.dir.rmdir()
