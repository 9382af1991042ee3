"""Which failure the summary names first: the earliest recorded error, not the first exit."""

from __future__ import annotations

from ftrun.agent.outcome import mark_root_cause
from ftrun.observe.events import WorkerExit


def _exit(rank: int, returncode: int, *, first: bool = False, stopped: bool = False,
          error_at: float | None = None, message: str | None = None) -> WorkerExit:
    return WorkerExit(rank=rank, local_rank=rank, node="n", pid=100 + rank, generation=0,
                      returncode=returncode, time=10.0 + rank, stopped_by_agent=stopped,
                      first=first, message=message or f"error of rank {rank}",
                      error_at=error_at)


def test_the_rank_that_raised_first_is_the_root_cause_even_if_it_exited_later() -> None:
    # rank 0's collective broke because rank 1 raised; rank 0 crashed at exit first.
    exits = [_exit(0, -11, first=True, error_at=9.5), _exit(1, -15, stopped=True, error_at=9.0)]
    marked = mark_root_cause(exits)
    assert [e.rank for e in marked if e.first] == [1]


def test_the_first_exit_stays_first_when_its_error_is_the_earliest() -> None:
    exits = [_exit(0, 1, first=True, error_at=1.0), _exit(1, -15, stopped=True, error_at=2.0)]
    assert mark_root_cause(exits) == exits


def test_without_error_files_the_first_exit_stays_first() -> None:
    exits = [_exit(0, -9, first=True), _exit(1, -15, stopped=True)]
    assert mark_root_cause(exits) == exits


def test_errors_written_after_the_first_exit_are_its_consequences() -> None:
    # rank 0 was SIGKILLed at t=10 (no error file); rank 1's collective then failed.
    exits = [_exit(0, -9, first=True), _exit(1, -15, stopped=True, error_at=10.5)]
    assert mark_root_cause(exits) == exits


def test_just_before_the_exit_seen_a_lost_peer_is_a_consequence_a_raise_is_a_cause() -> None:
    # rank 0 SIGKILLed at ~9.99; the agent saw its exit at 10.0 (late by a GIL wait); rank 1
    # wrote "connection closed" 5 ms before that: a consequence. An exception of the
    # script's own 20 ms before a peer's SIGSEGV at exit is that crash's cause.
    lost = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    exits = [_exit(0, -9, first=True), _exit(1, -15, stopped=True, error_at=9.995,
                                             message=lost)]
    assert mark_root_cause(exits) == exits
    raised = [_exit(0, -11, first=True), _exit(1, 1, error_at=9.98,
                                               message="RuntimeError: injected failure")]
    assert [e.rank for e in mark_root_cause(raised) if e.first] == [1]
    # seen 0.5 s late under load (a CI run named rank 1 for that once): still a consequence
    late = [_exit(0, -9, first=True), _exit(1, -15, stopped=True, error_at=9.5, message=lost)]
    assert mark_root_cause(late) == late
    long_before = [_exit(0, -9, first=True), _exit(1, 1, error_at=8.5, message=lost)]
    assert [e.rank for e in mark_root_cause(long_before) if e.first] == [1]
    # gloo's words for a peer in trouble, whatever the first line (torch 2.13)
    for gloo in ("[gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:4242: This is "
                 "typically caused by a remote worker crashing. Check the logs of the remote "
                 "worker before reporting an error. GLHF!",
                 "[gloo/transport/tcp/pair.cc:530] Read timeout [127.0.0.1]:4242: This is "
                 "typically caused by a remote worker hanging or bugs in the application. "
                 "Check the logs of the remote worker before reporting an error. GLHF!"):
        peer = [_exit(0, -9, first=True), _exit(1, -15, stopped=True, error_at=9.98,
                                                 message=f"RuntimeError: {gloo}")]
        assert mark_root_cause(peer) == peer, gloo


def test_a_worker_that_succeeded_is_never_the_root_cause() -> None:
    exits = [_exit(0, 0, error_at=0.5), _exit(1, 1, first=True, error_at=10.5)]
    assert [e.rank for e in mark_root_cause(exits) if e.first] == [1]


def test_last_error_is_the_final_line_of_the_last_traceback() -> None:
    from ftrun.agent.processes import last_error

    lines = ["[rank1]: warming up\n", "[rank1]: Traceback (most recent call last):\n",
             '[rank1]:   File "a.py", line 3, in <module>\n', "[rank1]:     f()\n",
             "[rank1]:     ^^^\n", "[rank1]: KeyError: 'x'\n", "\n",
             "During handling of the above exception, another exception occurred:\n",
             "Traceback (most recent call last):\n", '  File "a.py", line 5, in <module>\n',
             "ValueError: boom\n", "exiting\n"]
    assert last_error(lines) == "ValueError: boom"  # the last traceback's exception
    assert last_error(lines[:-1]) == "ValueError: boom"
    assert last_error(lines[:6]) == "KeyError: 'x'"
    assert last_error(["just a line\n"]) is None
