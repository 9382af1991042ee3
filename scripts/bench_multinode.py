"""Multi-node benchmarks: node-loss recovery, rendezvous of many agents, store load.

    python scripts/bench_multinode.py                      # everything, table
    python scripts/bench_multinode.py --json               # the same, as JSON
    python scripts/bench_multinode.py --only rendezvous --agents 64,256,512
    python scripts/bench_multinode.py --only store-load --store-load 1000

* ``node_loss_recovery_s``: three network-namespace hosts (tests/infra/netns.py; needs root)
  each run one launcher and one gloo worker of scripts/train_ddp.py (elastic 2:3, c10d).
  h3's link is cut; the figure is the time from the cut to the survivors' first training
  step after it. ftrun and torchrun run the same job with the same flags. torchrun has no
  node heartbeat: its survivors sit in the gloo collective until a timeout, so a run that
  shows no step within ``--cap`` seconds is reported as the cap and listed in
  ``censored`` (the true figure is larger).
* ``rendezvous_s``: N simulated agents (threads with one store client each, in a few
  processes) join generation 0 of ftrun's c10d rendezvous against a real TCPStore; the figure
  is from the start signal to the moment every agent holds the generation record. torchrun's
  figures are the anchors measured on this machine type (docs: TEST-INFRA.md) unless
  ``--torchrun-rendezvous`` re-measures them with torch's own C10dRendezvousBackend.
* ``store_load``: the request rate N agents put on the store with the heartbeat defaults,
  offered to a real TCPStore by a few client processes, with heartbeat latencies and the
  leader's scan time.

JSON: ``{"node_loss_recovery_s": {"ftrun": [...], "torchrun": [...]}, "rendezvous_s":
{"ftrun": {N: s}, "torchrun": {N: s}}, ...}`` (the first two keys are a contract).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BIN = Path(sys.executable).parent
STEP = re.compile(r"step=(\d+) .* t=([\d.]+)")
# torchrun 2.13 c10d rendezvous on this machine type (TEST-INFRA.md): None = did not finish.
TORCHRUN_RDZV_ANCHORS = {64: 1.3, 128: 3.6, 256: 35.0, 512: None}


# --- node-loss recovery on namespace hosts -------------------------------------------------


def _launcher_args(program: str, leader_addr: str, host_addr: str, script: Path,
                   workdir: Path) -> list[str]:
    common = ["--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"{leader_addr}:29400", "--rdzv-id", "bench",
              "--max-restarts", "3", "--local-addr", host_addr]
    # is_host: torchrun recognises the store host by its hostname, which the namespaces
    # share with the machine, so without it no agent hosts the store and all wait forever.
    is_host = "1" if host_addr == leader_addr else "0"
    common += ["--rdzv-conf", f"last_call_timeout=15,is_host={is_host}"]
    if program == "torchrun":
        common += ["--monitor-interval", "0.1"]
    return [str(BIN / program), *common, str(script), "--steps", "100000",
            "--step-sleep", "0.05", "--checkpoint-dir", str(workdir),
            "--checkpoint-every", "10"]


class _Reader:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.steps: list[float] = []  # wall time each step line was read
        self.lines: list[str] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if STEP.search(line):
                self.steps.append(time.time())


def node_loss_once(program: str, cap_s: float) -> float | None:
    from tests.infra.netns import NetnsNetwork

    workdir = Path(tempfile.mkdtemp(prefix="bench_mn_"))
    script = workdir / "train_ddp.py"
    shutil.copy(REPO / "scripts" / "train_ddp.py", script)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", FTRUN_JOB_TOKEN="bench-token")
    try:
        with NetnsNetwork(3) as net:
            readers = []
            for host in net:
                args = _launcher_args(program, net["h1"].addr, host.addr, script, workdir)
                proc = host.popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, errors="replace", env=env, cwd=workdir)
                readers.append(_Reader(proc))
            deadline = time.time() + 180
            while not all(len(r.steps) >= 5 for r in readers):
                if time.time() > deadline:
                    raise RuntimeError(f"{program}: no steps: {readers[0].lines[-20:]}")
                time.sleep(0.1)
            net.cut_link(net["h3"])
            cut = time.time()
            # Progress again: a step of each survivor, read after the cut, that is not the
            # tail of steps already in flight (half a second of grace).
            deadline = cut + cap_s
            while time.time() < deadline:
                if all(any(t > cut + 0.5 for t in r.steps) for r in readers[:2]):
                    after = [min(t for t in r.steps if t > cut + 0.5) for r in readers[:2]]
                    # A survivor that kept stepping through the cut never lost progress.
                    return max(after) - cut
                time.sleep(0.05)
            return None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# --- rendezvous of many simulated agents ---------------------------------------------------


def _agents_proc(host: str, port: int, ids: list[int], ready: mp.Queue, go_at: object,
                 out: mp.Queue) -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore

    from ftrun.auth import Signer
    from ftrun.rendezvous import DynamicRendezvous, NodeSlot
    from ftrun.store import JsonStore

    # Hundreds of agents share this process's GIL (real agents, one per host, do not).
    # BENCH_SWITCH_INTERVAL (seconds) is for experiments only: 0.0005 made 512 agents
    # take 15 s instead of 1.8 s here (context switches), so the default is Python's.
    if os.environ.get("BENCH_SWITCH_INTERVAL"):
        sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL"]))
    results: list[float] = []
    lock = threading.Lock()
    start = threading.Event()  # one waiter per process, not hundreds of spinning threads

    def starter() -> None:
        while go_at.value == 0:  # type: ignore[attr-defined]
            time.sleep(0.01)
        time.sleep(max(0.0, go_at.value - time.time()))  # type: ignore[attr-defined]
        start.set()

    def agent(i: int) -> None:
        while True:  # plain clients: connect_store serialises connects within a process
            try:
                raw = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
                break
            except RuntimeError:
                time.sleep(0.1)
        store = JsonStore(raw, "ftrun/bench", signer=Signer(b"bench-token"))
        rdzv = DynamicRendezvous(store, min_nodes=1, max_nodes=10**6, last_call_s=0,
                                 is_leader=False, poll_s=0.05, interrupted=lambda: False)
        slot = NodeSlot(-1, 1, f"10.0.{i // 250}.{i % 250}", f"sim{i}", os.getpid(), f"sim-{i}")
        ready.put(i)  # connected: connects are not part of the figure (see TEST-INFRA.md)
        start.wait()
        rdzv.join(0, slot, 120, lambda: ("", 0))
        with lock:
            results.append(time.time())

    threading.Thread(target=starter, daemon=True).start()
    threads = [threading.Thread(target=agent, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(results)


def rendezvous_once(n: int, procs: int = 4) -> float:
    from ftrun.auth import Signer
    from ftrun.rendezvous import DynamicRendezvous, NodeSlot
    from ftrun.store import JsonStore, serve_store

    server = serve_store(0, 120)
    store = JsonStore(server, "ftrun/bench", signer=Signer(b"bench-token"))
    leader = DynamicRendezvous(store, min_nodes=n + 1, max_nodes=n + 1, last_call_s=0,
                               is_leader=True, poll_s=0.01, interrupted=lambda: False)
    ctx = mp.get_context("spawn")  # forking a process that runs a store server can deadlock
    out: mp.Queue = ctx.Queue()
    ready: mp.Queue = ctx.Queue()
    go_at = ctx.Value("d", 0.0)
    workers = [ctx.Process(target=_agents_proc,
                           args=("127.0.0.1", server.port, list(range(k, n, procs)), ready,
                                 go_at, out))
               for k in range(procs)]
    for w in workers:
        w.start()
    for _ in range(n):
        ready.get(timeout=300)
    go = time.time() + 0.2
    go_at.value = go
    while time.time() < go:
        time.sleep(0.001)
    own = NodeSlot(-1, 1, "127.0.0.1", "leader", os.getpid(), "leader")
    leader.join(0, own, 300, lambda: ("127.0.0.1", 1))
    formed = time.time() - go
    done = [t for _ in workers for t in out.get(timeout=300)]
    for w in workers:
        w.join(30)
    if os.environ.get("BENCH_VERBOSE"):
        done.sort()
        print(f"  n={n}: record written {formed:.3f} s, agents hold it: first "
              f"{done[0] - go:.3f} median {done[len(done) // 2] - go:.3f} "
              f"last {done[-1] - go:.3f}", file=sys.stderr)
    return max(done) - go


def torchrun_rendezvous_once(n: int, procs: int = 4) -> float | None:
    """torch's own c10d rendezvous handler, n simulated agents as threads."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        create_handler,
    )

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    done: list[float] = []
    go = time.time() + 2.0 + n / 100

    def agent(i: int) -> None:
        client = TCPStore("127.0.0.1", server.port, is_master=False,
                          timeout=timedelta(seconds=120))
        backend = C10dRendezvousBackend(client, "bench")
        params = RendezvousParameters("c10d", f"127.0.0.1:{server.port}", "bench", n, n,
                                      join_timeout=120, last_call_timeout=1)
        handler = create_handler(client, backend, params)
        while time.time() < go:
            time.sleep(0.001)
        handler.next_rendezvous()
        done.append(time.time())

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(5.0, go + 150 - time.time()))
    return max(done) - go if len(done) == n else None


