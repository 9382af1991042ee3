"""``--preload``: workers forked from a per-node fork server that imported torch once.

What a worker must not be able to tell (compared with the same script under torchrun, or
under ftrun without the option): its torchrun variables, ``sys.argv``, ``__name__``,
``sys.path[0]``, working directory, signal dispositions, exit status, unbuffered output;
what must differ: torch is already imported when the script starts, and a restart does not
import it again. The fork server must leave nothing behind, also when the agent is killed.

Latency bound: a restart's workers reach their first line fast because nothing is imported
again; measured 0.05-0.2 s from the restart to the restarted workers' start lines here (vs
~1.5-3 s without), so 5 s fails a regression to re-importing under load.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.launch import Launch, launcher, running, wait_until
from tests.test_launcher import ENV_DUMP, TORCHRUN_NAMES, VARIES, _env_by_rank

RESTART_START_BOUND_S = 5.0

PROBE = """
import json, os, signal, sys, time
facts = {
    "preloaded": "torch" in sys.modules,
    "argv": sys.argv, "name": __name__, "path0": sys.path[0], "cwd": os.getcwd(),
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "stdin": sys.stdin.read(),
    "sid": os.getsid(0) == os.getpid(),
    "restart": os.environ["TORCHELASTIC_RESTART_COUNT"], "rank": os.environ["RANK"],
    "ppid": os.getppid(), "pid": os.getpid(), "t": time.time(),
}
print("FACTS " + json.dumps(facts))  # no flush: the output must be unbuffered
if os.environ["RANK"] == "1" and facts["restart"] == "0":
    sys.exit(7)
if "--stay" in sys.argv:
    time.sleep(600)
