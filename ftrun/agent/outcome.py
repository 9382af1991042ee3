"""How one generation of a job ended, in the words both the agent and the regroup
supervisor use: the outcome, the workers' exits, and the cause record another node (or the
leader) wrote into the store, which is read back as untrusted JSON and only described."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from ftrun.observe.events import WorkerExit, describe_returncode


class Outcome(Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # a local worker failed
    REMOTE_FAILED = "remote_failed"  # another node ended the generation
    SIGNALED = "signaled"


@dataclass
class GenerationResult:
    outcome: Outcome
    exits: list[WorkerExit]
    cause: dict[str, Any] | None = None


def describe_cause(cause: dict[str, Any] | None) -> str:
    """One line for a generation's end cause (any shape: it comes from the store)."""
    if not cause:
        return "unknown cause"
    if cause.get("kind") == "node lost":
        return (f"node {cause.get('node_rank')} ({cause.get('node')}) lost: no heartbeat for "
                f"{cause.get('silent_s')} s")
    if cause.get("kind") == "join":
        return f"node {cause.get('node')} ({cause.get('addr')}) joins"
    if cause.get("kind") in ("hang", "frozen"):
        return str(cause.get("detail", "a worker hung"))
    if cause.get("kind") in ("regroup", "dropped", "escalate", "refused", "crash loop"):
        return str(cause.get("reason", "the job could not regroup"))
    code = cause.get("returncode")  # from the store: checked before use
    what = describe_returncode(code) if isinstance(code, int) else f"exit code {code}"
    return f"rank {cause.get('rank')} on {cause.get('node')} ({what})"


# How much later than a peer's "lost peer" error the agent may see the exit that caused
# it: 4 ms measured unloaded, more than 50 ms (the bound until a3df630) in a loaded CI run,
# which then named a peer's gloo error instead of the SIGKILLed rank. A peer's words about
# a lost peer a whole second before any exit was seen are taken as a fault of their own.
_OBSERVED_LATE_S = 1.0
# What a rank's error says when a peer's death broke its collective (gloo, NCCL, the store).
# torch 2.13's gloo ends such errors with "This is typically caused by a remote worker
# crashing" or "... a remote worker hanging or bugs in the application" (a loaded CI run's
# summary named a rank with the second, not the SIGKILLed rank the test killed).
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "Connection refused", "NCCL communicator was aborted", "remote process exited",
              "caused by a remote worker")


def _lost_peer(exit_: WorkerExit, first: WorkerExit) -> bool:
    """An error recorded just before the first exit the agent saw, saying that a peer went
    away: a consequence of that exit, not its cause. The agent sees an exit a few
    milliseconds after it happens (its main thread waits for the GIL behind the log pumps;
    a forked worker's status comes from the fork server), while a peer whose connection the
    dead rank closed writes its error at once (seen: 4 ms under --preload)."""
    message = exit_.message or ""
    close = exit_.error_at is not None and first.time - exit_.error_at <= _OBSERVED_LATE_S
    return close and any(words in message for words in _LOST_PEER)


def mark_root_cause(exits: list[WorkerExit]) -> list[WorkerExit]:
    """Mark as ``first`` the failed worker that recorded its error (its error file's time)
    before the exit the agent saw first: a rank that raises can take longer to exit than
    the peer its exception broke (seen: the raising rank still tearing down gloo while its
    peer, whose collective failed, crashed with SIGSEGV at exit first). Errors recorded
    after that exit, or just before it and saying that a peer went away, are its
    consequences (a SIGKILLed rank writes no error; its peers then do)."""
    first = next((e for e in exits if e.first), None)
    if first is None:
        return exits
    seen_by = min(first.time, first.error_at or first.time)
    earlier = [e for e in exits if not e.ok and e is not first and e.error_at is not None
               and e.error_at < seen_by and not _lost_peer(e, first)]
    if not earlier:
        return exits
    root = min(earlier, key=lambda e: e.error_at or 0.0)
    return [replace(e, first=e is root) for e in exits]


def root_fields(root: WorkerExit | None) -> dict[str, Any]:
    """The root cause's rank, pid, exit status and error for a ``restart`` event: the fault
    record names that rank even when another's exit was seen first (mark_root_cause)."""
    if root is None:
        return {}
    return {"rank": root.rank, "pid": root.pid, "returncode": root.returncode,
            "message": root.message}


def restart_all_words(restart_count: int, max_restarts: int) -> str:
    """What ending the job generation leads to, said when it is ended: 'restarting all'
    only while a restart is left (the agent's loop gives up at ``max_restarts``)."""
    if restart_count < max_restarts:
        return f"restarting all ({restart_count + 1}/{max_restarts})"
    restarts = "no restart left" if max_restarts == 0 else f"all {max_restarts} restarts used"
    return f"the job fails ({restarts})"
