"""The signals an agent forwards to its workers, as a file descriptor its loops can sleep on.

The agent never does work inside a signal handler: the handler only records the first
signal, and Python's wakeup fd makes every ``select`` in the watch loops return at once.
"""

from __future__ import annotations

import contextlib
import os
import signal


class SignalInbox:
    """Turns the signals ftrun forwards into a readable fd and a 'first signal' value."""

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.received: signal.Signals | None = None
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals}
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)

    @property
    def fd(self) -> int:
        return self._read_fd

    def _handle(self, signum: int, _frame: object) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read_fd, 512):
                pass

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._read_fd)
        os.close(self._write_fd)
