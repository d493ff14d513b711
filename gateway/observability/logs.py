"""Logging: text or JSON lines (``--log-format``), and one access line per request (``--access-log``).

The access line (logger ``tandem.access``) is written by ``gateway.http.app.MetricsMiddleware`` when a
request ends, whatever its outcome: its id (the client's ``X-Request-Id`` or a new one, echoed in
the answer), method, path, model, tenant, key name, status, and for requests a replica served the
time it waited for a slot, its time to first byte, its total time, and its tokens in and out (the
``usage`` the client received: a stream has it only with ``stream_options.include_usage``).

JSON: one object per line, ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, plus the
access fields at the top level, for log pipelines (Loki, Elasticsearch, Cloud Logging).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

ACCESS = logging.getLogger("tandem.access")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_enabled = False  # one access line per request (``--access-log``)


class JsonFormatter(logging.Formatter):
    def __init__(self, prefix: dict | None = None):
        super().__init__()
        self.prefix = prefix or {}

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "logger": record.name, **self.prefix,
               "message": record.getMessage()}
        access = getattr(record, "access", None)
        if access:
            out.update(access)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str, fmt: str = "text", access_log: bool = False, text_format: str = TEXT_FORMAT,
                  prefix: dict | None = None) -> None:
    """The root logger's level and format (``text`` or ``json``), and whether requests are logged.
    ``prefix``: fields every JSON line carries (a gateway process's index)."""
    global _enabled
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(prefix) if fmt == "json" else logging.Formatter(text_format))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    _enabled = access_log
    if access_log and ACCESS.getEffectiveLevel() > logging.INFO:
        ACCESS.setLevel(logging.INFO)  # the access lines show at any --log-level


def access_enabled() -> bool:
    return _enabled


def log_access(state: dict, method: str, path: str, status: int, total_s: float) -> None:
    """The request's access line (``state``: the ASGI scope's, as the gateway filled it)."""
    key = state.get("tandem_key")
    stats = state.get("tandem_stats") or {}
    fields = {"request_id": state.get("request_id"), "method": method, "path": path, "status": status,
              "model": state.get("tandem_model"), "tenant": getattr(key, "tenant_name", None),
              "key": state.get("tandem_key_name"), "total_ms": round(total_s * 1000, 2)}
    for name in ("queue_s", "ttft_s"):
        if stats.get(name) is not None:
            fields[name.replace("_s", "_ms")] = round(stats[name] * 1000, 2)
    for name in ("prompt_tokens", "completion_tokens", "replica", "trace_id"):
        if stats.get(name) is not None:
            fields[name] = stats[name]
    text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None and k not in ("method", "path", "status"))
    ACCESS.info("%s %s %d %s", method, path, status, text, extra={"access": fields})
