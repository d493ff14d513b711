"""The gateway's edge, wired: API keys, rate limits, input limits and CORS on one app.

What each part does lives beside it: ``gateway/admission/keys.py`` (keys, per-key token buckets, the auth
middleware), ``gateway/request/limits.py`` (input limits, the body-size middleware); their settings are
``tandem_core.config``'s ``AuthConfig``, ``LimitsConfig`` and ``CorsConfig``. Every refusal is a
``TandemError`` (``tandem_core.errors``: ``Unauthenticated``, ``RateLimited``, ``LimitExceeded``,
``BodyTooLarge``), so it leaves through the one handler, in the OpenAI envelope.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from starlette.middleware.cors import CORSMiddleware
from starlette.types import Scope

from gateway.admission.keys import KeyStore, RateLimiter, resolve_keys
from gateway.http.middleware import AuthMiddleware, BodySizeLimit
from tandem_core.config import AuthConfig, CorsConfig, LimitsConfig
from tandem_core.errors import TandemError
from tandem_core.protocol import ROUTE_TABLE

logger = logging.getLogger(__name__)


def install_security(app: Any, auth: AuthConfig, limits: LimitsConfig, cors: CorsConfig, *,
                     clock: Callable[[], float] = time.monotonic,
                     on_reject: Callable[[Scope, TandemError], None] | None = None,
                     environ: Mapping[str, str] | None = None, base_dir: Path | None = None,
                     body_limits: dict[str, int] | None = None) -> RateLimiter:
    """Add the middlewares to a Starlette/FastAPI ``app``: CORS outermost (so refusals carry its
    headers), then auth (a 401 before any body is read), then the body limit. Returns the
    limiter whose ``check_tokens`` the routes call. ``body_limits``: paths with a body limit of
    their own (also where ``limits.max_body_bytes`` is None). Raises ValueError for an unreadable key."""
    keys = resolve_keys(auth, environ, base_dir)
    limiter = RateLimiter(keys, clock)
    # add_middleware puts each new middleware outside the ones added before it
    if limits.max_body_bytes is not None or body_limits:
        app.add_middleware(BodySizeLimit, max_body_bytes=limits.max_body_bytes or 2**62, per_path=body_limits)
    if auth.enabled:
        app.add_middleware(AuthMiddleware, keystore=KeyStore(keys), limiter=limiter, public_paths=auth.public(),
                           on_reject=on_reject, admin_paths=[r.path for r in ROUTE_TABLE if r.admin])
        logger.info("API keys required on all but %s: %s", ", ".join(sorted(auth.public())),
                    ", ".join(k.name for k in keys))
    if cors.enabled:
        app.add_middleware(CORSMiddleware, **cors.middleware_kwargs())
    return limiter
