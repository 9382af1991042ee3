"""An etcd-v3 wait held across its caller's slices (``EtcdClient.wait_any``): a joining
agent's wait for its assignment, and every agent's watch of its generation's end
(ftrun/control/endwatch.py).

Why: the rendezvous waits in slices (``Rendezvous.WAIT_SLICE_S``, 2 s) so that a signal
to a waiting agent takes effect within one. On the TCPStore a slice costs the store's
thread a wait, its cancel and a check. On etcd it cost a new watch (a gRPC stream behind
the JSON gateway) and two reads (``gen/N`` and the shutdown record), and 4,095 agents
waiting for a 4,096-node generation renewed 2,000 times a second, more than one member
serves: the leader wrote the generation, and no agent held its assignment within 60 s
(docs/scale.md). Here a wait is one stream with a watch of each key
it waits for (``etcdwire.AnyStream``), read by a daemon thread; a slice is a wait on that
thread, with no request to etcd. The end watch had the same cost, a new watch per 0.83 s
slice, 2.4 requests a second per agent, and one member could not carry it at 2,000 agents.

The watches start at the store's revision when etcd makes them, and once etcd confirmed
them, one read of every key finds what was written before: nothing is missed. Made the
other way round, from the revision of a read before them, a watch that etcd makes after
other writes must first catch up, and etcd catches up such watches 512 at a time every
100 ms (``syncWatchersLoop``): 4,096 agents arming at once, with each other's offers
written in between, had their events that much later.

Bounds and failover (what a silent stream could otherwise hide):

* the gateway ends the stream ``HOLD_S`` after it began (``Grpc-Timeout``); the next
  slice watches again and reads again;
* the keys are read once etcd confirmed every watch; a stream that fails first has
  failed its endpoint;
* a member cut off or frozen after the stream began is silent, not reset. Any client of
  this process whose request to that endpoint failed after the stream began (the agent's
  heartbeat, a request every interval, notices first) notes it in :data:`FAILED_AT`; the
  wait then gives the stream up at its next slice and moves to the next endpoint;
* where no client of the process has had an answer from that member for
  :data:`UNHEARD_S` (they failed over elsewhere before; :data:`HEARD_AT`), the wait asks
  it itself: the read of a first slice again. A silent member fails that read, which moves
  on to the next endpoint and watches there. Without it such a silence lasted until the
  stream's read bound, ``HOLD_S`` and a second. In a running agent the heartbeat's
  requests go to the same member, so the read is rare: a slice still costs no request.

The two tables, :data:`FAILED_AT` and :data:`HEARD_AT`, are the only state this module
keeps beyond its objects: written by every client of the process, read by held waits.

Errors: ``RuntimeError`` as the client's requests. A failed stream moves the client to
its next endpoint (``EtcdClient._failed_over``, which raises with a single endpoint) and
is otherwise a slice without news: the caller's next slice reads every key again.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import requests
from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import Etcd3Client

from ftrun.control import etcdwire as wire

#: How long one held stream lasts before the gateway ends it (a new read and stream then).
HOLD_S = 30.0

#: endpoint ("host:port") -> time.monotonic() of the last request of this process's
#: clients to it that failed. Written by every client, read by held waits; a float per
#: endpoint, so the GIL keeps each write whole.
FAILED_AT: dict[str, float] = {}

#: endpoint -> time.monotonic() of the last answer a client of this process had from it
#: (written and read as :data:`FAILED_AT`).
HEARD_AT: dict[str, float] = {}

#: How long the first call on a new stream waits for etcd to confirm its watches (the read
#: follows the confirmation), even past the call's own timeout, before it returns without
#: news. The stream is kept: a busy member confirms late (4,096 agents arming at once on one
#: loopback member, up to about 3 s), and a stream given up for that is made again on top
#: of the load (the light harness giving up after 1 s made 12,654 streams again). A member
#: that never confirms is found as any silent one is: a failed request of the process to
#: it (:data:`FAILED_AT`), or no answer for :data:`UNHEARD_S` and then a failed read.
CONFIRM_S = 5.0

#: How long a held stream's member may go unheard by every client of the process before
#: the wait reads from it (a silent stream is no proof that the member answers): the
#: heartbeat timeout by default on etcd-v3, whose beat (every 1 s) keeps its member heard.
UNHEARD_S = 5.0


class BoundedSession(requests.Session):
    """A requests session whose requests are all bounded: etcd3gw gives no timeout to the
    request that opens a watch, which would block on a frozen member forever. Its CA
    (``cacert``) is given with each request: requests lets ``REQUESTS_CA_BUNDLE`` or
    ``CURL_CA_BUNDLE`` in the environment override a session's own, which ignored the
    option on hosts that set them (etcd's certificate then failed to verify)."""

    def __init__(self, timeout: tuple[float, float]) -> None:
        super().__init__()
        self.bound = timeout

    def request(self, *args: Any, **kwargs: Any) -> requests.Response:  # type: ignore[override]
        if kwargs.get("timeout") is None:
            kwargs["timeout"] = self.bound
        if isinstance(self.verify, str) and kwargs.get("verify") is None:
            kwargs["verify"] = self.verify
        return super().request(*args, **kwargs)


def note_failure(endpoint: str, error: BaseException | None = None) -> None:
    """A request to ``endpoint`` failed in transport (``error``: what etcd3gw or requests
    raised; None: the caller's own verdict). An answer of etcd's, such as a 404 for an
    expired lease, is no sign of a silent member and is not noted."""
    transport = (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError,
                 etcd_errors.InternalServerError, requests.RequestException)
    if error is None or isinstance(error, transport):
        FAILED_AT[endpoint] = time.monotonic()


def note_answer(endpoint: str) -> None:
    """A request to ``endpoint`` was answered: its member is not silent."""
    HEARD_AT[endpoint] = time.monotonic()


def freshest(endpoints: list[str]) -> int:
    """Where a new client starts: the endpoint this process last had an answer from and
    that has not failed since (0 when none has). A new client (each generation's end
    watch, a reconnect) then talks to the member the others moved to, which keeps it
    heard, rather than to the first one, which a held wait would then read from every
    :data:`UNHEARD_S`."""
    best, best_at = 0, -1.0
    for index, endpoint in enumerate(endpoints):
        heard = HEARD_AT.get(endpoint, -1.0)
        if heard > best_at and heard > FAILED_AT.get(endpoint, -1.0):
            best, best_at = index, heard
    return best


class HeldWatch:
    """One stream on several keys' spans from one revision, read by a daemon thread until
    its first event, the gateway's end of it, a failure, or :meth:`close`."""

    def __init__(self, endpoint: str, gateway: Etcd3Client, ekeys: list[bytes],
                 connect_s: float, hold_s: float) -> None:
        self.ekeys, self.endpoint = ekeys, endpoint
        self.opened = time.monotonic()
        self.stream = wire.AnyStream(ekeys)
        self.outcome: tuple[int, bytes | None] | None = None
        self.failure = ""  # why the stream failed ("": it did not)
        self.done = threading.Event()  # outcome, failure or end: the thread is over
        self.settled = threading.Event()  # etcd confirmed every watch, or the thread is over
        self.keys_read = False  # the keys were read since etcd confirmed every watch
        self._closed = False
        self._response: requests.Response | None = None
        session = BoundedSession((connect_s, hold_s + 1.0))  # close() shuts it
        session.verify, session.cert = gateway.session.verify, gateway.session.cert
        body = "".join(json.dumps(r) for r in self.stream.requests())
        threading.Thread(target=self._read, args=(session, gateway, body, connect_s, hold_s),
                         name="ftrun-etcd-wait", daemon=True).start()

    def _read(self, session: requests.Session, gateway: Etcd3Client, body: str,
              connect_s: float, hold_s: float) -> None:
        try:
            # in this thread: etcd3gw asks an endpoint it has not used yet for its API path
            # (a GET bounded by the client's timeout), and a frozen member never answers
            url = gateway.get_url("/watch")
            with session.post(url, data=body, stream=True, timeout=(connect_s, hold_s + 1.0),
                              headers={"Content-Type": "application/json",
                                       "Grpc-Timeout": f"{int(hold_s * 1000)}m"}
                              ) as response:
                self._response = response
                if self._closed:  # closed while the request was on its way
                    return
                if response.status_code not in (200, 504):  # 504: the deadline, its body
                    self.failure = f"HTTP {response.status_code} {response.reason}"
                    return
                for line in response.iter_lines():
                    if self._closed:
                        return
                    if line.strip():
                        self.outcome = self.stream.take(json.loads(line))
                        if self.outcome is not None:
                            return
                        if self.stream.confirmed:
                            self.settled.set()
                if not self.stream.ended:
                    self.failure = "the stream ended"
        except (etcd_errors.Etcd3Exception, requests.RequestException, ValueError) as error:
            self.failure = wire.short(error)
        except (AttributeError, TypeError):
            self.failure = "a message that is not etcd's"
        finally:
            session.close()
            self.done.set()
            self.settled.set()

    def stale(self) -> str:
        """Why this stream can no longer be trusted to tell a write ("": it can)."""
        if self.failure:
            return self.failure
        if self.done.is_set() and self.outcome is None:
            return "ended"  # the gateway's end at HOLD_S (or a failure, said above)
        if FAILED_AT.get(self.endpoint, -1.0) > self.opened:
            return "a request of this process to the endpoint failed since the watch began"
        return ""

    def unheard(self) -> bool:
        """No client of this process had an answer from the stream's member for
        :data:`UNHEARD_S` (and the stream told nothing)."""
        heard = max(HEARD_AT.get(self.endpoint, -1.0), self.opened)
        return self.outcome is None and time.monotonic() - heard > UNHEARD_S

    def close(self) -> None:
        """End the stream now (its thread ends with it; not joined: a daemon)."""
        self._closed = True
        with contextlib.suppress(Exception):  # not begun, or over already
            self._response.raw.shutdown()  # type: ignore[union-attr]


class HeldWaits:
    """A client's held wait (at most one: a client serves one thread). ``gateway()``: the
    client's current endpoint and its etcd3gw client; ``txn`` and ``failed_over``: the
    client's transaction and its move to the next endpoint; ``connect_s``: its connect
    bound (a stream's own bounds: :data:`CONFIRM_S`, ``hold_s``)."""

    def __init__(self, gateway: Callable[[], tuple[str, Etcd3Client]],
                 txn: Callable[[list[Any], list[Any], list[Any]], dict[str, Any]],
                 failed_over: Callable[[str], None], connect_s: float,
                 hold_s: float = HOLD_S) -> None:
        self._gateway, self._txn, self._failed_over = gateway, txn, failed_over
        self._connect_s, self.hold_s = connect_s, hold_s
        self.held: HeldWatch | None = None

    def wait(self, ekeys: list[bytes], timeout_s: float) -> tuple[int, bytes | None] | None:
        """See ``EtcdClient.wait_any`` (``ekeys``: the keys with the client's root). A
        stream that ends or fails within the call leaves the rest of ``timeout_s`` to pass
        without news, so one that fails at once costs a watch (and a read) per slice, never
        a loop of them. With no stream held the call may take up to :data:`CONFIRM_S`:
        etcd's confirmation of the new watches comes before the read."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        held = self.held
        if held is not None and (held.ekeys != ekeys or held.endpoint != self._gateway()[0]):
            self.close()
        elif held is not None and held.outcome is None and (why := held.stale()):
            self.close()
            if why != "ended":  # the gateway's end at the hold: watch and read again now
                self._failed_over(f"watch: {why}")  # the next slice watches elsewhere
                return None
        if self.held is not None and self.held.unheard():
            # a look at an unheard member (a silent one fails the read, which moves on to
            # the next endpoint: the stream moves with it, below)
            found = self._read(ekeys)
            if found is not None:
                return found
        if self.held is None:
            endpoint, gateway = self._gateway()
            self.held = HeldWatch(endpoint, gateway, ekeys, self._connect_s, self.hold_s)
        held = self.held
        if not held.keys_read:
            patience = max(deadline, held.opened + CONFIRM_S) - time.monotonic()
            if not held.settled.wait(max(patience, 0.0)):
                return None  # not confirmed yet: the next slice waits on the same stream
            if not held.stream.confirmed:  # the stream failed before etcd confirmed it
                self.close()
                self._failed_over(f"watch: {held.failure or 'the stream ended'}")
                time.sleep(max(deadline - time.monotonic(), 0.0))
                return None
            held.keys_read = True
            found = self._read(ekeys)
            if found is not None or self.held is None:
                return found
        if not held.done.wait(max(deadline - time.monotonic(), 0.0)):
            return None  # nothing yet: the next slice looks at the same stream
        if held.outcome is None:  # ended or failed: the next call says why, watches again
            time.sleep(max(deadline - time.monotonic(), 0.0))
            return None
        self.close()
        index, value = held.outcome
        return None if index < 0 else (index, value)  # canceled: the next slice reads

    def _read(self, ekeys: list[bytes]) -> tuple[int, bytes | None] | None:
        """One read of every key: the first found (the stream closed), else None, the
        stream closed too when the read went to another endpoint than it (a failover:
        the next slice watches there). RuntimeError when no endpoint answered."""
        try:
            result = self._txn([], [{"request_range": wire.span(e)} for e in ekeys], [])
        except RuntimeError:  # no endpoint answered: the stream goes with the wait
            self.close()
            raise
        for index, response in enumerate(result.get("responses") or []):
            kvs = (response.get("response_range") or {}).get("kvs") or []
            if kvs:
                self.close()
                return index, wire.joined(kvs)
        if self.held is not None and self.held.endpoint != self._gateway()[0]:
            self.close()
        return None

    def close(self) -> None:
        """End the held stream, if any (the wait is over, or its client is dropped)."""
        if self.held is not None:
            self.held.close()
            self.held = None
