"""The stuck and stalled verdicts (ftrun.decide.progress), at their edges, with a fake clock."""

from __future__ import annotations

from ftrun.decide.progress import STUCK_FLOOR_S, Observation, ProgressWatch

FLOOR = 5.0


def obs(member: str, epoch: int, steps: int, collectives: int = 0) -> Observation:
    return Observation(member, epoch, steps, collectives)


def stepped(watch: ProgressWatch, members: list[str], upto: int, every_s: float,
            start: float = 0.0, epoch: int = 0) -> float:
    """Members commit steps 1..upto inside ``epoch``, one every ``every_s``; returns the
    clock after the last."""
    now = start
    for step in range(1, upto + 1):
        now += every_s
        assert watch.observe(now, [obs(m, epoch, step) for m in members], {}) == []
    return now


def test_the_limit_is_the_floor_until_steps_make_it_longer() -> None:
    watch = ProgressWatch(FLOOR)
    assert watch.limit_s() == FLOOR and watch.median_step_s is None
    stepped(watch, ["a", "b"], upto=5, every_s=0.1)
    assert watch.limit_s() == FLOOR  # 20 x 0.1 s = 2 s < the floor
    watch = ProgressWatch(FLOOR)
    stepped(watch, ["a", "b"], upto=5, every_s=1.0)
    assert watch.median_step_s == 1.0 and watch.limit_s() == 20.0


def test_a_member_behind_the_others_inside_one_epoch_is_stalled_at_the_limit() -> None:
    watch = ProgressWatch(FLOOR)
    now = stepped(watch, ["a", "b", "c"], upto=5, every_s=1.0)  # limit 20 s
    seen = [obs("a", 0, 5, 3), obs("b", 0, 5, 3), obs("c", 0, 5, 0)]
    assert watch.observe(now, seen, {}) == []
    assert watch.observe(now + 19.9, seen, {}) == []
    verdicts = watch.observe(now + 20.1, seen, {})
    assert [v.member for v in verdicts] == ["c"]
    assert "stalled: no progress for 20.1s (limit 20.0s)" in verdicts[0].cause


def test_everyone_at_the_same_point_is_nobodys_stall() -> None:
    watch = ProgressWatch(FLOOR)
    now = stepped(watch, ["a", "b"], upto=3, every_s=1.0)
    seen = [obs("a", 0, 3, 2), obs("b", 0, 3, 2)]
    assert watch.observe(now + 10_000, seen, {}) == []


def test_no_stall_verdict_before_a_step_interval_is_known() -> None:
    watch = ProgressWatch(FLOOR)
    seen = [obs("a", 0, 0, 1), obs("b", 0, 0, 0)]
    assert watch.observe(0.0, seen, {}) == []
    assert watch.observe(1000.0, seen, {}) == []


def test_the_convergence_case_the_member_stuck_in_the_ended_epoch_is_the_culprit() -> None:
    """The case that killed healthy members: rank 2 died in epoch 0; ranks 0 and 1 left the
    ended epoch and wait for the next one (between epochs: -1), rank 3 never left epoch 0.
    The old rule compared them all, found 0 and 1 'behind' (-1 < 4) and killed them."""
    watch = ProgressWatch(FLOOR)
    now = stepped(watch, ["0.0", "0.1", "0.3"], upto=4, every_s=0.2)  # stuck limit: 5 s
    ended = {0: now}
    seen = [obs("0.0", -1, 4), obs("0.1", -1, 4), obs("0.3", 0, 4, 2)]
    assert watch.observe(now + 1.0, seen, ended) == []
    assert watch.observe(now + STUCK_FLOOR_S, seen, ended) == []  # not past the limit
    verdicts = watch.observe(now + STUCK_FLOOR_S + 0.1, seen, ended)
    assert [v.member for v in verdicts] == ["0.3"]
    assert verdicts[0].cause.startswith("stuck in member epoch 0, which ended and was "
                                        "followed 5.1s ago (limit 5.0s)")
    # the members waiting between epochs are never judged, however long they wait
    assert watch.observe(now + 1000, [obs("0.0", -1, 4), obs("0.1", -1, 4)], ended) == []


