"""tests/lines.py: the parser of the scripts' lines and the regroup invariant checker.

The end-to-end tests trust these two to see a broken recovery; here the parser reads
output of the real training script (a run with one fault) and lines copied from real
runs, and the checker is shown to fail on each kind of tampering it exists to catch.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from tests.launch import REPO, Launch
from tests.lines import (
    Blocking,
    Done,
    ElasticStep,
    Finished,
    Line,
    Regroup,
    Released,
    Resumed,
    Start,
    Step,
    Victim,
    assert_steps_consecutive,
    check_regroup_invariants,
    find,
    parse,
    parse_line,
    select,
)

STEPS = 14
FAULT_AT = 6


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory: pytest.TempPathFactory) -> list[Line]:
    """Records of a real regroup: 3 workers of train_elastic.py, rank 2 raises at step 6,
    the other two regroup in place (world 2) and finish."""
    job_dir = tmp_path_factory.mktemp("lines")
    script = job_dir / "train_elastic.py"
    shutil.copy(REPO / "scripts" / "train_elastic.py", script)
    run = Launch(["--nproc-per-node", "3", "--recovery", "regroup", "--on-failure", "shrink",
                  str(script), "--steps", str(STEPS), "--hidden", "16",
                  "--raise-at-step", str(FAULT_AT), "--fault-rank", "2"], cwd=job_dir)
    try:
        assert run.wait(180) == 0, run.output
    finally:
        run.kill()
        Launch.running.remove(run)
    return parse(run.lines)


def _survivors(records: list[Line]) -> set[int]:
    """The processes that went on after the fault: those that committed the last step."""
    return {s.pid for s in select(records, ElasticStep) if s.step == STEPS}


def test_real_run_parses_into_every_record_of_a_regroup(shrunk: list[Line]) -> None:
    steps, regroups = select(shrunk, ElasticStep), select(shrunk, Regroup)
    done = select(shrunk, Done)
    # 3 ranks commit steps 1..6, rank 2 raises computing the next (when ft.step is 6), the
    # other 2 regroup at step 6 and go on to the end.
    assert len(steps) == 3 * FAULT_AT + 2 * (STEPS - FAULT_AT), shrunk
    assert {(r.epoch, r.world, r.step) for r in regroups} == {(1, 2, FAULT_AT)}
    assert sorted(r.rank for r in regroups) == [0, 1]
    assert sorted(d.rank for d in done) == [0, 1] and {d.steps for d in done} == {STEPS}
    assert all(s.source == f"rank{s.rank}" for s in steps if s.epoch == 0)
    assert len(_survivors(shrunk)) == 2
    check_regroup_invariants(shrunk, survivors=_survivors(shrunk), world=2, finished=STEPS)


def test_checker_fails_on_a_differing_checksum(shrunk: list[Line]) -> None:
    index = next(i for i, r in enumerate(shrunk) if isinstance(r, Regroup))
    regroup = shrunk[index]
    assert isinstance(regroup, Regroup)
    tampered = [*shrunk]
    tampered[index] = dataclasses.replace(regroup, checksum=regroup.checksum + "1")
    with pytest.raises(AssertionError, match=r"member epoch 1: rank \d has checksum"):
        check_regroup_invariants(tampered)
    check_regroup_invariants(shrunk)  # the untouched records pass


def test_checker_fails_on_a_step_applied_twice_or_skipped(shrunk: list[Line]) -> None:
    survivors = _survivors(shrunk)
    index = next(i for i, r in enumerate(shrunk)
                 if isinstance(r, ElasticStep) and r.pid in survivors and r.step == 3)
    twice = [*shrunk[:index + 1], shrunk[index], *shrunk[index + 1:]]
    with pytest.raises(AssertionError, match=r"went from step 3 to 3:\n.*line \d+: \[rank"):
        check_regroup_invariants(twice, survivors=survivors)
    skipped = [*shrunk[:index], *shrunk[index + 1:]]
    with pytest.raises(AssertionError, match="went from step 2 to 4"):
        check_regroup_invariants(skipped, survivors=survivors)
    with pytest.raises(AssertionError, match="committed no step"):
        assert_steps_consecutive(shrunk, {123456789})


def test_checker_fails_when_a_generation_does_not_start_after_the_last_commit(
        shrunk: list[Line]) -> None:
    tampered = [dataclasses.replace(r, step=r.step - 1) if isinstance(r, Regroup) else r
                for r in shrunk]
    with pytest.raises(AssertionError, match=rf"member epoch 1 regrouped at step {FAULT_AT - 1} .* "
                                             rf"first committed step is {FAULT_AT + 1}"):
        check_regroup_invariants(tampered)


def test_checker_fails_on_the_wrong_world_or_ending(shrunk: list[Line]) -> None:
    with pytest.raises(AssertionError, match="no member epoch formed with 3 ranks"):
        check_regroup_invariants(shrunk, world=3)
    with pytest.raises(AssertionError, match=f"expected steps={STEPS + 1}"):
        check_regroup_invariants(shrunk, finished=STEPS + 1)
    done = next(r for r in shrunk if isinstance(r, Done))
    extra = dataclasses.replace(done, param_sum="0.5")
    with pytest.raises(AssertionError, match="3 ranks printed done, the final world has 2"):
        check_regroup_invariants([*shrunk, extra], finished=STEPS)
    other = [dataclasses.replace(r, param_sum="0.5") if r is done else r for r in shrunk]
    with pytest.raises(AssertionError, match=rf"expected steps={STEPS} param_sum=0\.5"):
        check_regroup_invariants(other, finished=STEPS)
    with pytest.raises(AssertionError, match="no regroup happened"):
        check_regroup_invariants([r for r in shrunk if not isinstance(r, Regroup)])


def test_checker_final_world_counts_a_joiner_admitted_at_the_last_step(
        shrunk: list[Line]) -> None:
    """Seen in CI: the replacement's generation formed after the survivors' last step, so
    no step carries its world; its regroup lines do, and its done line belongs."""
    done = select(shrunk, Done)
    last = max(select(shrunk, Regroup), key=lambda r: r.epoch)
    world = last.world + 1
    joined = [dataclasses.replace(last, epoch=last.epoch + 1, rank=rank, world=world, step=STEPS)
              for rank in range(world)]
    joiner_done = dataclasses.replace(done[0], rank=world - 1)
    check_regroup_invariants([*shrunk, *joined, joiner_done], finished=STEPS)
    with pytest.raises(AssertionError, match=f"{len(done)} ranks printed done, the final "
                                             f"world has {world}"):
        check_regroup_invariants([*shrunk, *joined], finished=STEPS)


def test_checker_survivor_must_step_past_the_fault(shrunk: list[Line]) -> None:
    survivors = _survivors(shrunk)
    check_regroup_invariants(shrunk, survivors=dict.fromkeys(survivors, STEPS - 1))
    with pytest.raises(AssertionError, match=f"committed no step after step {STEPS}"):
        check_regroup_invariants(shrunk, survivors=dict.fromkeys(survivors, STEPS))


def test_checker_loss_must_fall_when_asked() -> None:
    def run(losses: list[float]) -> list[Line]:
        return parse(["[rank0]: regroup epoch=1 rank=0 world=1 step=1 checksum=0.1",
                      *(f"[rank0]: step={n} loss={loss} rank=0 pid=7 t=1.5 epoch=1 world=1"
                        for n, loss in enumerate(losses, start=2))])

    rising, falling = run([1.0] * 8 + [2.0] * 8), run([2.0] * 8 + [1.0] * 8)
    check_regroup_invariants(rising)
    check_regroup_invariants(falling, loss_falls=True)
    with pytest.raises(AssertionError, match="the loss did not fall"):
        check_regroup_invariants(rising, loss_falls=True)


# Lines as the scripts print them and the agent forwards them (copied from real runs).
SAMPLES: list[tuple[str, Line]] = [
    ("[rank2]: step=60 loss=0.090627 rank=1 pid=9252 t=1796137498.902891 epoch=2 world=3",
     ElasticStep(source="rank2", origin="", index=0, text="", step=60, loss=0.090627, rank=1,
                 pid=9252, t=1796137498.902891, epoch=2, world=3)),
    ("[member0.3]: regroup epoch=2 rank=2 world=3 step=49 checksum=-4.607841366002",
     Regroup(source="member0.3", origin="", index=0, text="", epoch=2, rank=2, world=3,
             step=49, checksum="-4.607841366002")),
    ("[rank0]: done rank=0 steps=60 param_sum=-5.047536645587",
     Done(source="rank0", origin="", index=0, text="", rank=0, steps=60,
          param_sum="-5.047536645587")),
    ("step=7 loss=0.12345 rank=3 pid=41 t=1700000000.000001",  # unprefixed (torchrun)
     Step(source=None, origin="", index=0, text="", step=7, loss=0.12345, rank=3, pid=41,
          t=1700000000.000001)),
    ("[rank1]: step=3 loss=0.2 rank=1 pid=5 t=1.0 epoch=-1 world=2",  # outside regroup
     ElasticStep(source="rank1", origin="", index=0, text="", step=3, loss=0.2, rank=1,
                 pid=5, t=1.0, epoch=-1, world=2)),
    ("[rank1]: resumed step=20 rank=1",
     Resumed(source="rank1", origin="", index=0, text="", step=20, rank=1)),
    ("[rank3]: start rank=3 world=4 restart=1 pid=77",
     Start(source="rank3", origin="", index=0, text="", rank=3, world=4, restart=1, pid=77)),
    ("[rank0]: finished generation=1 world=1 step=3",
     Finished(source="rank0", origin="", index=0, text="", generation=1, world=1, step=3)),
    ("[rank1]: victim pid=99", Victim(source="rank1", origin="", index=0, text="", pid=99)),
    ("[rank0]: blocking in ncclAllReduce pid=98",
     Blocking(source="rank0", origin="", index=0, text="", pid=98)),
    ("[rank0]: released code=3 after=0.250",
     Released(source="rank0", origin="", index=0, text="", code=3, after=0.25)),
]


@pytest.mark.parametrize(("text", "expected"), SAMPLES, ids=lambda x: type(x).__name__)
def test_each_kind_of_line(text: str, expected: Line) -> None:
    parsed = parse_line(text, 4, "h1")
    assert parsed == dataclasses.replace(expected, text=text, index=4, origin="h1")
    assert type(parsed) is type(expected)
    assert parsed.where() == f"h1, line 4: {text}"


def test_unrelated_lines_and_quotes_are_not_records() -> None:
    lines = [
        "[ftrun vm:0] rank 1 (pid 9249) failed: killed by SIGKILL",
        "[rank0]: [W1201 15:04:56.704689990 socket.cpp:469] [c10d] waitForInput: poll",
        "[ftrun vm:0] root cause: [rank1]: step=3 loss=0.1 rank=1 pid=5 t=1.0",  # quoted
        "[rank0]: ValueError: injected error at step 20 on rank 2",
        "[rank0]: step=3 loss=0.1 rank=1",  # cut short
        "[rank0]: step=3 loss=abc rank=1 pid=5 t=1.0",
        "[rank0]: done rank=0 steps=60 param_sum=1.0 and more",
        "", "[rank0]: ", "[rank0]:step=1 loss=0.1 rank=0 pid=5 t=1.0",
    ]
    assert parse(lines) == []
    records = parse(["noise", "[rank0]: resumed step=2 rank=0", "noise",
                     "[rank0]: start rank=0 world=2 restart=0 pid=5"], origin="n")
    assert [(type(r), r.index, r.origin) for r in records] == [(Resumed, 1, "n"), (Start, 3, "n")]
    assert find(["[rank0]: step=1 loss=0.1 rank=0 pid=5 t=1.0 epoch=0 world=1",
                 "[rank0]: step=2 loss=0.1 rank=0 pid=5 t=1.0"], Step) == [
        parse_line("[rank0]: step=1 loss=0.1 rank=0 pid=5 t=1.0 epoch=0 world=1"),
        parse_line("[rank0]: step=2 loss=0.1 rank=0 pid=5 t=1.0", 1)]
