"""The command line: torchrun's flags and spellings, and every kind of bad input.

Parsing is checked in-process on the real parser; bad input is checked on the real
``ftrun`` program, which must answer with one line and exit 2 without starting anything.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ftrun.cli import config_from_args
from ftrun.config import ConfigError, Std
from tests.launch import launcher


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('ran')\n")
    return path


def test_torchrun_flags_in_both_spellings_and_prefixes(script: Path) -> None:
    config = config_from_args(
        ["--nproc_per_node", "3", "--max-restarts=2", "--monitor_interval", "0.5",
         "--role", "trainer", "-t", "0:1,1:3", "--local_ranks_filter", "0,2",
         str(script), "--lr", "0.1", "--nproc-per-node", "9"],
        {},
    )
    assert config.nproc_per_node == 3
    assert config.max_restarts == 2
    assert config.monitor_interval_s == 0.5
    assert config.role == "trainer"
    assert config.tee.for_rank(1) is Std.ALL and config.tee.for_rank(0) is Std.OUT
    assert config.local_ranks_filter == frozenset({0, 2})
    # Everything after the script is the script's, untouched, even launcher-like flags.
    assert config.args == ("--lr", "0.1", "--nproc-per-node", "9")


def test_unambiguous_prefix(script: Path) -> None:
    assert config_from_args(["--nproc-per", "4", str(script)], {}).nproc_per_node == 4
    assert config_from_args(["--nproc", "2", str(script)], {}).nproc_per_node == 2


def test_pet_environment_fallback_and_flag_precedence(script: Path) -> None:
    env = {"PET_NPROC_PER_NODE": "5", "PET_MAX_RESTARTS": "7", "PET_STANDALONE": "1"}
    config = config_from_args([str(script)], env)
    assert (config.nproc_per_node, config.max_restarts, config.standalone) == (5, 7, True)
    assert config_from_args(["--nproc-per-node", "2", str(script)], env).nproc_per_node == 2


def test_ftrun_options_have_env_fallbacks(script: Path) -> None:
    env = {"FTRUN_HEARTBEAT_INTERVAL": "0.5", "FTRUN_HEARTBEAT_TIMEOUT": "3",
           "FTRUN_STOP_GRACE": "4", "FTRUN_SHIM": "0", "FTRUN_EVENTS_FILE": "/tmp/e.jsonl"}
    config = config_from_args([str(script)], env)
    assert config.heartbeat_interval_s == 0.5 and config.heartbeat_timeout_s == 3.0
    assert config.shutdown_timeout_s == 4.0
    assert config.use_shim is False
    assert config_from_args([str(script)], {"FTRUN_SHIM": "1"}).use_shim is True
    assert config.events_file == Path("/tmp/e.jsonl")


def test_single_node_takes_a_free_port_like_torchrun(script: Path) -> None:
    config = config_from_args([str(script)], {})
    assert (config.rdzv_port, config.rdzv_host) == (0, "localhost")
    static = config_from_args(["--master-port", "29611", str(script)], {})
    assert (static.rdzv_port, static.rdzv_backend) == (29611, "static")


def test_worker_command_forms(script: Path) -> None:
    assert config_from_args([str(script), "a"], {}).worker_command()[1:] == ["-u", str(script), "a"]
    assert config_from_args(["-m", "json.tool", "x"], {}).worker_command()[1:] == [
        "-u", "-m", "json.tool", "x"]
    assert config_from_args(["--no-python", "true", "x"], {}).worker_command() == ["true", "x"]


def test_signals_and_nnodes_parsing(script: Path) -> None:
    config = config_from_args(["--signals-to-handle", "SIGTERM,USR1", str(script)], {})
    assert config.signals_to_handle == (signal.SIGTERM, signal.SIGUSR1)
    with pytest.raises(ConfigError, match="cannot be handled"):
        config_from_args(["--signals-to-handle", "SIGKILL", str(script)], {})


def _run_ftrun(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [launcher(), *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )


def _assert_usage_error(result: subprocess.CompletedProcess[str], needle: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ftrun: error:")
    assert needle in lines[0]
    assert "Traceback" not in result.stderr
    assert "ran" not in result.stdout  # the script never started


@pytest.fixture
def busy_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["missing.py"], "no such file"),
        (["--nproc-per-node", "0", "{script}"], "at least 1"),
        (["--nproc-per-node", "abc", "{script}"], "expected a number"),
        (["--nnodes", "3:2", "{script}"], "MIN <= MAX"),
        (["--no-such-flag", "{script}"], "unrecognized arguments"),
        (["--master-addr", "no-such-host.invalid", "--master-port", "29612", "{script}"],
         "cannot resolve"),
        (["--master-port", "{busy_port}", "{script}"], "in use"),
        (["--numa-binding", "node", "{script}"], "not supported"),
        (["--logs-specs", "custom", "{script}"], "not supported"),
        (["--rdzv-backend", "etcd", "{script}"], "static and c10d"),
        (["--max-restarts", "-1", "{script}"], "negative"),
        (["--recovery", "sometimes", "{script}"], "auto, restart or regroup"),
        (["--redirects", "9", "{script}"], "expected 0-3"),
        (["--nnodes", "2", "--standby-nodes", "1", "--recovery", "regroup", "--rdzv-backend",
          "static", "--node-rank", "0", "{script}"], "c10d or etcd-v3"),
        ([], "required"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], needle: str, script: Path, busy_port: int
) -> None:
    filled = [a.format(script=script, busy_port=busy_port) for a in args]
    _assert_usage_error(_run_ftrun(*filled), needle)


def _as_unprivileged() -> list[str]:
    """A command prefix that runs a program as ``nobody``: root reads any file, so the
    "not readable" path is only reached without root's privileges."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to run a check as nobody when root"
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_unreadable_script() -> None:
    # Outside pytest's tmp_path, whose parent is private to the user running the tests:
    # nobody must reach the file to find it unreadable (else it is "no such file").
    directory = Path(tempfile.mkdtemp(prefix="ftrun-unreadable-"))
    try:
        directory.chmod(0o755)
        target = directory / "x.py"
        target.write_text("print('ran')\n")
        target.chmod(0)
        result = subprocess.run([*_as_unprivileged(), launcher(), str(target)],
                                capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(directory)
    _assert_usage_error(result, "not readable")


def test_a_program_that_cannot_be_executed_is_bad_input_not_an_internal_error(
        tmp_path: Path) -> None:
    """``--no-python ./x`` where ./x exists and is executable but names a missing
    interpreter: exec fails (ENOENT) before any worker runs. That is the user's input, not
    a bug in ftrun, so it is one line and exit 2 like every bad input (README), not exit 70,
    "internal error ... please report it" and a crash file. Fails today (ftrun/cli.py turns
    the OSError from ftrun/agent/processes.py spawn into an internal error)."""
    program = tmp_path / "x"
    program.write_text("#!/nonexistent/interpreter\nprint('ran')\n")
    program.chmod(0o755)
    _assert_usage_error(_run_ftrun("--no-python", str(program)), str(program))



def test_a_program_whose_bare_interpreter_cannot_be_found_is_bad_input_at_its_start(
        tmp_path: Path) -> None:
    """``--no-python ./x`` where ./x's ``#!`` names a bare word (``#!no-such-python``),
    which ftrun leaves to exec to judge: exec fails (ENOENT) when the worker starts, after
    the job began. Still the user's input: one line and exit 2, not exit 70 ("internal
    error") and a crash file."""
    program = tmp_path / "x"
    program.write_text("#!no-such-python-interpreter\nprint('ran')\n")
    program.chmod(0o755)
    result = _run_ftrun("--no-python", str(program), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [x for x in result.stderr.splitlines() if "error" in x.lower()]
    assert len(errors) == 1 and f"cannot run {program}" in errors[0], result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    assert "ran" not in result.stdout


def test_version_and_module_entry() -> None:
    result = _run_ftrun("--version")
    assert result.returncode == 0 and result.stdout.startswith("ftrun ")
    module = subprocess.run(
        [sys.executable, "-m", "ftrun", "--version"], capture_output=True, text=True, timeout=60
    )
    assert module.returncode == 0 and module.stdout == result.stdout


def test_script_named_like_a_subcommand(tmp_path: Path) -> None:
    (tmp_path / "doctor").write_text("print('ran the script')\n")
    result = _run_ftrun("./doctor", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "ran the script" in result.stdout
    dashed = _run_ftrun("--", "doctor", cwd=tmp_path)
    assert dashed.returncode == 0 and "ran the script" in dashed.stdout


def _in_time_wait(port: int) -> bool:
    """Whether a TCP socket whose local port is ``port`` is in TIME_WAIT (state 06 of
    /proc/net/tcp and tcp6, where ports are hexadecimal)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                local, state = row.split()[1], row.split()[3]
                if int(local.rsplit(":", 1)[1], 16) == port and state == "06":
                    return True
    return False


def test_port_check_refuses_a_listener_but_not_a_just_ended_job(script: Path) -> None:
    """A port someone listens on is refused; one whose last job's connections linger in
    TIME_WAIT (an agent re-run at once on the same --master-port) is not: the store binds
    over those, and so must the check, in-process and in the real program."""
    from ftrun.config import check_port_free

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    with pytest.raises(ConfigError, match="port is in use"):
        check_port_free(port, "--master-port")
    _assert_usage_error(_run_ftrun("--master-port", str(port), str(script)), "in use")
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server side closes first: its end of the pair waits in TIME_WAIT
    client.close()
    listener.close()
    # The case under test must really be there: without a TIME_WAIT socket on the port the
    # check would pass whatever it does with SO_REUSEADDR.
    deadline = time.monotonic() + 10
    while not _in_time_wait(port):
        assert time.monotonic() < deadline, f"no TIME_WAIT socket on port {port}"
        time.sleep(0.01)
    check_port_free(port, "--master-port")
    assert _in_time_wait(port), "the TIME_WAIT socket is gone (it lasts a minute)"
    rerun = _run_ftrun("--master-port", str(port), str(script))
    assert rerun.returncode == 0, rerun.stderr
    assert "[rank0]: ran" in rerun.stdout
