"""Fault injection end to end: ``ftrun --inject SPEC`` and ``ftrun inject`` on real jobs.

* A schedule (a kill, later a freeze) and ``ftrun inject`` (a raise, then a hang once the
  replacement joined) cover every worker fault kind; each gets one
  fault record whose fields match what was injected and what the agent saw: the rank and
  pid of the ``inject`` event, the cause (SIGKILL, frozen, the script's exit, a stall),
  the fault counted from the injection, detection within its detector's bound (a hang
  within the stall limit), and training progressing again; the scheduled job finishes.
* ``ftrun inject`` on a running job that signs its records: an unknown kind, a rank that
  does not exist, no token, a wrong token are one line and exit 2 with the job untouched
  (no inject event, no failure); with the token each fault lands and gets its record;
  ``ftrun status`` then shows the live job (world, members, the same faults) and refuses
  a reader without the token.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ftrun import cli
from ftrun.client.faultspec import parse_item, parse_schedule
from ftrun.client.jobref import registry_dir
from ftrun.control.auth import Signer
from ftrun.control.store import JsonStore
from tests.launch import PRELOAD, REPO, Launch, launcher, wait_until
from tests.lines import ElasticStep, find

ELASTIC = REPO / "scripts" / "train_elastic.py"
# Detection bounds (s), about 10 x what was measured here unloaded: a kill is seen on the
# pidfd (0.05 s), a SIGSTOP within a monitor interval (0.09 s), a raise once the process
# exits (0.3 s: the traceback, then gloo's teardown). A raise is the process's own work, so
# load stretches it most: 6.0 s in one clean-clone CI run at load 6 (2026-12-02); 12 s is
# twice that. The record's cause ("exit code 1", not "stalled") tells it from a hang.
KILL_DETECT_S = 1.0
FREEZE_DETECT_S = 1.5
RAISE_DETECT_S = 12.0
# A hang: the hang watch's timeout (auto: 2 s) with the stacks, or a stall: max(--stall-floor
# 6 s, 20 x the median step) of no progress while the others wait, then the leader's verdict.
HANG_DETECT_S = 20.0


FROZEN_STORE_HOST = """
import sys
from ftrun.control.tcpstore import serve_store
store = serve_store(0, 60.0)
print(store.port, flush=True)
sys.stdin.read()
"""


def test_status_of_a_frozen_store_host_is_one_line_and_exit_3() -> None:
    """A SIGSTOPped store host: the kernel still accepts the connection, torch's client then
    waits for an answer that never comes, and ``ftrun status`` gives up on that thread at
    its --timeout. It must still end as documented (3, one line) when that thread comes
    back as the command exits: left to interpreter teardown, it aborted the process (-6,
    "terminate called without an active exception")."""
    host = subprocess.Popen([sys.executable, "-c", FROZEN_STORE_HOST], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        os.kill(host.pid, signal.SIGSTOP)
        wait_until(lambda: all(  # a stop is asynchronous: every thread shows state T
            (task / "stat").read_text().rpartition(")")[2].split()[0] == "T"
            for task in Path(f"/proc/{host.pid}/task").iterdir()), 10, "the stopped host")
        status = subprocess.Popen([launcher(), "status", "--timeout", "1", f"127.0.0.1:{port}"],
                                  env={**os.environ, "FTRUN_JOB_TOKEN": "status-test-secret"},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert status.stderr is not None
        said = status.stderr.readline()
        # The host dies as the command gives up: the abandoned thread's read returns at
        # once, while the command exits (what a store host that ends its job does).
        host.kill()
        said += status.stderr.read()
        assert status.wait(60) == 3, said
        assert said.count("\n") == 1, said
        assert f"cannot reach the store at 127.0.0.1:{port}" in said, said
    finally:
        host.kill()
        host.wait(10)



def test_status_that_gave_up_on_a_hung_connect_leaves_without_interpreter_teardown(
        tmp_path: Path) -> None:
    """The same frozen store host, left frozen: the connect ``ftrun status`` gave up on
    still runs inside torch as the command ends. It ends as documented (3, one line) and
    at once (``exit_at_once``), without the interpreter's teardown, which that thread can
    abort (-6) whenever it comes back during it: an exit handler of the process's own
    (a ``sitecustomize`` on its ``PYTHONPATH``) never runs."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import atexit\nprint('SITE RAN', flush=True)\n"
        "atexit.register(lambda: print('TEARDOWN RAN', flush=True))\n")
    host = subprocess.Popen([sys.executable, "-c", FROZEN_STORE_HOST], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        os.kill(host.pid, signal.SIGSTOP)
        wait_until(lambda: all(  # a stop is asynchronous: every thread shows state T
            (task / "stat").read_text().rpartition(")")[2].split()[0] == "T"
            for task in Path(f"/proc/{host.pid}/task").iterdir()), 10, "the stopped host")
        path = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
        done = subprocess.run([launcher(), "status", "--timeout", "1", f"127.0.0.1:{port}"],
                              env={**os.environ, "FTRUN_JOB_TOKEN": "status-test-secret",
                                   "PYTHONPATH": path},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 3, done
        assert done.stderr.count("\n") == 1, done.stderr
        assert f"cannot reach the store at 127.0.0.1:{port}" in done.stderr, done.stderr
        assert "SITE RAN" in done.stdout and "TEARDOWN RAN" not in done.stdout, done.stdout
    finally:
        host.kill()
        host.wait(10)


def _registration(run_id: str) -> Path:
    return registry_dir() / f"{run_id}.json"


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_worker_fault_kind_by_schedule_gets_its_record(job_dir: Path) -> None:
    events = job_dir / "events.jsonl"
    script = job_dir / "train_elastic.py"
    shutil.copy(ELASTIC, script)
    # Far apart: a fault that lands while a replacement is being admitted can fail the
    # survivors (seen here under load; a regroup bug of its own, not injection's).
    spec = "kill rank=1 step=10; freeze rank=2 step=150"
    # Forked (tests.launch.PRELOAD): a replacement is often admitted before a leader tick
    # sees the world-2 epoch form; the record must still carry that epoch (world 2).
    run = Launch(["--nproc-per-node", "3", "--recovery", "regroup", "--events-file",
                  str(events), "--inject", spec, *PRELOAD, str(script), "--steps", "220",
                  "--hidden",
                  "64", "--step-sleep", "0.05"], cwd=job_dir)
    assert run.wait(400) == 0, run.output
    evs = _events(events)
    injected = [e for e in evs if e["event"] == "inject"]
    assert [(e["kind"], e["rank"]) for e in injected] == [("kill", 1), ("freeze", 2)], \
        injected
    records = [e for e in evs if e["event"] == "fault"]
    assert len(records) == 2, (records, run.output)
    causes = ("killed by SIGKILL", "frozen (stopped by a signal)")
    for inj, record, cause, bound, item in zip(injected, records, causes,
                                               (KILL_DETECT_S, FREEZE_DETECT_S),
                                               spec.split("; "), strict=True):
        _check_record(record, inj, cause, bound)
        assert record["injected"] == item
    # The scheduled step: the fault fired once the job had committed it (progress marks),
    # and the record's step (where the survivors resumed) is at or past it.
    for record, step in zip(records, (10, 150), strict=True):
        assert record["step"] >= step and record["world"] == 2, record
    assert find(run.lines, ElasticStep)[-1].step == 220


def _check_record(record: dict, inj: dict, cause: str | tuple[str, ...], bound: float) -> None:
    """A fault record against its inject event: who, what, from when, how fast."""
    assert (record["rank"], record["pid"]) == (inj["rank"], inj["pid"]), record
    assert record["cause"].startswith(cause), record
    assert record["happened"] == inj["ts"]  # counted from the injection
    assert 0 <= record["detection_s"] < bound, record
    assert record["path"] == "regroup", record
    assert record["recovered"] > record["detected"] and record["steps_lost"] == 0


def test_ftrun_inject_checks_everything_before_touching_the_job(
        job_dir: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    events = job_dir / "events.jsonl"
    script = job_dir / "train_elastic.py"
    shutil.copy(ELASTIC, script)
    token = {"FTRUN_JOB_TOKEN": "inject-test-secret"}
    # A raising rank may take seconds to exit on a loaded machine (its traceback, then
    # gloo's teardown): the stall floor and the liveness timeout leave it that time, so
    # that its record says its exit, not a stall or a lost heartbeat (both seen at a load
    # average of 10-130 with --stall-floor 2 and the 5 s liveness default).
    # --preload: the workers and their replacements fork from a server that imported torch
    # and torch._dynamo (the optimizer's constructor imports it) once: this test is about
    # injection, not cold starts (~3 s of CPU per fresh worker).
    run = Launch(["--nproc-per-node", "2", "--recovery", "regroup", "--stall-floor", "6",
                  "--liveness-timeout", "15", *PRELOAD,
                  "--events-file", str(events), str(script), "--steps", "100000",
                  "--hidden", "32", "--step-sleep", "0.02"], cwd=job_dir, env=token)
    run.wait_step(3, 120)
    run_id = _events(events)[0]["run_id"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRUN_JOB_TOKEN")}

    def inject(*args: str, secret: str | None = None) -> subprocess.CompletedProcess[str]:
        extra = {"FTRUN_JOB_TOKEN": secret} if secret else {}
        return subprocess.run([launcher(), "inject", "--job", run_id, *args],
                              env={**env, **extra}, capture_output=True, text=True,
                              timeout=60)

    def here(command: str, *args: str, secret: str | None = None) -> tuple[int, str, str]:
        """``ftrun COMMAND ...`` through the same ``cli.main`` the binary runs, in this
        process (torch is imported here already: a fresh ``ftrun`` that reaches the store
        imports it, ~2 s of CPU per call); the binary itself runs below (inject, status)."""
        for name in [k for k in os.environ if k.startswith("FTRUN_JOB_TOKEN")]:
            monkeypatch.delenv(name)
        if secret:
            monkeypatch.setenv("FTRUN_JOB_TOKEN", secret)
        capsys.readouterr()
        code = cli.main([command, *args])
        said = capsys.readouterr()
        return code, said.out, said.err

    seen: list[dict] = []  # the last status view caught_up() read

    def caught_up(faults_seen: int) -> bool:
        """Whether ``ftrun status`` shows two ranks again and ``faults_seen`` faults: the
        leader refreshes the job's record every second (ftrun/agent/inject.py), and
        ``ftrun inject`` checks a rank against the world size in it."""
        code, out, err = here("status", "--json", run_id, secret="inject-test-secret")
        assert code == 0, err
        seen[:] = [json.loads(out)]
        return seen[0]["world_size"] == 2 and len(seen[0]["faults"]) == faults_seen

    for args, secret, says in ((("explode", "rank=1"), "inject-test-secret",
                                "unknown fault kind 'explode'"),
                               (("kill", "rank=2"), "inject-test-secret",
                                "rank 2 does not exist: the job has 2 ranks"),
                               (("kill", "rank=1"), None, "set FTRUN_JOB_TOKEN"),
                               (("kill", "rank=1"), "wrong", "this token is not the job's"),
                               (("kill", "rank=1", "step=5"), "inject-test-secret",
                                "--inject schedules")):
        code, out, err = here("inject", "--job", run_id, *args, secret=secret)
        assert code == 2, (args, out, err)
        assert err.count("\n") == 1 and says in err, err
    # A request written straight into the store without the token (no ftrun inject to
    # stop it) is refused by the agent itself: said, a rejected event, nothing executed.
    host, port = json.loads(_registration(run_id).read_text())["host"], \
        json.loads(_registration(run_id).read_text())["port"]
    forger = JsonStore(dist.TCPStore(host, port, is_master=False,
                                     timeout=timedelta(seconds=30)),
                       f"ftrun/{run_id}", signer=Signer(None))
    number = forger.add("inject/next", 1)
    forger.set_record(f"inject/{number}", {"kind": "kill", "rank": 1, "text": "forged"})
    run.wait_for(lambda lines: any(f"inject/{number}" in x and "ignored" in x
                                   for x in lines), 30, "the forged request refused")
    wait_until(lambda: any(e["event"] == "rejected" for e in _events(events)), 10,
               "the rejected event (written after the line)")
    untouched = [e["event"] for e in _events(events)]
    assert "inject" not in untouched and "failure" not in untouched
    # Each kind that needs the script's help (raise, hang; the schedule test has the kill),
    # the second once the first's replacement joined (a fault during an admission is
    # another matter).
    # The hang: the hang watch names it from the stacks ("hung in <its frame>") or the
    # stall rule from the step counts ("stalled"), whichever sees it first.
    faults = (("raise", 0, "exit code 1", RAISE_DETECT_S),
              ("hang", 1, ("stalled", "hung in"), HANG_DETECT_S))
    for joined, (kind, rank, cause, bound) in enumerate(faults, start=1):
        wait_until(lambda n=joined - 1: caught_up(n), 30,
                   f"ftrun status showing two ranks and {joined - 1} faults")
        stepping = {s.pid for s in find(run.lines, ElasticStep)}
        if joined == 1:  # through the binary
            done = inject(kind, f"rank={rank}", secret="inject-test-secret")
            code, out, err = done.returncode, done.stdout, done.stderr
        else:  # in this process, through the same cli.main
            code, out, err = here("inject", "--job", run_id, kind, f"rank={rank}",
                                  secret="inject-test-secret")
        assert code == 0, err
        said = re.search(rf"injected: {kind} rank {rank} \(pid (\d+)\) on node 0", out)
        assert said, out
        victim = int(said[1])  # the process that held the rank: a worker of this job
        assert victim in {s.pid for s in find(run.lines, ElasticStep)}
        wait_until(lambda n=joined: len([e for e in _events(events)
                                         if e["event"] == "fault"]) >= n, 120,
                   f"the injected {kind}'s fault record")
        record = [e for e in _events(events) if e["event"] == "fault"][joined - 1]
        inj = [e for e in _events(events) if e["event"] == "inject"][joined - 1]
        assert inj["pid"] == victim
        _check_record(record, inj, cause, bound)
        assert record["injected"] == f"{kind} rank={rank}"
        # Its replacement in (a forked one may be ready before the survivors' regroup is
        # published, and is then in it: no separate "joined" line): two ranks again, one a
        # new process. The next fault lands only then.
        run.wait_for(lambda lines, old=stepping: any(
            s.world == 2 and s.pid not in old for s in find(lines, ElasticStep)), 120,
            f"the {kind}'s replacement stepping in a world of 2")
    # ftrun status on the same live job (single node): the token rule, the record's view.
    def status(*args: str, secret: str | None = None) -> subprocess.CompletedProcess[str]:
        extra = {"FTRUN_JOB_TOKEN": secret} if secret else {}
        return subprocess.run([launcher(), "status", *args, run_id], env={**env, **extra},
                              capture_output=True, text=True, timeout=60)

    code, _, err = here("status", "--json", run_id)
    assert code == 2 and "set FTRUN_JOB_TOKEN" in err, err
    wait_until(lambda: caught_up(len(faults)), 30, "the status record's faults, two ranks")
    view = seen[0]
    records = [e for e in _events(events) if e["event"] == "fault"]
    assert view["run_id"] == run_id and view["world_size"] == 2 and view["age_s"] < 10
    assert view["epoch"] >= len(faults)  # a member epoch per regroup (and per join)
    assert [m["rank"] for m in view["members"]] == [0, 1]
    assert all(m["state"] == "ready" and m["pid"] > 0 for m in view["members"])
    assert [(f["rank"], f["cause"], f["recovery_s"]) for f in view["faults"]] == \
        [(r["rank"], r["cause"], r["recovery_s"]) for r in records]
    table = status(secret="inject-test-secret")
    assert table.returncode == 0 and "last faults" in table.stdout, table.stderr
    run.proc.terminate()
    assert run.wait(60) == 143


def test_schedules_parse_with_their_seed_and_bad_specs_are_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    text = "kill rank=1 step=10..20; freeze rank=random after=1.5..3; seed=7"
    schedule = parse_schedule(text)
    assert schedule == parse_schedule(text) and schedule.seed == 7  # repeatable
    kill, freeze = schedule.faults
    assert (kill.kind, kill.rank) == ("kill", 1) and 10 <= kill.step <= 20
    assert freeze.random_rank and 1.5 <= freeze.after_s <= 3
    assert {schedule.pick_rank(freeze, 1, 4) for _ in range(3)} == \
        {schedule.pick_rank(freeze, 1, 4)}
    cut, default = parse_schedule("cut-link node=1 step=30 for=2.5; cut-link").faults
    assert (cut.kind, cut.node, cut.step, cut.for_s) == ("cut-link", 1, 30, 2.5)
    assert (default.node, default.for_s) == (0, 10.0)
    for bad, says in (("explode rank=1", "unknown fault kind 'explode'"),
                      ("kill", "kill needs rank=N or rank=random"),
                      ("kill rank=1 step=5 after=3", "give step or after, not both"),
                      ("kill rank=x", "rank must be a whole number"),
                      ("kill-agent rank=1", "kill-agent takes node=N"),
                      ("cut-link rank=1", "cut-link takes node=N"),
                      ("kill rank=1 for=3", "for= is for cut-link only"),
                      ("cut-link node=1 for=0.01", "for must be at least 0.1 s"),
                      ("kill rank=1 colour=red", "unknown key 'colour'"),
                      ("seed=x; kill rank=1", "the seed is a whole number"),
                      ("kill rank=1 step=9..3", "out of range"),
                      (" ; ", "no fault in it")):
        assert cli.main(["--inject", bad, str(ELASTIC)]) == 2, bad
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, (bad, err)


def test_a_metrics_port_in_use_is_one_line_and_exit_2(job_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([launcher(), "--nproc-per-node", "1", "--metrics-port",
                               str(port), str(ELASTIC)], capture_output=True, text=True,
                              timeout=120, cwd=job_dir)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and f"--metrics-port {port}: cannot listen" \
        in done.stderr, done.stderr
    assert "step=" not in done.stdout  # nothing started


def test_the_job_record_says_a_new_world_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader's ``ftrun/job`` record, which ``ftrun inject`` checks a rank against,
    says a new world at the inject thread's next tick, not at its once-a-second refresh:
    a request right after a regroup was refused ("rank 1 does not exist: the job has 1
    ranks"). The refresh is pushed out to a minute here, so only the change can write it."""
    import time

    from ftrun.agent import inject
    from ftrun.control.tcpstore import connect_store, serve_store
    from ftrun.observe.events import Event, EventLog

    monkeypatch.setattr(inject, "JOB_EVERY_S", 60.0)
    server = serve_store(0, 10.0)
    signer = Signer(b"job-record-secret")
    reader = JsonStore(server, "ftrun", signer=signer)
    events = EventLog("vm")
    injector = inject.Injector(None, events, say=lambda *a, **k: None, node_rank=lambda: 0)
    events.emit(Event.GENERATION, generation=0, world_size=1, nnodes=1)
    injector.start(lambda: JsonStore(connect_store("127.0.0.1", server.port, 10.0),
                                     "ftrun/rec", signer=signer), {"run_id": "rec"})

    def world() -> object:
        return (reader.get_record(inject.JOB_KEY) or {}).get("world_size")
    try:
        wait_until(lambda: world() == 1, 10, "the first job record")
        events.emit(Event.EPOCH, epoch=1, members=["0.0", "1.0"])
        changed = time.monotonic()
        wait_until(lambda: world() == 2, 10, "the job record of the new world")
        print(f"the job record said the new world {time.monotonic() - changed:.2f}s after it")
    finally:
        injector.stop()


def test_the_inject_thread_outlives_a_failed_store_request(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A store request that fails (an etcd member slow past the request bound, here a port
    that refuses) does not end the agent's inject thread: it opens a client again after a
    pause and answers a request written later. Before, the thread ended at the first error
    and a CI run's ``ftrun inject`` was never executed on that node."""
    from ftrun.agent import inject
    from ftrun.control.tcpstore import connect_store, serve_store
    from ftrun.observe.events import EventLog

    monkeypatch.setattr(inject, "RETRY_S", 0.2)
    server = serve_store(0, 10.0)
    signer = Signer(b"retry-secret")
    writer = JsonStore(server, "ftrun/retry", signer=signer)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    opened: list[int] = []

    def open_store() -> JsonStore:
        opened.append(1)
        port = dead if len(opened) == 1 else server.port
        client = connect_store("127.0.0.1", port, 0.5, op_timeout_s=0.5)  # StoreError
        return JsonStore(client, "ftrun/retry", signer=signer)

    injector = inject.Injector(None, EventLog("vm"), say=lambda *a, **k: None,
                               node_rank=lambda: 0)
    injector.start(open_store, None)
    try:
        wait_until(lambda: len(opened) >= 2, 20, "a second client after the failed one")
        number = writer.add("inject/next", 1)
        # a cut-link of node 0 is answered first, and refused outside a named namespace
        writer.set_record(f"inject/{number}", parse_item("cut-link node=0 for=1").to_json())
        wait_until(lambda: writer.exists(f"inject/{number}/done/0"), 20, "the answer")
        answer = writer.get_record(f"inject/{number}/done/0")
        assert answer is not None and answer["ok"] is False, answer
        assert "namespace" in answer["detail"], answer
    finally:
        injector.stop()


def test_a_registry_entry_whose_pid_was_reused_names_no_job(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A SIGKILLed agent leaves its entry; a later process with its pid must not make the
    job look alive (it did: a test's `ftrun inject RUN_ID` went to an old etcd cluster)."""
    from ftrun.client.jobref import JobRefError, register, register_etcd, resolve

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    live = register("reused", "10.0.0.1", 29400)
    assert live is not None and resolve("reused").port == 29400  # this process: alive
    stale = json.loads(live.read_text())
    stale["started"] -= 3600.0  # the same pid, started an hour before: another process
    live.write_text(json.dumps(stale))
    with pytest.raises(JobRefError, match="has ended"):
        resolve("reused")
    entry = register_etcd("reusedetcd", "10.0.0.2:2379", {})
    assert entry is not None and resolve("reusedetcd").etcd == "10.0.0.2:2379"
    stale = json.loads(entry.read_text())
    stale["started"] += 3600.0
    entry.write_text(json.dumps(stale))
    with pytest.raises(JobRefError, match="has ended"):
        resolve("reusedetcd")


def test_the_registry_prunes_dead_agents_and_status_alone_finds_the_live_job(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A killed job never unregisters: the next agent to register, and ``ftrun status``
    without a name, remove entries whose agent is gone. ``ftrun status`` alone shows the one
    live job of the host, lists several, and says in one line (exit 3) when there is none.
    The registrations are made here (this process is their live agent); ``ftrun status``
    runs as the user runs it, a process of its own."""
    from ftrun.client.jobref import live_jobs, prune, register

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([launcher(), "status", *args], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)})

    none = status()
    assert none.returncode == 3, none.stderr
    assert "no live ftrun job is registered on this host" in none.stderr
    dead = register("dead-job", "10.0.0.9", 29400)
    assert dead is not None
    stale = json.loads(dead.read_text())
    stale["pid"], stale["started"] = 2**22 + 7, 1.0  # no such process
    dead.write_text(json.dumps(stale))
    live = register("live-job", "127.0.0.1", 1)  # this process: alive; it pruned dead-job
    assert live is not None and not dead.exists()
    assert [j.run_id for j in live_jobs()] == ["live-job"]
    dead.write_text(json.dumps(stale))
    assert prune() == [dead] and not dead.exists()
    dead.write_text(json.dumps(stale))
    # the one live job is named for the user: its store (port 1) refuses, exit 3 says where;
    # the dead entry is pruned on the way
    one = status("--timeout", "1")
    assert one.returncode == 3, one.stderr
    assert "127.0.0.1:1" in one.stderr and not dead.exists()
    register("second-job", "127.0.0.1", 2)
    both = status("--json")
    assert both.returncode == 0, both.stderr
    listed = json.loads(both.stdout)["jobs"]
    assert [j["run_id"] for j in listed] == ["live-job", "second-job"]
    assert {j["agent_pid"] for j in listed} == {os.getpid()}
