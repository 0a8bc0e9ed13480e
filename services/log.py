"""Logging with the service name and the current request id on every line.

Two formats (`--log-format`): "text", `time level service [request id] logger: message`,
and "json", one object a line with the same fields plus `trace_id` while a traced
request is being handled (services.tracing) and `exc_info` for a logged exception.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable
from typing import TextIO

from services.flags import Flag

LOG_LEVEL = Flag("INFO", "DEBUG, INFO, WARNING or ERROR.")  # every service's --log-level

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
trace_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("trace_id", default="")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        record.trace_id = trace_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, service, request_id, logger,
    message, and trace_id / exc_info when there are any."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "service": self.service,
            "request_id": getattr(record, "request_id", "-"),
            "logger": record.name,
            "message": record.getMessage(),
        }
        trace_id = getattr(record, "trace_id", "")
        if trace_id:
            entry["trace_id"] = trace_id
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(
    service: str, level: str = "INFO", log_format: str = "text", stream: TextIO | None = None
) -> None:
    """Configure the root logger to write `log_format` ("text" or "json") lines to `stream`
    (default: stderr)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(_RequestIdFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(
            logging.Formatter(
                f"%(asctime)s %(levelname)s {service} [%(request_id)s] %(name)s: %(message)s"
            )
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    enable_stack_dumps()


def enable_stack_dumps() -> None:
    """`kill -USR1 <pid>` prints every thread's Python stack to stderr, the service running on
    (how to see where a hung service waits, without a debugger)."""
    if hasattr(signal, "SIGUSR1") and sys.__stderr__ is not None:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


def request_stack_dumps(pids: Iterable[int], settle_s: float) -> None:
    """Ask the processes `pids` (services that called enable_stack_dumps) for their stacks,
    then give them `settle_s` to write them; a process already gone is skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(settle_s)


def current_log_format() -> str:
    """The format `setup_logging` gave the root logger ("text" unless it is "json"): what a
    process started by this one (a tensor-parallel rank) is told to use."""
    handlers = logging.getLogger().handlers
    return "json" if handlers and isinstance(handlers[0].formatter, JsonFormatter) else "text"
