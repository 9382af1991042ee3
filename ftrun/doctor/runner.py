"""Running the checks and reporting them: the ``ftrun doctor`` command itself.

* all checks start at once, each in a daemon thread, and the runner stops waiting for a
  check ``--timeout`` seconds after the start: a hung NVML call or DNS lookup becomes a
  ``fail`` for that check, never a hung doctor (the thread is abandoned, and the CLI exits
  with ``os._exit`` so that it cannot block interpreter shutdown either);
* a check that raises becomes a ``fail`` with the exception's one-line summary: no
  traceback ever reaches the user;
* the results go out as a table for people (rich) or one JSON object (``--json``).

The checks themselves are registered by the modules ``ftrun.doctor`` imports; this module
runs whatever is registered.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer

from ftrun.doctor.core import (
    CHECKS,
    STATUSES,
    CheckResult,
    CheckSpec,
    Context,
    failed,
    nvml_hint,
    one_line,
)
from ftrun.doctor.gate import quick_selector
from ftrun.doctor.options import (
    DEFAULT_TIMEOUT_S,
    Options,
    UsageError,
    parse_endpoint,
    parse_nproc,
    parse_port,
    parse_timeout,
)
from ftrun.exitcodes import exit_at_once
from ftrun.host import gpu as gpumod


def _run_one(spec: CheckSpec, ctx: Context, slot: list[CheckResult]) -> None:
    t = time.monotonic()
    try:
        res = spec.fn(ctx)
    except Exception as exc:  # a check that raises is a failing check, not a traceback
        nvml = sys.modules.get("pynvml")
        if nvml is not None and isinstance(exc, nvml.NVMLError):
            res = failed(f"NVML: {exc}", nvml_hint(nvml, exc))
        else:
            res = failed(one_line(exc), "this is a bug in the check or a very broken node")
    slot.append(dataclasses.replace(res, name=spec.name, elapsed_s=time.monotonic() - t))


def run_checks(options: Options | None = None,
               only: Callable[[str], bool] | None = None,
               checks: Sequence[CheckSpec] | None = None) -> list[CheckResult]:
    """Run every check (or those ``only`` selects) in parallel; return their results in
    report order. Never raises for a failing node and never waits much more than
    ``options.timeout`` seconds: a check still running then is reported as a timed-out fail
    (its daemon thread is abandoned).

    ``checks`` defaults to every registered check (``ftrun.doctor.core.CHECKS``).
    """
    import warnings

    warnings.filterwarnings("ignore", message=gpumod.PYNVML_DEPRECATION, category=FutureWarning)
    opts = options or Options()
    ctx = Context(opts)
    registered = CHECKS if checks is None else checks
    specs = [s for s in registered if only is None or only(s.name)]
    if only is None:  # every check: start the slowest lookup before any check asks for it
        ctx.torch.start()  # (a selection imports torch only if one of its checks needs it)
    if opts.nproc_per_node != "cpu":
        ctx.nvml.start()
    running = []
    for spec in specs:
        slot: list[CheckResult] = []
        thread = threading.Thread(target=_run_one, args=(spec, ctx, slot), daemon=True,
                                  name=f"doctor-{spec.name}")
        thread.start()
        running.append((spec, thread, slot))
    deadline = ctx.t0 + opts.timeout
    results = []
    for spec, thread, slot in running:
        thread.join(max(0.0, deadline - time.monotonic()))
        if slot:
            results.append(slot[0])
        else:
            results.append(CheckResult(
                spec.name, "fail", f"timed out: no answer within {opts.timeout:g} s",
                spec.timeout_hint or "something on this node blocks; rerun with a longer --timeout",
                time.monotonic() - ctx.t0))
    return results


def check_selector(names: Sequence[str], within: Callable[[str], bool] | None = None,
                   ) -> Callable[[str], bool] | None:
    """Selects the checks ``--check`` names (each with those under it: ``gpu`` is ``gpu``
    and ``gpu.*``), among those ``within`` selects; None (every check) when both are None.
    Raises UsageError for a name that is no check's."""
    if not names:
        return within
    known = [spec.name for spec in CHECKS]
    for name in names:
        if not any(k == name or k.startswith(f"{name}.") for k in known):
            raise UsageError(f"--check {name!r}: no such check (known: {', '.join(known)})")

    def selected(check: str) -> bool:
        return any(check == n or check.startswith(f"{n}.") for n in names) and (
            within is None or within(check))

    return selected


def report(results: list[CheckResult], elapsed_s: float) -> dict[str, Any]:
    """The ``--json`` document."""
    return {
        "checks": [r.to_dict() for r in results],
        "ok": all(r.status != "fail" for r in results),
        "elapsed_s": round(elapsed_s, 3),
    }


