"""Structured logging: every record carries its context as key=value pairs
(or one JSON object per line), so a trajectory id is greppable on every line
that concerns it."""
from __future__ import annotations

import json
import logging
import sys
import time

# Attributes every LogRecord has; anything else came in through `extra`.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def _context(record: logging.LogRecord) -> dict:
    return {key: value for key, value in vars(record).items() if key not in _STANDARD}


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        pairs = " ".join(f"{key}={json.dumps(value) if isinstance(value, str) and ' ' in value else value}"
                         for key, value in _context(record).items())
        line = f"{stamp} {record.levelname.lower()} {record.name}: {record.getMessage()}" + (f" {pairs}" if pairs else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": record.created, "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        doc.update(_context(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger("rollstream")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
