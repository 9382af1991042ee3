"""Learning that a generation ended without polling the store.

Every agent must react within a moment when any node ends the running generation (a
worker failed somewhere, a node was lost, a newcomer asks to join). Polling the end key
every ``--monitor-interval`` costs the store host 10 requests per second per agent at the
default 0.1 s: at 1,000 nodes that is most of what one TCPStore serves. An
:class:`EndWatcher` instead holds one server-side ``wait`` on ``gen/<N>/end`` from a thread
with its own connection (a TCPStore client is not thread safe), renewed every ``slice_s``
(shorter than the connection's request timeout, or the socket gives up first):
the store answers the moment the key is written, and the thread wakes the agent's loop
through a pipe. The agent then reads and verifies the record itself: the watcher only says
that the key exists, which a forged write can make true (the agent then polls that
generation's end as before).

Errors: a failed or timed-out request makes the thread reconnect after a pause of one
slice (so that it does not crowd the heartbeat thread's reconnects); it never raises and
never decides that the store is lost (the heartbeat thread does that). While it has not
completed a wait for a while (:attr:`EndWatcher.healthy` is false: reconnecting, stuck in
a connect to a frozen host, or dead) the agent reads the end key itself, as it did before.
:meth:`EndWatcher.stop` waits for the thread (at most one slice plus a request timeout) so
that no thread is inside torch when the interpreter exits.

On etcd-v3 the same watcher is one watch stream held across its slices
(``JsonStore.wait_any``, ftrun/control/etcdheld.py): a stream of the end key's watch, read
by a thread of its own, and once etcd confirmed it a read of the key; a slice looks at
that thread and costs etcd no request. The stream is made (and the key read) again when
the gateway ends it (every ``etcdheld.HOLD_S``, 30 s), and given up for the next endpoint
when its member falls silent (a failed request of the agent's heartbeat to it, or no
answer from it to any client of the process for ``etcdheld.UNHEARD_S``, then a failed
read). Before, each slice (0.83 s at the 5 s default) watched again:
``scripts/bench_etcd.py`` measured 2.4 requests per second per agent and 4.9 ms of etcd
CPU per second net of etcd's idle CPU
(a lease keepalive beat costs 0.5 ms), and these renewals, not the leases, were what one
member could not carry at 2,000 agents (docs/scale.md). Such a
slice asks etcd nothing, so there :attr:`EndWatcher.healthy` says that the thread's waits
come back, not that etcd answered: a silent member is noticed through the process's other
requests (as above), and then the wait moves to the next endpoint, or, with one endpoint,
fails and the watcher reconnects (unhealthy until it can: the agent reads the end key
itself meanwhile). Not covered: a stream whose connection a middlebox drops without a
reset while its member stays heard tells nothing until the gateway's end (``HOLD_S``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ftrun.control.store import JsonStore

if TYPE_CHECKING:
    from torch.distributed import TCPStore


class EndWatcher:
    """One generation's end, watched from a thread; see the module docstring."""

    def __init__(self, connect: Callable[[], TCPStore], template: JsonStore, key: str,
                 slice_s: float) -> None:
        self._connect = connect
        self._template = template
        self.key = key
        self.slice_s = slice_s
        self.fired = threading.Event()  # the key exists (not yet verified)
        self._last_wait = time.monotonic()  # when a wait last came back (or the start)
        self._stop = threading.Event()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._thread = threading.Thread(target=self._run, name="ftrun-end-watch", daemon=True)

    @property
    def fd(self) -> int:
        """Readable once the key exists."""
        return self._read_fd

    @property
    def healthy(self) -> bool:
        """Whether its waits are coming back: a slice, a connect and some slack since the
        last one (a renewal that takes longer is failing)."""
        return self._thread.is_alive() and \
            time.monotonic() - self._last_wait < 3 * self.slice_s + 1.0

    @property
    def end_may_exist(self) -> bool:
        """Whether the agent should read the end key now: it exists (to be verified), or
        the watcher is not working and cannot say."""
        return self.fired.is_set() or not self.healthy

    def wake_fds(self) -> list[int]:
        """What the agent's ``select`` adds: the pipe, until it has fired."""
        return [] if self.fired.is_set() else [self.fd]

    def start(self) -> EndWatcher:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return  # stuck past every bound: leave it its pipe rather than a reused fd
        for fd in (self._read_fd, self._write_fd):
            os.close(fd)

    def _run(self) -> None:
        store: JsonStore | None = None
        try:
            while not self._stop.is_set():
                try:
                    if store is None:
                        store = self._template.with_client(self._connect())
                        store.on_reject = None  # the agent reads, verifies and says
                    found = store.wait_any([self.key], self.slice_s)
                    self._last_wait = time.monotonic()
                    if found is not None:  # it exists (its record: the agent's to verify)
                        self.fired.set()
                        os.write(self._write_fd, b"!")
                        return
                except Exception:  # StoreError; nothing may end the thread unseen
                    if store is not None:
                        store.close_waits()
                    store = None  # a timed-out client may be out of step: reconnect
                    self._stop.wait(self.slice_s)
        finally:
            if store is not None:
                store.close_waits()  # etcd-v3: the held stream ends with the watcher


class ReadEnd:
    """The stand-in for the agents that need no watcher (the leader, whose store is
    in-process, and a single node): the end key is read every tick."""

    end_may_exist = True

    def wake_fds(self) -> list[int]:
        return []

    def stop(self, timeout_s: float = 0.0) -> None:
        """Nothing to stop."""
