"""A worker whose script raises ends cleanly: its process groups are destroyed while the
interpreter is whole (ftrun/exithook.py), so the exit is status 1, not a SIGABRT while
torch's gloo threads are torn down. The hook reaches unmodified scripts, started the
normal way and forked by ``--preload``, and leaves no trace the script can see."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.launch import Launch

SCRIPT = """
import atexit, json, os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

def gloo_threads():
    names = (open(f"/proc/self/task/{t}/comm").read().strip()
             for t in os.listdir("/proc/self/task"))
    return sorted(n for n in names if "gloo" in n)

def report():  # registered after the hook: runs after it, before the interpreter ends
    print("AT_EXIT " + json.dumps({"initialized": dist.is_initialized(),
                                   "gloo_threads": bool(gloo_threads()),
                                   "pythonpath": os.environ.get("PYTHONPATH"),
                                   "hook_env": sorted(k for k in os.environ
                                                      if k.startswith("FTRUN_EXIT")),
                                   "site_on_path": any("_exit_site" in p for p in sys.path)}),
          flush=True)

def main():  # as scripts for torchrun are written: the model is main's
    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(8, 1))  # imports torch.distributed.nn
    model(torch.randn(4, 8)).sum().backward()
    print("RUNNING " + json.dumps({"gloo_threads": bool(gloo_threads())}), flush=True)
    atexit.register(report)
    if sys.argv[1] == "raise":
        raise RuntimeError("boom on purpose")

main()
"""


def _at_exit(run: Launch) -> dict:
    line = next(x for x in run.lines if "AT_EXIT " in x)
    return json.loads(line[line.index("AT_EXIT ") + len("AT_EXIT "):])


# A forked worker exits by the same hook as a spawned one (long tier).
@pytest.mark.parametrize("preload", [False, pytest.param(True, marks=pytest.mark.long)],
                         ids=["spawned", "preloaded"])
def test_a_raising_worker_destroys_its_groups_and_exits_1(job_dir: Path, preload: bool) -> None:
    script = job_dir / "raiser.py"
    script.write_text(SCRIPT)
    flags = ["--preload", "torch"] if preload else []
    user_path = job_dir / "user-path"
    user_path.mkdir()
    (user_path / "sitecustomize.py").write_text("print('USER SITECUSTOMIZE ran', flush=True)\n")
    env = {"PYTHONPATH": str(user_path)}
    run = Launch([*flags, "--nproc-per-node", "1", "--max-restarts", "0", str(script),
                  "raise"], cwd=job_dir, env=env)
    assert run.wait(120) == 1, run.output
    seen = _at_exit(run)
    # the hook ran after the traceback, before the script's own exit handlers, and gloo's
    # threads, alive while it ran, were joined (DDP's reducer and torch.distributed.nn's
    # default arguments held the group)
    assert '"gloo_threads": true' in run.output, run.output
    assert seen["initialized"] is False and seen["gloo_threads"] is False, seen
    assert "RuntimeError: boom on purpose" in run.output
    assert "rank 0 (pid" in run.output and "failed: exit code 1" in run.output, run.output
    assert "Fatal Python error" not in run.output and "Error in sitecustomize" not in run.output
    # the script saw its own PYTHONPATH and nothing of the hook
    assert seen["pythonpath"] == env["PYTHONPATH"], seen
    assert seen["hook_env"] == [] and seen["site_on_path"] is False, seen
    if not preload:  # the script's own sitecustomize still ran (the fork server's ran once)
        assert "USER SITECUSTOMIZE ran" in run.output, run.output


def test_a_successful_worker_keeps_its_groups_to_the_end(job_dir: Path) -> None:
    """Only an uncaught exception triggers the hook: a script that ends normally finds its
    group as it left it, as under torchrun, and the PYTHONPATH the launcher was given."""
    script = job_dir / "ender.py"
    script.write_text(SCRIPT)
    run = Launch(["--nproc-per-node", "1", str(script), "end"], cwd=job_dir)
    assert run.wait(120) == 0, run.output
    seen = _at_exit(run)
    assert seen == {"initialized": True, "gloo_threads": True,
                    "pythonpath": os.environ.get("PYTHONPATH"), "hook_env": [],
                    "site_on_path": False}, seen
    assert "Error in sitecustomize" not in run.output, run.output  # no other one to run
