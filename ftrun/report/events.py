"""Reading an event log written by ``--events-file`` (one JSON object per line).

The file is input from a person's command line: every line must be a JSON object, and the
first one that is not is a clear one-line error naming the file and the line
(:class:`EventsFileError`), never a traceback. Blank lines are allowed (a log that is
still being written may end in one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class EventsFileError(ValueError):
    """The events file cannot be read or is not JSON lines; the message is one line."""


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every event of ``path`` in file order. Raises :class:`EventsFileError`."""
    try:
        text = path.read_text(errors="replace")
    except OSError as error:
        raise EventsFileError(f"cannot read {path}: {error.strerror or error}") from None
    events: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise EventsFileError(f"{path} line {number} is not JSON ({error.msg}): "
                                  "expected the JSON lines of --events-file") from None
        if not isinstance(record, dict) or not isinstance(record.get("event"), str):
            raise EventsFileError(f"{path} line {number} is not an ftrun event (a JSON "
                                  "object with an 'event' name)")
        events.append(record)
    if not events:
        raise EventsFileError(f"{path} holds no events")
    return events
