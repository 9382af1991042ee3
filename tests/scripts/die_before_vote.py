"""scripts/train_elastic.py with one member that dies between its gradient collective and
its vote: the commit vote tested where it decides something.

    die_before_vote.py TRAIN_ELASTIC --die-at-step S --die-rank R [train_elastic.py's args]

Every process runs the given copy of train_elastic.py unchanged (its training, its lines),
with one seam of the worker API wrapped in this process only: ``Membership.decide``, which
``run_step`` calls after ``compute`` (the gradient collective) has returned. The member that
has rank R in member epoch 0 finishes step S's collective like every other member, then,
instead of voting, waits until every other member's vote on step S is in the store and
SIGKILLs itself. The fault lands after some members voted and before the step's decision:
the count of votes can no longer reach the world size, and every survivor must abort step S
and repeat it in the next member epoch. (A wait on the others' votes, not a timer, makes
the order certain; past ``VOTE_WAIT_S`` the victim exits 3 and says why, so the test fails
on its output rather than on a different fault.)

Every process also prints, for step S in any member epoch, the decision it followed and the
members whose valid votes it found in the store once it had one (tests/lines.py,
``Decision``):

    decision epoch=E step=S value=abort voters=0.0,0.2,0.3 pid=P
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import time

from ftrun import protocol as P
from ftrun.worker.membership import Membership

VOTE_WAIT_S = 60.0  # the other members' votes arrive within a step's time; this only ends it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train_elastic")
    parser.add_argument("--die-at-step", type=int, required=True)
    parser.add_argument("--die-rank", type=int, required=True)
    ours, theirs = parser.parse_known_args()
    decide = Membership.decide

    def die_before_voting(self: Membership, epoch: int, step: int) -> None:
        others = [P.vote_key(epoch, step, m) for m in self.members if m != self.member_id]
        deadline = time.monotonic() + VOTE_WAIT_S
        while not self.store.exist_all(others):
            if time.monotonic() > deadline:
                print(f"die_before_vote: the other members' votes on step {step} did not "
                      f"arrive in {VOTE_WAIT_S} s", flush=True)
                os._exit(3)
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGKILL)

    def decide_and_say(self: Membership, epoch: int, step: int, voted: bool) -> str:
        if (step == ours.die_at_step and epoch == 0
                and self.members.index(self.member_id) == ours.die_rank):
            die_before_voting(self, epoch, step)
        decision = decide(self, epoch, step, voted)
        if step == ours.die_at_step:
            keys = {m: P.vote_key(epoch, step, m) for m in self.members}
            found = self.store.present_records(list(keys.values()))
            voters = [m for m, key in keys.items() if found.get(key) is not None]
            print(f"decision epoch={epoch} step={step} value={decision} "
                  f"voters={','.join(voters) or '-'} pid={os.getpid()}", flush=True)
        return decision

    Membership.decide = decide_and_say  # type: ignore[method-assign]
    sys.argv = [ours.train_elastic, *theirs]
    runpy.run_path(ours.train_elastic, run_name="__main__")


if __name__ == "__main__":
    main()
