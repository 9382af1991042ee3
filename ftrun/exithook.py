"""A clean exit for workers whose script ends on an uncaught exception.

Why: a script written for torchrun seldom destroys its process groups when it raises.
Python then tears the interpreter down while torch's gloo threads still hold work objects
whose tensors refer back into it, and now and then the process aborts (SIGABRT, "terminate
called without an active exception") instead of exiting with status 1: the agent then reads
a signal, and the job's output a fatal-error dump, for what was a plain Python error.
(torch's own proposal to destroy the groups at exit, pytorch/pytorch#179291, was
withdrawn; it would apply to every exit, while this applies only to the failing one.)

How it reaches an unmodified script: the agent puts the package's ``_exit_site`` directory,
which holds only a ``sitecustomize.py`` stub, first on the worker's ``PYTHONPATH`` and names
it in ``FTRUN_EXIT_HOOK`` (the original ``PYTHONPATH``, if any, in
``FTRUN_EXIT_HOOK_PYTHONPATH``). At interpreter start the stub calls :func:`boot`, which
installs the hook, takes the directory back out of ``sys.path`` and the environment (the
script and its children see exactly what they would under torchrun) and runs the
``sitecustomize`` that would otherwise have run. A ``--preload`` worker, forked from a server
that started long before, calls :func:`adopt` instead. Nothing here imports torch or ftrun.

What the hook does on an uncaught exception: Python's own hook (or the one the script set)
prints the traceback first, as always; then, if the script initialised
``torch.distributed``, every process group is destroyed while the interpreter is whole.
A gloo group's threads stop only when its last reference goes, and two references outlive
a failed script on their own: the failed frames' locals (the model, whose DDP reducer holds
the group), kept by the traceback; and the default arguments of
``torch.distributed.nn.functional`` (``group=group.WORLD``, evaluated when that module is
first imported, which DDP does after ``init_process_group``). The hook clears the first and
resets the second to ``None`` before the destroy. A model kept in a module global still
holds its group: such a script exits as it would under torchrun.

The destroy is bounded by ``DESTROY_TIMEOUT_S``: one that does not return (an NCCL destroy
waiting for a peer) ends the process with ``os._exit(1)`` after flushing the standard
streams, the status an uncaught exception gives anyway. Errors in the destroy are swallowed:
the traceback that matters was already printed.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
import threading
import traceback
from types import TracebackType

from ftrun.exitcodes import exit_at_once

ENV_DIR = "FTRUN_EXIT_HOOK"
ENV_PYTHONPATH = "FTRUN_EXIT_HOOK_PYTHONPATH"
DESTROY_TIMEOUT_S = 10.0
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_exit_site")


def point_at(env: dict[str, str]) -> None:
    """Make a worker environment start the hook (the agent's side)."""
    env[ENV_DIR] = SITE_DIR
    if "PYTHONPATH" in env:
        env[ENV_PYTHONPATH] = env["PYTHONPATH"]
        env["PYTHONPATH"] = f"{SITE_DIR}{os.pathsep}{env['PYTHONPATH']}"
    else:
        env["PYTHONPATH"] = SITE_DIR


def boot(stub_path: str) -> None:
    """Run by the agent's ``sitecustomize`` stub at interpreter start."""
    here = os.path.dirname(os.path.abspath(stub_path))
    sys.path[:] = [p for p in sys.path if not p or os.path.abspath(p) != here]
    adopt()
    stub = sys.modules.pop("sitecustomize")
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as error:
        if error.name != "sitecustomize":
            raise
    finally:
        # the import that is running the stub reads the module back from sys.modules
        sys.modules.setdefault("sitecustomize", stub)


def adopt() -> None:
    """Install the hook if the agent asked for it, and restore the environment."""
    if os.environ.pop(ENV_DIR, None) is None:
        return
    original = os.environ.pop(ENV_PYTHONPATH, None)
    if original is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = original
    previous = sys.excepthook

    def on_uncaught(kind: type[BaseException], value: BaseException,
                    tb: TracebackType | None) -> None:
        previous(kind, value, tb)
        if "torch.distributed" in sys.modules:
            release_failed_frames(value, tb)
            destroy_process_groups(DESTROY_TIMEOUT_S)

    sys.excepthook = on_uncaught


def release_failed_frames(value: BaseException, tb: TracebackType | None) -> None:
    """Drop what the failed script's frames and torch's default arguments keep alive."""
    traceback.clear_frames(tb)
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    value.__traceback__ = None
    functional = sys.modules.get("torch.distributed.nn.functional")
    group_type = getattr(sys.modules.get("torch.distributed"), "ProcessGroup", None)
    if functional is not None and isinstance(group_type, type):
        for item in vars(functional).values():
            defaults = getattr(item, "__defaults__", None)
            if isinstance(defaults, tuple) and any(isinstance(d, group_type) for d in defaults):
                item.__defaults__ = tuple(None if isinstance(d, group_type) else d
                                          for d in defaults)
    gc.collect()


def destroy_process_groups(timeout_s: float) -> None:
    """Destroy torch's process groups if the script made any; ``os._exit(1)`` when that
    does not finish within ``timeout_s``. Never raises."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
    except Exception:  # a half-imported torch: nothing to clean
        return
    done = threading.Event()

    def destroy() -> None:
        try:
            with contextlib.suppress(Exception):  # the exception that matters was printed
                dist.destroy_process_group()
        finally:
            done.set()

    threading.Thread(target=destroy, name="ftrun-exit", daemon=True).start()
    if done.wait(timeout_s):
        gc.collect()  # the groups' last references: their threads are joined here
    else:
        exit_at_once(1)
