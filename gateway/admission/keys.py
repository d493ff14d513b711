"""API keys and per-key rate limits.

- ``resolve_keys`` is the one place that reads key environment variables and files.
- ``KeyStore`` keeps only SHA-256 digests and compares a token with every one of them
  (constant time, no early exit): a key is never logged or echoed.
- ``RateLimiter``: per key, a token bucket of requests and one of tokens (estimated).

The HTTP edge that asks for them (``AuthMiddleware``) is in ``gateway/http/middleware.py``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gateway.request.intake import Intake
from gateway.request.limits import show
from tandem_core.config import ApiKey, AuthConfig
from tandem_core.errors import LimitExceeded, RateLimited

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- keys


@dataclass(frozen=True)
class ResolvedKey:
    name: str
    key: str = field(repr=False)
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    role: str = "user"  # or "admin": the operators' routes too
    tenant: str = ""  # whose usage its requests count to ("": the key's name)
    models: frozenset[str] | None = None  # the models it may call (None: every one)
    priority: int = 0  # of its requests that name none
    min_priority: int | None = None  # the most urgent it may use
    weight: float = 1.0  # its tenant's fair share

    @property
    def tenant_name(self) -> str:
        return self.tenant or self.name

    def may_use(self, model: object) -> bool:
        return self.models is None or model in self.models


def resolve_keys(cfg: AuthConfig, environ: Mapping[str, str] | None = None,
                 base_dir: Path | None = None) -> list[ResolvedKey]:
    """Read every key from the config, its environment variables and files. A ValueError names
    the missing variable or file, or the key's name; never the key."""
    env = os.environ if environ is None else environ
    rpm, tpm = cfg.default_requests_per_minute, cfg.default_tokens_per_minute
    keys = []
    for i, k in enumerate(cfg.api_keys):
        name = k.name or f"key-{i}"
        keys.append(ResolvedKey(name, _valid_key(_read_key(k, name, env, base_dir), name),
                                k.requests_per_minute if k.requests_per_minute is not None else rpm,
                                k.tokens_per_minute if k.tokens_per_minute is not None else tpm,
                                role=k.role, tenant=k.tenant or "",
                                models=frozenset(k.models) if k.models is not None else None,
                                priority=k.priority, min_priority=k.min_priority, weight=k.weight))
    if cfg.api_keys_env is not None:
        raw = env.get(cfg.api_keys_env)
        if raw is None:
            raise ValueError(f"auth.api_keys_env: environment variable {cfg.api_keys_env} is not set")
        listed = [p.strip() for p in raw.split(",") if p.strip()]
        if not listed:
            raise ValueError(f"auth.api_keys_env: environment variable {cfg.api_keys_env} holds no keys")
        for j, key in enumerate(listed):
            name = f"{cfg.api_keys_env}[{j}]"
            keys.append(ResolvedKey(name, _valid_key(key, name), rpm, tpm))
    by_key: dict[str, str] = {}
    for k in keys:
        if k.key in by_key:
            raise ValueError(f"API keys {by_key[k.key]!r} and {k.name!r} are the same key")
        by_key[k.key] = k.name
    names = [k.name for k in keys]
    if len(set(names)) != len(names):
        raise ValueError(f"API key names must be unique; got {', '.join(names)}")
    return keys


def _read_key(k: ApiKey, name: str, env: Mapping[str, str], base_dir: Path | None) -> str:
    if k.key is not None:
        return k.key.get_secret_value()
    if k.key_env is not None:
        if k.key_env not in env:
            raise ValueError(f"API key {name!r}: environment variable {k.key_env} is not set")
        return env[k.key_env].strip()
    assert k.key_file is not None, "this is a bug: ApiKey validated with no source"
    path = k.key_file if k.key_file.is_absolute() or base_dir is None else base_dir / k.key_file
    try:
        return path.read_text().strip()
    except OSError as e:
        raise ValueError(f"API key {name!r}: cannot read key file {path}: {e.strerror or type(e).__name__}") from None
    except UnicodeDecodeError:
        raise ValueError(f"API key {name!r}: key file {path} is not UTF-8 text") from None


def _valid_key(key: str, name: str) -> str:
    if not key:
        raise ValueError(f"API key {name!r} is empty")
    if not all(33 <= ord(c) <= 126 for c in key):  # it travels in an HTTP header
        raise ValueError(f"API key {name!r} must be printable ASCII without spaces")
    return key


def _digest(raw: bytes) -> bytes:
    return hashlib.sha256(raw).digest()


