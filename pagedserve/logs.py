"""Logging setup shared by both services: text for people, JSON lines for log pipelines.

With ``--log-format json`` every record is one JSON object with ``time``,
``level``, ``logger`` and ``message``, plus ``request_id`` and ``executor``
when the record concerns one (loggers pass them as ``extra``; a loop's logger
always carries its executor).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

FORMATS = ("text", "json")
FIELDS = ("request_id", "executor")
TEXT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            if (value := getattr(record, name, None)) is not None:
                out[name] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def for_executor(logger: logging.Logger, executor: str) -> logging.LoggerAdapter:
    """A logger whose records carry ``executor``."""
    return logging.LoggerAdapter(logger, {"executor": executor})
