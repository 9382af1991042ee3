"""ftrun under a real Slurm: ``srun -n2 ftrun ...`` forms one job from two agents."""

from __future__ import annotations

from pathlib import Path

from ftrun.cli import config_from_args
from tests.launch import copy_train_script, launcher
from tests.lines import Done, find

SRUN_TASK_ENV = {
    "SLURM_JOB_ID": "812", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_NPROCS": "2",
    "SLURM_JOB_NODELIST": "vm", "SLURM_STEP_NODELIST": "vm", "SLURM_TASKS_PER_NODE": "2",
    "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURMD_NODENAME": "vm",
}


def test_slurm_step_gives_defaults_and_flags_win(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    config = config_from_args([str(script)], SRUN_TASK_ENV)
    assert (config.nnodes, config.node_rank, config.rdzv_host) == (2, 1, "vm")
    assert config.rdzv_backend == "static" and config.rdzv_id == "812.0"
    assert "SIGUSR1" in config.signals_to_handle_text
    explicit = config_from_args(["--nnodes", "1", "--node-rank", "0", str(script)],
                                SRUN_TASK_ENV)
    assert (explicit.nnodes, explicit.node_rank) == (1, 0)
    pet = config_from_args([str(script)], {**SRUN_TASK_ENV, "PET_NODE_RANK": "0"})
    assert pet.node_rank == 0


def test_outside_slurm_nothing_changes(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    config = config_from_args([str(script)], {"SLURM_JOB_ID": "3"})  # a batch script
    assert (config.nnodes, config.node_rank, config.rdzv_port) == (1, 0, 0)


def test_srun_two_agents_form_one_job(slurm_cluster, job_dir: Path) -> None:  # type: ignore[no-untyped-def]
    script = copy_train_script(job_dir)
    result = slurm_cluster.srun(
        # one worker per agent: every worker spawned imports torch (CI's CPU is the limit)
        ["-N1", "-n2", "--export=ALL,FTRUN_RDZV_PORT=29671", launcher(),
         "--nproc-per-node", "1", str(script), "--steps", "10"],
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    done = find(result.stdout.splitlines(), Done)
    assert sorted(d.rank for d in done) == [0, 1], result.stdout
    assert len({d.param_sum for d in done}) == 1