def test_members_inside_different_epochs_are_not_compared() -> None:
    """A joiner's epoch 1 published: the members step on in epoch 0 until their next
    commit, one already in 1 waits for the others there. Nobody lags anybody."""
    watch = ProgressWatch(FLOOR)
    now = stepped(watch, ["a", "b", "c"], upto=5, every_s=0.2)
    seen = [obs("a", 1, 6), obs("b", 0, 5, 3), obs("c", 0, 5, 3)]
    assert watch.observe(now + 100, seen, {}) == []  # epoch 0 not ended: not stuck either


def test_a_member_inside_an_ended_epoch_is_stuck_only_after_the_limit_from_the_end() -> None:
    watch = ProgressWatch(FLOOR)
    now = stepped(watch, ["a", "b"], upto=5, every_s=1.0)  # stuck limit max(5, 3 x 1) = 5 s
    ended = {0: now + 100.0}  # ended long after the last step
    seen = [obs("a", 0, 5, 1), obs("b", 1, 5)]
    assert watch.observe(now + 104.9, seen, ended) == []
    assert [v.member for v in watch.observe(now + 105.1, seen, ended)] == ["a"]


def test_a_publication_restarts_the_clocks() -> None:
    watch = ProgressWatch(FLOOR)
    now = stepped(watch, ["a", "b"], upto=3, every_s=1.0)  # limit 20 s
    seen = [obs("a", 0, 3, 1), obs("b", 0, 3, 0)]
    watch.observe(now, seen, {})
    watch.restart_clocks(now + 15)
    assert watch.observe(now + 30, seen, {}) == []  # 15 s since the publication
    assert [v.member for v in watch.observe(now + 35.5, seen, {})] == ["b"]


def test_step_intervals_are_counted_inside_one_epoch_only() -> None:
    watch = ProgressWatch(FLOOR)
    watch.observe(0.0, [obs("a", 0, 1)], {})
    watch.observe(1.0, [obs("a", 0, 2)], {})  # 1 s
    watch.observe(50.0, [obs("a", 1, 2)], {})  # a new epoch: no interval
    watch.observe(52.0, [obs("a", 1, 3)], {})  # 2 s, counted from entering epoch 1
    assert sorted(watch.intervals) == [1.0, 2.0]


def test_the_stuck_limit_is_three_steps_not_twenty() -> None:
    watch = ProgressWatch(FLOOR)
    now = stepped(watch, ["a", "b"], upto=5, every_s=2.0)  # stall limit 40 s, stuck 6 s
    assert watch.limit_s() == 40.0 and watch.stuck_limit_s() == 6.0
    ended = {0: now}
    seen = [obs("a", 0, 5, 1), obs("b", -1, 5)]
    assert watch.observe(now + 6.0, seen, ended) == []
    assert [v.member for v in watch.observe(now + 6.1, seen, ended)] == ["a"]


def test_the_stuck_clock_runs_from_the_next_epoch_not_from_the_end() -> None:
    """Epoch 0 ended at t; the leader published epoch 1 only 4 s later (it waited for a
    held node's NCCL abort, which must come first: a member blocked in NCCL cannot leave
    before it). Counted from the end the member would be stuck at t + 5.1; counted from
    the publication it is judged only at t + 9.1 (CI: two healthy members of the held node
    taken out, the job below its minimum nodes failed)."""
    watch = ProgressWatch(FLOOR)
    now = stepped(watch, ["0.0", "1.0"], upto=4, every_s=0.2)
    ended, superseded = {0: now}, {0: now + 4.0}
    seen = [obs("0.0", -1, 4), obs("1.0", 0, 4, 2)]
    assert watch.observe(now + STUCK_FLOOR_S + 0.1, seen, ended, superseded=superseded) == []
    assert watch.observe(now + 3.9 + STUCK_FLOOR_S, seen, ended, superseded=superseded) == []
    verdicts = watch.observe(now + 4.0 + STUCK_FLOOR_S + 0.1, seen, ended,
                             superseded=superseded)
    assert [v.member for v in verdicts] == ["1.0"]
    # an ended epoch not yet followed by another: nobody waits in a next one, no verdict
    assert watch.observe(now + 100, seen, ended, superseded={}) == []
