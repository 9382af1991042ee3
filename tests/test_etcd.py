"""The etcd-v3 backend (ftrun/control/etcd.py) against real etcd (Debian's etcd-server).

Store semantics and bad input run against one member on loopback; the job runs across three
network-namespace hosts with a 3-member cluster (tests/infra/etcd_cluster.py), one member
per host. Skipped only when etcd-server (or, for the job, iproute2/iptables) is missing.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ftrun.cli import config_from_args
from ftrun.config import ConfigError
from ftrun.control.auth import Signer
from ftrun.control.errors import StoreError
from ftrun.control.etcd import EtcdClient, EtcdOptions, connect_etcd
from ftrun.control.etcdkeepalive import KeepAliveStream
from ftrun.control.store import JsonStore
from tests.infra.etcd_cluster import (
    FreezableRelay,
    etcd_missing_reason,
    loopback_etcd,
    member_process,
    suspend,
)
from tests.launch import REPO, Launch, launcher, wait_until
from tests.lines import Done, ElasticStep, find, parse, reached
from tests.test_multinode import TOKEN, HostLaunch, _check_regroup_across_nodes

pytestmark = pytest.mark.skipif(etcd_missing_reason() is not None,
                                reason=etcd_missing_reason() or "")

HB_TIMEOUT_S = 5.0  # etcd elects a new leader in about a second: well inside it


def test_etcd_store_operations_signed_records_and_failover() -> None:
    """On a real etcd: compare_set keeps the first value, concurrent adds from several
    clients all count (transactions), appends keep their order, a wait wakes on another
    client's write and times out within its bound; unsigned or forged records and another
    prefix's keys are ignored; a dead first endpoint is skipped; an agent promoted to
    writer while it waits for a generation forms that generation; an offer that failed is
    made again within the join's deadline."""
    with loopback_etcd() as endpoint:
        # the first endpoint refuses connections: every request fails over to the second
        options = EtcdOptions.parse(f"127.0.0.1:1,{endpoint}", {"etcd_prefix": "/ftrun"})
        client = connect_etcd(options, 10, op_timeout_s=2)
        assert client.endpoint == endpoint
        assert client.compare_set("cs", "", "first") == b"first"
        assert client.compare_set("cs", "", "second") == b"first"
        assert client.compare_set("cs", "first", "third") == b"third"

        def adder(i: int) -> None:
            mine = connect_etcd(options, 10, op_timeout_s=5)
            for n in range(20):
                mine.add("count", 1)
                mine.append("many", f"{i}.{n};")  # a part key each: none lost, none merged
        threads = [threading.Thread(target=adder, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert client.add("count", 0) == 80
        parts = client.get("many").decode().rstrip(";").split(";")
        assert sorted(parts) == sorted(f"{i}.{n}" for i in range(4) for n in range(20))
        for i in range(4):  # each writer's parts in the order it appended them
            assert [p for p in parts if p.startswith(f"{i}.")] == [f"{i}.{n}" for n in range(20)]
        for part in ("a", "b", "c"):
            client.append("log", part)
        assert client.get("log") == b"abc" and client.check(["log", "many", "count"])
        client.set("log", "new")  # set replaces the appended parts too, as torch's does
        assert client.get("log") == b"new"
        names = [f"k{i}" for i in range(300)]  # more than etcd's 128 operations a txn
        client.multi_set(names, [str(i) for i in range(300)])
        assert client.check(names) and not client.check([*names, "absent"])
        assert client.multi_get(names) == [str(i).encode() for i in range(300)]

        started = time.monotonic()
        with pytest.raises(RuntimeError, match="wait timeout"):
            client.wait(["nothing"], timedelta(seconds=0.5))
        assert 0.4 < time.monotonic() - started < 5.0
        writer = connect_etcd(options, 10, op_timeout_s=2)
        threads_before = set(threading.enumerate())
        during: list[list[str]] = []

        def write_later() -> None:  # while the main thread waits: which threads are new
            during.append([t.name for t in set(threading.enumerate()) - threads_before
                           if t is not threading.current_thread()])
            writer.set("later", "x")
        timer = threading.Timer(0.3, write_later)
        timer.start()
        started = time.monotonic()
        client.wait(["later"], timedelta(seconds=10))  # a watch, woken by the write
        assert time.monotonic() - started < 5.0
        timer.join()
        # the wait read its stream itself: no thread of its own (a thread pool per wait,
        # etcd3gw's watch_once, is what 128 light agents could not carry)
        assert during == [[]], during

        rejected: list[str] = []
        job = JsonStore(client, "ftrun/job", signer=Signer(TOKEN.encode()),
                        on_reject=rejected.append)
        rogue = JsonStore(writer, "ftrun/job")  # no secret
        rogue.put_record("gen/0/end", {"kind": "forged"})
        job.put_record("gen/0/end", {"kind": "real"})
        assert job.first_record("gen/0/end") == {"kind": "real"}
        rogue.set_record("hb/n1", {"seq": 99})
        assert job.get_record("hb/n1") is None and rejected
        # the same key names under another prefix are another job's: never seen here
        other = JsonStore(connect_etcd(EtcdOptions.parse(endpoint, {"etcd_prefix": "/other"}),
                                       10, op_timeout_s=2),
                          "ftrun/job", signer=Signer(TOKEN.encode()))
        other.set_record("latest", {"number": 7})
        assert job.get_record("latest") is None
        assert other.get_record("latest") == {"number": 7}

        # No endpoint answers: a request, after its reconnects, fails with the store's own
        # error (the agent's one-line path), not a bare RuntimeError (an "internal error")
        dead = EtcdOptions.parse("127.0.0.1:1,127.0.0.1:2", {})
        cut_off = JsonStore(EtcdClient(dead, 0.5), "ftrun/job",
                            reconnect=lambda: connect_etcd(dead, 0.3, op_timeout_s=0.3),
                            retry_s=1.0)
        with pytest.raises(StoreError, match=r"127\.0\.0\.1:2"):
            cut_off.set("x", {})

        # The writer is gone while two agents wait for generation 0 (neither is the
        # writer): the one promoted, as Agent._promote does, forms the generation it
        # waited for (not the next), and the other receives its assignment.
        from ftrun.control.rendezvous import DynamicRendezvous, NodeSlot

        def agent(i: int) -> tuple[DynamicRendezvous, NodeSlot]:
            store = JsonStore(connect_etcd(options, 10, op_timeout_s=5), "ftrun/promo",
                              signer=Signer(TOKEN.encode()))
            return (DynamicRendezvous(store, min_nodes=2, max_nodes=3, last_call_s=0.5,
                                      is_leader=False, poll_s=0.02, interrupted=lambda: False),
                    NodeSlot(-1, 1, f"10.0.0.{i}", f"h{i}", 1, f"node-{i}"))
        joined: dict[int, object] = {}

        def join(i: int, rdzv: DynamicRendezvous, slot: NodeSlot) -> None:
            joined[i] = rdzv.join(0, slot, 30, lambda: ("10.0.0.1", 4242))
        agents = [agent(i) for i in (1, 2)]
        threads = [threading.Thread(target=join, args=(i, *a)) for i, a in enumerate(agents)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # both offered and waiting for the writer's assignment
        assert not joined
        agents[0][0].is_leader = True  # promoted (the writer's key was won)
        for thread in threads:
            thread.join(30)
        generations = [joined[0], joined[1]]
        assert [g.number for g in generations] == [0, 0], generations  # type: ignore[attr-defined]
        assert generations[1].node("node-2").node_rank == 1  # type: ignore[attr-defined]
        assert generations[1].worker_store_port == 4242  # type: ignore[attr-defined]

        # An offer that fails (the etcd member frozen: every request times out, the
        # store's own retries spent) is made again within the join's deadline: once etcd
        # answers, the node is in the generation (before, its join failed at once).
        class Counted(DynamicRendezvous):
            tries = 0

            def _offer(self, number: int, slot: NodeSlot) -> None:
                self.tries += 1
                super()._offer(number, slot)

        member = member_process(endpoint)
        joiner = Counted(_quick_store(options, "ftrun/retry"), min_nodes=2, max_nodes=2,
                         last_call_s=0.5, is_leader=False, poll_s=0.02,
                         interrupted=lambda: False)
        leader = DynamicRendezvous(
            JsonStore(connect_etcd(options, 10, op_timeout_s=5), "ftrun/retry",
                      signer=Signer(TOKEN.encode())),
            min_nodes=2, max_nodes=2, last_call_s=0.5, is_leader=True, poll_s=0.02,
            interrupted=lambda: False)
        retried: dict[str, object] = {}
        suspend(member)
        try:
            late = threading.Thread(target=_join_into, args=(
                retried, "joiner", joiner, NodeSlot(-1, 1, "10.0.0.2", "h2", 1, "node-2")))
            late.start()
            deadline = time.monotonic() + 30
            while joiner.tries < 3 and late.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            member.resume()
        assert joiner.tries >= 3, (joiner.tries, retried)  # failed twice, offered again
        _join_into(retried, "leader", leader, NodeSlot(-1, 1, "10.0.0.1", "h1", 1, "node-1"))
        late.join(60)
        generation = retried["joiner"]
        assert not isinstance(generation, Exception), generation
        assert generation.nnodes == 2 and generation.node("node-2").node_rank == 1, \
            generation  # type: ignore[union-attr]



def _quick_store(options: EtcdOptions, prefix: str, kind: type[JsonStore] = JsonStore
                 ) -> JsonStore:
    """A store whose requests give up within 0.4 s and are retried for 0.4 s on a new
    connection: against a frozen member, each request fails in about a second."""
    quick = lambda: connect_etcd(options, 0.4, op_timeout_s=0.4)  # noqa: E731
    return kind(quick(), prefix, signer=Signer(TOKEN.encode()), reconnect=quick, retry_s=0.4)


def _join_into(joined: dict[str, object], name: str, rdzv: Any, slot: Any,
               timeout_s: float = 120) -> None:
    """``rdzv.join`` of generation 0 into ``joined[name]``: the generation, or the error
    (a thread's target: the test's assertions show it)."""
    try:
        joined[name] = rdzv.join(0, slot, timeout_s, lambda: ("10.0.0.1", 4343))
    except Exception as error:
        joined[name] = error


def _lead_node_2_in(options: EtcdOptions, prefix: str, waiting: threading.Thread,
                    joined: dict[str, object]) -> None:
    """Form generation 0 of two with the real leader (node-1) and check that the joiner
    (node-2, joining in ``waiting`` into ``joined["joiner"]``) holds rank 1 in it."""
    from ftrun.control.rendezvous import DynamicRendezvous, NodeSlot

    leader = DynamicRendezvous(
        JsonStore(connect_etcd(options, 10, op_timeout_s=5), prefix,
                  signer=Signer(TOKEN.encode())),
        min_nodes=2, max_nodes=2, last_call_s=0.5, is_leader=True, poll_s=0.02,
        interrupted=lambda: False)
    leader.join(0, NodeSlot(-1, 1, "10.0.0.1", "h1", 1, "node-1"), 60,
                lambda: ("10.0.0.1", 4343))
    waiting.join(60)
    generation = joined["joiner"]
    assert not isinstance(generation, Exception), generation
    assert generation.node("node-2").node_rank == 1, generation  # type: ignore[union-attr]


def test_a_leader_whose_reads_fail_under_load_forms_the_generation_once_etcd_answers() -> None:
    """The writer's reads while it waits for slots fail while the etcd member is frozen
    (every request times out, the store's own retries spent): it reads again until the
    join's deadline, and once etcd answers, the generation forms with the late joiner in
    it. Before, the leader's join ended at its first failed read (4,096 light agents on one
    member). Each poll makes two reads, the slots and the shutdown record: the member is
    frozen just before the first read of each kind and resumed once it failed (freezing
    from the test's thread when a read was seen had landed on the slots' read 16 times in
    a row: the shutdown read follows it at once)."""
    from ftrun.control.rendezvous import DynamicRendezvous, NodeSlot

    class Frozen(DynamicRendezvous):
        """Fails the first read of each kind by freezing the member around it."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            self.failed = {"slots": 0, "shutdown": 0}

        def _frozen(self, kind: str, read: Callable[[], Any]) -> Any:
            if self.failed[kind]:
                return read()
            suspend(member)
            try:
                return read()
            except StoreError:
                self.failed[kind] += 1
                raise
            finally:
                member.resume()

        def _arrivals(self, number: int) -> list[NodeSlot]:
            return self._frozen("slots", lambda: super(Frozen, self)._arrivals(number))

        def shutdown_reason(self) -> dict | None:
            return self._frozen("shutdown", lambda: super(Frozen, self).shutdown_reason())

    with loopback_etcd() as endpoint:
        options = EtcdOptions.parse(endpoint, {"etcd_prefix": "/ftrun"})
        member = member_process(endpoint)
        leader = Frozen(_quick_store(options, "ftrun/lead"), min_nodes=2, max_nodes=2,
                        last_call_s=0.5, is_leader=True, poll_s=0.02,
                        interrupted=lambda: False)
        joined: dict[str, object] = {}
        lead = threading.Thread(target=_join_into, args=(
            joined, "leader", leader, NodeSlot(-1, 1, "10.0.0.1", "h1", 1, "node-1")))
        lead.start()
        wait_until(lambda: min(leader.failed.values()) >= 1 or not lead.is_alive(), 60,
                   "a failed read of each kind")
        assert min(leader.failed.values()) >= 1, (leader.failed, joined)
        assert lead.is_alive(), joined
        joiner = DynamicRendezvous(
            JsonStore(connect_etcd(options, 10, op_timeout_s=5), "ftrun/lead",
                      signer=Signer(TOKEN.encode())),
            min_nodes=2, max_nodes=2, last_call_s=0.5, is_leader=False, poll_s=0.02,
            interrupted=lambda: False)
        _join_into(joined, "joiner", joiner, NodeSlot(-1, 1, "10.0.0.2", "h2", 1, "node-2"))
        lead.join(60)
        for name in ("leader", "joiner"):
            generation = joined[name]
            assert not isinstance(generation, Exception), (name, generation)
            assert generation.nnodes == 2 and \
                generation.node("node-2").node_rank == 1, generation  # type: ignore[union-attr]


@pytest.mark.parametrize("noticed_by", ["heartbeat", "the wait"])
def test_an_agent_whose_member_goes_silent_while_it_waits_still_joins_once_etcd_answers(
        noticed_by: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other half: an agent waits for its assignment on one held watch stream
    (``EtcdClient.wait_any``); the etcd member then freezes (SIGSTOP: silent, not reset).
    ``heartbeat``: once another request of the agent's process to it fails (as its
    heartbeat's would), the wait gives the stream up at its next slice (the wait's own
    look at the member is put off for this case). ``the wait``: no other client of the
    process talks to the member (its heartbeat failed over elsewhere before): once the
    member has been unheard for ``UNHEARD_S``, the wait reads from it, which fails. Either
    way it connects again, which fails while the member is frozen (slices without news,
    not an error), well before the stream's read bound (``HOLD_S``, 30 s); once etcd
    answers, it reads again, watches again and holds the generation the leader writes."""
    from ftrun.control import etcdheld
    from ftrun.control.rendezvous import DynamicRendezvous, NodeSlot

    if noticed_by == "heartbeat":
        monkeypatch.setattr(etcdheld, "UNHEARD_S", 600.0)

    class Counted(JsonStore):
        """Counts the wait's slices and its attempts to replace a failed connection."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            self.slices = self.reconnects = 0

        def wait_any(self, *args: Any, **kwargs: Any) -> Any:
            self.slices += 1
            return super().wait_any(*args, **kwargs)

        def _replace_client(self) -> None:
            self.reconnects += 1
            super()._replace_client()

    with loopback_etcd() as endpoint:
        options = EtcdOptions.parse(endpoint, {"etcd_prefix": "/ftrun"})
        member = member_process(endpoint)
        store = _quick_store(options, "ftrun/wait", Counted)
        beat = connect_etcd(options, 10, op_timeout_s=0.4)  # the agent's heartbeat client
        joiner = DynamicRendezvous(store, min_nodes=2, max_nodes=2, last_call_s=0.5,
                                   is_leader=False, poll_s=0.02, interrupted=lambda: False)
        joined: dict[str, object] = {}
        waiting = threading.Thread(target=_join_into, args=(
            joined, "joiner", joiner, NodeSlot(-1, 1, "10.0.0.2", "h2", 1, "node-2")))
        waiting.start()
        held = lambda: store.raw._held.held  # noqa: E731
        wait_until(lambda: held() is not None and held().stream.confirmed, 30,
                   "the joiner's held watch")
        wait_until(lambda: store.slices >= 2, 30, "a slice on the held watch")
        assert store.reconnects == 0
        suspend(member)
        try:
            if noticed_by == "heartbeat":
                stream = KeepAliveStream.for_options(options)
                with pytest.raises(RuntimeError, match="no etcd endpoint answered"):
                    beat.keep_alive(1, stream)
                stream.close()
            # heartbeat: within a slice or so (2 s); the wait: within UNHEARD_S (5 s) and a
            # slice; not at the stream's read timeout (HOLD_S, 30 s)
            wait_until(lambda: store.reconnects >= 2, 10 if noticed_by == "heartbeat" else 18,
                       "the joiner giving the stream up and connecting again")
            assert waiting.is_alive(), joined
        finally:
            member.resume()
        _lead_node_2_in(options, "ftrun/wait", waiting, joined)


def test_a_joining_agent_watches_for_its_assignment_before_it_offers_its_slot() -> None:
    """A joining agent arms its wait (``JsonStore.arm_wait``: one watch stream of its
    assignment, the record and the shutdown record, and once etcd confirmed the watches,
    one read of the three) before it offers its slot, and the wait after the offer holds
    that same stream: once the last node has offered, etcd has only the leader's writes
    and their events to serve. Before, each node read and watched after its offer, and at
    512 light agents those reads and watches queued in etcd ahead of the leader's writes
    (docs/scale.md, rendezvous on etcd-v3). The read comes after the confirmation: a watch made
    from the revision of an earlier read must first be caught up by etcd, 512 at a time
    every 100 ms, which at 4,096 agents delayed their events."""
    from ftrun.control.rendezvous import DynamicRendezvous, NodeSlot

    class Offering(JsonStore):
        """Notes, at the offer and at each wait, which held watch the client has."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            self.at_offer: Any = None
            self.offered = False
            self.waited_on: list[Any] = []

        def put_record(self, name: str, body: dict[str, Any]) -> None:
            if name.endswith("/slots"):
                self.at_offer, self.offered = self.raw._held.held, True
            super().put_record(name, body)

        def wait_any(self, *args: Any, **kwargs: Any) -> Any:
            if self.offered:
                self.waited_on.append(self.raw._held.held)
            return super().wait_any(*args, **kwargs)

    with loopback_etcd() as endpoint:
        options = EtcdOptions.parse(endpoint, {"etcd_prefix": "/ftrun"})
        store = Offering(connect_etcd(options, 10, op_timeout_s=5), "ftrun/arm",
                         signer=Signer(TOKEN.encode()))
        joiner = DynamicRendezvous(store, min_nodes=2, max_nodes=2, last_call_s=0.5,
                                   is_leader=False, poll_s=0.02, interrupted=lambda: False)
        held_waits = store.raw._held
        reads: list[bool] = []  # each read of the wait: whether etcd had confirmed its watch
        txn = held_waits._txn

        def noted_txn(*args: Any) -> Any:
            reads.append(held_waits.held is not None and held_waits.held.stream.confirmed)
            return txn(*args)
        held_waits._txn = noted_txn
        joined: dict[str, object] = {}
        waiting = threading.Thread(target=_join_into, args=(
            joined, "joiner", joiner, NodeSlot(-1, 1, "10.0.0.2", "h2", 1, "node-2")))
        waiting.start()
        wait_until(lambda: store.offered, 30, "the joiner's offer")
        armed = store.at_offer
        assert armed is not None, "the joiner offered its slot before it watched"
        assert reads == [True], reads  # one read, once the watches were confirmed
        wanted = [b"/ftrun/ftrun/arm/" + k.encode()
                  for k in ("gen/0/as/node-2", "gen/0", "shutdown")]
        assert armed.ekeys == wanted, armed.ekeys
        _lead_node_2_in(options, "ftrun/arm", waiting, joined)
        assert store.waited_on and store.waited_on[0] is armed, store.waited_on


def _ftrun(args: list[str], script: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([launcher(), *args, str(script)], capture_output=True, text=True,
                          timeout=timeout, env={"PATH": "/usr/bin:/bin",
                                                "FTRUN_JOB_TOKEN": TOKEN})


def test_etcd_bad_input_is_one_line(tmp_path: Path) -> None:
    """Unreachable endpoints: one line naming them, a non-zero exit, within the bound given
    (read_timeout) plus start-up; bad options: a one-line ConfigError (the CLI prints it
    and exits 2, as for etcd's deprecated v2 backend here); never a traceback."""
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    base = ["--nnodes", "2", "--rdzv-backend", "etcd-v3", "--rdzv-id", "bad"]
    started = time.monotonic()
    done = _ftrun([*base, "--rdzv-endpoint", "127.0.0.1:1,127.0.0.1:2",
                   "--rdzv-conf", "read_timeout=2"], script, 60)
    took = time.monotonic() - started
    assert done.returncode not in (0, 2), done
    assert "Traceback" not in done.stderr, done.stderr
    failure = [x for x in done.stderr.splitlines() if "cannot reach etcd" in x]
    assert len(failure) == 1 and "127.0.0.1:1" in failure[0] and "127.0.0.1:2" in failure[0], \
        done.stderr
    assert took < 30, took  # 2 s of tries + the interpreter and torch import on 2 cores
    for extra, says in [
        (["--rdzv-endpoint", "127.0.0.1:2379", "--rdzv-conf", "protocol=ftp"], "protocol"),
        (["--rdzv-endpoint", "127.0.0.1:2379", "--rdzv-conf", "protocol=https,cacert=/no/ca"],
         "cacert"),
        (["--rdzv-endpoint", "127.0.0.1:2379", "--rdzv-conf", "etcd_prefix=no slash"],
         "etcd_prefix"),
        (["--rdzv-endpoint", "h1:99999"], "port"),
        (["--rdzv-endpoint", ""], "--rdzv-endpoint"),
    ]:
        with pytest.raises(ConfigError, match=says) as error:
            config_from_args([*base, *extra, str(script)], {})
        assert "\n" not in str(error.value)
    done = _ftrun(["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379"],
                  script, 60)  # torchrun's v2 backend: the usage code, one line
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "etcd-v3" in lines[0], done



#: Before torch on sys.path, a package named torch that fails to import
NO_TORCH = Path(__file__).parent / "data" / "no_torch"


def _status_or_inject(*args: str, token: str = TOKEN, registry: Path | None = None
                      ) -> subprocess.CompletedProcess[str]:
    """The command, where torch cannot be imported: an etcd-v3 job's record needs no torch
    (3-4 CPU-seconds an import on this machine, for a command a person waits on)."""
    env = {"PATH": "/usr/bin:/bin", "FTRUN_JOB_TOKEN": token, "PYTHONPATH": str(NO_TORCH)}
    if registry is not None:
        env["XDG_RUNTIME_DIR"] = str(registry)
    return subprocess.run([launcher(), *args], capture_output=True, text=True, timeout=60,
                          env=env)


def _one_line(done: subprocess.CompletedProcess[str], code: int, says: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code and len(lines) == 1 and says in lines[0], done
    assert "Traceback" not in done.stderr, done.stderr


def test_status_and_inject_name_an_etcd_job_or_say_why_not(tmp_path: Path) -> None:
    """``ftrun status`` and ``ftrun inject`` name an etcd-v3 job as
    ``etcd-v3://HOST:PORT,.../RUN_ID`` or by a run id registered on this host (by every
    agent: ``<run id>@<pid>.json``). A record signed with another token is refused, an
    unknown run id or an unreachable etcd is exit 3, a malformed name or option exit 2, a
    registration whose agent died says the job ended: each one line. (A live job is read
    and steered in tests/test_etcd_standby.py.)"""
    with loopback_etcd() as endpoint:
        url = f"etcd-v3://{endpoint}/job1"
        _one_line(_status_or_inject("status", url), 3, "no ftrun job record")
        client = connect_etcd(EtcdOptions.parse(endpoint, {}), 10)
        other = JsonStore(client, "ftrun/job1", signer=Signer(b"another job's token"))
        other.set_record("job", {"run_id": "job1", "world_size": 2, "nnodes": 1,
                                 "updated": time.time()})
        _one_line(_status_or_inject("status", url), 2, "this token is not the job's")
        _one_line(_status_or_inject("inject", "--job", url, "kill", "rank=0"), 2,
                  "this token is not the job's")
        done = _status_or_inject("status", "--json", url, token="another job's token")
        assert done.returncode == 0 and json.loads(done.stdout)["world_size"] == 2, done
        # the registry: a live agent's entry names the job, a dead one's says it ended
        registry = tmp_path / "run"
        (registry / "ftrun").mkdir(parents=True)
        entry = {"etcd": endpoint, "options": {"etcd_prefix": "/ftrun"}, "pid": os.getpid()}
        (registry / "ftrun" / f"job1@{os.getpid()}.json").write_text(json.dumps(entry))
        done = _status_or_inject("status", "--json", "job1", token="another job's token",
                                 registry=registry)
        assert done.returncode == 0, done
        assert json.loads(done.stdout)["endpoint"] == f"etcd at {endpoint} (run id job1)"
        dead = subprocess.Popen(["true"])
        dead.wait()
        (registry / "ftrun" / f"job2@{dead.pid}.json").write_text(
            json.dumps({**entry, "pid": dead.pid}))
        _one_line(_status_or_inject("status", "job2", registry=registry), 2, "has ended")
    started = time.monotonic()
    _one_line(_status_or_inject("status", "--timeout", "2", "etcd-v3://127.0.0.1:1/job1"), 3,
              "cannot reach the job's store (etcd at 127.0.0.1:1 (run id job1))")
    assert time.monotonic() - started < 30
    for name, says in [("etcd-v3://127.0.0.1:2379/", "RUN_ID"),
                       ("etcd-v3://127.0.0.1:2379/a/b", "RUN_ID"),
                       ("etcd-v3://127.0.0.1:2379/job1?bogus=1", "unknown option 'bogus'"),
                       ("etcd-v3://127.0.0.1:2379/job1?protocol=ftp", "protocol"),
                       ("etcd-v3://127.0.0.1:99999/job1", "port")]:
        _one_line(_status_or_inject("status", name), 2, says)
        _one_line(_status_or_inject("inject", "--job", name, "kill", "rank=0"), 2, says)

# --- a job across three namespace hosts ----------------------------------------------------


def _etcd_job(net, cluster, job_dir: Path, steps: int) -> list[Launch]:  # type: ignore[no-untyped-def]
    script = job_dir / "train_elastic.py"
    shutil.copy(REPO / "scripts" / "train_elastic.py", script)
    args = ["--nnodes", "1:4", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3",
            "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", "etcdjob",
            "--rdzv-conf", "last_call_timeout=5", "--heartbeat-interval", "0.5",
            "--heartbeat-timeout", str(HB_TIMEOUT_S), "--recovery", "regroup",
            "--max-restarts", "2"]
    train = [str(script), "--steps", str(steps), "--hidden", "64", "--step-sleep", "0.05",
             "--checkpoint-dir", str(job_dir), "--checkpoint-every", "10"]
    env = {"GLOO_SOCKET_IFNAME": "eth0", "FTRUN_JOB_TOKEN": TOKEN}
    return [HostLaunch(host, [*args, "--local-addr", host.addr, *train], env=env, cwd=job_dir)
            for host in net]


def _etcd_range(host, port: int, start: bytes, end: bytes) -> list[tuple[bytes, bytes, int]]:  # type: ignore[no-untyped-def]
    """(key, value, lease) of every key in [start, end), read from ``host``'s etcd member
    (its v3 gateway, from the host's namespace)."""
    payload = json.dumps({"key": base64.b64encode(start).decode(),
                          "range_end": base64.b64encode(end).decode()}).encode()
    sock = host.socket()
    try:
        sock.settimeout(10)
        sock.connect((host.addr, port))
        sock.sendall(b"POST /v3/kv/range HTTP/1.0\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    finally:
        sock.close()
    reply = json.loads(data.partition(b"\r\n\r\n")[2])
    return [(base64.b64decode(kv["key"]), base64.b64decode(kv.get("value", "")),
             int(kv.get("lease", 0))) for kv in reply.get("kvs") or []]


def _liveness_keys(host, port: int) -> dict[str, tuple[object, int]]:  # type: ignore[no-untyped-def]
    """The job's liveness keys, read from ``host``'s etcd member: key (as the job's store
    names it) -> (its record, its lease)."""
    root, span = b"/ftrun/", b"/ftrun/ftrun/etcdjob/hb/"
    return {key[len(root):].decode(): (json.loads(value), lease)
            for key, value, lease in _etcd_range(host, port, span, span[:-1] + b"0")}


def _steps_by_pid(node: Launch) -> dict[int, list[ElasticStep]]:
    by_pid: dict[int, list[ElasticStep]] = {}
    for step in find(node.lines, ElasticStep):
        by_pid.setdefault(step.pid, []).append(step)
    return by_pid


def _resynced(node: Launch) -> set[int]:
    """Worker pids that took another member's state at a step resync (ftrun/worker/api.py
    says so: the decision of their last step died with the writer's store)."""
    return {int(m[1]) for x in node.lines
            if (m := re.search(r"ftrun: member \S+ \(pid (\d+)\) took the state", x))}


def _check_in_place(survivors: list[Launch], before: dict[int, int], world: int) -> None:
    """tests/lines.py's invariants for survivors that regrouped in process (same pids, one
    checksum per member epoch, each epoch starting after the last committed step, no
    restart). A survivor that took the state at a step resync skipped that one step's
    computation (it received its result): it is held to every invariant but that one, and
    its steps may skip exactly one number, once, at the fault."""
    resynced = set().union(*(_resynced(n) for n in survivors))
    _check_regroup_across_nodes(
        survivors, {p: s for p, s in before.items() if p not in resynced}, world)
    for node in survivors:
        for pid, mine in _steps_by_pid(node).items():
            if pid in resynced:
                gaps = [b.step - a.step for a, b in itertools.pairwise(mine)]
                assert sorted(set(gaps)) in ([1], [1, 2]) and gaps.count(2) <= 1, gaps


def test_netns_etcd_member_killed_then_writer_node_killed_then_writer_cut_off(
        job_dir: Path, etcd_net) -> None:  # type: ignore[no-untyped-def]
    """Four ftrun nodes on a 3-member etcd cluster (one member on each of h1..h3),
    in-process regroup, one run, four faults. First, every agent but the writer beats
    through a lease: its liveness key in etcd is bound to the lease that its record (signed
    with the job's token) names, with the heartbeat timeout as its TTL. Then:

    0. a node whose agent is not the writer is SIGKILLed (agent and worker): the writer
       declares it lost through its presence connection (ftrun/control/presence.py, served
       by the writer on etcd too), well inside the heartbeat timeout, and the other three
       regroup at a world of three;
    1. the etcd member every agent talks to first (h1's, the first endpoint) is SIGKILLed:
       the agents move to the next member; for longer than the heartbeat timeout and 15
       more steps no node is declared lost, no generation ends, nothing restarts, and each
       worker commits consecutive steps in the same process (the member is then started
       again: the cluster needs it for the third fault);
    2. the node of the agent elected as the job's writer (it forms the generations and
       hosts the store of their member epochs) is SIGKILLed, agent and workers: its
       presence connections end and its port refuses, so a survivor revokes its lease
       (not waited out), exactly one survivor takes the writer's key and serves a new
       member-epoch store, and the survivors' workers reconnect to it and regroup in place: the same
       pids, no step lost or repeated, one checksum per member epoch, a world of two, no
       restart (tests/lines.py's invariants);
    3. the link of that new writer's host is cut (no reset, its etcd member cut off too):
       it cannot renew its lease, says so and exits 3 within the bound (no second writer
       runs beside the next); nothing refuses a connect, so the last node takes over once
       the lease expired, and its worker goes on in place alone; it finishes the training
       and exits 0, and every survivor of 2. agrees on the parameters at the moment of the
       cut.
    """
    net, cluster = etcd_net
    # enough for the three faults with room: the 6 s wait after the first is up to 120
    # steps at 0.05 s each (a CI run's job finished its 120 before the third fault)
    steps = 300
    nodes = _etcd_job(net, cluster, job_dir, steps)
    try:
        for node in nodes:
            node.wait_for(lambda lines: len(find(lines, ElasticStep)) >= 10, 180,
                          "steps everywhere")
        (first,) = [n for n in nodes if any("job's writer (elected" in x for x in n.lines)]
        # every other agent's heartbeat is a lease: its liveness key is bound to the lease
        # its record (verified with the job's token) names, of the heartbeat timeout
        # read from a member's host (the writer may be the fourth host, which has no member)
        keys = _liveness_keys(cluster.hosts[0], cluster.client_port)
        signer = Signer(TOKEN.encode())
        assert len(keys) == 3, keys
        for key, (record, lease) in keys.items():
            body = signer.unwrap(key, record)
            assert lease != 0 and body == {"lease": lease, "ttl": int(HB_TIMEOUT_S)}, keys
        victim = [n for n in nodes if n is not first][-1]
        victim.kill()
        killed = time.monotonic()
        first.wait_for(lambda lines: any("lost" in x and "connection closed" in x
                                         for x in lines), 60, "the writer's verdict")
        detected = time.monotonic() - killed
        print(f"a non-writer node SIGKILLed to the writer's verdict: {detected:.2f}s")
        assert detected < 10, detected  # ~0.2 s by its connection; the heartbeat's: >= 5 s
        nodes = [n for n in nodes if n is not victim]
        for node in nodes:
            node.wait_for(lambda lines: any(s.world == 3 for s in find(lines, ElasticStep)),
                          120, "the three others regrouped")
        first.wait_for(lambda lines: any("survivors regrouped in" in x for x in lines), 60,
                       "the writer's account of the regroup")
        regrouped = [len(n.lines) for n in nodes]  # fault 1 is judged on the lines after
        before = [len(find(node.lines, ElasticStep)) for node in nodes]
        cluster.kill(0)
        killed = time.monotonic()
        for node, count in zip(nodes, before, strict=True):
            node.wait_for(lambda lines, count=count: len(find(lines, ElasticStep)) >= count + 15,
                          120, "15 steps after the etcd member died")
        while time.monotonic() - killed < HB_TIMEOUT_S + 1.0:  # a lost node is seen by now
            time.sleep(0.2)
        for node, mark in zip(nodes, regrouped, strict=True):
            assert len(_steps_by_pid(node)) == 1  # one worker process throughout
            mine = find(node.lines[mark:], ElasticStep)
            numbers = [s.step for s in mine]
            assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
            assert len({s.epoch for s in mine}) == 1 and mine[-1].world == 3, mine[-1]
            own = "\n".join(x for x in node.lines[mark:] if "step=" not in x)
            for sign in ("lost", "ended", "restarting", "failed", "Traceback"):
                assert sign not in own, own[-3000:]
        cluster.restart(0)

        (writer,) = [n for n in nodes if any("job's writer (elected" in x for x in n.lines)]
        survivors = [n for n in nodes if n is not writer]
        marks = [len(n.lines) for n in survivors]
        reached_at: dict[int, int] = {}
        for node, mark in zip(survivors, marks, strict=True):
            reached_at.update(reached(parse(node.lines[:mark])))
        writer.kill()
        killed = time.monotonic()
        for node, mark in zip(survivors, marks, strict=True):
            node.wait_for(lambda lines, mark=mark: any(
                s.world == 2 for s in find(lines[mark:], ElasticStep)),
                120, "the survivors regrouped with two nodes")
        print(f"writer's node SIGKILLed to the survivors stepping at world 2: "
              f"{time.monotonic() - killed:.2f}s")
        (second,) = [n for n in survivors if "took over" in n.output]
        (last,) = [n for n in survivors if n is not second]
        _check_in_place(survivors, reached_at, world=2)
        # the new writer's record of the lost writer: detected when its lease expired, a
        # TTL (the heartbeat timeout) after its last renewal, not "in 0.00 s"
        since = marks[survivors.index(second)]
        second.wait_for(lambda lines: any("detected in" in x for x in lines[since:]), 60,
                        "the new writer's fault record")
        record = next(x for x in second.lines[since:] if "detected in" in x)
        print(f"the new writer's record: {record}")
        detected = float(re.findall(r"detected in ([\d.]+) s", record)[0])
        # its agent died, so its presence port refused a survivor's connect: its lease was
        # revoked, not waited out (HB_TIMEOUT_S); detected from when that was seen
        assert any("its agent died: its lease was revoked" in x
                   for x in second.lines[since:]), second.output[-3000:]
        assert detected < HB_TIMEOUT_S, record
        # the resync lost no step (its decisions died with the old store: not "1 steps lost")
        assert "steps lost" not in record, record

        mark = len(last.lines)
        reached_at = reached(parse(last.lines[:mark]))
        second.host.cut_link()
        cut = time.monotonic()
        last.wait_for(lambda lines: any(s.world == 1 for s in find(lines[mark:], ElasticStep)),
                      120, "the last node going on alone")
        print(f"new writer's link cut to the last node stepping alone: "
              f"{time.monotonic() - cut:.2f}s")
        # cut off, it renews neither its heartbeat nor its lease (5 s): it stops its workers
        # and exits 3 (measured 10 s from the cut; once in seven runs about 60 s, cause not
        # found: the bound is the loose 10x of the standard, a hang still fails)
        assert second.wait(110) == 3, second.output[-3000:]
        stopped = time.monotonic() - cut
        assert stopped < 100, (stopped, second.output[-5000:])
        assert "lost the rendezvous store" in second.output, second.output[-3000:]
        assert sum("took over" in x for x in last.lines[mark:]) == 1, last.output[-3000:]
        # a writer cut off refuses nothing (a connect to it times out): its lease ran out
        assert any("(its lease expired): this agent took over" in x
                   for x in last.lines[mark:]), last.output[-3000:]
        assert last.wait(120) == 0, last.output[-3000:]
        _check_in_place([last], reached_at, world=1)
        (done,) = find(last.lines[mark:], Done)
        assert done.steps == steps and done.rank == 0, done
    finally:
        for node in nodes:
            node.kill()


def test_netns_etcd_writer_killed_while_the_others_wait_for_a_generation(
        job_dir: Path, etcd_net) -> None:  # type: ignore[no-untyped-def]
    """The writer dies during a rendezvous. h1's agent is elected the job's writer and
    stopped (SIGSTOP); h2 and h3 start, and h1's agent is SIGKILLed before it formed
    anything (``--nnodes 2:4``). One of the others takes the writer's key (at its start if
    the stopped writer's lease had already expired, else while it waits) and forms
    generation 0 with no slot of the dead writer's (a writer offers none: one it had
    offered outlived it, and the generation formed with the dead node failed on its
    heartbeat); its last call is 3 s. The other joins as node 1 of 2, and both train to
    the end and exit 0 with the same parameters; nothing restarts."""
    net, cluster = etcd_net
    script = job_dir / "train_elastic.py"
    shutil.copy(REPO / "scripts" / "train_elastic.py", script)
    run_id, steps = "waitjob", 30
    args = ["--nnodes", "2:4", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3",
            "--rdzv-endpoint", cluster.endpoints, "--rdzv-id", run_id,
            "--rdzv-conf", "last_call_timeout=3", "--heartbeat-interval", "0.5",
            "--heartbeat-timeout", str(HB_TIMEOUT_S), "--recovery", "regroup"]
    train = [str(script), "--steps", str(steps), "--hidden", "32", "--step-sleep", "0.05"]
    env = {"GLOO_SOCKET_IFNAME": "eth0", "FTRUN_JOB_TOKEN": TOKEN}

    def launch(name: str) -> HostLaunch:
        host = net[name]
        return HostLaunch(host, [*args, "--local-addr", host.addr, *train], env=env,
                          cwd=job_dir)

    nodes: list[HostLaunch] = []
    try:
        nodes.append(launch("h1"))
        writer = nodes[0]
        writer.wait_for(lambda lines: any("job's writer (elected" in x for x in lines), 120,
                        "h1's agent elected the writer")
        os.kill(writer.proc.pid, signal.SIGSTOP)  # the agent itself: ip netns exec execs it
        nodes += [launch("h2"), launch("h3")]
        waiting = nodes[1:]
        writer.kill()
        killed = time.monotonic()
        for node in waiting:
            node.wait_for(lambda lines: any(re.search(r"joined generation 0 as node \d of 2",
                                                      x) for x in lines), 120,
                          "generation 0 of the two waiting nodes")
        print(f"writer SIGKILLed during the join to both others in generation 0: "
              f"{time.monotonic() - killed:.2f} s (the new writer's last call is 3 s)")
        took = [n for n in waiting if any("took over" in x or "job's writer (elected" in x
                                          for x in n.lines)]
        assert len(took) == 1, [n.output[-2000:] for n in waiting]
        codes = [node.wait(180) for node in waiting]
        # every node's output: the failing node's own says why (CI showed only the other's,
        # "rank 0 on vm (killed by SIGABRT)": a worker aborted by gRPC's poller between its
        # fork and exec, 2 runs in about 70 until the agent turned grpcio's fork support off)
        assert codes == [0, 0], "\n=====\n".join(n.output[-4000:] for n in waiting)
        done = [d for n in waiting for d in find(n.lines, Done)]
        assert sorted(d.rank for d in done) == [0, 1], done
        assert len({d.param_sum for d in done}) == 1 and done[0].steps == steps, done
        out = "\n".join(n.output for n in waiting)
        assert "restarting" not in out and "Traceback" not in out, out[-3000:]
    finally:
        for node in nodes:
            node.kill()

#: An agent's heartbeat thread (the real HeartbeatSender) in a process of its own, which
#: the test stops and continues: it prints its lease, its expired count, its last error and
#: when its last beat was answered (time.monotonic(): the same clock as the test's).
_BEATER = """
import sys, time
from ftrun.control.auth import Signer
from ftrun.control.etcd import EtcdOptions, connect_etcd
from ftrun.control.heartbeat import HeartbeatSender
from ftrun.control.store import JsonStore
options = EtcdOptions.parse(sys.argv[1], {"etcd_prefix": "/ftrun"})
connect = lambda: connect_etcd(options, 5, op_timeout_s=2)
store = JsonStore(connect(), "ftrun/job", signer=Signer(sys.argv[2].encode()))
sender = HeartbeatSender(connect, store, "a", 0.2, 2.0)
sender.start()
while True:
    print(sender.lease.lease, sender.lease.expired, sender.last_error or "-",
          sender.last_ok, flush=True)
    time.sleep(0.1)
"""


def test_etcd_heartbeats_are_leases_a_foreign_delete_is_not_a_loss_and_a_pause_regrants(
        job_dir: Path) -> None:
    """etcd-v3 heartbeats are leases (ftrun/control/election.py LeaseBeat, LeaseView), on a
    real etcd, judged on the store channel alone (no presence pings):

    * each sender grants a lease and puts its signed key bound to it, then only keeps the
      lease alive; the writer's monitor hears every node through its watch;
    * a node whose process is stopped (SIGSTOP) is lost once its lease expires: not before
      its TTL (the verdict is the lease's), well within 10x of it;
    * a foreign client that deletes a liveness key, or overwrites it unsigned, makes no
      lost node (the lease still lives: its TTL is read, the state is "kept");
    * continued after longer than its TTL, the stopped sender finds its lease expired at
      its next beat: it grants a new one and puts its key again (no error), and is heard
      again."""
    from ftrun.control.heartbeat import HeartbeatMonitor, HeartbeatSender, heartbeat_key

    with loopback_etcd() as endpoint:
        options = EtcdOptions.parse(endpoint, {"etcd_prefix": "/ftrun"})
        connect = lambda: connect_etcd(options, 5, op_timeout_s=2)  # noqa: E731
        store = JsonStore(connect(), "ftrun/job", signer=Signer(TOKEN.encode()),
                          reconnect=connect, retry_s=2)
        timeout = 2.0  # a TTL of 2 s, etcd's least
        monitor = HeartbeatMonitor(store, timeout, None, 0.2)
        assert monitor.leases is not None
        senders = {n: HeartbeatSender(connect, store, n, 0.2, timeout) for n in ("b", "c")}
        assert all(s.lease is not None for s in senders.values())
        for sender in senders.values():
            sender.start()
        script = job_dir / "beater.py"
        script.write_text(_BEATER)
        child = subprocess.Popen([sys.executable, str(script), endpoint, TOKEN],
                                 stdout=subprocess.PIPE, text=True, cwd=job_dir,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
        said: list[list[str]] = []
        reader = threading.Thread(target=lambda: said.extend(
            line.split() for line in child.stdout), daemon=True)  # type: ignore[union-attr]
        reader.start()
        try:
            monitor.watch(["a", "b", "c"])
            deadline = time.monotonic() + 60  # the child imports torch (store.py)
            # and until the child has printed its lease: a line printed before its first
            # beat (or in a beat, between dropping a lease and granting the next) says None
            while {monitor.leases.state(n) for n in "abc"} != {"live"} \
                    or not said or said[-1][0] == "None":
                assert time.monotonic() < deadline, \
                    ([monitor.leases.state(n) for n in "abc"], said[-1:])
                assert child.poll() is None, said
                time.sleep(0.05)
            assert monitor.scan() == []
            rogue = connect()  # no secret: deletes one key, overwrites another
            assert rogue.delete_key(store.key(heartbeat_key("b")))
            rogue.set(store.key(heartbeat_key("c")), '{"forged": true}')
            os.kill(child.pid, signal.SIGSTOP)
            silenced = time.monotonic()
            first, renewed = said[-1][0], float(said[-1][3])  # its last renewal, or later
            lost_at = None
            while time.monotonic() - silenced < 20:
                lost = monitor.scan()
                assert "b" not in lost and "c" not in lost, (lost, monitor.leases.state("b"))
                if "a" in lost:  # b and c, deleted before, were judged for a TTL by now
                    lost_at = time.monotonic() - silenced
                    break
                time.sleep(0.1)
            print(f"a stopped lease-holder lost {lost_at} s after the stop (TTL 2 s)")
            # never before its lease expired: a TTL after its last renewal (which etcd made
            # before the answer the child printed, a few ms at most)
            assert lost_at is not None and lost_at < 10 * timeout, lost_at
            assert silenced + lost_at - renewed >= 2.0 - 0.1, (lost_at, silenced - renewed)
            assert monitor.leases.state("b") == "kept" and monitor.leases.state("c") == "kept"
            assert monitor.leases.state("a") == "expired"
            os.kill(child.pid, signal.SIGCONT)
            deadline = time.monotonic() + 20
            while said[-1][0] in (first, "None") or said[-1][1] != "1" \
                    or monitor.leases.state("a") != "live" or "a" in monitor.scan():
                # a new lease, granted after the one that expired
                assert time.monotonic() < deadline, (said[-3:], monitor.leases.state("a"))
                time.sleep(0.05)
            assert said[-1][2] == "-", said[-3:]
            assert all(s.last_error == "" and s.failing_since is None
                       for s in senders.values()), \
                {n: (s.last_error, s.failing_since) for n, s in senders.items()}
        finally:
            child.kill()
            child.wait(10)
            for sender in senders.values():
                sender.stop(2.0)
            stuck = monitor.close()  # its lease view's thread is joined (a slice, a request)
        assert stuck == "" and not monitor.leases._thread.is_alive(), stuck
        assert monitor.leases._thread.name == "ftrun-lease-view"


def test_lease_view_on_loopback_etcd() -> None:
    """The writer's lease view (ftrun/control/election.py LeaseView) and the lease reads
    under it, on one loopback etcd with no job:

    * a lease in its last second reads as alive (etcd truncates the TTL left to whole
      seconds and its gateway omits a 0), a revoked or unknown one as gone (-1);
    * while ``hb/`` is quiet (keepalives make no revision) and the store moves on, the
      view's watch start revision still advances (no ever longer history scan per slice);
    * a member that stops answering (a frozen relay to it, first of the endpoints) does
      not stop the view from hearing a live node: its watch fails over to the next one;
    * a revoked lease's node is expired, and forgotten once no longer watched (prune);
    * a view stuck in requests to frozen members (three, each up to its 1 s timeout)
      never reports a node heard later than its last confirmation by etcd plus a slice and
      one request (silence is not hidden while the thread is blocked);
    * stop() ends a watch's wait at once (a 30 s slice), not after it."""
    from ftrun.control.election import LeaseBeat, LeaseView

    with loopback_etcd() as endpoint:
        options = EtcdOptions.parse(endpoint, {"etcd_prefix": "/ftrun"})
        client = connect_etcd(options, 10, op_timeout_s=10)  # a loaded host
        before = time.monotonic()  # the lease ends a TTL (2 s) after its grant, or later
        lease, ttl = client.grant_ttl(2)
        assert ttl == 2
        left: list[tuple[float, int]] = []
        while time.monotonic() - before < 1.9:
            value = client.time_to_live(lease)
            left.append((time.monotonic() - before, value))
            time.sleep(0.05)
        read_alive = [v for t, v in left if t < 2.0]
        assert read_alive and all(v >= 0 for v in read_alive), left
        assert any(v == 0 for t, v in left), left  # its last second was read
        client.revoke(lease)
        assert client.time_to_live(lease) == -1
        assert client.time_to_live(12345) == -1

        store = JsonStore(client, "ftrun/job", signer=Signer(TOKEN.encode()))
        # A live node, its lease longer than the test's phases' deadlines together (a 30 s
        # one expired before the prune in a clean-clone run with 3 test workers).
        LeaseBeat(300.0)(store, "hb/a")
        relay = FreezableRelay(int(endpoint.rsplit(":", 1)[1]))
        slice_s = 0.25

        def view(endpoints: str, slice_s: float = slice_s, op_s: float = 1.0) -> LeaseView:
            opts = EtcdOptions.parse(endpoints, {"etcd_prefix": "/ftrun"})
            found = LeaseView(lambda: EtcdClient(opts, op_s), store, "hb/", slice_s)
            found.max_lag = 50
            return found.start()

        direct, failover, stuck = view(endpoint), view(f"{relay.endpoint},{endpoint}"), \
            view(",".join([relay.endpoint] * 3))
        idle = view(endpoint, 30.0, 60.0)  # its watch waits 30 s unless stop() ends it
        views = (direct, failover, stuck, idle)
        try:
            # each phase's own deadline: loose (a functional wait, not a latency bound; a
            # single 20 s one for all of them failed at load average 8-11)
            deadline = time.monotonic() + 30
            while not all(v.state("a") == "live" and v.revision for v in views):
                assert time.monotonic() < deadline, [(v.state("a"), v.revision) for v in views]
                time.sleep(0.05)
            start = direct.revision
            for i in range(100):  # unrelated writes: the store's revision moves, hb/ not
                client.set(f"ftrun/job/other/{i}", "x")
            moved_to = client._range("ftrun/job/other/0")[1]
            # The start revision is read again once the store is max_lag (50) ahead: the lag
            # stays bounded. Not "past the last write": a read made during the writes (seen
            # at 91 of 102 with 3 test workers) is within the bound, and stays.
            deadline = time.monotonic() + 30
            while moved_to - direct.revision >= direct.max_lag:
                assert time.monotonic() < deadline, (start, direct.revision, moved_to)
                time.sleep(0.05)
            assert direct.revision > start
            print(f"watch start revision {start} -> {direct.revision} (store at {moved_to})")
            gone = LeaseBeat(30.0)
            gone(store, "hb/z")
            deadline = time.monotonic() + 30
            while direct.state("z") != "live":
                assert time.monotonic() < deadline, direct.state("z")
                time.sleep(0.05)
            client.revoke(gone.lease)  # its key goes with it: the view reads the lease, gone
            deadline = time.monotonic() + 30
            while direct.state("z") != "expired":
                assert time.monotonic() < deadline, direct.state("z")
                time.sleep(0.05)
            direct.prune(["a"])  # the monitor no longer watches z: forgotten, a kept
            assert direct.state("z") is None and direct.state("a") == "live"

            relay.freeze()
            frozen = time.monotonic()
            latest = 0.0  # the stuck view: how far past its last confirmation it said
            while time.monotonic() - frozen < 2.5:
                with stuck._lock:
                    synced = stuck.synced_at
                heard = stuck.heard(["a"])["a"]
                assert synced is not None
                latest = max(latest, heard - synced)
                assert heard <= synced + slice_s + stuck.request_s + 0.05, \
                    (heard - synced, time.monotonic() - frozen)
                time.sleep(0.05)
            assert stuck.synced_at is not None and stuck.synced_at < frozen + 0.1
            assert failover.synced_at is not None and failover.synced_at > frozen + 1.0, \
                (failover.synced_at - frozen, failover.requests)
            assert time.monotonic() - failover.heard(["a"])["a"] < 1.5
            print(f"failover view synced {failover.synced_at - frozen:.2f} s after the "
                  f"freeze; stuck view heard at most {latest:.2f} s past its last sync")
            asked = time.monotonic()
            assert idle.state("a") == "live" and idle.stop(), "stop() waited out the watch"
            print(f"stop() of a view in a 30 s watch took {time.monotonic() - asked:.3f} s")
            assert time.monotonic() - asked < 5.0, time.monotonic() - asked
        finally:
            for v in views:
                v.stop(0.0)
            relay.close()
            for v in views:
                assert v.stop(), "a lease view's thread outlived its stop"


def test_an_etcd_agent_at_its_end_stops_its_lease_view() -> None:
    """An agent's end (``etcdwriter.stop_watches``, Agent.run's last step) stops its heartbeat
    monitor's lease view: on a member that answers, its thread is gone when the call
    returns and nothing is said; with the store lost and the thread stuck in a request to
    a frozen member, the call does not wait for it (a daemon, it ends with the process or
    its request's bound) and says so once, naming the node."""
    from ftrun.agent.etcdwriter import stop_watches
    from ftrun.control.heartbeat import HeartbeatMonitor

    said: list[str] = []

    def agent(monitor: HeartbeatMonitor, store_lost: str | None) -> Any:
        """What stop_watches reads of an agent: the parts an etcd-v3 agent has at its end."""
        return SimpleNamespace(_writer_watch=None, nodes=SimpleNamespace(monitor=monitor),
                               store_lost=store_lost, node_id="node-7",
                               say=lambda text, **_: said.append(text))

    with loopback_etcd() as endpoint:
        relay = FreezableRelay(int(endpoint.rsplit(":", 1)[1]))
        try:
            for where in (endpoint, relay.endpoint):
                options = EtcdOptions.parse(where, {"etcd_prefix": "/ftrun"})
                connect = lambda o=options: connect_etcd(o, 5, op_timeout_s=2)  # noqa: E731
                store = JsonStore(connect(), "ftrun/end", signer=Signer(TOKEN.encode()),
                                  reconnect=connect, retry_s=2)
                monitor = HeartbeatMonitor(store, 2.0, None, 0.2)
                view = monitor.leases
                assert view is not None and view._thread.is_alive()
                wait_until(lambda v=view: v.synced_at is not None, 30, "the view's first read")
                if where == endpoint:
                    stop_watches(agent(monitor, None))
                    assert not view._thread.is_alive() and said == [], said
                    continue
                relay.freeze()
                # stuck: no look for longer than a slice (in a request that gets no answer)
                wait_until(lambda v=view: time.monotonic() - (v.looked_at or 0.0)
                           > v.slice_s + 0.3, 30, "the view stuck in a request")
                started = time.monotonic()
                stop_watches(agent(monitor, "the store was lost"))
                assert time.monotonic() - started < 0.5
                assert view._thread.is_alive()
                assert len(said) == 1 and "node node-7" in said[0] \
                    and "still in a request" in said[0], said
                wait_until(lambda v=view: not v._thread.is_alive(), 30,
                           "the stuck thread ending by itself")
        finally:
            relay.close()


def test_a_writer_watch_revokes_only_the_dead_writers_lease() -> None:
    """A survivor told that a node's agent died (``WriterWatch.nudge``: its presence port
    refused) revokes the writer key's lease only while the key names that node: a nudge
    naming another node changes nothing; one naming the holder frees the key at once (not
    after the 3 s TTL), the survivor wins it, its election dated from the nudge, and the
    revoked writer's own renewal finds its lease gone (it stops writing)."""
    from ftrun.control.election import Election, WriterWatch

    with loopback_etcd() as endpoint:
        options = EtcdOptions.parse(endpoint, {"etcd_prefix": "/ftrun"})

        def connect() -> EtcdClient:
            return connect_etcd(options, 10, op_timeout_s=10)
        key = "ftrun/ww/writer"
        writer = Election(connect, key, "writer-node", ttl_s=3)
        assert writer.campaign() and writer.lease is not None
        won: list[Election] = []
        watch = WriterWatch(connect, key, "survivor", ttl_s=3, interval_s=60,
                            on_won=won.append).start()  # it looks only when nudged
        try:
            watch.nudge("another-node")
            wait_until(lambda: watch.looks >= 1, 10, "the watch's look after a nudge")
            assert watch.revoked == 0 and not won
            assert connect().time_to_live(writer.lease) > 0
            nudged = time.time()
            watch.nudge("writer-node")
            wait_until(lambda: won, 10, "the survivor's election")
            took = time.time() - nudged
            print(f"nudge to the survivor holding the key: {took:.2f}s")
            assert took < 3, took  # a revoke, not the TTL
            assert watch.revoked == 1 and won[0].gone_at is not None
            assert abs(won[0].gone_at - nudged) < 1.0
            assert connect().time_to_live(writer.lease) == -1
            assert connect()._range(key)[0] == b"survivor"
            wait_until(lambda: writer.lost_at is not None, 10, "the revoked writer's stop")
        finally:
            watch.stop()
            for election in (writer, *won):
                election.resign(0.5)
