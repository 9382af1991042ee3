"""``ftrun inject --job RUN_ID|HOST:PORT KIND key=value ...``: a fault, now, in a running job.

The request goes through the job's control store as a control record signed with the job
token (``FTRUN_JOB_TOKEN`` / ``FTRUN_JOB_TOKEN_FILE``, the same as the agents'); the agent
that holds the rank executes it (ftrun.agent.inject) and answers. Before anything is
written, the command checks what it can, so that bad input leaves the job untouched:

* the fault parses (ftrun.client.faultspec: an unknown kind is one line);
* the job's record (``ftrun/job``) verifies with this token: a job that signs its records
  refuses a command without the token or with another one;
* the rank (or node) exists in the job's current world.

Exit codes: 0 injected; 2 bad input (the fault, the token, a rank that does not exist, a
script that cannot take a hang or raise); 3 the store cannot be reached, or no agent
answered within ``--timeout`` (default 10 s). Every error is one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from ftrun.client.faultspec import NODE_KINDS, FaultSpecError, parse_item
from ftrun.client.jobref import JobRef, JobRefError, resolve
from ftrun.control.auth import AuthError, Signer, TokenError, load_secret
from ftrun.exitcodes import ExitCode

POLL_S = 0.05  # between two looks at the agent's answer (a check, never a blocking wait)


class InjectError(Exception):
    """One line for the user, and the exit code."""

    def __init__(self, message: str, code: int = ExitCode.USAGE) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise InjectError(message)


def _parser() -> _Parser:
    parser = _Parser(prog="ftrun inject", description="Inject a fault into a running job now.")
    parser.add_argument("--job", required=True,
                        help="the job: HOST:PORT of its control store, "
                        "etcd-v3://HOST:PORT,.../RUN_ID, or its run id (on the leader's "
                        "host; on any node of an etcd-v3 job)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for the store and the agent's answer")
    parser.add_argument("fault", nargs="+", help="KIND key=value ... (e.g. kill rank=3)")
    return parser


def read_job(client: Any, signer: Signer, key: str = "ftrun/job") -> dict[str, Any]:
    """The job's record (``key``: ``ftrun/job`` in a job's TCPStore, ``ftrun/<run
    id>/job`` on etcd), checked against this command's token."""
    if not client.check([key]):
        raise InjectError("no ftrun job record in that store (is it an ftrun job's control "
                          "store, and has it started?)")
    try:
        record = json.loads(client.get(key))
    except (ValueError, UnicodeDecodeError):
        raise InjectError("the job record in that store is not JSON") from None
    if not signer.enabled and isinstance(record, dict) and isinstance(record.get("mac"), str):
        raise InjectError("the job signs its control records: set FTRUN_JOB_TOKEN (or "
                          "FTRUN_JOB_TOKEN_FILE) to its token")
    try:
        body = signer.unwrap(key, record)
    except AuthError:
        raise InjectError("refused: this token is not the job's (its records do not verify "
                          "with it)") from None
    if not isinstance(body.get("run_id"), str) or not isinstance(body.get("world_size"), int):
        raise InjectError("the job record in that store is malformed")
    return body


def open_job(name: str, timeout_s: float) -> tuple[JobRef, Signer, Any]:
    """The job named ``name`` (ftrun.client.jobref), this command's token and a client of the
    job's store, reached within ``timeout_s``. Raises InjectError (its code says which exit:
    bad input 2, an unreachable store 3)."""
    from ftrun.control.errors import StoreError

    try:
        ref = resolve(name)
        signer = Signer(load_secret())
    except (JobRefError, TokenError) as error:
        raise InjectError(str(error)) from None
    try:
        return ref, signer, ref.connect(timeout_s)
    except JobRefError as error:
        raise InjectError(str(error)) from None
    except StoreError as error:
        raise InjectError(f"cannot reach the job's store ({ref.describe()}): {error}",
                          ExitCode.RENDEZVOUS_FAILED) from None


def run(args: Sequence[str]) -> str:
    """Inject; returns what was done. Raises :class:`InjectError`."""
    ns = _parser().parse_args(list(args))
    try:
        fault = parse_item(" ".join(ns.fault))
    except FaultSpecError as error:
        raise InjectError(str(error)) from None
    if fault.step is not None or fault.after_s is not None or fault.random_rank:
        raise InjectError("ftrun inject acts now on a given rank: step=, after= and "
                          "rank=random belong to --inject schedules")
    if not 0 < ns.timeout <= 3600:
        raise InjectError("--timeout must be in (0, 3600] seconds")
    ref, signer, client = open_job(ns.job, ns.timeout)
    where = ref.describe()
    from ftrun.control.errors import StoreError
    from ftrun.control.store import JsonStore

    try:
        job = read_job(client, signer, ref.job_key)
        world, nnodes = job["world_size"], job.get("nnodes")
        if fault.rank is not None and not fault.rank < world:
            raise InjectError(f"rank {fault.rank} does not exist: the job has {world} ranks "
                              f"(0..{world - 1})")
        if fault.kind in NODE_KINDS and isinstance(nnodes, int) and \
                not (fault.node or 0) < nnodes:
            raise InjectError(f"node {fault.node} does not exist: the job has {nnodes} nodes")
        store = JsonStore(client, f"ftrun/{job['run_id']}", signer=signer)
        number = store.add("inject/next", 1)
        store.set_record(f"inject/{number}", fault.to_json())
        if fault.kind == "kill-agent":
            return f"sent: {fault.text} (request {number})"
        deadline = time.monotonic() + ns.timeout
        prefix = f"inject/{number}/done/"
        while time.monotonic() < deadline:
            answers = [store.get_record(f"{prefix}{node}") for node in range(nnodes or 1)
                       if store.exists(f"{prefix}{node}")]
            for answer in answers:
                if answer is None:
                    continue
                if answer.get("ok") is True:
                    return f"injected: {answer.get('detail')}"
                raise InjectError(f"refused by the job: {answer.get('detail')}")
            time.sleep(POLL_S)
    except StoreError as error:
        raise InjectError(f"the job's store ({where}) failed: {error}",
                          ExitCode.RENDEZVOUS_FAILED) from None
    raise InjectError(f"no agent answered request {number} within {ns.timeout:g} s",
                      ExitCode.RENDEZVOUS_FAILED)


def main(args: Sequence[str]) -> int:
    try:
        print(run(args))
    except InjectError as error:
        print(f"ftrun inject: error: {error}", file=sys.stderr)
        return error.code
    return ExitCode.SUCCESS