# --- store load ------------------------------------------------------------------------------


def _load_proc(port: int, agents: list[int], interval: float, poll: float, seconds: float,
               out: mp.Queue) -> None:
    from ftrun.auth import Signer
    from ftrun.store import JsonStore, connect_store

    store = JsonStore(connect_store("127.0.0.1", port, 30), "ftrun/load",
                      signer=Signer(b"bench-token"))
    # Each agent: one heartbeat per interval, one end check per poll. Spread evenly.
    period = 1.0 / (len(agents) / interval + len(agents) / poll)
    beats_every = round(interval / poll) + 1  # of every k requests, one is a beat
    latencies: list[float] = []
    start = time.monotonic()
    k = 0
    seq = 0
    next_at = start
    while time.monotonic() - start < seconds:
        agent = agents[k % len(agents)]
        t0 = time.monotonic()
        if (k // len(agents)) % beats_every == 0:
            seq += 1
            store.set_record(f"hb/sim-{agent}", {"seq": seq})
            latencies.append(time.monotonic() - t0)
        else:
            store.exists("gen/0/end")
        k += 1
        next_at += period
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    out.put((k, latencies))


def store_load(n: int, interval: float, poll: float, seconds: float = 10.0,
               procs: int = 4) -> dict[str, float]:
    from ftrun.auth import Signer
    from ftrun.heartbeat import HeartbeatMonitor
    from ftrun.store import JsonStore, serve_store

    server = serve_store(0, 60)
    store = JsonStore(server, "ftrun/load", signer=Signer(b"bench-token"))
    for i in range(n):
        store.set_record(f"hb/sim-{i}", {"seq": 0})
    ctx = mp.get_context("spawn")  # forking a process that runs a store server can deadlock
    out: mp.Queue = ctx.Queue()
    workers = [ctx.Process(target=_load_proc,
                           args=(server.port, list(range(k, n, procs)), interval, poll,
                                 seconds, out))
               for k in range(procs)]
    started = time.monotonic()
    for w in workers:
        w.start()
    monitor = HeartbeatMonitor(store, timeout_s=1e9)
    monitor.watch([f"sim-{i}" for i in range(n)])
    scans: list[float] = []
    while time.monotonic() - started < seconds:
        t0 = time.monotonic()
        monitor.scan()
        scans.append(time.monotonic() - t0)
        time.sleep(interval / 2)
    results = [out.get(timeout=60) for _ in workers]
    for w in workers:
        w.join(30)
    elapsed = time.monotonic() - started
    total = sum(k for k, _ in results)
    lat = sorted(x for _, ls in results for x in ls)
    return {
        "agents": n,
        "offered_req_per_s": n / interval + n / poll,
        "achieved_req_per_s": total / elapsed,
        "heartbeat_set_p50_ms": 1000 * lat[len(lat) // 2] if lat else 0.0,
        "heartbeat_set_p99_ms": 1000 * lat[int(len(lat) * 0.99)] if lat else 0.0,
        "leader_scan_median_ms": 1000 * statistics.median(scans),
        "leader_scan_max_ms": 1000 * max(scans),
    }


# --- main ----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", choices=["recovery", "rendezvous", "store-load"])
    parser.add_argument("--runs", type=int, default=2, help="node-loss runs per launcher")
    parser.add_argument("--cap", type=float, default=90.0, help="torchrun recovery cap (s)")
    parser.add_argument("--agents", default="64,128,256,512")
    parser.add_argument("--torchrun-rendezvous", action="store_true",
                        help="re-measure torchrun's c10d rendezvous (slow at 256+)")
    parser.add_argument("--torchrun-max-agents", type=int, default=256,
                        help="above this, torchrun's figure is the anchor (512 never ends)")
    parser.add_argument("--store-load", type=int, default=1000)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--poll", type=float, default=0.1)
    args = parser.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    result: dict[str, object] = {
        "node_loss_recovery_s": {"ftrun": [], "torchrun": []},
        "rendezvous_s": {"ftrun": {}, "torchrun": {}},
        "censored": {"torchrun": []},
    }
    if args.only in (None, "recovery"):
        recovery = result["node_loss_recovery_s"]
        assert isinstance(recovery, dict)
        for _ in range(args.runs):
            for program in ("ftrun", "torchrun"):
                took = node_loss_once(program, args.cap)
                print(f"  node loss, {program}: {took}", file=sys.stderr, flush=True)
                if took is None:
                    took = args.cap
                    censored = result["censored"]
                    assert isinstance(censored, dict)
                    censored.setdefault(program, []).append(len(recovery[program]))
                recovery[program].append(round(took, 2))
    if args.only in (None, "rendezvous"):
        rdzv = result["rendezvous_s"]
        assert isinstance(rdzv, dict)
        counts = [int(x) for x in args.agents.split(",")]
        for n in counts:
            rdzv["ftrun"][n] = round(rendezvous_once(n), 3)
            print(f"  rendezvous, ftrun, {n} agents: {rdzv['ftrun'][n]}", file=sys.stderr,
                  flush=True)
        for n in counts:  # last: a torchrun run that does not finish leaves threads behind
            if args.torchrun_rendezvous and n <= args.torchrun_max_agents:
                took_t = torchrun_rendezvous_once(n)
                rdzv["torchrun"][n] = None if took_t is None else round(took_t, 3)
                print(f"  rendezvous, torchrun, {n} agents: {rdzv['torchrun'][n]}",
                      file=sys.stderr, flush=True)
            else:
                rdzv["torchrun"][n] = TORCHRUN_RDZV_ANCHORS.get(n)
        result["torchrun_rendezvous_source"] = (
            f"measured up to {args.torchrun_max_agents} agents, TEST-INFRA.md anchors above"
            if args.torchrun_rendezvous else "TEST-INFRA.md anchors")
    if args.only in (None, "store-load"):
        result["store_load"] = store_load(args.store_load, args.interval, args.poll)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print("node loss -> training progressing again (s), link of h3 cut:")
    rec = result["node_loss_recovery_s"]
    for program in ("ftrun", "torchrun"):
        values = rec[program]  # type: ignore[index]
        if values:
            note = f"  (>= cap {args.cap:.0f} s: no progress)" if program in result[
                "censored"] and result["censored"][program] else ""  # type: ignore[index]
            print(f"  {program:9} {' '.join(f'{v:7.2f}' for v in values)}{note}")
    rd = result["rendezvous_s"]
    if rd["ftrun"]:  # type: ignore[index]
        print(f"rendezvous of N agents (s)   [torchrun: {result['torchrun_rendezvous_source']}]")
        print(f"  {'N':>6} {'ftrun':>9} {'torchrun':>9}")
        for n, v in rd["ftrun"].items():  # type: ignore[index]
            t = rd["torchrun"].get(n)  # type: ignore[index]
            print(f"  {n:>6} {v:9.3f} {('n/a' if t is None else f'{t:.3f}'):>9}")
    if "store_load" in result:
        print("store load:")
        for key, value in result["store_load"].items():  # type: ignore[union-attr]
            print(f"  {key:24} {value:10.1f}")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
