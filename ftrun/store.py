"""The job's key-value store: torch's ``TCPStore``, served by one agent, read by all.

Two kinds of store exist in a job:

* the **control store**, hosted by the agent on the rendezvous host for the whole job: the
  generation records, joins, ends and shutdown of :mod:`ftrun.rendezvous`;
* one **worker store** per generation, hosted by the same agent on a fresh port, which the
  workers of that generation reach through ``MASTER_ADDR``/``MASTER_PORT`` with
  ``TORCHELASTIC_USE_AGENT_STORE=True`` (torch then connects as a client and never hosts a
  store in rank 0). A fresh key space per generation is what makes a restart always work:
  the workers of generation N+1 can never read an address that a dead worker of generation
  N left behind (the failure mode of pytorch/pytorch#135712).

Values in the control store are JSON objects, validated by their readers; nothing is ever
pickled. Every call has an explicit timeout. Errors: connection problems raise
:class:`StoreError`; a value that is not the JSON object a reader expects raises
:class:`StoreValueError` naming the key.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

# Bounds each blocking connect so that a signal to the agent is acted on promptly.
_CONNECT_SLICE_S = 2.0


class StoreError(RuntimeError):
    """The store cannot be reached or served."""


class StoreValueError(StoreError):
    """A key holds something other than the JSON object its reader expects."""


def serve_store(port: int, timeout_s: float) -> TCPStore:
    """Host a store on every interface; ``port=0`` takes a free port (see ``.port``)."""
    try:
        return TCPStore(
            "0.0.0.0",
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
    except (RuntimeError, ValueError) as error:
        raise StoreError(f"cannot serve the store on port {port}: {error}") from None


def connect_store(
    host: str,
    port: int,
    timeout_s: float,
    *,
    interrupted: Callable[[], bool] = lambda: False,
) -> TCPStore:
    """Connect to a store that may not be up yet, retrying until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last_error = "no attempt"
    while True:
        slice_s = min(_CONNECT_SLICE_S, max(deadline - time.monotonic(), 0.1))
        try:
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=slice_s))
            store.set_timeout(timedelta(seconds=timeout_s))
            return store
        except (RuntimeError, ValueError) as error:
            last_error = str(error).splitlines()[0] if str(error) else type(error).__name__
        if interrupted() or time.monotonic() >= deadline:
            raise StoreError(f"cannot reach the store at {host}:{port}: {last_error}")


class JsonStore:
    """Namespaced JSON records on a TCPStore, for the control plane."""

    def __init__(self, store: TCPStore, prefix: str) -> None:
        self.raw = store
        self.prefix = prefix.rstrip("/") + "/"

    def key(self, name: str) -> str:
        return self.prefix + name

    def set(self, name: str, value: dict[str, Any]) -> None:
        self._call(self.raw.set, self.key(name), json.dumps(value, separators=(",", ":")))

    def set_first(self, name: str, value: dict[str, Any]) -> dict[str, Any]:
        """Write ``value`` unless the key exists; return whichever value won."""
        won = self._call(
            self.raw.compare_set, self.key(name), "", json.dumps(value, separators=(",", ":"))
        )
        return self._decode(name, won)

    def get(self, name: str) -> dict[str, Any] | None:
        """The record, or None when the key does not exist (never blocks)."""
        if not self.exists(name):
            return None
        return self._decode(name, self._call(self.raw.get, self.key(name)))

    def exists(self, name: str) -> bool:
        return bool(self._call(self.raw.check, [self.key(name)]))

    def add(self, name: str, amount: int) -> int:
        return int(self._call(self.raw.add, self.key(name), amount))

    def _decode(self, name: str, raw: bytes) -> dict[str, Any]:
        try:
            value = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise StoreValueError(f"store key {self.key(name)!r} is not JSON") from None
        if not isinstance(value, dict):
            raise StoreValueError(f"store key {self.key(name)!r} is not a JSON object")
        return value

    @staticmethod
    def _call(method: Callable[..., Any], *args: Any) -> Any:
        try:
            return method(*args)
        except (RuntimeError, ValueError) as error:  # torch's DistStoreError is a RuntimeError
            raise StoreError(f"store request failed: {str(error).splitlines()[0]}") from None


def require(record: dict[str, Any], field: str, kind: type | tuple[type, ...]) -> Any:
    """Read one field of a store record, checking its type (bool is not an int here)."""
    value = record.get(field)
    if isinstance(value, bool) and kind is int:
        raise StoreValueError(f"field {field!r} must be an integer")
    if not isinstance(value, kind):
        raise StoreValueError(f"field {field!r} must be {getattr(kind, '__name__', kind)}")
    return value
