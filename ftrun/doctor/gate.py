"""The health gate: the quick subset of ``ftrun doctor`` that a node passes before it joins a
multi-node job (or stands by as a hot spare node, ``--standby-nodes``).

Why: a node with a broken setup that joins a job costs every other node a re-formed
generation, and a standby that is promoted onto a broken setup fails again at once. The
checks here are the ones that take well under a second on a healthy node and whose
failure means this node's workers would fail: Python too old, ``/dev/shm`` too small,
``GLOO_SOCKET_IFNAME`` or ``NCCL_SOCKET_IFNAME`` naming no usable interface, too few open
files; and, on a node with NVIDIA devices, the GPU checks of NVML. Checks that ask the
network about other nodes (ports, the rendezvous endpoint) are left out: the join itself
answers them.

:func:`health_gate` returns the failures (``"<check>: <detail>"``), an empty list for a
healthy node; warnings do not refuse a node. It never raises for a failing node and is
bounded by ``timeout_s``; unlike ``ftrun doctor``, a check still running then does not
refuse the node (on a loaded machine that proves nothing about the node).
``FTRUN_HEALTH_GATE=0`` in the agent's environment skips it. ``ftrun doctor --quick`` runs
the same checks by hand.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from ftrun.doctor.options import Options

#: The quick checks (names of ``ftrun.doctor`` checks); ``gpu*`` only where a GPU device
#: node exists.
QUICK_CHECKS = ("python", "host.shm", "host.nofile", "net.gloo_ifname", "net.nccl_ifname")
GPU_CHECKS = ("gpu",)
GATE_ENV = "FTRUN_HEALTH_GATE"
DEFAULT_TIMEOUT_S = 2.0
TIMED_OUT = "timed out"  # how ftrun.doctor.runner reports a check past its deadline


def quick_check_names(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The names the gate runs on this node."""
    env = os.environ if environ is None else environ
    gpus = os.path.exists("/dev/nvidia0") and env.get("CUDA_VISIBLE_DEVICES", "x") != ""
    return QUICK_CHECKS + (GPU_CHECKS if gpus else ())


def gate_enabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(GATE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def quick_selector(environ: Mapping[str, str] | None = None) -> Callable[[str], bool]:
    """Selects the gate's checks by name (for ``run_checks(only=...)``, ``ftrun doctor
    --quick``)."""
    wanted = set(quick_check_names(environ))
    return lambda name: name in wanted or any(
        name.startswith(f"{g}.") for g in GPU_CHECKS if g in wanted)


def health_gate(environ: Mapping[str, str] | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Run the quick checks; return one line per failed check (see the module docstring)."""
    from ftrun.doctor import run_checks  # the check registry is imported only when used

    env = dict(os.environ if environ is None else environ)
    names = quick_check_names(env)
    gpus = any(n.startswith("gpu") for n in names)
    options = Options(nproc_per_node="gpu" if gpus else "cpu", timeout=timeout_s,
                      environ=env)
    results = run_checks(options, only=quick_selector(env))
    # A check that did not answer in time proves a busy machine, not a broken node: only
    # a check that ran and failed refuses the node (the join is not held up past timeout_s).
    return [f"{r.name}: {r.detail}" for r in results
            if r.status == "fail" and not r.detail.startswith(TIMED_OUT)]
