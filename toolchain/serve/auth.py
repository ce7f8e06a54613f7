"""API keys and per-key rate limits.

The keys file holds one key a line, `id:sha256hex(key)[:limits]`, where limits are `rpm=N,tpm=N` (requests and
tokens per minute; either may be left out); `#` starts a comment. The server never sees a key at rest: a presented
key is hashed and compared with every entry in constant time (hmac.compare_digest), so neither a lookup's timing
nor an early exit tells how close a guess was. Metrics and logs name the key's id, never the key.

Rate limits are token buckets refilled continuously (capacity = the per-minute limit). Tokens per minute reserve
prompt + max_tokens at admission and give back what the request did not use when it ends, so a burst of long
requests cannot overshoot the limit by what they are about to generate.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolchain.errors import UserError, read_utf8

_LIMIT_KEYS = {"rpm", "tpm"}


@dataclass(frozen=True)
class ApiKey:
    id: str
    digest: bytes  # sha256 of the key
    rpm: int | None = None
    tpm: int | None = None


def _parse_limits(path: Path, number: int, text: str) -> dict[str, int]:
    limits: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = item.partition("=")
        if name not in _LIMIT_KEYS or not value.isdigit() or int(value) < 1:
            raise UserError(
                f"{path}:{number}: limit {item!r}; expected rpm=N and/or tpm=N with N >= 1, comma-separated"
            )
        limits[name] = int(value)
    return limits


def read_keys(path: Path) -> list[ApiKey]:
    if not path.is_file():
        raise UserError(f"--api-keys {path}: no such file; one `id:sha256hex(key)[:rpm=N,tpm=N]` line per key")
    keys: list[ApiKey] = []
    for number, raw in enumerate(read_utf8(path).splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key_id, _, rest = line.partition(":")
        digest, _, limit_text = rest.partition(":")
        if not key_id or len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
            raise UserError(
                f"{path}:{number}: expected `id:sha256hex(key)[:rpm=N,tpm=N]` (64 hex digits: "
                "printf %s KEY | sha256sum)"
            )
        if any(k.id == key_id for k in keys):
            raise UserError(f"{path}:{number}: key id {key_id!r} appears twice; ids name keys in metrics and logs")
        keys.append(ApiKey(key_id, bytes.fromhex(digest), **_parse_limits(path, number, limit_text)))
    if not keys:
        raise UserError(f"--api-keys {path}: no keys in the file")
    return keys


class KeyRing:
    def __init__(self, keys: list[ApiKey]):
        self.keys = keys

    def identify(self, authorization: str | None) -> ApiKey | None:
        """The key a `Bearer` header presents, or None. Every entry is compared, whatever matches."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        digest = hashlib.sha256(authorization[len("Bearer ") :].strip().encode()).digest()
        found = None
        for key in self.keys:
            if hmac.compare_digest(digest, key.digest):
                found = key
        return found


class TokenBucket:
    """`capacity` units, refilled at capacity per minute; thread-safe."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.capacity, self.rate, self.clock = float(per_minute), per_minute / 60.0, clock
        self.level, self.stamp = float(per_minute), clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, amount: float) -> float:
        """Take `amount` now and return 0, or take nothing and return the seconds until it would fit (inf if it
        never can: more than the whole capacity)."""
        with self._lock:
            self._refill()
            if amount <= self.level:
                self.level -= amount
                return 0.0
            if amount > self.capacity:
                return math.inf
            return (amount - self.level) / self.rate

    def give_back(self, amount: float) -> None:
        with self._lock:
            self._refill()
            self.level = min(self.capacity, self.level + amount)


class RateLimiter:
    """Each key's request and token buckets."""

    def __init__(self, keys: list[ApiKey], clock: Callable[[], float] = time.monotonic):
        self.requests = {k.id: TokenBucket(k.rpm, clock) for k in keys if k.rpm}
        self.tokens = {k.id: TokenBucket(k.tpm, clock) for k in keys if k.tpm}

    def admit(self, key_id: str, reserve_tokens: int) -> float:
        """0 when admitted (one request and `reserve_tokens` taken), else seconds to wait (inf: never fits)."""
        wait = self.requests[key_id].take(1) if key_id in self.requests else 0.0
        if wait:
            return wait
        if key_id in self.tokens:
            wait = self.tokens[key_id].take(reserve_tokens)
            if wait and key_id in self.requests:
                self.requests[key_id].give_back(1)
        return wait

    def refund(self, key_id: str, reserved: int) -> None:
        """A request admitted here and then refused (the queue was full): its request and its tokens go back."""
        if key_id in self.requests:
            self.requests[key_id].give_back(1)
        self.settle(key_id, reserved, 0)

    def settle(self, key_id: str, reserved: int, used: int) -> None:
        """A request ended having used `used` of the `reserved` tokens: the rest goes back."""
        if key_id in self.tokens and reserved > used:
            self.tokens[key_id].give_back(reserved - used)
