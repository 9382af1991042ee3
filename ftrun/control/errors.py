"""The store's errors and the one record-field check, apart from torch.

Readers of store records (the agent, the worker API, :mod:`ftrun.protocol`) validate what
they read with :func:`require`; keeping these here, and not in :mod:`ftrun.control.store`,
lets the agent/worker contract be imported without importing torch (the shim and doctor
use it on machines where importing torch takes seconds).
"""

from __future__ import annotations

from typing import Any


class StoreError(RuntimeError):
    """The store cannot be reached or served."""


class RendezvousError(RuntimeError):
    """The generation could not be formed (timeout, store lost, inconsistent records)."""


class BeatDeferred(RuntimeError):
    """A heartbeat held back on purpose (etcd-v3: a lease grant waiting out its back-off
    after a failed one): not a beat, but no sign that the client is out of step either."""


class StoreValueError(StoreError):
    """A key holds something other than the JSON object its reader expects."""


def require(record: dict[str, Any], field: str, kind: type | tuple[type, ...]) -> Any:
    """Read one field of a store record, checking its type (bool is not an int here)."""
    value = record.get(field)
    if isinstance(value, bool) and kind is int:
        raise StoreValueError(f"field {field!r} must be an integer")
    if not isinstance(value, kind):
        raise StoreValueError(f"field {field!r} must be {getattr(kind, '__name__', kind)}")
    return value