class KeyStore:
    """Which configured key a bearer token is. Holds only digests; comparing equal-length digests
    with ``hmac.compare_digest`` against every key, without an early exit, leaks neither a key's
    length nor which key came close."""

    def __init__(self, keys: Iterable[ResolvedKey]):
        keys = list(keys)
        self._entries = [(_digest(k.key.encode()), k.name) for k in keys]
        self.by_name = {k.name: k for k in keys}  # what a key may do (role, tenant, models)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token: str | bytes) -> str | None:
        raw = token.encode("utf-8", "surrogatepass") if isinstance(token, str) else token
        digest = _digest(raw)
        found = None
        for stored, name in self._entries:
            if hmac.compare_digest(digest, stored) and found is None:
                found = name
        return found


# ---------------------------------------------------------------- rate limits


class TokenBucket:
    """``capacity`` tokens, refilled evenly at ``refill_per_s``; starts full. The caller passes
    ``now`` (any monotonic clock), so tests drive it with a fake one."""

    def __init__(self, capacity: float, refill_per_s: float):
        if not (capacity > 0 and refill_per_s > 0):
            raise ValueError("a token bucket needs a positive capacity and refill rate")
        self.capacity = capacity
        self.refill_per_s = refill_per_s
        self.tokens = float(capacity)
        self._last: float | None = None

    def _refill(self, now: float) -> None:
        if self._last is not None and now > self._last:
            self.tokens = min(self.capacity, self.tokens + (now - self._last) * self.refill_per_s)
        if self._last is None or now > self._last:  # a clock that steps back refills nothing
            self._last = now

    def try_take(self, amount: float, now: float) -> float:
        """Take ``amount`` and return 0.0; or take nothing and return the seconds until
        ``amount`` will be there (``math.inf`` if it is more than the bucket holds)."""
        self._refill(now)
        if amount <= self.tokens:
            self.tokens -= amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.tokens) / self.refill_per_s

    def give_back(self, amount: float) -> None:
        self.tokens = min(self.capacity, self.tokens + amount)


class RateLimiter:
    """Per-key request and token buckets, each holding a minute's worth and refilling evenly.
    Its methods never await, so each check is atomic on the event loop. A key without limits,
    or no key at all (auth off: ``key_name`` None), is never limited."""

    def __init__(self, keys: Iterable[ResolvedKey] = (), clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}
        self._names: list[str] = []  # the keys' order (``replace_buckets``)
        for k in keys:
            self._names.append(k.name)
            if k.requests_per_minute is not None:
                self._requests[k.name] = TokenBucket(k.requests_per_minute, k.requests_per_minute / 60)
            if k.tokens_per_minute is not None:
                self._tokens[k.name] = TokenBucket(k.tokens_per_minute, k.tokens_per_minute / 60)

    def replace_buckets(self, make: Callable[[int, str, float, float], TokenBucket]) -> None:
        """Swap every bucket for ``make(key index, "requests" | "tokens", capacity, refill_per_s)``
        (e.g. one held in a store shared by several gateway processes: ``gateway/admission/shared_limits.py``)."""
        for i, name in enumerate(self._names):
            for kind, buckets in (("requests", self._requests), ("tokens", self._tokens)):
                if name in buckets:
                    old = buckets[name]
                    buckets[name] = make(i, kind, old.capacity, old.refill_per_s)

    def check_request(self, key_name: str | None) -> None:
        """Called by AuthMiddleware once per authenticated request: takes one request from the
        key's bucket, or raises RateLimited and takes nothing."""
        bucket = self._requests.get(key_name) if key_name is not None else None
        if bucket is None:
            return
        wait = bucket.try_take(1, self.clock())
        if wait:
            raise RateLimited(math.ceil(wait), f"rate limit reached for API key {key_name!r}: "
                              f"{bucket.capacity} requests per minute; retry in {math.ceil(wait)} s")

    def check_tokens(self, key_name: str | None, intake: Intake) -> None:
        """Called by a generation route once its body is taken in (after ``check_limits``), once
        per request that passed AuthMiddleware. Takes the intake's token estimate
        (``Intake.tokens``, as ``estimate_tokens``) from the key's bucket, or raises RateLimited
        (429), or LimitExceeded (400) when the request alone needs more than a minute's worth. A
        refused request also gets back the request that check_request took: it costs nothing."""
        bucket = self._tokens.get(key_name) if key_name is not None else None
        if bucket is None:
            return
        need = intake.tokens
        wait = bucket.try_take(need, self.clock())
        if not wait:
            return
        if key_name in self._requests:
            self._requests[key_name].give_back(1)
        limit = f"{int(bucket.capacity)} tokens per minute"
        if math.isinf(wait):
            raise LimitExceeded(f"this request may use about {show(need)} tokens (prompt + max output tokens x n), "
                                f"more than API key {key_name!r} may use: {limit}", intake.output_param)
        raise RateLimited(math.ceil(wait), f"rate limit reached for API key {key_name!r}: {limit}; this request "
                          f"may use about {need} tokens; retry in {math.ceil(wait)} s")
