#!/usr/bin/env bash
# gpu_check.sh - the shim's checks that need a real GPU (one GPU, one rank, < 5 minutes).
#
#   scripts/gpu_check.sh            (PYTHON=/path/to/python with a CUDA torch, default python3)
#
# 1. builds the shim from csrc/ with cc (no pip, no CUDA toolkit);
# 2. a torch NCCL process group of size 1 runs under the shim: the shim counts its calls;
# 3. the agent side aborts on command: the next collective raises in the script,
#    destroy_process_group() does not crash, a new group forms and computes correctly;
# 3b. the same worker forked from ftrun's fork server (--preload), which preloads the shim
#    without a page: the fork attaches to its own, counts its calls, and is aborted the same;
# 4. per-collective time with and without the shim;
# 5. `ftrun doctor --json`, if the ftrun command exists.
# Prints PASS/FAIL lines and one JSON summary line ("SUMMARY {...}"); exit status 0 only if
# every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=$(mktemp -d /tmp/ftrun-gpu-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

echo "== build the shim"
if ! cc -O2 -g -std=gnu11 -Wall -fPIC -fvisibility=hidden -shared -o "$WORK/libftrun_shim.so" \
    csrc/ftshim.c -ldl -lpthread; then
  echo "FAIL build: cc could not compile csrc/ftshim.c"
  echo 'SUMMARY {"ok": false, "stage": "build"}'
  exit 1
fi
echo "PASS build: $WORK/libftrun_shim.so"

DOCTOR_JSON="$WORK/doctor.json"
if command -v ftrun >/dev/null 2>&1; then
  echo "== ftrun doctor --json"
  timeout 120 ftrun doctor --json >"$DOCTOR_JSON" 2>"$WORK/doctor.err"
  echo "doctor exit status $?"
else
  echo "(ftrun command not found: doctor skipped)"
fi

export FTRUN_GPU_CHECK_LIB="$WORK/libftrun_shim.so" FTRUN_GPU_CHECK_WORK="$WORK"
export FTRUN_GPU_CHECK_DOCTOR="$DOCTOR_JSON"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 240 "$PY" - <<'PYEOF'
import json, os, subprocess, sys, time
from pathlib import Path

from ftrun.shim import ShimControl, ShimError, torch_env_for_survivors

LIB = Path(os.environ["FTRUN_GPU_CHECK_LIB"])
WORK = Path(os.environ["FTRUN_GPU_CHECK_WORK"])
results = {}
ok_all = True


def check(name, ok, detail=""):
    global ok_all
    ok_all &= bool(ok)
    results[name] = {"ok": bool(ok), "detail": detail}
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


WORKER = r'''
import os, sys, time, torch
import torch.distributed as dist
work = sys.argv[1]
mode = sys.argv[2]
dev = torch.device("cuda:0")
torch.cuda.set_device(dev)

def group(tag):
    dist.init_process_group("nccl", init_method=f"file://{work}/store-{tag}", world_size=1,
                            rank=0, device_id=dev)

def say(*a):
    print(*a, flush=True)

if mode == "bench":
    group(f"bench-{os.getpid()}")
    x = torch.ones(1, device=dev)
    for _ in range(50):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    say("BENCH", (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6)
    dist.destroy_process_group()
    sys.exit(0)

group("g0")
x = torch.ones(4, device=dev)
for _ in range(100):
    dist.all_reduce(x)
torch.cuda.synchronize()
say("READY", torch.__version__, ".".join(map(str, torch.cuda.nccl.version())), float(x[0]))
go = os.environ.get("GPU_CHECK_GO")  # a forked worker's stdin is /dev/null: a file instead
if go:
    while not os.path.exists(go):
        time.sleep(0.01)
else:
    sys.stdin.readline()  # the agent aborts now
t0 = time.monotonic()
try:
    dist.all_reduce(x)
    torch.cuda.synchronize()
    say("NORAISE")
except Exception as exc:  # DistBackendError expected
    say("RAISED", type(exc).__name__, f"{time.monotonic() - t0:.4f}", str(exc).replace("\n", " ")[:200])
try:
    dist.destroy_process_group()
    say("DESTROYED")
except Exception as exc:
    say("DESTROYFAIL", type(exc).__name__, str(exc).replace("\n", " ")[:200])
group("g1")
y = torch.full((4,), 3.0, device=dev)
dist.all_reduce(y)
torch.cuda.synchronize()
say("NEWGROUP", float(y[0]))
dist.destroy_process_group()
say("DONE")
'''
(WORK / "worker.py").write_text(WORKER)


def readline(proc, deadline):
    import selectors
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                return proc.stdout.readline().strip()
    return ""