"""


def _facts(run: Launch) -> list[dict]:
    return [json.loads(line[line.index("FACTS ") + 6:]) for line in run.lines if "FACTS " in line]


def test_forked_workers_look_like_torchruns_and_restart_without_imports(job_dir: Path) -> None:
    dump = job_dir / "dump_env.py"
    dump.write_text(ENV_DUMP.format(names=sorted(TORCHRUN_NAMES)))
    seen = {}
    for index, (program, extra) in enumerate((("torchrun", []), ("ftrun", ["--preload", "torch"]))):
        run = Launch([*extra, "--nproc-per-node", "2", "--master-port", str(29671 + index),
                      str(dump)], program=program, cwd=job_dir)
        assert run.wait(120) == 0, run.output
        seen[program] = _env_by_rank(run)
    assert seen["torchrun"].keys() == seen["ftrun"].keys() == {"0", "1"}
    for rank, theirs in seen["torchrun"].items():
        ours = {k: v for k, v in seen["ftrun"][rank].items() if not k.startswith("FTRUN_")}
        theirs = {k: v for k, v in theirs.items() if not k.startswith("FTRUN_")}  # inherited
        assert ours.keys() == theirs.keys(), (rank, ours.keys() ^ theirs.keys())
        assert {k for k in theirs if theirs[k] != ours[k]} <= VARIES

    probe = job_dir / "probe.py"
    probe.write_text(PROBE)
    run = Launch(["--preload", "torch", "--nproc-per-node", "2", "--max-restarts", "1",
                  str(probe), "a", "b"], cwd=job_dir)
    assert run.wait(120) == 0, run.output
    facts = _facts(run)
    first = [f for f in facts if f["restart"] == "0"]
    again = [f for f in facts if f["restart"] == "1"]
    assert len(first) == 2 and len(again) == 2, run.output
    for fact in facts:
        assert fact["preloaded"], fact  # forked from the server: torch is already there
        assert fact["argv"] == [str(probe), "a", "b"] and fact["name"] == "__main__"
        assert fact["path0"] == str(job_dir) and fact["cwd"] == str(job_dir)
        assert fact["sigint"] and fact["sigterm"] and fact["stdin"] == "" and fact["sid"]
    assert len({f["ppid"] for f in facts}) == 1  # one server for both generations
    assert "rank 1" in run.output and "exit code 7" in run.output  # the exit status survives
    restarted_at = min(f["t"] for f in again) - max(f["t"] for f in first)
    print(f"first generation's start lines to the restarted ones': {restarted_at:.3f} s")
    assert restarted_at < RESTART_START_BOUND_S, restarted_at


def test_killing_the_agent_leaves_no_server_and_no_worker(job_dir: Path) -> None:
    probe = job_dir / "probe.py"
    probe.write_text(PROBE)
    run = Launch(["--preload", "torch", "--nproc-per-node", "2", str(probe), "--stay"],
                 cwd=job_dir)
    facts = run.wait_for(lambda lines: len(f := [x for x in lines if "FACTS " in x]) == 2
                         and f, 120, "two workers")
    pids = [json.loads(line[line.index("FACTS ") + 6:])["pid"] for line in facts]
    server = psutil.Process(pids[0]).ppid()
    run.proc.send_signal(signal.SIGKILL)
    run.wait(30)
    for pid in (*pids, server):
        wait_until(lambda p=pid: not running(p), 10, f"process {pid} to die with the agent")


def test_bad_preload_is_a_one_line_error(job_dir: Path) -> None:
    (job_dir / "threader.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), "
        "daemon=True).start()\n")
    script = job_dir / "hello.py"
    script.write_text("print('hello')\n")
    cases = {
        "nosuchmodule_xyz": "cannot import 'nosuchmodule_xyz'",
        "threader": "started 1 thread(s)",
        "not a module": "is not a module name",
    }
    for value, words in cases.items():
        started = time.monotonic()
        result = subprocess.run([launcher(), "--preload", value, "--nproc-per-node", "2",
                                 str(script)], cwd=job_dir, capture_output=True, text=True,
                                timeout=120, env={**os.environ, "PYTHONPATH": str(job_dir)})
        assert result.returncode == 2, (value, result.stdout, result.stderr)
        errors = [line for line in result.stderr.splitlines() if line.startswith("ftrun: error")]
        assert len(errors) == 1 and words in errors[0], (value, result.stderr)
        assert "Traceback" not in result.stderr + result.stdout, value
        assert "hello" not in result.stdout  # no worker ran
        assert time.monotonic() - started < 60


AUTO_PROBE = """
import os, sys
forked = "torch._dynamo" in sys.modules  # before this script's own import
import torch  # noqa: E402,F401
print(f"AUTO forked={forked} rank={os.environ['RANK']}", flush=True)
"""


def _auto_lines(run: Launch) -> dict[str, str]:
    return {line.split("rank=")[1].strip(): line.split("forked=")[1].split()[0]
            for line in run.lines if "AUTO forked=" in line}


def test_auto_is_the_default_for_a_torch_script_and_none_turns_it_off(job_dir: Path) -> None:
    """No flag: a script that imports torch is forked from a server that imported torch and
    its distributed modules (said in one line); ``--preload none`` spawns it; a script that
    imports no torch gets no server at all."""
    script = job_dir / "probe.py"
    script.write_text(AUTO_PROBE)
    plain = job_dir / "plain.py"
    plain.write_text("import os\nprint(f\"PLAIN rank={os.environ['RANK']}\", flush=True)\n")
    default = {"FTRUN_PRELOAD": None}  # the suite's conftest sets none
    for extra, forked in (([], "True"), (["--preload", "none"], "False")):
        run = Launch([*extra, "--nproc-per-node", "2", str(script)], cwd=job_dir, env=default)
        assert run.wait(120) == 0, run.output
        assert _auto_lines(run) == {"0": forked, "1": forked}, run.output
        said = [line for line in run.lines if "preload: imported" in line]
        assert len(said) == (forked == "True"), run.output
        if said:
            assert "torch, torch._dynamo, torch.distributed" in said[0], said
    run = Launch(["--nproc-per-node", "2", str(plain)], cwd=job_dir, env=default)
    assert run.wait(120) == 0, run.output
    assert len([line for line in run.lines if "PLAIN rank=" in line]) == 2, run.output
    assert not any("preload" in line for line in run.lines), run.output


def test_auto_falls_back_to_spawning_with_one_line_where_the_server_cannot_serve(
        job_dir: Path) -> None:
    """The default's choice, not the user's: where the fork server cannot be used, the job
    still runs, spawned, with one line saying why, instead of stopping with exit 2 as an
    explicit ``--preload`` does. Here the script's own ``torch`` package (beside it, so the
    agent's torch is untouched) has no ``torch._dynamo``; and a ``PYTHON_EXEC`` that is not
    ftrun's interpreter."""
    (job_dir / "torch").mkdir()
    (job_dir / "torch" / "__init__.py").write_text("")
    script = job_dir / "probe.py"
    script.write_text(AUTO_PROBE)
    wrapper = job_dir / "python-wrapper"
    wrapper.write_text(f"#!/bin/sh\nexec {os.path.realpath(sys.executable)} \"$@\"\n")
    wrapper.chmod(0o755)
    cases: tuple[tuple[dict[str, str | None], str], ...] = (
        ({"FTRUN_PRELOAD": None}, "cannot import 'torch._dynamo'"),
        ({"FTRUN_PRELOAD": None, "PYTHON_EXEC": str(wrapper)},
         "is not the interpreter ftrun runs in"))
    for env, words in cases:
        run = Launch(["--nproc-per-node", "2", str(script)], cwd=job_dir, env=env)
        assert run.wait(120) == 0, run.output
        text = " ".join(run.output.split())  # the console wraps long lines
        assert text.count("preload off:") == 1, run.output
        said = text.split("preload off:")[1].split("[ftrun")[0]
        assert words in said and "workers start the normal way" in said, said
        assert _auto_lines(run) == {"0": "False", "1": "False"}, run.output
        assert "Traceback" not in run.output, run.output
