"""The server's logging: text or JSON lines on stderr, one format for infergate's and
uvicorn's loggers, and the level each event kind deserves."""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from infergate.client_errors import escape_controls

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("text", "json")
# Events an operator must see at --log-level warning: the event bus logs them at INFO.
WARNING_EVENTS = frozenset(
    {"model_unavailable", "profile_rejected", "breaker_open", "worker_restarting"}
)
# uvicorn's records carry `color_message`, the message's template with terminal colours.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "color_message",
}


class TextFormatter(logging.Formatter):
    """The text format: one line a message, whatever the message holds (a traceback
    after it keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        # A client's text in a message (the access log's path is percent-decoded: %0A is
        # a line break) could start a forged line, or move a terminal's cursor (JSON lines
        # escape them already). One regex search when there is none: 0.4 us a line.
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, and the
    record's extra fields (the access log's request_id, model, status...)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


class EventLevels(logging.Filter):
    """Raises the event kinds in WARNING_EVENTS to WARNING, then applies the chosen level
    (the events logger itself lets INFO through so that this filter sees them)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        kind = record.args[0] if isinstance(record.args, tuple) and record.args else None
        if kind in WARNING_EVENTS and record.levelno < logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return record.levelno >= self.level


def configure(level: str, fmt: str, access_log: bool) -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    events = logging.getLogger("infergate.events")
    events.setLevel(min(logging.INFO, root.level))
    events.addFilter(EventLevels(root.level))
    # The access log is INFO; --access-log turns it on whatever the level.
    logging.getLogger("infergate.access").setLevel(logging.INFO if access_log else logging.WARNING)