def expect(proc, word, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = readline(proc, deadline)
        if not line and proc.poll() is not None:
            return None
        if line.startswith(word) or (word == "RAISED" and line.startswith("NORAISE")):
            return line
        if line:
            print("  worker:", line, flush=True)
    return None


summary = {}
ctl = ShimControl(label="gpu-check", library=LIB)
env = ctl.worker_env(torch_env_for_survivors(os.environ))
proc = subprocess.Popen([sys.executable, str(WORK / "worker.py"), str(WORK), "main"], env=env,
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
ctl.bind(proc.pid)
try:
    line = expect(proc, "READY", 120)
    check("group_up", line is not None, line or f"worker exited {proc.poll()}")
    if line:
        _, tv, nv, val = line.split()
        summary.update(torch=tv, nccl=nv)
        comms = ctl.communicators()
        live = [c for c in comms if c.state == "live"]
        seq = max((c.seq for c in live), default=0)
        check("shim_counts_calls", live and seq >= 100,
              f"{len(comms)} comms, max seq {seq}, last op {live[0].last_op if live else '-'}; "
              f"status {ctl.status()}")
        summary["communicators"] = [c.__dict__ for c in comms]
        try:
            t0 = time.monotonic()
            rep = ctl.abort_all(timeout_s=30)
            check("abort_report", rep.attached and rep.entries and not rep.unsafe,
                  f"{rep.mechanism} {len(rep.entries)} comms in {rep.elapsed_s * 1e3:.2f} ms "
                  f"(round trip {rep.round_trip_s * 1e3:.2f} ms)")
            summary["abort"] = rep.to_dict()
        except ShimError as exc:
            check("abort_report", False, str(exc))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = expect(proc, "RAISED", 90)
        check("next_collective_raises", line and line.startswith("RAISED"), line or "no answer")
        line = expect(proc, "DESTROY", 60)
        check("destroy_process_group", line == "DESTROYED", line or "no answer (hang or crash)")
        line = expect(proc, "NEWGROUP", 60)
        check("new_group_works", line is not None and float(line.split()[1]) == 3.0,
              line or "no answer")
        expect(proc, "DONE", 30)
        proc.wait(timeout=30)
        check("worker_exit", proc.returncode == 0, f"status {proc.returncode}")
finally:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    ctl.close()



def forked_check():
    """The same worker forked from ftrun's fork server (--preload): the server preloads the
    shim without a page (it never makes a communicator); the fork attaches to its own."""
    import io
    import types

    from ftrun.agent.forkserver import ForkServer

    server_env = dict(torch_env_for_survivors(os.environ))
    server_env.pop("FTRUN_SHIM_CONTROL", None)
    server_env["LD_PRELOAD"] = ":".join(filter(None, [server_env.get("LD_PRELOAD"), str(LIB)]))
    server = ForkServer(["torch"], env=server_env, path0=str(WORK))
    fctl = ShimControl(label="gpu-check-forked", library=LIB)
    try:
        server.wait_ready(timeout_s=120)
        go = WORK / "go-forked"
        env = dict(fctl.worker_env(torch_env_for_survivors(os.environ)), GPU_CHECK_GO=str(go))
        child = server.spawn([str(WORK / "worker.py"), str(WORK), "main"], module=False,
                             env=env, cwd=str(WORK))
        fctl.bind(child.pid)
        proc = types.SimpleNamespace(stdout=io.TextIOWrapper(child.stdout), poll=child.poll)
        line = expect(proc, "READY", 120)
        check("forked_group_up", line is not None, line or f"worker exited {child.poll()}")
        if not line:
            return
        live = [c for c in fctl.communicators() if c.state == "live"]
        status = fctl.status()
        check("forked_shim_counts_calls",
              live and max(c.seq for c in live) >= 100 and status["owner_pid"] == child.pid,
              f"{len(live)} live comms; owner {status['owner_pid']} (worker {child.pid}, "
              f"server {server.pid}); attaches {status['attach_count']}")
        try:
            rep = fctl.abort_all(timeout_s=30)
            check("forked_abort_report", rep.attached and rep.entries and not rep.unsafe,
                  f"{rep.mechanism} {len(rep.entries)} comms in {rep.elapsed_s * 1e3:.2f} ms")
        except ShimError as exc:
            check("forked_abort_report", False, str(exc))
        go.touch()
        line = expect(proc, "RAISED", 90)
        check("forked_next_collective_raises", line and line.startswith("RAISED"),
              line or "no answer")
    finally:
        server.close()
        fctl.close()


forked_check()

# overhead per collective, with and without the shim
timing = {}
for label in ("without_shim", "with_shim"):
    runs = []
    for _ in range(3):
        c = ShimControl(label="gpu-bench", library=LIB) if label == "with_shim" else None
        e = c.worker_env(os.environ) if c else dict(os.environ)
        out = subprocess.run([sys.executable, str(WORK / "worker.py"), str(WORK), "bench"], env=e,
                             capture_output=True, text=True, timeout=120)
        if c:
            c.close()
        line = next((l for l in out.stdout.splitlines() if l.startswith("BENCH")), None)
        if line:
            runs.append(tuple(map(float, line.split()[1:])))
    if runs:
        timing[label] = {"launch_us_best": min(r[0] for r in runs),
                         "total_us_best": min(r[1] for r in runs)}
if len(timing) == 2:
    d_launch = timing["with_shim"]["launch_us_best"] - timing["without_shim"]["launch_us_best"]
    d_total = timing["with_shim"]["total_us_best"] - timing["without_shim"]["total_us_best"]
    timing["overhead_launch_us"] = d_launch
    timing["overhead_total_us"] = d_total
    check("overhead", d_launch < 1.0,
          f"launch {timing['without_shim']['launch_us_best']:.2f} -> "
          f"{timing['with_shim']['launch_us_best']:.2f} us/op ({d_launch * 1e3:+.0f} ns)")
else:
    check("overhead", False, f"bench runs failed: {timing}")
summary["timing"] = timing

doctor = Path(os.environ["FTRUN_GPU_CHECK_DOCTOR"])
if doctor.is_file():
    try:
        summary["doctor"] = json.loads(doctor.read_text())
    except ValueError:
        summary["doctor"] = {"unparsed": doctor.read_text()[:2000]}
summary["checks"] = results
summary["ok"] = ok_all
print("SUMMARY " + json.dumps(summary, default=str), flush=True)
sys.exit(0 if ok_all else 1)
PYEOF
status=$?
if [ $status -eq 124 ]; then echo "FAIL timeout: the check ran past 240 s"; fi
exit $status
