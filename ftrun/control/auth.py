"""Authenticated control records: an HMAC from the job's secret on every record that steers
the job (generation records, joins, ends, shutdown, heartbeats).

The secret is ``FTRUN_JOB_TOKEN`` (the token itself) or ``FTRUN_JOB_TOKEN_FILE`` (a file
that holds it; surrounding whitespace is stripped). Every agent of a job must see the same
secret; under Slurm, export it in the batch script and ``srun`` passes it to every task.

A signed record is ``{"body": {...}, "mac": "<hex>"}`` where the MAC is
``HMAC-SHA256(secret, canonical JSON of {"key": <full store key>, "body": body})``. Binding
the store key (which includes the run id) means a record copied from one key to another
(an old generation's end replayed onto the current generation) does not verify.

Without a secret, records are written with ``"mac": null`` and read without a check: the
job works as before, but anyone who reaches the store port can steer it (the agent says so
once at start for multi-node jobs). A reader that has a secret never accepts an unsigned or
badly signed record; see docs/multinode.md for the threat model.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TOKEN_ENV = "FTRUN_JOB_TOKEN"
TOKEN_FILE_ENV = "FTRUN_JOB_TOKEN_FILE"


class AuthError(ValueError):
    """A record failed its check (no MAC, bad MAC, malformed envelope)."""


class TokenError(ValueError):
    """The secret is configured but unusable (unreadable or empty file)."""


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


# The stored form of a signed record (Signer.line): {"body":<canonical body>,"mac":"<hex>"}
_HEAD = b'{"body":'
_MAC_OPEN = b',"mac":"'
_HEX = 64  # a SHA-256 MAC in hex
_TAIL = len(_MAC_OPEN) + _HEX + 2  # the MAC and the closing '"}'


class Signer:
    """Wraps and checks record bodies; ``Signer(None)`` is the unauthenticated mode."""

    def __init__(self, secret: bytes | None) -> None:
        self._secret = secret

    @property
    def enabled(self) -> bool:
        return self._secret is not None

    def _mac(self, key: str, body: Mapping[str, Any]) -> str:
        assert self._secret is not None
        return hmac.new(self._secret, canonical({"key": key, "body": body}), hashlib.sha256
                        ).hexdigest()

    def wrap(self, key: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return {"body": dict(body), "mac": self._mac(key, body) if self.enabled else None}

    def line(self, key: str, body: Mapping[str, Any]) -> str:
        """The stored form of :meth:`wrap`'s record, as compact JSON, encoding the body
        once: its canonical JSON is both what the MAC covers (the canonical form of
        ``{"key", "body"}`` is ``{"body":<canonical body>,"key":<key>}``) and what is
        stored (the leader signs 4,096 assignments per generation at that size)."""
        text = canonical(body)
        if not self.enabled:
            return '{"body":' + text.decode() + ',"mac":null}'
        assert self._secret is not None
        signed = b'{"body":' + text + b',"key":' + json.dumps(key).encode() + b"}"
        mac = hmac.new(self._secret, signed, hashlib.sha256).hexdigest()
        return '{"body":' + text.decode() + ',"mac":"' + mac + '"}'

    def unwrap_line(self, key: str, raw: bytes | str) -> dict[str, Any]:
        """The body of a record as stored (a line read from ``key``); AuthError unless it is
        trustworthy, ``json.JSONDecodeError``/``UnicodeDecodeError`` when it is not JSON.

        A line in the form :meth:`line` writes is checked on its bytes: the MAC covers the
        body's canonical text exactly as it is stored, so a valid MAC proves those bytes
        are a body this job signed for this key, and the body is not encoded again to
        check it (that encoding was half the cost of the regroup leader's read of every
        member's status: scripts/bench_member_statuses.py). Anything else, or a MAC that
        does not match there, goes through :meth:`unwrap`, which says what is wrong."""
        if self._secret is not None and isinstance(raw, bytes) and raw.startswith(_HEAD) \
                and raw[-_TAIL:-_HEX - 2] == _MAC_OPEN and raw.endswith(b'"}'):
            text = raw[len(_HEAD):-_TAIL]
            signed = _HEAD + text + b',"key":' + json.dumps(key).encode() + b"}"
            mac = hmac.new(self._secret, signed, hashlib.sha256).hexdigest().encode()
            if hmac.compare_digest(raw[-_HEX - 2:-2], mac):
                body = json.loads(text)
                if isinstance(body, dict):
                    return body
        return self.unwrap(key, json.loads(raw))

    def unwrap(self, key: str, record: Any) -> dict[str, Any]:
        """The body of a record read from ``key``; AuthError unless it is trustworthy."""
        if not isinstance(record, dict) or not isinstance(record.get("body"), dict):
            raise AuthError(f"{key}: not a control record")
        body: dict[str, Any] = record["body"]
        mac = record.get("mac")
        if not self.enabled:
            return body
        if not isinstance(mac, str):
            raise AuthError(f"{key}: unsigned record (its writer has no job token)")
        if not hmac.compare_digest(mac, self._mac(key, body)):
            raise AuthError(f"{key}: bad MAC (written without this job's token)")
        return body


def load_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The job secret from the environment, or None when none is configured."""
    env = os.environ if environ is None else environ
    token = env.get(TOKEN_ENV)
    if token:
        return token.encode()
    path = env.get(TOKEN_FILE_ENV)
    if not path:
        return None
    try:
        text = Path(path).read_text().strip()
    except OSError as error:
        raise TokenError(f"{TOKEN_FILE_ENV}={path}: {error.strerror or error}") from None
    if not text:
        raise TokenError(f"{TOKEN_FILE_ENV}={path}: the file is empty")
    return text.encode()