_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def print_table(results: list[CheckResult], elapsed_s: float) -> None:
    """The human report: one row per check, hints only where something is off."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=False)
    table = Table(title="ftrun doctor", title_justify="left", expand=False)
    table.add_column("status", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("finding / [italic]fix[/]")
    for r in results:
        style = _STYLE[r.status]
        text = _escape(r.detail)
        if r.hint and r.status in ("warn", "fail"):
            text += f"\n[italic]fix: {_escape(r.hint)}[/]"
        table.add_row(f"[{style}]{r.status}[/]", r.name, text)
    console.print(table)
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    verdict = "[bold red]NOT READY[/]" if counts["fail"] else "[green]ready[/]"
    console.print(f"{verdict}: {counts['pass']} pass, {counts['warn']} warn, "
                  f"{counts['fail']} fail, {counts['skip']} skip in {elapsed_s:.2f} s")


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


# --------------------------------------------------------------------------- CLI

app = typer.Typer(
    add_completion=False,
    rich_markup_mode=None,  # plain click errors: no boxes, no tracebacks
    pretty_exceptions_enable=False,
    help="Check whether this node can train, before the job starts.",
)


def _usage_error(message: str) -> typer.Exit:
    typer.echo(f"ftrun doctor: error: {message}", err=True)
    return typer.Exit(2)


@app.command()
def doctor(
    nproc_per_node: str = typer.Option(
        "auto", "--nproc-per-node", "--nproc_per_node", envvar="PET_NPROC_PER_NODE",
        metavar="auto|cpu|gpu|N",
        help="auto, cpu, gpu or N workers, as for torchrun; 'gpu' makes a missing GPU a failure.",
    ),
    rdzv_endpoint: str | None = typer.Option(
        None, "--rdzv-endpoint", "--rdzv_endpoint", envvar="PET_RDZV_ENDPOINT",
        metavar="HOST[:PORT]",
        help="host[:port] of the c10d rendezvous store (default port 29400); "
        "checked for reachability.",
    ),
    master_port: str | None = typer.Option(
        None, "--master-port", "--master_port", envvar="PET_MASTER_PORT", metavar="PORT",
        help="Port this node must be able to listen on (default 29500, only warned about).",
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object on stdout."),
    timeout: str = typer.Option(
        str(DEFAULT_TIMEOUT_S), "--timeout", metavar="SECONDS",
        help="Seconds before a check that hangs is failed."),
    quick: bool = typer.Option(
        False, "--quick", help="Only the health gate's quick checks (what a node passes "
        "before it joins a multi-node job: ftrun/doctor/gate.py)."),
    check: Annotated[list[str] | None, typer.Option(
        "--check", metavar="NAME",
        help="Only this check and those under it (e.g. gpu: gpu, gpu.ecc, gpu.nvlink...); "
        "may be given more than once.")] = None,
) -> None:
    """Check this node (GPUs, drivers, NCCL, shim, host limits, network, Slurm) in seconds.

    Exit code 0 when nothing failed, 1 when something failed, 2 on bad usage.
    """
    try:
        options = Options(
            nproc_per_node=parse_nproc(nproc_per_node),
            rdzv_endpoint=rdzv_endpoint or None,
            master_port=parse_port(master_port, "--master-port") if master_port else None,
            timeout=parse_timeout(timeout),
        )
        if options.rdzv_endpoint:
            parse_endpoint(options.rdzv_endpoint)
        only = check_selector(check or [], quick_selector(options.environ) if quick else None)
    except UsageError as exc:
        raise _usage_error(str(exc)) from None
    t0 = time.monotonic()
    results = run_checks(options, only)
    elapsed = time.monotonic() - t0
    if as_json:
        sys.stdout.write(json.dumps(report(results, elapsed)) + "\n")
    else:
        print_table(results, elapsed)
    code = 1 if any(r.status == "fail" for r in results) else 0
    if any(t.name.startswith("doctor-") for t in threading.enumerate()):
        # A check is stuck in a blocking call (NVML, DNS...). Its daemon thread could still
        # hold the import lock or wedge interpreter teardown: leave without teardown, but
        # not without the processes checks started (the shim self-test's worker).
        _kill_children()
        exit_at_once(code)
    raise typer.Exit(code)


def _kill_children() -> None:
    """Kill and reap the processes this process started (only ever ours, by pid)."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
        for child in children:
            child.kill()
        psutil.wait_procs(children, timeout=2)
    except Exception:
        pass


def main(argv: list[str] | None = None) -> None:
    """``python -m ftrun.doctor ARGS``."""
    app(args=argv, prog_name="ftrun doctor")
