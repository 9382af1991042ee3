"""tests/MUTATIONS.md as data: one :class:`Mutation` per row of its tables.

Each row of tests/MUTATIONS.md is a promise of the product, a breakage of it and the tests
that catch that breakage. Here the breakage is a text edit: ``find`` occurs exactly once in
``file`` (repository-relative) today and becomes ``replace`` in a scratch copy of the
repository, where the ``tests`` (pytest node ids) must then fail. ``scripts/mutate.py`` runs
them (``--id``, ``--sample``, ``--check-only``); ``tests/test_mutations.py`` checks every
entry against the source in the default run, and runs a sample in the long tier.

A row whose text no longer exists (the code changed) fails ``--check-only`` loudly: update
its ``find`` (and the row) with the change that moved it.

Fields beyond the row's: ``note`` says how the edit differs from the breakage first tried
(the code moved, or the first breakage was not a text edit); ``known_miss`` marks a row the
table records as not caught, or caught only in some runs (reported, never a failure, never
sampled); ``unsafe`` marks a row that, when not caught, acts on this machine (never sampled;
run it only by ``--id``, where that is harmless). Rows that are not executable are kept in
tests/MUTATIONS.md alone, marked so; :data:`NOT_EXECUTABLE` names them.
"""
# ruff: noqa: E501  (find/replace reproduce source lines at their own indentation)

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    """One row of tests/MUTATIONS.md (see the module docstring)."""

    id: str
    promise: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]
    section: str
    note: str = ""
    known_miss: str = ""
    unsafe: str = ""


REGROUP = "Regroup (in-process recovery)"
LAUNCHER = "Launcher, restart path, exit codes"
HANGS = "Hangs of scripts without the worker API (restart path)"
CONTROL = "Control plane exposure (issue 14)"

MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        id="vote-first-decides",
        section=REGROUP,
        promise=(
            "a step commits only when every member voted; a member that dies before voting makes "
            "every survivor abort it"
        ),
        file="ftrun/worker/membership.py",
        find="            if counted >= len(self.members) and self._all_valid(list(votes.values())):",
        replace="            if counted >= 1:  # MUTATION: the first vote decides",
        tests=(
            "tests/test_regroup.py::test_member_dying_after_the_others_voted_aborts_the_step_on_every_survivor",
        ),
        note=(
            "`counted >= 1`, and the check of the votes' records (`_all_valid`, added since) "
            "dropped with it"
        ),
    ),
    Mutation(
        id="retired-backend-kept-alive",
        section=REGROUP,
        promise=(
            "recovery is fast: a retired backend's sockets close, so peers inside the failed "
            "collective fail at once"
        ),
        file="ftrun/worker/group.py",
        find=(
            "    with contextlib.suppress(RuntimeError):\n"
            "        backend.abort()\n"
            "    del backend  # the destructor closes the backend's connections"
        ),
        replace="    release.__dict__.setdefault(\"kept\", []).append(backend)  # MUTATION: kept alive, not aborted",
        tests=(
            "tests/test_regroup.py::test_kill_inside_allreduce_survivors_continue_and_match_fault_free",
            "tests/test_regroup.py::test_frozen_worker_is_detected_killed_and_replaced",
        ),
    ),
    Mutation(
        id="leader-skips-abort-confirmations",
        section=REGROUP,
        promise=(
            "the leader publishes epoch N+1 only after every surviving node confirmed its NCCL "
            "abort"
        ),
        file="ftrun/agent/leader.py",
        find=(
            "        if missing:\n"
            "            waited = self.clock() - self.waiting_since"
        ),
        replace=(
            "        if False:  # MUTATION: the confirmations of the nodes' NCCL aborts not waited for\n"
            "            waited = self.clock() - self.waiting_since"
        ),
        tests=(
            "tests/test_regroup_nccl.py::test_the_leader_publishes_the_next_epoch_only_after_every_node_aborted",
            "tests/test_supervisors.py::test_a_node_that_never_confirms_its_abort_is_waited_for_only_so_long",
        ),
    ),
    Mutation(
        id="stall-limit-one-step",
        section=REGROUP,
        promise="a healthy job is never stalled (limit max(floor, 20 x median step))",
        file="ftrun/decide/progress.py",
        find="STALL_STEPS = 20",
        replace="STALL_STEPS = 1  # MUTATION: 20 -> 1",
        tests=(
            "tests/test_supervisors.py::test_a_slow_but_healthy_job_is_never_stalled_by_the_floor",
            "tests/test_supervisors.py::test_a_rank_behind_the_others_is_stalled_after_the_limit_and_not_before",
        ),
        note=(
            "ftrun/decide/progress.py `STALL_STEPS = 1` (the 20 moved there from "
            "`_watch_progress`)"
        ),
    ),
    Mutation(
        id="abort-comm-epoch-one",
        section=REGROUP,
        promise=(
            "every abort releases a survivor blocked in NCCL, whatever comm epoch its "
            "communicator has"
        ),
        file="ftrun/agent/regroup.py",
        find="                report = shim.abort_all(timeout_s=self.config.abort_timeout_s)",
        replace="                report = shim.abort(1, timeout_s=self.config.abort_timeout_s)  # MUTATION: abort_all() -> abort(1)",
        tests=(
            "tests/test_regroup_nccl.py::test_a_second_abort_releases_a_communicator_made_after_the_first",
        ),
    ),
    Mutation(
        id="abort-names-member-epoch",
        section=REGROUP,
        promise="after a job re-form, the shim still releases a blocked survivor",
        file="ftrun/agent/regroup.py",
        find="                report = shim.abort_all(timeout_s=self.config.abort_timeout_s)",
        replace="                report = shim.abort(epoch + 1, timeout_s=self.config.abort_timeout_s)  # MUTATION: the abort counted in member epochs, not the page's",
        tests=(
            "tests/test_regroup_nccl.py::test_survivor_blocked_in_nccl_is_released_after_the_job_re_formed",
        ),
        note=(
            "`agent/regroup.py` `_abort_communicators`: `abort(epoch + 1)`, the member epoch's "
            "number, instead of `abort_all()` (the pre-redesign code's counting: it seeded each "
            "page with the job generation)"
        ),
        known_miss=(
            "MISSED in issue 37's run (21.8 s, the test passed): likely, the survivor's shim page nev"
            "er counts more comm epochs than member epoch + 1 in that test, so abort(epoch + "
            "1) still covers its communicator"
        ),
    ),
    Mutation(
        id="restart-supervisor-exits",
        section=LAUNCHER,
        promise="`--recovery restart` runs a job at all",
        file="ftrun/agent/restart.py",
        find=(
            "        config, inbox = services.config, services.inbox\n"
            "        reported: set[int] = set()"
        ),
        replace=(
            "        raise SystemExit  # MUTATION: the restart supervisor never watches\n"
            "        config, inbox = services.config, services.inbox\n"
            "        reported: set[int] = set()"
        ),
        tests=(
            "tests/test_recovery_modes.py::test_crash_restarts_every_worker_and_resumes_from_the_checkpoint[restart-no-api]",
            "tests/test_recovery_modes.py::test_crash_restarts_every_worker_and_resumes_from_the_checkpoint[restart-api]",
            "tests/test_recovery_modes.py::test_signal_reaches_every_worker_as_itself_and_ftrun_exits_128_plus_n[restart-SIGINT]",
            "tests/test_recovery_modes.py::test_max_restarts_n_restarts_n_times_then_exits_1_naming_the_failure[restart]",
        ),
    ),
    Mutation(
        id="restart-signal-becomes-sigkill",
        section=LAUNCHER,
        promise="SIGTERM/SIGINT reach the workers as that signal, restart mode",
        file="ftrun/agent/restart.py",
        find="                self._stop(group, inbox.received, \"signal\")",
        replace="                self._stop(group, signal.SIGKILL, \"signal\")  # MUTATION: not the received signal",
        tests=(
            "tests/test_recovery_modes.py::test_signal_reaches_every_worker_as_itself_and_ftrun_exits_128_plus_n[restart-SIGINT]",
        ),
    ),
    Mutation(
        id="stop-sends-sigkill",
        section=LAUNCHER,
        promise="signals forwarded, every mode",
        file="ftrun/agent/processes.py",
        find="            worker.signal_group(sig)\n",
        replace="            worker.signal_group(signal.SIGKILL)  # MUTATION: not sig\n",
        tests=(
            "tests/test_recovery_modes.py::test_signal_reaches_every_worker_as_itself_and_ftrun_exits_128_plus_n[restart-SIGINT]",
            "tests/test_recovery_modes.py::test_signal_reaches_every_worker_as_itself_and_ftrun_exits_128_plus_n[regroup-api-SIGTERM]",
            "tests/test_recovery_modes.py::test_signal_reaches_every_worker_as_itself_and_ftrun_exits_128_plus_n[auto-api-SIGINT]",
            "tests/test_recovery_modes.py::test_signal_reaches_every_worker_as_itself_and_ftrun_exits_128_plus_n[auto-no-api-SIGTERM]",
        ),
    ),
    Mutation(
        id="port-check-without-reuseaddr",
        section=LAUNCHER,
        promise="the port check binds like the store (TIME_WAIT is not \"in use\")",
        file="ftrun/host/hostnet.py",
        find="        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n",
        replace="",
        tests=(
            "tests/test_cli.py::test_port_check_refuses_a_listener_but_not_a_just_ended_job",
        ),
    ),
    Mutation(
        id="worker-without-pdeathsig",
        section=LAUNCHER,
        promise="`kill -9 ftrun` leaves no worker (PR_SET_PDEATHSIG)",
        file="ftrun/agent/processes.py",
        find="    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)\n",
        replace="    pass  # MUTATION: no PR_SET_PDEATHSIG\n",
        tests=(
            "tests/test_recovery_modes.py::test_sigkill_of_ftrun_takes_every_worker_with_it[restart]",
            "tests/test_recovery_modes.py::test_sigkill_of_ftrun_takes_every_worker_with_it[regroup-api]",
            "tests/test_recovery_modes.py::test_sigkill_of_ftrun_takes_every_worker_with_it[auto-no-api]",
        ),
    ),
    Mutation(
        id="unreadable-script-accepted",
        section=LAUNCHER,
        promise="an unreadable script is refused with exit 2",
        file="ftrun/config.py",
        find="    if not os.access(path, os.R_OK):",
        replace="    if False:  # MUTATION: the R_OK check removed",
        tests=(
            "tests/test_cli.py::test_unreadable_script",
        ),
    ),
    Mutation(
        id="shim-not-built",
        section=LAUNCHER,
        promise="the suite builds the shim; a missing one is a failure",
        file="ftrun/shim/native.py",
        find="_NATIVE = Path(__file__).resolve().parent.parent / \"_native\"  # ftrun/_native",
        replace="_NATIVE = Path(__file__).resolve().parent.parent / \"_native_missing\"  # MUTATION: as if ftrun/_native were not built",
        tests=(
            "tests/test_shim.py::test_self_test_round_trip",
            "tests/test_doctor.py::test_shim_self_test_round_trip_is_reported",
        ),
        note=(
            "`ftrun/shim/native.py`: `_NATIVE` names a directory that does not exist (first tried"
            " as a scratch worktree without ftrun/_native)"
        ),
    ),
    Mutation(
        id="stop-never-sees-a-frozen-worker",
        section=LAUNCHER,
        promise="a frozen worker is killed at once, not after the grace (restart mode)",
        file="ftrun/agent/processes.py",
        find="        \"\"\"Stopped by SIGSTOP or a tracer: it cannot act on SIGTERM until resumed.\"\"\"\n",
        replace=(
            "        \"\"\"Stopped by SIGSTOP or a tracer: it cannot act on SIGTERM until resumed.\"\"\"\n"
            "        return False  # MUTATION: stop() sends SIGTERM to a frozen worker too\n"
        ),
        tests=(
            "tests/test_launcher.py::test_frozen_worker_does_not_cost_the_grace_period[restart]",
        ),
        note=(
            "ftrun/agent/processes.py `WorkerProcess.is_frozen` always False, so `stop` sends "
            "SIGTERM to every worker (first tried as the `is_frozen()` branch of `stop` removed; "
            "`stop` now looks twice)"
        ),
    ),
    Mutation(
        id="max-restarts-off-by-one",
        section=LAUNCHER,
        promise="`--max-restarts N`: N restarts, then exit 1",
        file="ftrun/agent/loop.py",
        find="            if restart_count >= self.config.max_restarts:",
        replace="            if restart_count > self.config.max_restarts:  # MUTATION: was >=",
        tests=(
            "tests/test_recovery_modes.py::test_max_restarts_n_restarts_n_times_then_exits_1_naming_the_failure[restart]",
            "tests/test_recovery_modes.py::test_max_restarts_n_restarts_n_times_then_exits_1_naming_the_failure[regroup]",
        ),
    ),
    Mutation(
        id="summary-first-failure-last",
        section=LAUNCHER,
        promise="the summary names the first failure first",
        file="ftrun/observe/summary.py",
        find="key=lambda e: (not e.first, e.stopped_by_agent, e.time))",
        replace="key=lambda e: (e.first, e.stopped_by_agent, e.time))  # MUTATION: was not e.first",
        tests=(
            "tests/test_recovery_modes.py::test_max_restarts_n_restarts_n_times_then_exits_1_naming_the_failure[restart]",
            "tests/test_recovery_modes.py::test_max_restarts_n_restarts_n_times_then_exits_1_naming_the_failure[regroup]",
        ),
    ),
    Mutation(
        id="signal-exit-code-1",
        section=LAUNCHER,
        promise="exit code 128+N after a signal",
        file="ftrun/exitcodes.py",
        find="    return 128 + int(signal.Signals(signum))",
        replace="    return 1  # MUTATION: not 128+N",
        tests=(
            "tests/test_recovery_modes.py::test_signal_reaches_every_worker_as_itself_and_ftrun_exits_128_plus_n[restart-SIGINT]",
            "tests/test_recovery_modes.py::test_signal_reaches_every_worker_as_itself_and_ftrun_exits_128_plus_n[regroup-api-SIGTERM]",
            "tests/test_recovery_modes.py::test_signal_reaches_every_worker_as_itself_and_ftrun_exits_128_plus_n[auto-api-SIGINT]",
            "tests/test_recovery_modes.py::test_signal_reaches_every_worker_as_itself_and_ftrun_exits_128_plus_n[auto-no-api-SIGTERM]",
        ),
    ),
    Mutation(
        id="api-member-restarts-all",
        section=LAUNCHER,
        promise="regroup/auto with the API: survivors continue in place",
        file="ftrun/agent/regroup.py",
        find="        initial_without_api = member.state is MemberState.STARTING and member.initial",
        replace="        initial_without_api = member.initial  # MUTATION: every initial member taken for a script without the API",
        tests=(
            "tests/test_recovery_modes.py::test_crash_with_the_worker_api_survivors_continue_in_place[regroup]",
            "tests/test_recovery_modes.py::test_crash_with_the_worker_api_survivors_continue_in_place[auto]",
        ),
    ),
    Mutation(
        id="restart-mode-ignored",
        section=LAUNCHER,
        promise="`--recovery restart` is honoured for an API script",
        file="ftrun/agent/loop.py",
        find=(
            "        if self.config.recovery is Recovery.RESTART:\n"
            "            return RestartSupervisor(services)"
        ),
        replace=(
            "        if False:  # MUTATION: always the regroup supervisor\n"
            "            return RestartSupervisor(services)"
        ),
        tests=(
            "tests/test_recovery_modes.py::test_crash_restarts_every_worker_and_resumes_from_the_checkpoint[restart-api]",
        ),
    ),
    Mutation(
        id="node-loss-after-three-timeouts",
        section=LAUNCHER,
        promise="node loss declared within the heartbeat timeout + 2 s",
        file="ftrun/control/heartbeat.py",
        find="            if silent > limit or node_id in gone:",
        replace="            if silent > 3 * limit or node_id in gone:  # MUTATION: three timeouts",
        tests=(
            "tests/test_multinode.py::test_netns_node_cut_off_is_declared_lost_then_rejoins",
        ),
    ),
    Mutation(
        id="multinode-agent-exits-0-on-sigterm",
        section=LAUNCHER,
        promise="multi-node agents exit 128+SIGTERM when stopped",
        file="ftrun/agent/loop.py",
        find=(
            "        exit_at_once(code)\n"
            "    return code"
        ),
        replace=(
            "        exit_at_once(0 if code == 143 else code)  # MUTATION\n"
            "    return code"
        ),
        tests=(
            "tests/test_multinode.py::test_netns_node_lost_survivors_regroup_in_process",
        ),
    ),
    Mutation(
        id="unexecutable-program-is-internal-error",
        section=LAUNCHER,
        promise=(
            "a worker program that cannot be executed is bad input (exit 2), not an internal "
            "error"
        ),
        file="ftrun/agent/launcher.py",
        find=(
            "        except OSError as error:\n"
            "            program = launch.argv[0]"
        ),
        replace=(
            "        except ImportError as error:  # MUTATION: the OSError escapes (the code before d400163)\n"
            "            program = launch.argv[0]"
        ),
        tests=(
            "tests/test_cli.py::test_a_program_whose_bare_interpreter_cannot_be_found_is_bad_input_at_its_start",
            "tests/test_cli.py::test_a_program_that_cannot_be_executed_is_bad_input_not_an_internal_error",
        ),
        note=(
            "ftrun/agent/launcher.py `spawn_worker`: the spawn's OSError is not caught, as in the"
            " code before d400163 (an internal error, exit 70)"
        ),
    ),
    Mutation(
        id="hang-watch-never-samples",
        section=HANGS,
        promise="a hung rank is found in seconds, named, and the job restarts",
        file="ftrun/agent/hangs.py",
        find=(
            "    def sample(self, group: Sequence[WorkerProcess]) -> Hang | None:\n"
            "        now = self.clock()"
        ),
        replace=(
            "    def sample(self, group: Sequence[WorkerProcess]) -> Hang | None:\n"
            "        return None  # MUTATION: never a hang\n"
            "        now = self.clock()"
        ),
        tests=(
            "tests/test_hangs.py::test_a_hung_rank_is_named_and_the_job_restarts_in_seconds[restart-py-spy]",
            "tests/test_hangs.py::test_a_hung_rank_is_named_and_the_job_restarts_in_seconds[auto-faulthandler]",
            "tests/test_hangs.py::test_a_frozen_worker_restarts_the_job_at_once",
        ),
    ),
    Mutation(
        id="root-cause-any-error-file",
        section=HANGS,
        promise="the summary names the root cause, not a peer its exception broke",
        file="ftrun/agent/outcome.py",
        find=(
            "    earlier = [e for e in exits if not e.ok and e is not first and e.error_at is not None\n"
            "               and e.error_at < seen_by and not _lost_peer(e, first)]"
        ),
        replace="    earlier = [e for e in exits if not e.ok and e is not first and e.error_at is not None]  # MUTATION: any error file",
        tests=(
            "tests/test_launcher.py::test_killed_worker_restarts_resumes_from_checkpoint_and_completes",
        ),
    ),
    Mutation(
        id="store-binds-every-interface",
        section=CONTROL,
        promise="a single-node job's stores listen on loopback only",
        file="ftrun/control/tcpstore.py",
        find=(
            "    if host is None:\n"
            "        try:\n"
            "            return tcpstore(\"0.0.0.0\""
        ),
        replace=(
            "    if True:  # MUTATION: host ignored, the wildcard bound\n"
            "        try:\n"
            "            return tcpstore(\"0.0.0.0\""
        ),
        tests=(
            "tests/test_exposure.py::test_netns_single_node_stores_are_loopback_only_while_a_multinode_job_works",
            "tests/test_exposure.py::test_serve_store_listens_on_the_address_it_is_given",
        ),
        note=(
            "ftrun/control/tcpstore.py `serve_store` (moved from control/store.py) binds 0.0.0.0 "
            "whatever `host` says; the in-process test now runs on the scratch copy too"
        ),
    ),
    Mutation(
        id="failed-store-client-reused",
        section=CONTROL,
        promise=(
            "a store client whose request failed is never used again (the 512-agent "
            "`std::bad_alloc`)"
        ),
        file="ftrun/control/store.py",
        find=(
            "            except StoreError as error:\n"
            "                detail = str(error)\n"
            "                time.sleep(0.05)"
        ),
        replace=(
            "            except StoreError as error:\n"
            "                detail = str(error)\n"
            "                time.sleep(0.05)\n"
            "                self._conn.failed = False  # MUTATION: the old client again"
        ),
        tests=(
            "tests/test_multinode.py::test_a_failed_client_is_never_reused_even_when_its_reconnect_fails",
        ),
    ),
    Mutation(
        id="restarting-all-without-a-restart-left",
        section=CONTROL,
        promise="with no restart left, the console never says \"restarting all\" (issue 13)",
        file="ftrun/agent/outcome.py",
        find=(
            "    if restart_count < max_restarts:\n"
            "        return f\"restarting all"
        ),
        replace=(
            "    if True:  # MUTATION: the old message\n"
            "        return f\"restarting all"
        ),
        tests=(
            "tests/test_faults.py::test_no_restarting_all_without_a_restart_left",
        ),
    ),
    Mutation(
        id="formed-step-from-beats",
        section=CONTROL,
        promise="a regroup's fault record names the step the survivors resumed from",
        file="ftrun/observe/faults.py",
        find="            elif self.last_commit is not None:",
        replace="            elif False:  # MUTATION: the members' status beats, not last_commit",
        tests=(
            "tests/test_faults.py::test_an_epoch_followed_at_once_by_the_next_still_gets_its_own_formed_record",
            "tests/test_faults.py::test_an_epoch_that_never_formed_is_dropped_once_a_later_one_has",
            "tests/test_faults.py::test_a_killed_worker_gets_one_record_a_line_and_the_success_summary",
        ),
    ),
    Mutation(
        id="forked-worker-without-pdeathsig",
        section=CONTROL,
        promise="--preload: a forked worker dies with its fork server (which dies with the agent)",
        file="ftrun/agent/zygote.py",
        find=(
            "    os.setsid()\n"
            "    _die_with_parent(server)\n"
        ),
        replace="    os.setsid()\n",
        tests=(
            "tests/test_preload.py::test_killing_the_agent_leaves_no_server_and_no_worker",
        ),
    ),
    Mutation(
        id="forked-worker-ignores-sigint",
        section=CONTROL,
        promise="--preload: a forked worker has Python's default signal dispositions",
        file="ftrun/agent/zygote.py",
        find="    signal.signal(signal.SIGINT, signal.default_int_handler)",
        replace="    signal.signal(signal.SIGINT, signal.SIG_IGN)  # MUTATION: not Python's default",
        tests=(
            "tests/test_preload.py::test_forked_workers_look_like_torchruns_and_restart_without_imports",
        ),
        note=(
            "ftrun/agent/zygote.py `_become_worker`: the forked worker ignores SIGINT (first tried as a"
            " server that ignores SIGINT and a worker that does not reset it)"
        ),
    ),
    Mutation(
        id="one-port-keys-not-deleted",
        section=CONTROL,
        promise=(
            "one-port (explicit --master-port): no restart reads a dead generation's worker keys"
        ),
        file="ftrun/agent/loop.py",
        find=(
            "                for key in stale:\n"
            "                    self._control_raw.delete_key(key)"
        ),
        replace=(
            "                for key in stale:\n"
            "                    pass  # MUTATION: nothing deleted"
        ),
        tests=(
            "tests/test_launcher.py::test_many_consecutive_restarts_always_recover[one-port]",
        ),
    ),
    Mutation(
        id="job-hang-never-judged",
        section=CONTROL,
        promise="a hang whose culprit and waiters are on different nodes is named (issue 15)",
        file="ftrun/agent/restart.py",
        find=(
            "        if not self.services.rdzv.is_leader:\n"
            "            return None\n"
            "        names = [f\"hang/"
        ),
        replace=(
            "        if True:  # MUTATION: never judges\n"
            "            return None\n"
            "        names = [f\"hang/"
        ),
        tests=(
            "tests/test_hangs.py::test_a_hang_across_nodes_is_named_with_its_node_from_every_nodes_view",
        ),
    ),
    Mutation(
        id="generation-digest-unchecked",
        section=CONTROL,
        promise="an agent's membership, read on demand, is the generation its assignment names",
        file="ftrun/control/rendezvous.py",
        find="        if record_digest(record) != own.digest:",
        replace="        if False:  # MUTATION: the digest check skipped",
        tests=(
            "tests/test_rendezvous_scale.py::test_forged_assignments_are_ignored_and_a_record_that_does_not_match_is_refused",
        ),
    ),
    Mutation(
        id="assignment-unverified",
        section=CONTROL,
        promise="an assignment that is not a valid signed record is not acted on",
        file="ftrun/control/rendezvous.py",
        find=(
            "                if key == name:\n"
            "                    if body is not None:"
        ),
        replace=(
            "                if key == name:\n"
            "                    body = body or (self.store.get(name) or {}).get(\"body\")  # MUTATION: whatever the key holds\n"
            "                    if body is not None:"
        ),
        tests=(
            "tests/test_rendezvous_scale.py::test_an_agent_that_finds_only_a_forged_assignment_waits_for_the_leader_s",
            "tests/test_rendezvous_scale.py::test_forged_assignments_are_ignored_and_a_record_that_does_not_match_is_refused",
        ),
    ),
    Mutation(
        id="timeline-drops-last-fault",
        section=CONTROL,
        promise="`ftrun report`'s picture holds every fault (issue 13)",
        file="ftrun/report/timeline.py",
        find=(
            "    for fault in timeline.faults:\n"
            "        start, end = _fault_span(timeline, fault)\n"
            "        figure.add_vrect("
        ),
        replace=(
            "    for fault in timeline.faults[:-1]:  # MUTATION: every fault but the last\n"
            "        start, end = _fault_span(timeline, fault)\n"
            "        figure.add_vrect("
        ),
        tests=(
            "tests/test_report.py::test_report_agrees_with_the_agent_and_the_html_holds_every_fault",
        ),
    ),
    Mutation(
        id="metrics-count-no-regroup",
        section=CONTROL,
        promise="the metrics show a regroup while the job runs (issue 13)",
        file="ftrun/observe/metrics.py",
        find=(
            "                if ev.get(\"gone\"):\n"
            "                    self.regroups.inc()"
        ),
        replace=(
            "                if False:  # MUTATION: ftrun_regroups_total never counted\n"
            "                    self.regroups.inc()"
        ),
        tests=(
            "tests/test_faults.py::test_a_killed_worker_gets_one_record_a_line_and_the_success_summary",
        ),
    ),
    Mutation(
        id="inject-request-unsigned",
        section=CONTROL,
        promise="the agent executes only requests signed with the job token (issue 13)",
        file="ftrun/agent/inject.py",
        find="            record = store.get_record(request_key(number))",
        replace="            record = (store.get(request_key(number)) or {}).get(\"body\")  # MUTATION: the signature not checked",
        tests=(
            "tests/test_inject.py::test_ftrun_inject_checks_everything_before_touching_the_job",
        ),
    ),
    Mutation(
        id="restore-incomplete-snapshot",
        section=CONTROL,
        promise="sharded recovery restores only a snapshot complete on every rank (issue 12)",
        file="ftrun/worker/restartable.py",
        find="if complete(self._store_of(held[0]), held, self.directory)),",
        replace="if True),  # MUTATION: completeness not checked",
        tests=(
            "tests/test_sharded.py::test_bad_state_then_faults_while_snapshotting_twice_and_during_recovery",
        ),
    ),
    Mutation(
        id="restore-chosen-by-each-member",
        section=CONTROL,
        promise=(
            "every member of a member epoch restores the one snapshot chosen for it (issue 12)"
        ),
        file="ftrun/worker/restartable.py",
        find=(
            "        if rank == epoch.source_rank:\n"
            "            candidates = list(reversed(self.history)) or self._earlier_snapshots()"
        ),
        replace=(
            "        if True:  # MUTATION: each member chooses on its own\n"
            "            candidates = list(reversed(self.history)) or self._earlier_snapshots()\n"
            "            return next((records.Restore(*held) for held in candidates\n"
            "                         if complete(self._store_of(held[0]), held, self.directory)),\n"
            "                        records.NONE)"
        ),
        tests=(
            "tests/test_sharded.py::test_fsdp_sigkill_in_backward_restores_from_memory",
        ),
    ),
    Mutation(
        id="meshes-not-forgotten",
        section=CONTROL,
        promise="a re-entered FSDP2+TP rank forgets the old device mesh (issue 12)",
        file="ftrun/worker/reentry.py",
        find="    for clear in clears:\n",
        replace="    for clear in clears[:0]:  # MUTATION: none of torch's DTensor caches cleared\n",
        tests=(
            "tests/test_sharded.py::test_fsdp_tp_2x2_sigkill_in_backward_and_the_memory_cap",
        ),
        note=(
            "ftrun/worker/reentry.py `forget_meshes` (was in ftrun/worker/restartable.py) clears "
            "none of torch's DTensor caches"
        ),
    ),
    Mutation(
        id="snapshot-keeps-nothing",
        section=CONTROL,
        promise=(
            "a rank keeps its newest complete snapshot until a newer one is complete (issue 12)"
        ),
        file="ftrun/snapshot/writer.py",
        find="                if parsed is not None and parsed[3] == rank and parsed[:3] != self.kept:",
        replace="                if parsed is not None and parsed[3] == rank:  # MUTATION: the kept one retired too",
        tests=(
            "tests/test_sharded.py::test_bad_state_then_faults_while_snapshotting_twice_and_during_recovery",
        ),
        note=(
            "ftrun/snapshot/writer.py `_settle` (was `_remove_old`) keeps nothing: the complete "
            "snapshot is retired too"
        ),
    ),
    Mutation(
        id="snapshot-copy-skipped",
        section=CONTROL,
        promise="a snapshot holds the state of its step (issue 12)",
        file="ftrun/snapshot/writer.py",
        find="            self._copy(target.view, start, entries, locals_, non_blocking=False)",
        replace="            pass  # MUTATION: the copy skipped (stale bytes written)",
        tests=(
            "tests/test_sharded.py::test_fsdp_sigkill_in_backward_restores_from_memory",
        ),
    ),
    Mutation(
        id="decide-server-side-wait",
        section=CONTROL,
        promise="a clean regroup run prints no torch socket-timeout warnings (issue 13)",
        file="ftrun/worker/membership.py",
        find="            present = self.store.exists(key)",
        replace="            present = self.store.wait_for(key, 0.05)  # MUTATION: a 50 ms server-side wait per look",
        tests=(
            "tests/test_worker_waits.py::test_a_member_waiting_for_a_late_decision_prints_no_store_warnings",
            "tests/test_regroup.py::test_kill_inside_allreduce_survivors_continue_and_match_fault_free",
        ),
    ),
    Mutation(
        id="etcd-requests-never-fail-over",
        section=CONTROL,
        promise="etcd-v3: the job goes on when the etcd member an agent talks to dies (issue 14)",
        file="ftrun/control/etcd.py",
        find=(
            "                note_failure(self.endpoint, None if isinstance(error, RuntimeError) else error)\n"
            "                self._current = (self._current + 1) % len(self._clients)"
        ),
        replace="                note_failure(self.endpoint, None if isinstance(error, RuntimeError) else error)  # MUTATION: the next endpoint never tried",
        tests=(
            "tests/test_etcd.py::test_netns_etcd_member_killed_then_writer_node_killed_then_writer_cut_off",
        ),
        note=(
            "ftrun/control/etcd.py `_post` (`_on_each_endpoint`) never moves to the next endpoint"
        ),
        known_miss=(
            "MISSED in issue 37's run (88.8 s, the test passed once; not investigated for lac"
            "k of time)"
        ),
    ),
    Mutation(
        id="fault-cause-without-error",
        section=CONTROL,
        promise="the fault table's cause names the failed rank's own error (issue 13)",
        file="ftrun/observe/faults.py",
        find=(
            "        if pid is None or not message:\n"
            "            return"
        ),
        replace=(
            "        if True:  # MUTATION: the error event ignored\n"
            "            return"
        ),
        tests=(
            "tests/test_faults.py::test_a_restart_gets_its_record_and_line",
        ),
    ),
    Mutation(
        id="lost-node-record-never-found",
        section=CONTROL,
        promise="a lost node is one record naming its ranks, path regroup (issue 13)",
        file="ftrun/observe/faults.py",
        find=(
            "        if not _valid_member(member):\n"
            "            return None\n"
            "        node = str(P.node_of(member))"
        ),
        replace=(
            "        if True:  # MUTATION: never finds the node's record\n"
            "            return None\n"
            "        node = str(P.node_of(member))"
        ),
        tests=(
            "tests/test_faults.py::test_a_lost_node_is_one_record_naming_its_ranks",
        ),
    ),
    Mutation(
        id="cut-link-outside-a-namespace",
        section=CONTROL,
        promise="cut-link never acts on a machine's own network (issue 13)",
        file="ftrun/agent/inject.py",
        find=(
            "    if named_netns() is None:\n"
            "        return (\"cut-link acts only"
        ),
        replace=(
            "    if False:  # MUTATION: refuses nothing outside a named namespace\n"
            "        return (\"cut-link acts only"
        ),
        tests=(
            "tests/test_observe_multinode.py::test_cut_link_is_refused_outside_a_namespace_host",
        ),
        unsafe="not caught, the agent cuts this machine's own link with iptables",
    ),
    Mutation(
        id="straggler-without-window",
        section=CONTROL,
        promise="a straggler counts only after a whole window above the factor (issue 13)",
        file="ftrun/agent/stragglers.py",
        find="            if state.flagged or now - state.above_since < self.window_s:",
        replace="            if state.flagged:  # MUTATION: flagged as soon as above the factor",
        tests=(
            "tests/test_stragglers.py::test_the_verdict_needs_a_whole_window_and_is_said_once_then_cleared",
        ),
    ),
    Mutation(
        id="straggler-counts-waiting-beats",
        section=CONTROL,
        promise=(
            "the straggler is the rank whose own work (beats before the step's first collective) "
            "is long (issue 13)"
        ),
        file="ftrun/agent/stragglers.py",
        find="                    state.samples.append((now, collectives == 0))",
        replace="                    state.samples.append((now, collectives > 0))  # MUTATION: beats with collectives issued",
        tests=(
            "tests/test_stragglers.py::test_a_slow_rank_is_named_with_its_node_and_taken_out_as_a_fault",
        ),
    ),
    Mutation(
        id="replica-unverified",
        section=CONTROL,
        promise=(
            "the buddy keeps a replica only after it parsed and its CRC32 equals the published "
            "one (issue 12)"
        ),
        file="ftrun/snapshot/replica.py",
        find=(
            "        snapshot = fmt.parse(blob)  # the whole file checks, data CRC32 included\n"
            "        if snapshot.crc32 != crc:"
        ),
        replace="        if False:  # MUTATION: no parse, no CRC32 check",
        tests=(
            "tests/test_sharded_replica.py::test_buddy_stores_only_verified_copies_bounded_and_refuses_bad_requests",
        ),
    ),
    Mutation(
        id="replica-record-after-failed-replication",
        section=CONTROL,
        promise="phase 2 is written only after the buddy's verified acknowledgement (issue 12)",
        file="ftrun/snapshot/writer.py",
        find=(
            "            copy = self.replicate(job.step, crc, self.kept)\n"
            "            self.store.set_record(records.replica_key(where.epoch, job.step, where.rank),\n"
            "                                  copy.to_json())"
        ),
        replace=(
            "            try:  # MUTATION: a failed replication still writes the replica record\n"
            "                body = self.replicate(job.step, crc, self.kept).to_json()\n"
            "            except _FAILURES:\n"
            "                body = written.to_json()\n"
            "            self.store.set_record(records.replica_key(where.epoch, job.step, where.rank),\n"
            "                                  body)"
        ),
        tests=(
            "tests/test_sharded_replica.py::test_a_failed_replication_keeps_the_previous_complete_snapshot_and_mixes_nothing",
        ),
        note=(
            "ftrun/snapshot/writer.py `_publish` (was `_write`): a failed replication still "
            "writes the replica record"
        ),
    ),
    Mutation(
        id="complete-without-replicas",
        section=CONTROL,
        promise="a multi-node snapshot counts only with every rank's replica (issue 12)",
        file="ftrun/snapshot/writer.py",
        find=(
            "    if replicas:\n"
            "        keys += [records.replica_key(epoch, step, r) for r in range(world)]\n"
            "    if not store.all_valid(keys):"
        ),
        replace="    if not store.all_valid(keys):  # MUTATION: replica records not required",
        tests=(
            "tests/test_sharded_replica.py::test_a_failed_replication_keeps_the_previous_complete_snapshot_and_mixes_nothing",
        ),
    ),
    Mutation(
        id="replica-not-stored",
        section=CONTROL,
        promise="a lost node's shards come from the buddy's memory (issue 12)",
        file="ftrun/snapshot/replica.py",
        find=(
            "                tmp.write_bytes(blob)\n"
            "                os.rename(tmp, self.replicas / name)\n"
        ),
        replace="                pass  # MUTATION: acknowledged, not stored\n",
        tests=(
            "tests/test_sharded_nodes.py::test_node_lost_shards_restored_from_buddy_bitwise",
        ),
    ),
    Mutation(
        id="writer-watch-never-campaigns",
        section=CONTROL,
        promise="etcd-v3: a new writer takes over when the writer's lease expires (issue 14)",
        file="ftrun/control/election.py",
        find="                if election.campaign():",
        replace="                if False:  # MUTATION: never runs for the free key",
        tests=(
            "tests/test_etcd.py::test_netns_etcd_member_killed_then_writer_node_killed_then_writer_cut_off",
        ),
        note=(
            "ftrun/control/election.py (was control/etcd.py) `WriterWatch._run` never runs for "
            "the free key"
        ),
    ),
    Mutation(
        id="sharded-job-shrinks",
        section=CONTROL,
        promise="a sharded job fills a lost node's ranks with spares, never shrinks (issue 12)",
        file="ftrun/agent/leader.py",
        find="        if self.whole_world or any(n.standby for n in self.generation.nodes):",
        replace="        if any(n.standby for n in self.generation.nodes):  # MUTATION: whole_world ignored",
        tests=(
            "tests/test_sharded_nodes.py::test_node_lost_shards_restored_from_buddy_bitwise",
        ),
    ),
    Mutation(
        id="promoted-waiter-keeps-waiting",
        section=CONTROL,
        promise=(
            "etcd-v3: an agent promoted to writer while it waits for a generation forms that "
            "generation (issue 14)"
        ),
        file="ftrun/control/rendezvous.py",
        find=(
            "                if self.is_leader:\n"
            "                    return None  # promoted while waiting (etcd-v3's writer election)"
        ),
        replace=(
            "                if False:  # MUTATION: no return when its agent became the leader\n"
            "                    return None  # promoted while waiting (etcd-v3's writer election)"
        ),
        tests=(
            "tests/test_etcd.py::test_etcd_store_operations_signed_records_and_failover",
        ),
    ),
    Mutation(
        id="etcd-watches-never-fail-over",
        section=CONTROL,
        promise="etcd-v3: failover across endpoints (issue 14), tried again on the final test",
        file="ftrun/control/etcd.py",
        find=(
            "        note_failure(self.endpoint)\n"
            "        self._current = (self._current + 1) % len(self._clients)\n"
            "        if len(self._clients) == 1:"
        ),
        replace=(
            "        note_failure(self.endpoint)  # MUTATION: the next endpoint never tried\n"
            "        if len(self._clients) == 1:"
        ),
        tests=(
            "tests/test_etcd.py::test_netns_etcd_member_killed_then_writer_node_killed_then_writer_cut_off",
        ),
        note=(
            "ftrun/control/etcd.py `_failed_over` never moves to the next endpoint (the row "
            "above's `_post` half: `etcd-requests-never-fail-over`)"
        ),
    ),
    Mutation(
        id="etcd-unreachable-is-runtimeerror",
        section=CONTROL,
        promise=(
            "no etcd endpoint answering is a StoreError (the one-line path), never a bare "
            "RuntimeError (issue 14)"
        ),
        file="ftrun/control/etcd.py",
        find="                raise StoreError(f\"cannot reach etcd at {options.describe()} within \"",
        replace="                raise RuntimeError(f\"cannot reach etcd at {options.describe()} within \"  # MUTATION",
        tests=(
            "tests/test_etcd.py::test_etcd_store_operations_signed_records_and_failover",
        ),
    ),
    Mutation(
        id="presence-loss-makes-no-verdict",
        section=CONTROL,
        promise="a killed agent is lost at once through its presence connection (issue 14)",
        file="ftrun/control/presence.py",
        find=(
            "                if conn.bye:\n"
            "                    self._left.add(node_id)\n"
            "                else:\n"
            "                    self._gone[node_id] = self._clock()"
        ),
        replace=(
            "                if conn.bye:\n"
            "                    self._left.add(node_id)  # MUTATION: an end without a goodbye makes no verdict"
        ),
        tests=(
            "tests/test_detect.py::test_presence_verdicts_kill_stop_goodbye_and_refusals",
        ),
    ),
    Mutation(
        id="presence-nonce-unchecked",
        section=CONTROL,
        promise="a presence hello is bound to its connection's nonce (no replay) (issue 14)",
        file="ftrun/control/presence.py",
        find="        if body.get(\"nonce\") != conn.nonce:",
        replace="        if False:  # MUTATION: the nonce check skipped",
        tests=(
            "tests/test_detect.py::test_presence_verdicts_kill_stop_goodbye_and_refusals",
        ),
    ),
    Mutation(
        id="presence-goodbye-unsent",
        section=CONTROL,
        promise="a clean agent exit says goodbye, never a loss (issue 14)",
        file="ftrun/control/presence.py",
        find=(
            "            body = {\"bye\": self.node_id, \"nonce\": nonce}\n"
            "            sock.sendall(self._signer.line(self._key, body).encode() + b\"\\n\")\n"
        ),
        replace="            body = {\"bye\": self.node_id, \"nonce\": nonce}  # MUTATION: closed without sending it\n",
        tests=(
            "tests/test_detect.py::test_presence_verdicts_kill_stop_goodbye_and_refusals",
        ),
    ),
    Mutation(
        id="standby-nodes-ignored",
        section=CONTROL,
        promise="a standby node's workers take a lost node's ranks (issue 14)",
        file="ftrun/agent/leader.py",
        find="        if self.whole_world or any(n.standby for n in self.generation.nodes):",
        replace="        if self.whole_world:  # MUTATION: standby nodes ignored",
        tests=(
            "tests/test_standby.py::test_a_standby_node_takes_a_lost_nodes_ranks_and_failing_nodes_are_refused",
        ),
    ),
    Mutation(
        id="health-gate-always-passes",
        section=CONTROL,
        promise="a node that fails its health gate is refused (issue 14)",
        file="ftrun/control/rendezvous.py",
        find=(
            "        if not slot.health:\n"
            "            return True"
        ),
        replace=(
            "        if True:  # MUTATION: every node healthy\n"
            "            return True"
        ),
        tests=(
            "tests/test_standby.py::test_a_standby_node_takes_a_lost_nodes_ranks_and_failing_nodes_are_refused",
        ),
    ),
    Mutation(
        id="worker-store-never-moves",
        section=CONTROL,
        promise=(
            "etcd-v3: the survivors' workers follow the member-epoch store to the writer that "
            "took over, with 0 lost steps (issue 14)"
        ),
        file="ftrun/worker/membership.py",
        find=(
            "        path = os.environ.get(P.STORE_FILE_ENV)\n"
            "        if not path:\n"
            "            return None"
        ),
        replace=(
            "        path = os.environ.get(P.STORE_FILE_ENV)\n"
            "        if True:  # MUTATION: no reconnect through the agent's store file\n"
            "            return None"
        ),
        tests=(
            "tests/test_etcd.py::test_netns_etcd_member_killed_then_writer_node_killed_then_writer_cut_off",
        ),
    ),
    Mutation(
        id="moved-store-silence-from-now",
        section=CONTROL,
        promise=(
            "etcd-v3: after the store moved, a member's silence counts from its beat's request "
            "bound (issue 14)"
        ),
        file="ftrun/agent/regroup.py",
        find="        since = time.monotonic() + 10.0",
        replace="        since = time.monotonic()  # MUTATION: alive_at now, not now + 10 s",
        tests=(
            "tests/test_etcd.py::test_netns_etcd_member_killed_then_writer_node_killed_then_writer_cut_off",
        ),
        known_miss=(
            "not caught (twice, the second time with --liveness-timeout 3 s in the test): the "
            "survivors' beats reach the moved store within the liveness timeout"
        ),
    ),
    Mutation(
        id="etcd-ca-not-passed-per-request",
        section=CONTROL,
        promise=(
            "etcd-v3 over TLS: `cacert` is used even where `REQUESTS_CA_BUNDLE` names another CA "
            "(issue 14)"
        ),
        file="ftrun/control/etcdheld.py",
        find=(
            "        if isinstance(self.verify, str) and kwargs.get(\"verify\") is None:\n"
            "            kwargs[\"verify\"] = self.verify\n"
        ),
        replace="",
        tests=(
            "tests/test_etcd_tls.py::test_etcd_tls_job_forms_with_the_right_client_certificate_and_a_wrong_one_is_one_line",
        ),
        note=(
            "ftrun/control/etcdheld.py `BoundedSession.request` (was etcd.py `_Session.request`) "
            "no longer passes the session's CA with each request"
        ),
    ),
    Mutation(
        id="etcd-error-without-detail",
        section=CONTROL,
        promise=(
            "etcd-v3 over TLS: a TLS failure is one line naming the endpoint and OpenSSL's reason"
            " (issue 14)"
        ),
        file="ftrun/control/etcdwire.py",
        find="    whole = str(error).strip() or str(getattr(error, \"detail_text\", \"\") or \"\").strip()",
        replace="    whole = str(error).strip()  # MUTATION: etcd3gw's detail_text ignored",
        tests=(
            "tests/test_etcd_tls.py::test_etcd_tls_job_forms_with_the_right_client_certificate_and_a_wrong_one_is_one_line",
        ),
        note=(
            "ftrun/control/etcdwire.py `short` (was etcd.py `_short`) ignores etcd3gw's "
            "`detail_text`"
        ),
    ),
    Mutation(
        id="etcd-wait-thread-per-wait",
        section=CONTROL,
        promise=(
            "etcd-v3: a wait reads its own watch stream, no thread per wait (issue 14: what kept "
            "128 light agents from a rendezvous)"
        ),
        file="ftrun/control/etcd.py",
        find=(
            "        client = self._clients[self._current]\n"
            "        span = self._span(key)"
        ),
        replace=(
            "        client = self._clients[self._current]\n"
            "        try:  # MUTATION: etcd3gw's watch_once (a thread pool and a thread per wait)\n"
            "            client.watch_once(self._root + key.encode(), timeout=left,\n"
            "                              start_revision=revision + 1)\n"
            "        except Exception:\n"
            "            raise RuntimeError(f\"wait timeout after {int(left * 1000)}ms (etcd key {key!r})\"\n"
            "                               ) from None\n"
            "        return None\n"
            "        span = self._span(key)"
        ),
        tests=(
            "tests/test_etcd.py::test_etcd_store_operations_signed_records_and_failover",
        ),
        note=(
            "ftrun/control/etcd.py `_watch_create` waits in etcd3gw's `watch_once` (as the module"
            " of 03fddf3~1 did)"
        ),
    ),
    Mutation(
        id="spare-never-reused",
        section=CONTROL,
        promise=(
            "sharded snapshots: the spare a capture copies into is the previous snapshot's file, "
            "reused (no page allocation; two files per rank) (issue 12)"
        ),
        file="ftrun/snapshot/writer.py",
        find=(
            "    def _retire(self, path: Path) -> None:\n"
            "        target = self._maps.pop(path, None)\n"
            "        if self._spare is None:"
        ),
        replace=(
            "    def _retire(self, path: Path) -> None:\n"
            "        target = self._maps.pop(path, None)\n"
            "        if False:  # MUTATION: never renamed into the spare"
        ),
        tests=(
            "tests/test_sharded_writer.py::test_the_writer_publishes_what_it_copied_and_holds_two_files",
        ),
    ),
    Mutation(
        id="failed-snapshot-stays-published",
        section=CONTROL,
        promise=(
            "sharded snapshots: a snapshot whose replication failed adds no third file (issue 12)"
        ),
        file="ftrun/snapshot/writer.py",
        find="        the spare again (or goes), so no third file is ever held.\"\"\"\n",
        replace=(
            "        the spare again (or goes), so no third file is ever held.\"\"\"\n"
            "        return  # MUTATION: the failed file stays published\n"
        ),
        tests=(
            "tests/test_sharded_writer.py::test_the_writer_publishes_what_it_copied_and_holds_two_files",
        ),
    ),
    Mutation(
        id="crc32-not-zlibs",
        section=CONTROL,
        promise=(
            "sharded snapshots: the checksum is zlib's CRC-32 (computed by ISA-L), so every node "
            "agrees on it (issue 12)"
        ),
        file="ftrun/snapshot/format.py",
        find="    return _crc32(data) & 0xFFFFFFFF",
        replace="    return (_crc32(data) ^ 0x5A5A) & 0xFFFFFFFF  # MUTATION",
        tests=(
            "tests/test_sharded_writer.py::test_the_writer_publishes_what_it_copied_and_holds_two_files",
        ),
    ),
    Mutation(
        id="outgrown-manifest-not-moved",
        section=CONTROL,
        promise=(
            "sharded snapshots: a manifest that outgrew the room reserved at capture has its data"
            " moved, never lost (issue 12)"
        ),
        file="ftrun/snapshot/writer.py",
        find=(
            "        if fmt.data_start(prefix) > job.start:\n"
            "            self._move(job, fmt.data_start(prefix))"
        ),
        replace=(
            "        if False:  # MUTATION: _move skipped\n"
            "            self._move(job, fmt.data_start(prefix))"
        ),
        tests=(
            "tests/test_sharded_writer.py::test_the_writer_publishes_what_it_copied_and_holds_two_files",
        ),
    ),
    Mutation(
        id="exit-keeps-captured-groups",
        section=CONTROL,
        promise=(
            "a raising worker's gloo threads are joined before the interpreter ends (issue 15)"
        ),
        file="ftrun/exithook.py",
        find="    if functional is not None and isinstance(group_type, type):",
        replace="    if False:  # MUTATION: torch.distributed.nn.functional's captured default groups left in place",
        tests=(
            "tests/test_exit.py::test_a_raising_worker_destroys_its_groups_and_exits_1[spawned]",
            "tests/test_exit.py::test_a_raising_worker_destroys_its_groups_and_exits_1[preloaded]",
        ),
    ),
    Mutation(
        id="hangs-from-stacks-alone",
        section=CONTROL,
        promise=(
            "a rank behind its peers in NCCL is named from the shim's collective counts (issue "
            "15)"
        ),
        file="ftrun/agent/hangs.py",
        find="        self.progress_of = progress_of or nccl_progress",
        replace="        self.progress_of = lambda worker: None  # MUTATION: the stacks alone, no NCCL counts",
        tests=(
            "tests/test_hangs.py::test_a_rank_behind_its_peers_in_nccl_is_named_whatever_the_stacks_say",
        ),
        note=(
            "ftrun/agent/hangs.py `HangWatch`: no NCCL collective counts (`progress_of` ignored),"
            " the stacks alone, as before 3d55320"
        ),
    ),
    Mutation(
        id="resync-from-rank-0",
        section=CONTROL,
        promise=(
            "etcd-v3 store move: the first member epoch on the new store gives every member the "
            "state of the one furthest on (issue 14)"
        ),
        file="ftrun/worker/api.py",
        find=(
            "        source = torch.tensor([rank if self._step == highest else epoch.world_size],\n"
            "                              dtype=torch.int64)"
        ),
        replace="        source = torch.tensor([0], dtype=torch.int64)  # MUTATION: always rank 0's state",
        tests=(
            "tests/test_etcd_resync.py::test_resync_gives_every_member_the_state_of_the_member_furthest_on",
        ),
    ),
    Mutation(
        id="offer-made-once",
        section=CONTROL,
        promise=(
            "a join whose offer request failed offers again until its deadline (issue 14, etcd at"
            " scale)"
        ),
        file="ftrun/control/rendezvous.py",
        find=(
            "            self._repeated(deadline, f\"offering this node for generation {number}\",\n"
            "                           self._offer, number, slot)"
        ),
        replace="            self._offer(number, slot)  # MUTATION: offered once, not again until the deadline",
        tests=(
            "tests/test_etcd.py::test_etcd_store_operations_signed_records_and_failover",
        ),
    ),
    Mutation(
        id="standby-promoted-without-gate",
        section=CONTROL,
        promise=(
            "a standby node is promoted only after its health gate, run again after the member "
            "epoch ended, passed (issue 14)"
        ),
        file="ftrun/agent/leader.py",
        find=(
            "        slot = next((n for n in self.generation.nodes if n.node_rank == node_rank), None)\n"
            "        if slot is None or not slot.standby or self.gate_epoch is None:"
        ),
        replace=(
            "        return True  # MUTATION: promoted at once\n"
            "        slot = next((n for n in self.generation.nodes if n.node_rank == node_rank), None)\n"
            "        if slot is None or not slot.standby or self.gate_epoch is None:"
        ),
        tests=(
            "tests/test_standby.py::test_a_standby_node_takes_a_lost_nodes_ranks_and_failing_nodes_are_refused",
        ),
    ),
    Mutation(
        id="etcd-writer-serves-no-presence",
        section=CONTROL,
        promise=(
            "etcd-v3: a killed non-writer agent is lost at once through its presence connection, "
            "served by the elected writer (issue 14)"
        ),
        file="ftrun/agent/loop.py",
        find="        if multi and hosting:  # a killed agent is lost at once (etcd-v3: the writer serves)",
        replace="        if multi and hosting and etcd is None:  # MUTATION: no presence on etcd-v3",
        tests=(
            "tests/test_etcd.py::test_netns_etcd_member_killed_then_writer_node_killed_then_writer_cut_off",
        ),
        note=(
            "ftrun/agent/loop.py `_connect`: the elected etcd-v3 writer serves no presence "
            "connections (the code before 1d92f7c also gave etcd-v3 agents no PresenceClient)"
        ),
    ),
    Mutation(
        id="takeover-emits-no-node-lost",
        section=CONTROL,
        promise=(
            "etcd-v3 takeover: the new writer's fault record dates the lost writer from its "
            "lease's last renewal (issue 14)"
        ),
        file="ftrun/agent/etcdwriter.py",
        find="        _say_lost_writer(agent, generation, old)\n",
        replace="",
        tests=(
            "tests/test_etcd.py::test_netns_etcd_member_killed_then_writer_node_killed_then_writer_cut_off",
        ),
    ),
    Mutation(
        id="all-waiting-after-300-timeouts",
        section=CONTROL,
        promise=(
            "every rank inside torch's communication on one node is a hang after three timeouts "
            "(gloo)"
        ),
        file="ftrun/agent/hangs.py",
        find="        if idle_s < 3 * self.timeout_s:  # nobody to name: three timeouts",
        replace="        if idle_s < 300 * self.timeout_s:  # MUTATION: 300 timeouts",
        tests=(
            "tests/test_hangs.py::test_every_rank_inside_communication_is_a_hang_after_three_timeouts",
        ),
    ),
    Mutation(
        id="presence-pings-ignored",
        section=CONTROL,
        promise=(
            "a node that pings its presence connection is silent only while neither its store "
            "heartbeat nor its pings are heard (issue 14, the 2 s default)"
        ),
        file="ftrun/control/heartbeat.py",
        find="                silent, limit = min(silent, quiet[node_id]), self.timeout_s",
        replace="                silent, limit = silent, self.timeout_s  # MUTATION: the pings ignored",
        tests=(
            "tests/test_detect.py::test_pings_keep_a_quiet_store_heartbeat_alive_and_a_stopped_agent_is_lost_in_time",
        ),
    ),
    Mutation(
        id="lease-never-expires",
        section=CONTROL,
        promise="etcd-v3: a lost node is a lease that expired (issue 14)",
        file="ftrun/control/election.py",
        find="            node.state = \"kept\" if left >= 0 else \"expired\"",
        replace="            node.state = \"kept\"  # MUTATION: every lease read alive",
        tests=(
            "tests/test_etcd.py::test_etcd_heartbeats_are_leases_a_foreign_delete_is_not_a_loss_and_a_pause_regrants",
        ),
    ),
    Mutation(
        id="deleted-key-is-expired-lease",
        section=CONTROL,
        promise=(
            "etcd-v3: a foreign delete or unsigned overwrite of a liveness key is not a lost node"
            " (issue 14)"
        ),
        file="ftrun/control/election.py",
        find=(
            "        if node is not None and node.state != \"expired\":\n"
            "            self._check(client, node_id, node)"
        ),
        replace=(
            "        if node is not None and node.state != \"expired\":\n"
            "            with self._lock:  # MUTATION: expired without reading its TTL\n"
            "                node.state, node.at = \"expired\", now"
        ),
        tests=(
            "tests/test_etcd.py::test_etcd_heartbeats_are_leases_a_foreign_delete_is_not_a_loss_and_a_pause_regrants",
        ),
    ),
    Mutation(
        id="network-wait-never-seen",
        section=CONTROL,
        promise=(
            "A rank awaiting the network (a late remote read) is not a hang before three timeouts"
        ),
        file="ftrun/agent/stacks.py",
        find=(
            "        if not self.frames or not self.frames[0].in_network_io:\n"
            "            return False"
        ),
        replace=(
            "        if True:  # MUTATION: never awaiting the network\n"
            "            return False"
        ),
        tests=(
            "tests/test_hangs.py::test_a_slow_step_is_not_a_hang",
            "tests/test_hangs.py::test_a_rank_awaiting_the_network_is_named_only_after_three_timeouts",
        ),
    ),
    Mutation(
        id="expired-lease-kept",
        section=CONTROL,
        promise=(
            "etcd-v3: an agent whose lease expired while it was stopped grants a new one and puts"
            " its key again (issue 14)"
        ),
        file="ftrun/control/election.py",
        find=(
            "                self.expired += 1\n"
            "                self.lease = None"
        ),
        replace="                self.expired += 1  # MUTATION: counted, but kept (no new grant)",
        tests=(
            "tests/test_etcd.py::test_etcd_heartbeats_are_leases_a_foreign_delete_is_not_a_loss_and_a_pause_regrants",
        ),
    ),
    Mutation(
        id="local-wait-matches-nothing",
        section=CONTROL,
        promise=(
            "A local pipe (a data loader's multiprocessing queue, a child's output) is not a "
            "network wait"
        ),
        file="ftrun/agent/stacks.py",
        find="_LOCAL_WAIT = (\"/multiprocessing/\", \"/subprocess.py\", \"/concurrent/futures/\")",
        replace="_LOCAL_WAIT = ()  # MUTATION",
        tests=(
            "tests/test_hangs.py::test_py_spy_tells_a_remote_read_from_a_local_pipe",
        ),
    ),
    Mutation(
        id="late-rank-without-network-allowance",
        section=CONTROL,
        promise="The network allowance holds when the NCCL counts name the late rank",
        file="ftrun/agent/hangs.py",
        find=(
            "            culprits = tuple(w for w in live if w.pid in late)\n"
            "            if self._awaiting_network(culprits, stacks, idle_s, now):\n"
            "                return None\n"
        ),
        replace="            culprits = tuple(w for w in live if w.pid in late)  # MUTATION: no _awaiting_network\n",
        tests=(
            "tests/test_hangs.py::test_a_late_reply_neither_grows_the_timeout_nor_skips_the_rule_under_nccl",
        ),
    ),
    Mutation(
        id="spell-growth-unconditional",
        section=CONTROL,
        promise="A spell given the network allowance does not grow the auto timeout",
        file="ftrun/agent/hangs.py",
        find="            if not self.spell_awaited_network:  # a late reply has its own allowance",
        replace="            if True:  # MUTATION: the growth unconditional again",
        tests=(
            "tests/test_hangs.py::test_a_late_reply_neither_grows_the_timeout_nor_skips_the_rule_under_nccl",
        ),
    ),
    Mutation(
        id="local-wait-in-every-frame",
        section=CONTROL,
        promise="A local-pipe check sees only the I/O-library frames around the innermost one",
        file="ftrun/agent/stacks.py",
        find=(
            "            if not frame.in_network_io:\n"
            "                return True  # the caller of the I/O library: no local pipe underneath\n"
        ),
        replace="",
        tests=(
            "tests/test_hangs.py::test_a_rank_awaiting_the_network_is_named_only_after_three_timeouts",
            "tests/test_hangs.py::test_a_late_reply_neither_grows_the_timeout_nor_skips_the_rule_under_nccl",
            "tests/test_hangs.py::test_a_slow_step_is_not_a_hang",
        ),
    ),
    Mutation(
        id="presence-gone-empty",
        section=CONTROL,
        promise=(
            "The store-load generator's killed agent is lost at once through its presence "
            "connection, not after the heartbeat timeout (scripts/loadgen.py against the real "
            "leader)"
        ),
        file="ftrun/control/presence.py",
        find="            return dict(self._gone)",
        replace="            return {}  # MUTATION",
        tests=(
            "tests/test_rendezvous_scale.py::test_simulated_agents_speak_the_real_protocols_to_the_real_leader",
        ),
    ),
    Mutation(
        id="lease-last-second-dead",
        section=CONTROL,
        promise=(
            "etcd-v3: a lease in its last second is alive (etcd's gateway omits a TTL of 0; only "
            "an answer without `grantedTTL` is a lease gone)"
        ),
        file="ftrun/control/etcd.py",
        find="        return max(0, int(result.get(\"TTL\", 0))) if \"grantedTTL\" in result else -1",
        replace="        return int(result.get(\"TTL\", -1))  # MUTATION",
        tests=(
            "tests/test_etcd.py::test_lease_view_on_loopback_etcd",
        ),
    ),
    Mutation(
        id="uncreated-watch-swallowed",
        section=CONTROL,
        promise=(
            "etcd-v3: a lease view whose watch never got its \"created\" answer (a frozen first "
            "endpoint) fails over"
        ),
        file="ftrun/control/etcd.py",
        find="            if time.monotonic() < deadline - 0.05 or not created:",
        replace="            if time.monotonic() < deadline - 0.05:  # MUTATION: whatever created says",
        tests=(
            "tests/test_etcd.py::test_lease_view_on_loopback_etcd",
        ),
    ),
    Mutation(
        id="lease-view-no-lag-reread",
        section=CONTROL,
        promise="etcd-v3: the lease view's watch start revision advances while `hb/` is quiet",
        file="ftrun/control/election.py",
        find=(
            "                if current - self.revision >= max(self.max_lag, 2 * len(self._nodes)):\n"
            "                    self.revision = 0  # read again (see the class docstring)\n"
        ),
        replace="",
        tests=(
            "tests/test_etcd.py::test_lease_view_on_loopback_etcd",
        ),
    ),
    Mutation(
        id="lease-view-hides-stuck-time",
        section=CONTROL,
        promise=(
            "etcd-v3: a lease view stuck in requests does not hide silence past a slice and one "
            "request"
        ),
        file="ftrun/control/election.py",
        find="                synced = now - max(0.0, self.looked_at - synced) - stuck",
        replace="                synced = now - max(0.0, self.looked_at - synced)  # MUTATION: the stuck term dropped",
        tests=(
            "tests/test_etcd.py::test_lease_view_on_loopback_etcd",
        ),
    ),
    Mutation(
        id="lease-view-stop-joins-0s",
        section=CONTROL,
        promise="etcd-v3: `HeartbeatMonitor.close` stops the lease view's thread",
        file="ftrun/control/election.py",
        find="        self._thread.join(self.slice_s + self.request_s if timeout_s is None else timeout_s)",
        replace="        self._thread.join(0)  # MUTATION",
        tests=(
            "tests/test_etcd.py::test_etcd_heartbeats_are_leases_a_foreign_delete_is_not_a_loss_and_a_pause_regrants",
        ),
    ),
    Mutation(
        id="lease-view-stop-leaves-stream",
        section=CONTROL,
        promise="etcd-v3: `LeaseView.stop` ends a watch's wait at once",
        file="ftrun/control/election.py",
        find="            stream.raw.shutdown()  # type: ignore[union-attr]",
        replace="            pass  # MUTATION: the stream's shutdown removed",
        tests=(
            "tests/test_etcd.py::test_lease_view_on_loopback_etcd",
        ),
    ),
    Mutation(
        id="loadgen-record-names-another-lease",
        section=CONTROL,
        promise=(
            "The etcd-v3 store load's simulated agents put the liveness record an etcd-v3 agent "
            "puts (signed, naming its own lease), which the real writer's LeaseView accepts"
        ),
        file="scripts/loadgen.py",
        find="        line = gen.signer.line(key, {\"lease\": self.lease, \"ttl\": int(self.lease_ttl)})",
        replace="        line = gen.signer.line(key, {\"lease\": self.lease + 1, \"ttl\": int(self.lease_ttl)})  # MUTATION",
        tests=(
            "tests/test_rendezvous_scale.py::test_simulated_etcd_agents_keep_leases_the_real_writer_sees_and_join_its_generation",
        ),
    ),
    Mutation(
        id="worker-without-store-follower",
        section=CONTROL,
        promise=(
            "etcd-v3: a worker request blocked on a dead member-epoch store (a host that drops "
            "packets) gives up as soon as its agent names the new store"
        ),
        file="ftrun/worker/membership.py",
        find="        self._follow = None if moved is None else _StoreFollower(env, signer)",
        replace="        self._follow = None  # MUTATION: no store-file follower",
        tests=(
            "tests/test_worker_waits.py::test_a_worker_leaves_a_dead_store_for_the_one_its_agent_names",
        ),
    ),
    Mutation(
        id="revoke-whoever-holds-the-key",
        section=CONTROL,
        promise=(
            "etcd-v3: a survivor revokes the writer key's lease only while the key names the node"
            " whose agent it found dead"
        ),
        file="ftrun/control/election.py",
        find="                      if key == self.key and value == node_id.encode()), 0)",
        replace="                      if key == self.key), 0)  # MUTATION: no value check",
        tests=(
            "tests/test_etcd.py::test_a_writer_watch_revokes_only_the_dead_writers_lease",
        ),
    ),
    Mutation(
        id="dead-writer-lease-not-revoked",
        section=CONTROL,
        promise=(
            "etcd-v3: a writer whose agent died (its presence port refuses) is taken over without"
            " waiting out its lease"
        ),
        file="ftrun/agent/etcdwriter.py",
        find="        agent.heartbeat.on_server_gone = agent._writer_watch.nudge",
        replace="        pass  # MUTATION: a refused presence port nudges no one (no revoke)",
        tests=(
            "tests/test_etcd.py::test_netns_etcd_member_killed_then_writer_node_killed_then_writer_cut_off",
        ),
        note=(
            "ftrun/agent/etcdwriter.py `watch_writer`: the heartbeat's refused presence port is "
            "not passed to the writer watch, so no survivor revokes the dead writer's lease"
        ),
    ),
    Mutation(
        id="inject-rank-off-by-one",
        section=CONTROL,
        promise=(
            "`ftrun inject` refuses a rank outside the job before writing anything (exit 2), "
            "checked now in the test process through `cli.main`"
        ),
        file="ftrun/client/inject.py",
        find="        if fault.rank is not None and not fault.rank < world:",
        replace="        if fault.rank is not None and not fault.rank <= world:  # MUTATION",
        tests=(
            "tests/test_inject.py::test_ftrun_inject_checks_everything_before_touching_the_job",
        ),
    ),
    Mutation(
        id="appended-reads-unchecked",
        section=CONTROL,
        promise=(
            "etcd-v3: a key with appended parts read again fetches only what changed, and is "
            "always what a whole read returns"
        ),
        file="ftrun/control/etcdwire.py",
        find="            if count != had + len(kvs) or any(",
        replace="            if False and any(  # MUTATION: etcd's count and the parts' create revisions unchecked",
        tests=(
            "tests/test_rendezvous_scale.py::test_simulated_etcd_agents_keep_leases_the_real_writer_sees_and_join_its_generation",
        ),
    ),
    Mutation(
        id="watched-value-from-any-event",
        section=CONTROL,
        promise=(
            "etcd-v3: a wait takes the value from the watch's event only when its first revision "
            "is one put of the key itself"
        ),
        file="ftrun/control/etcdwire.py",
        find="    if len(at_first) != 1 or at_first[0].get(\"type\", \"PUT\") != \"PUT\":",
        replace="    if at_first[0].get(\"type\", \"PUT\") != \"PUT\":  # MUTATION: no one-event check",
        tests=(
            "tests/test_rendezvous_scale.py::test_simulated_etcd_agents_keep_leases_the_real_writer_sees_and_join_its_generation",
        ),
    ),
    Mutation(
        id="multi-set-skips-a-chunk",
        section=CONTROL,
        promise="etcd-v3: a `multi_set` split over parallel transactions writes every key",
        file="ftrun/control/etcd.py",
        find="                for chunk in chunks[k::len(clients)]:",
        replace="                for chunk in chunks[k + 1::len(clients)]:  # MUTATION: each skips its first chunk",
        tests=(
            "tests/test_etcd.py::test_etcd_store_operations_signed_records_and_failover",
        ),
    ),
    Mutation(
        id="loadgen-assignment-unverified",
        section=CONTROL,
        promise=(
            "The etcd light rendezvous's simulated agents verify their assignment as the agent "
            "does"
        ),
        file="scripts/loadgen.py",
        find="            own = Assignment.from_json(gen.signer.unwrap_line(gen.prefix + name, raw))",
        replace="            own = Assignment.from_json(json.loads(raw)[\"body\"])  # MUTATION: no signature check",
        tests=(
            "tests/test_rendezvous_scale.py::test_simulated_etcd_agents_keep_leases_the_real_writer_sees_and_join_its_generation",
        ),
    ),
    Mutation(
        id="fleet-drops-an-early-exit",
        section=CONTROL,
        promise=(
            "The scale harness fails a wait at once for a generator process that ended after its "
            "event (not at its deadline, which a benchmark takes for \"too many agents\" and halves"
            " N)"
        ),
        file="scripts/loadgen.py",
        find="                self._early.append((k, obj))  # it said what was asked, then ended: a later",
        replace="                continue  # MUTATION: the exit dropped again",
        tests=(
            "tests/test_rendezvous_scale.py::test_the_load_generators_harness_keeps_early_events_and_tells_failures_from_size",
        ),
    ),
    Mutation(
        id="watch-without-grpc-timeout",
        section=CONTROL,
        promise=(
            "etcd-v3: a wait's slices reuse the client's connection (the gateway ends each watch "
            "stream at its Grpc-Timeout)"
        ),
        file="ftrun/control/etcd.py",
        find="                                     headers={\"Grpc-Timeout\": f\"{max(1, int(left * 1000))}m\"},\n",
        replace="",
        tests=(
            "tests/test_rendezvous_scale.py::test_simulated_etcd_agents_keep_leases_the_real_writer_sees_and_join_its_generation",
        ),
    ),
    Mutation(
        id="loadgen-deadline-code-4-only",
        section=CONTROL,
        promise=(
            "The etcd simulated agents take the gateway's end of a slice's stream as its deadline"
            " in both forms it sends (DEADLINE_EXCEEDED, or UNKNOWN \"context deadline exceeded\")"
        ),
        file="scripts/loadgen.py",
        find="                if deadline_error(answer):  # the gateway ended it at the deadline",
        replace="                if isinstance(answer.get(\"error\"), dict) and answer[\"error\"].get(\"grpc_code\") == 4:  # MUTATION: only grpc_code 4",
        tests=(
            "tests/test_rendezvous_scale.py::test_a_simulated_agents_watch_takes_either_form_of_the_gateways_deadline[unknown]",
            "tests/test_rendezvous_scale.py::test_simulated_etcd_agents_keep_leases_the_real_writer_sees_and_join_its_generation",
        ),
    ),
    Mutation(
        id="heartbeat-judged-on-a-third",
        section=CONTROL,
        promise=(
            "A link flap shorter than the heartbeat timeout loses no node (the shortened 80-step "
            "job still sees it)"
        ),
        file="ftrun/control/heartbeat.py",
        find="            if silent > limit or node_id in gone:",
        replace="            if silent > limit / 3 or node_id in gone:  # MUTATION: a third of the timeout",
        tests=(
            "tests/test_multinode.py::test_netns_link_flap_shorter_than_heartbeat_timeout_changes_nothing",
        ),
    ),
    Mutation(
        id="one-port-stale-keys-none",
        section=CONTROL,
        promise=(
            "One-port restarts: the job store keeps no worker key of a dead generation (restarts "
            "now fork from a preloaded server, faster than cold ones)"
        ),
        file="ftrun/agent/loop.py",
        find="                stale = [k for k in self._control_raw.list_keys() if not k.startswith(\"ftrun/\")]",
        replace="                stale = []  # MUTATION: no worker key deleted",
        tests=(
            "tests/test_launcher.py::test_many_consecutive_restarts_always_recover[one-port]",
        ),
    ),
    Mutation(
        id="job-record-waits-for-refresh",
        section=CONTROL,
        promise=(
            "The leader's job record (what `ftrun inject` checks a rank against) says a new world"
            " at the next tick"
        ),
        file="ftrun/agent/inject.py",
        find="            reshaped = job is not None and (self.world_size, self.nnodes) != written",
        replace="            reshaped = False  # MUTATION: a new world waits for the refresh",
        tests=(
            "tests/test_inject.py::test_the_job_record_says_a_new_world_at_once",
        ),
        note=(
            "ftrun/agent/inject.py `Injector._run`: a changed world is not written at the next "
            "tick (`reshaped = False`), as in the code before"
        ),
    ),
    Mutation(
        id="readable-on-select",
        section=CONTROL,
        promise=(
            "An agent whose descriptors are numbered above 1023 (a large job's store host) still "
            "watches its workers"
        ),
        file="ftrun/agent/processes.py",
        find=(
            "    poller = select.poll()\n"
            "    for fd in fds:\n"
        ),
        replace=(
            "    return select.select(fds, [], [], max(timeout_s, 0.0))[0]  # MUTATION: back on select\n"
            "    poller = select.poll()\n"
            "    for fd in fds:\n"
        ),
        tests=(
            "tests/test_fdlimit.py::test_an_agent_with_descriptors_above_1023_watches_its_workers[exec]",
            "tests/test_fdlimit.py::test_an_agent_with_descriptors_above_1023_watches_its_workers[fork-server]",
        ),
        note=(
            "ftrun/agent/processes.py `readable` (what `wait_any` waits with) back on "
            "`select.select`"
        ),
    ),
    Mutation(
        id="forked-exit-check-on-select",
        section=CONTROL,
        promise="the same, for a forked worker's exit check",
        file="ftrun/agent/forkserver.py",
        find="        if self._pidfd >= 0 and not readable([self._pidfd], 0.0):",
        replace="        if self._pidfd >= 0 and not __import__(\"select\").select([self._pidfd], [], [], 0.0)[0]:  # MUTATION",
        tests=(
            "tests/test_fdlimit.py::test_an_agent_with_descriptors_above_1023_watches_its_workers[fork-server]",
        ),
    ),
    Mutation(
        id="fork-server-socket-on-select",
        section=CONTROL,
        promise="the same, for the fork server's socket",
        file="ftrun/agent/forkserver.py",
        find="        if not readable([self._sock.fileno()], timeout_s):",
        replace="        if not __import__(\"select\").select([self._sock.fileno()], [], [], timeout_s)[0]:  # MUTATION",
        tests=(
            "tests/test_fdlimit.py::test_an_agent_reads_a_fork_server_whose_socket_is_numbered_above_1023",
            "tests/test_fdlimit.py::test_an_agent_with_descriptors_above_1023_watches_its_workers[fork-server]",
        ),
    ),
    Mutation(
        id="zygote-socket-on-select",
        section=CONTROL,
        promise="the same, for the fork server's own wait on its socket",
        file="ftrun/agent/zygote.py",
        find="        ready = {fd for fd, _events in poller.poll(1000)}",
        replace="        ready = set(select.select([sock.fileno(), wake_r], [], [], 1.0)[0])  # MUTATION: back on select",
        tests=(
            "tests/test_fdlimit.py::test_a_fork_server_whose_socket_is_numbered_above_1023_forks_and_reports",
        ),
    ),
    Mutation(
        id="agent-limit-not-raised",
        section=CONTROL,
        promise="A multi-node agent raises its own soft open-file limit",
        file="ftrun/agent/loop.py",
        find="        fdlimit.raise_for(self.config, self.say)  # before any store or worker starts",
        replace="        pass  # MUTATION: fdlimit.raise_for not called",
        tests=(
            "tests/test_fdlimit.py::test_a_multinode_agent_raises_its_open_file_limit_but_not_its_workers[1:1000-True]",
            "tests/test_fdlimit.py::test_a_multinode_agent_raises_its_open_file_limit_but_not_its_workers[1:2-False]",
        ),
    ),
    Mutation(
        id="worker-keeps-raised-limit",
        section=CONTROL,
        promise="Its workers keep the limit the agent was started with",
        file="ftrun/agent/processes.py",
        find="    fdlimit.restore_in_child()",
        replace="    pass  # MUTATION: fdlimit.restore_in_child not called",
        tests=(
            "tests/test_fdlimit.py::test_a_multinode_agent_raises_its_open_file_limit_but_not_its_workers[1:1000-True]",
            "tests/test_fdlimit.py::test_a_multinode_agent_raises_its_open_file_limit_but_not_its_workers[1:2-False]",
        ),
    ),
    Mutation(
        id="limit-line-whatever-the-need",
        section=CONTROL,
        promise="The too-small-limit line only when the job's largest size needs more",
        file="ftrun/host/fdlimit.py",
        find="    if soft != resource.RLIM_INFINITY and soft < want:",
        replace="    if True:  # MUTATION: said whatever the need",
        tests=(
            "tests/test_fdlimit.py::test_a_multinode_agent_raises_its_open_file_limit_but_not_its_workers[1:2-False]",
        ),
    ),
    Mutation(
        id="replica-server-every-interface",
        section=CONTROL,
        promise=(
            "A multi-node job's snapshot replica server listens on its node's address, not every "
            "interface"
        ),
        file="ftrun/agent/snapshots.py",
        find="        serve_on = _bind_address(self._advertise, advertise)",
        replace="        serve_on = advertise or \"\"  # MUTATION: --local-addr or every interface",
        tests=(
            "tests/test_exposure.py::test_netns_replica_server_listens_on_the_nodes_address",
        ),
    ),
    Mutation(
        id="record-fast-path-without-mac",
        section=CONTROL,
        promise="A stored record verifies on its bytes only with this job's MAC for this key",
        file="ftrun/control/auth.py",
        find="            if hmac.compare_digest(raw[-_HEX - 2:-2], mac):",
        replace="            if True:  # MUTATION: the fast path without the MAC comparison",
        tests=(
            "tests/test_multinode.py::test_a_stored_record_is_checked_on_its_bytes_and_anything_else_the_long_way",
        ),
    ),
    Mutation(
        id="multi-get-parts-reversed",
        section=CONTROL,
        promise="Long key lists are read in parts, every record in the order asked",
        file="ftrun/control/store.py",
        find="                 for i in range(0, len(keys), self.KEYS_PER_REQUEST)]",
        replace="                 for i in range(0, len(keys), self.KEYS_PER_REQUEST)][::-1]  # MUTATION",
        tests=(
            "tests/test_multinode.py::test_long_key_lists_are_read_in_parts_in_order",
        ),
    ),
    Mutation(
        id="check-first-part-only",
        section=CONTROL,
        promise="... and a key missing from a later part is seen",
        file="ftrun/control/store.py",
        find="        return all(self._call(\"check\", keys[i:i + step]) for i in range(0, len(keys), step))",
        replace="        return bool(self._call(\"check\", keys[:step]))  # MUTATION: the first part only",
        tests=(
            "tests/test_multinode.py::test_long_key_lists_are_read_in_parts_in_order",
        ),
    ),
    Mutation(
        id="missed-at-always-none",
        section=CONTROL,
        promise=(
            "etcd-v3: a wait's later slices cost etcd no read (the watch starts from the revision"
            " the first slice's read found the key missing at)"
        ),
        file="ftrun/control/etcdwire.py",
        find="        if held is None or held[1] != endpoint or now - held[2] > self._horizon_s:",
        replace="        if True:  # MUTATION: MissedAt.since always None",
        tests=(
            "tests/test_rendezvous_scale.py::test_a_renewed_etcd_wait_costs_no_read_and_misses_no_write",
        ),
    ),
    Mutation(
        id="replayed-event-trusted",
        section=CONTROL,
        promise=(
            "etcd-v3: a write replayed to a renewed watch (made between two slices) is read, "
            "never taken from the event (it may have been undone)"
        ),
        file="ftrun/control/etcdwire.py",
        find="            if self.replay and (not self.created or first <= self.created):",
        replace="            if False:  # MUTATION: a replayed event trusted",
        tests=(
            "tests/test_rendezvous_scale.py::test_a_renewed_etcd_wait_costs_no_read_and_misses_no_write",
        ),
    ),
    Mutation(
        id="canceled-watch-ignored",
        section=CONTROL,
        promise="etcd-v3: a renewed watch canceled for a compacted revision reads the key again",
        file="ftrun/control/etcdwire.py",
        find=(
            "        if result.get(\"canceled\"):\n"
            "            return True, None\n"
        ),
        replace="",
        tests=(
            "tests/test_rendezvous_scale.py::test_a_renewed_etcd_wait_costs_no_read_and_misses_no_write",
        ),
    ),
    Mutation(
        id="answered-wait-keeps-revision",
        section=CONTROL,
        promise=(
            "etcd-v3: a renewed wait that was answered (written, canceled, failed over) drops the"
            " kept revision"
        ),
        file="ftrun/control/etcd.py",
        find="            self._missed.forget(ekey)  # written, canceled (compacted) or failed over: read",
        replace="            pass  # MUTATION: the kept revision kept",
        tests=(
            "tests/test_rendezvous_scale.py::test_a_renewed_etcd_wait_costs_no_read_and_misses_no_write",
        ),
    ),
    Mutation(
        id="missed-at-ignores-endpoint",
        section=CONTROL,
        promise="etcd-v3: after a failover a renewed wait reads on the new endpoint first",
        file="ftrun/control/etcdwire.py",
        find="        if held is None or held[1] != endpoint or now - held[2] > self._horizon_s:",
        replace="        if held is None or now - held[2] > self._horizon_s:  # MUTATION: the endpoint ignored",
        tests=(
            "tests/test_rendezvous_scale.py::test_a_renewed_etcd_wait_costs_no_read_and_misses_no_write",
        ),
    ),
    Mutation(
        id="missed-at-never-dropped",
        section=CONTROL,
        promise=(
            "etcd-v3: a key kept from more than `max_lag` revisions before the store's is read "
            "again (etcd replays every write since, under the lock its writes take: without the "
            "bound, 2 of 3 rendezvous of 2,048 agents took 6.8 and 7.7 s, with 858-1,098 replayed"
            " assignments read again; with it, 1.65-2.19 s in 9 runs)"
        ),
        file="ftrun/control/etcdwire.py",
        find="        if held is not None and (not revision or revision - held[0] > self._max_lag):",
        replace="        if False:  # MUTATION: never dropped",
        tests=(
            "tests/test_rendezvous_scale.py::test_a_renewed_etcd_wait_costs_no_read_and_misses_no_write",
        ),
    ),
    Mutation(
        id="doctor-judges-agent-limit",
        section=CONTROL,
        promise=(
            "`ftrun doctor`'s `host.nofile` (the health gate's) judges the workers' limit, not "
            "the agent's raised one"
        ),
        file="ftrun/doctor/host.py",
        find="    soft, hard = workers_limit()",
        replace="    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # MUTATION",
        tests=(
            "tests/test_fdlimit.py::test_doctor_judges_the_limit_the_workers_get",
        ),
    ),
    Mutation(
        id="stop-names-no-root",
        section=CONTROL,
        promise=(
            "With no restart left, the fault record and the summary's first failure name the root"
            " cause, not the exit seen first"
        ),
        file="ftrun/observe/faults.py",
        find=(
            "            if ev.get(\"reason\") == \"failed\":  # no restart left: the same root as a restart's\n"
            "                self._name_root(ts, pending, ev)"
        ),
        replace=(
            "            if ev.get(\"reason\") == \"failed\":  # no restart left: the same root as a restart's\n"
            "                pass  # MUTATION: without _name_root"
        ),
        tests=(
            "tests/test_faults.py::test_a_job_without_a_restart_left_names_the_root_cause_too",
        ),
    ),
    Mutation(
        id="cli-stays-for-hung-connect",
        section=CONTROL,
        promise=(
            "`ftrun status`/`inject` end with their code when a store connect they gave up on "
            "comes back as they exit"
        ),
        file="ftrun/cli.py",
        find=(
            "        if connect_still_running():\n"
            "            exit_at_once(code)"
        ),
        replace=(
            "        if connect_still_running():\n"
            "            pass  # MUTATION: returns without os._exit"
        ),
        tests=(
            "tests/test_inject.py::test_status_that_gave_up_on_a_hung_connect_leaves_without_interpreter_teardown",
            "tests/test_inject.py::test_status_of_a_frozen_store_host_is_one_line_and_exit_3",
        ),
    ),
    Mutation(
        id="checker-final-world-last-step",
        section=CONTROL,
        promise=(
            "The regroup checker's final world is the last generation's, which may have formed "
            "after the last committed step"
        ),
        file="tests/lines.py",
        find=(
            "        final_world = (last_formed.world if last_formed.epoch > steps[-1].epoch\n"
            "                       else steps[-1].world)"
        ),
        replace="        final_world = steps[-1].world  # MUTATION",
        tests=(
            "tests/test_lines.py::test_checker_final_world_counts_a_joiner_admitted_at_the_last_step",
        ),
    ),
    Mutation(
        id="no-atexit-let-go",
        section=CONTROL,
        promise=(
            "A regroup script that never calls `ft.close()` exits without an abort: ftrun's "
            "threads are joined before the interpreter finalizes"
        ),
        file="ftrun/worker/api.py",
        find="        atexit.register(self._let_go)\n",
        replace="",
        tests=(
            "tests/test_regroup.py::test_a_script_that_never_calls_close_exits_cleanly",
        ),
    ),
    Mutation(
        id="formed-latest-epoch-only",
        section=CONTROL,
        promise=(
            "A fault followed at once by its replacement's epoch keeps the survivors' regroup in "
            "its record (step and world 2)"
        ),
        file="ftrun/observe/faults.py",
        find="            self.pending.append((epoch, world_size, self.highest))",
        replace="            self.pending = [(epoch, world_size, self.highest)]  # MUTATION: the latest only",
        tests=(
            "tests/test_faults.py::test_an_epoch_followed_at_once_by_the_next_still_gets_its_own_formed_record",
        ),
    ),
    Mutation(
        id="formed-step-from-previous-epoch",
        section=CONTROL,
        promise=(
            "A formed epoch's step counts on from where the last formed epoch resumed, not only "
            "from a beat read before its publication"
        ),
        file="ftrun/observe/faults.py",
        find="                step = self.last_commit(base, max(reported, floor))",
        replace="                step = self.last_commit(epoch - 1, reported)  # MUTATION",
        tests=(
            "tests/test_faults.py::test_an_epoch_followed_at_once_by_the_next_still_gets_its_own_formed_record",
        ),
    ),
    Mutation(
        id="leader-reads-slots-once",
        section=CONTROL,
        promise=(
            "A rendezvous leader whose reads fail under load (the store's own retries spent) "
            "reads again until the join's deadline"
        ),
        file="ftrun/control/rendezvous.py",
        find=(
            "            arrived = self._repeated(deadline, f\"reading the slots of generation {number}\",\n"
            "                                     self._arrivals, number)"
        ),
        replace="            arrived = self._arrivals(number)  # MUTATION: not repeated until the deadline",
        tests=(
            "tests/test_etcd.py::test_a_leader_whose_reads_fail_under_load_forms_the_generation_once_etcd_answers",
        ),
    ),
    Mutation(
        id="held-stream-per-slice",
        section=CONTROL,
        promise=(
            "A joining agent on etcd-v3 holds one watch stream of its assignment, `gen/N` and the"
            " shutdown record across its slices (no request per slice)"
        ),
        file="ftrun/control/etcdheld.py",
        find="            return None  # nothing yet: the next slice looks at the same stream",
        replace=(
            "            self.close()  # MUTATION: the stream closed at the end of each slice\n"
            "            return None"
        ),
        tests=(
            "tests/test_rendezvous_scale.py::test_a_held_etcd_wait_costs_no_request_per_slice_and_misses_no_write",
        ),
    ),
    Mutation(
        id="held-stream-ignores-failed-requests",
        section=CONTROL,
        promise=(
            "A held wait gives its stream up once another request of the process to that endpoint"
            " failed (a member frozen or cut off is silent, not reset)"
        ),
        file="ftrun/control/etcdheld.py",
        find="        if FAILED_AT.get(self.endpoint, -1.0) > self.opened:",
        replace="        if False:  # MUTATION: without the FAILED_AT check",
        tests=(
            "tests/test_etcd.py::test_an_agent_whose_member_goes_silent_while_it_waits_still_joins_once_etcd_answers[heartbeat]",
            "tests/test_etcd.py::test_an_agent_whose_member_goes_silent_while_it_waits_still_joins_once_etcd_answers[the wait]",
        ),
    ),
    Mutation(
        id="held-stream-without-tls",
        section=CONTROL,
        promise=(
            "A held wait's stream (a session of its own) speaks TLS with the job's CA and client "
            "certificate"
        ),
        file="ftrun/control/etcdheld.py",
        find="        session.verify, session.cert = gateway.session.verify, gateway.session.cert\n",
        replace="",
        tests=(
            "tests/test_etcd_tls.py::test_etcd_tls_job_forms_with_the_right_client_certificate_and_a_wrong_one_is_one_line",
        ),
    ),
    Mutation(
        id="shutdown-read-only-on-its-hit",
        section=CONTROL,
        promise=(
            "A forged record on a watched key (the agent's assignment) never hides a valid "
            "shutdown from a joining agent"
        ),
        file="ftrun/control/rendezvous.py",
        find=(
            "                self._check_waiting(deadline, what, read_shutdown=hit is not None\n"
            "                                    or \"shutdown\" not in watched)"
        ),
        replace=(
            "                self._check_waiting(deadline, what, read_shutdown=key == \"shutdown\"  # MUTATION\n"
            "                                    or \"shutdown\" not in watched)"
        ),
        tests=(
            "tests/test_rendezvous_scale.py::test_a_forged_record_never_hides_a_shutdown_from_a_waiting_agent[tcpstore-assignment]",
            "tests/test_rendezvous_scale.py::test_a_forged_record_never_hides_a_shutdown_from_a_waiting_agent[etcd-v3-assignment]",
        ),
    ),
    Mutation(
        id="shutdown-unread-while-watched",
        section=CONTROL,
        promise=(
            "A valid shutdown that a joining agent's wait finds (on etcd-v3 through the held "
            "watch's event) ends its join"
        ),
        file="ftrun/control/rendezvous.py",
        find=(
            "                self._check_waiting(deadline, what, read_shutdown=hit is not None\n"
            "                                    or \"shutdown\" not in watched)"
        ),
        replace="                self._check_waiting(deadline, what, read_shutdown=\"shutdown\" not in watched)  # MUTATION",
        tests=(
            "tests/test_rendezvous_scale.py::test_a_forged_record_never_hides_a_shutdown_from_a_waiting_agent[tcpstore-none]",
            "tests/test_rendezvous_scale.py::test_a_forged_record_never_hides_a_shutdown_from_a_waiting_agent[etcd-v3-none]",
        ),
    ),
    Mutation(
        id="ended-stream-returns-at-once",
        section=CONTROL,
        promise=(
            "A held stream that fails at once leaves the rest of its slice to pass (since c9041f2"
            " no read: the read follows etcd's confirmation; not a loop of streams)"
        ),
        file="ftrun/control/etcdheld.py",
        find=(
            "        if held.outcome is None:  # ended or failed: the next call says why, watches again\n"
            "            time.sleep(max(deadline - time.monotonic(), 0.0))\n"
        ),
        replace="        if held.outcome is None:  # MUTATION: returns at once\n",
        tests=(
            "tests/test_rendezvous_scale.py::test_a_held_etcd_wait_whose_stream_ends_inside_its_slice_waits_out_the_slice",
            "tests/test_rendezvous_scale.py::test_a_held_etcd_wait_costs_no_request_per_slice_and_misses_no_write",
        ),
    ),
    Mutation(
        id="remote-worker-words-not-lost-peer",
        section=CONTROL,
        promise=(
            "A peer's gloo error that names a remote worker (\"caused by a remote worker crashing\""
            " / \"hanging\") just before the first exit seen is that exit's consequence, not the "
            "root cause"
        ),
        file="ftrun/agent/outcome.py",
        find=(
            "\"remote process exited\",\n"
            "              \"caused by a remote worker\")"
        ),
        replace="\"remote process exited\")  # MUTATION",
        tests=(
            "tests/test_outcome.py::test_just_before_the_exit_seen_a_lost_peer_is_a_consequence_a_raise_is_a_cause",
        ),
    ),
    Mutation(
        id="held-wait-never-unheard",
        section=CONTROL,
        promise=(
            "A held etcd wait whose member no client of the process has heard from for "
            "`UNHEARD_S` reads from it; a frozen member fails that read and the wait moves on "
            "(issue 14)"
        ),
        file="ftrun/control/etcdheld.py",
        find="        return self.outcome is None and time.monotonic() - heard > UNHEARD_S",
        replace="        return False  # MUTATION: never unheard",
        tests=(
            "tests/test_etcd.py::test_an_agent_whose_member_goes_silent_while_it_waits_still_joins_once_etcd_answers[the wait]",
            "tests/test_rendezvous_scale.py::test_a_held_etcd_wait_costs_no_request_per_slice_and_misses_no_write",
        ),
    ),
    Mutation(
        id="agent-end-leaves-lease-view",
        section=CONTROL,
        promise="An etcd-v3 agent's end stops its heartbeat monitor's lease view (issue 14)",
        file="ftrun/agent/etcdwriter.py",
        find="    close_monitor(agent, 0.0 if agent.store_lost else None)",
        replace="    pass  # MUTATION: close_monitor not called",
        tests=(
            "tests/test_etcd.py::test_an_etcd_agent_at_its_end_stops_its_lease_view",
        ),
    ),
    Mutation(
        id="agent-end-waits-for-lost-store",
        section=CONTROL,
        promise=(
            "With the store lost, an agent's end does not wait for a lease view stuck in a "
            "request, and says so"
        ),
        file="ftrun/agent/etcdwriter.py",
        find="    close_monitor(agent, 0.0 if agent.store_lost else None)",
        replace="    close_monitor(agent, None)  # MUTATION: waited whatever the store's state",
        tests=(
            "tests/test_etcd.py::test_an_etcd_agent_at_its_end_stops_its_lease_view",
        ),
    ),
    Mutation(
        id="end-watcher-wait-per-slice",
        section=CONTROL,
        promise=(
            "An etcd-v3 agent's EndWatcher holds one watch stream across its slices (issue 14)"
        ),
        file="ftrun/control/endwatch.py",
        find="                    found = store.wait_any([self.key], self.slice_s)",
        replace="                    found = store.wait_for(self.key, self.slice_s) or None  # MUTATION: a wait per slice",
        tests=(
            "tests/test_rendezvous_scale.py::test_an_etcd_end_watcher_holds_one_stream_and_wakes_on_the_end",
        ),
    ),
    Mutation(
        id="end-watcher-leaves-stream",
        section=CONTROL,
        promise="An EndWatcher stopped before its end closes its held stream",
        file="ftrun/control/endwatch.py",
        find="                store.close_waits()  # etcd-v3: the held stream ends with the watcher",
        replace="                pass  # MUTATION: the held stream left open",
        tests=(
            "tests/test_rendezvous_scale.py::test_an_etcd_end_watcher_holds_one_stream_and_wakes_on_the_end",
        ),
    ),
    Mutation(
        id="held-stream-left-behind",
        section=CONTROL,
        promise=(
            "A held etcd wait whose read from an unheard member moved on to the next endpoint "
            "moves its stream there in the same slice"
        ),
        file="ftrun/control/etcdheld.py",
        find=(
            "        if self.held is not None and self.held.endpoint != self._gateway()[0]:\n"
            "            self.close()\n"
            "        return None"
        ),
        replace="        return None  # MUTATION: the stream kept when the read went elsewhere",
        tests=(
            "tests/test_rendezvous_scale.py::test_a_held_etcd_wait_on_a_member_nobody_hears_moves_to_the_next_endpoint",
        ),
    ),
    Mutation(
        id="held-wait-no-look-at-unheard",
        section=CONTROL,
        promise="The same, with no look at an unheard member",
        file="ftrun/control/etcdheld.py",
        find="        if self.held is not None and self.held.unheard():",
        replace="        if False:  # MUTATION: no look at an unheard member",
        tests=(
            "tests/test_rendezvous_scale.py::test_a_held_etcd_wait_on_a_member_nobody_hears_moves_to_the_next_endpoint",
        ),
    ),
    Mutation(
        id="wait-record-checks-whole-value",
        section=CONTROL,
        promise=(
            "On a TCPStore, `JsonStore.wait_any` gives an appended key's first valid record (an "
            "end written by two nodes), not a rejection of the whole value (found by this "
            "session's review)"
        ),
        file="ftrun/control/store.py",
        find="        return True, self._first_valid(name, raw)",
        replace="        return True, self.check_record(name, raw)  # MUTATION: the whole value",
        tests=(
            "tests/test_multinode.py::test_end_watcher_wakes_on_the_write_and_stops_within_a_slice",
        ),
    ),
    Mutation(
        id="end-watcher-says-rejections",
        section=CONTROL,
        promise=(
            "The EndWatcher says nothing of the records it sees (the agent reads, verifies and "
            "says once)"
        ),
        file="ftrun/control/endwatch.py",
        find="                        store.on_reject = None  # the agent reads, verifies and says",
        replace="                        pass  # MUTATION: the agent's on_reject kept",
        tests=(
            "tests/test_multinode.py::test_end_watcher_wakes_on_the_write_and_stops_within_a_slice",
        ),
    ),
    Mutation(
        id="freshest-always-first",
        section=CONTROL,
        promise=(
            "A new etcd client starts at the endpoint the process last heard and that has not "
            "failed since"
        ),
        file="ftrun/control/etcdheld.py",
        find="    best, best_at = 0, -1.0\n",
        replace=(
            "    return 0  # MUTATION\n"
            "    best, best_at = 0, -1.0\n"
        ),
        tests=(
            "tests/test_rendezvous_scale.py::test_a_held_etcd_wait_on_a_member_nobody_hears_moves_to_the_next_endpoint",
        ),
    ),
    Mutation(
        id="cpp-backtraces-whole",
        section=CONTROL,
        promise=(
            "A C++ backtrace that torch logs with an error shows on the console as one line; the "
            "log files keep it"
        ),
        file="ftrun/agent/processes.py",
        find="        self.whole = os.environ.get(\"FTRUN_CPP_BACKTRACES\", \"\") not in (\"\", \"0\")",
        replace="        self.whole = True  # MUTATION",
        tests=(
            "tests/test_launcher.py::test_torch_cpp_backtraces_collapse_to_one_console_line",
        ),
    ),
    Mutation(
        id="observed-late-50ms",
        section=CONTROL,
        promise=(
            "a SIGKILLed rank is named as the cause even when the agent sees its exit late under "
            "load, after its peers' lost-peer errors"
        ),
        file="ftrun/agent/outcome.py",
        find="_OBSERVED_LATE_S = 1.0",
        replace="_OBSERVED_LATE_S = 0.05  # MUTATION",
        tests=(
            "tests/test_outcome.py::test_just_before_the_exit_seen_a_lost_peer_is_a_consequence_a_raise_is_a_cause",
        ),
    ),
    Mutation(
        id="takeover-no-catch-up",
        section=CONTROL,
        promise=(
            "on etcd-v3 a standby takes the ranks of a lost writer's node: the agent that took "
            "over waits for the pools the others write again to its new store"
        ),
        file="ftrun/agent/leader.py",
        find=(
            "        if self._catching_up(survivors):\n"
            "            return None"
        ),
        replace=(
            "        if False:  # MUTATION: no _catching_up wait\n"
            "            return None"
        ),
        tests=(
            "tests/test_etcd_standby.py::test_standbys_take_a_lost_nodes_ranks_and_the_lost_writers_on_etcd",
        ),
    ),
    Mutation(
        id="catch-up-without-statuses",
        section=CONTROL,
        promise="... and, while no survivor is known synced, for the surviving joiners' statuses",
        file="ftrun/agent/leader.py",
        find=(
            "        return not any(self._synced(x) for x in survivors) \\\n"
            "            and any(x.joiner and x.id not in self.m.statuses for x in survivors)"
        ),
        replace="        return False  # MUTATION: without its status clause",
        tests=(
            "tests/test_supervisors.py::test_after_a_takeover_the_survivors_state_is_waited_for_past_the_heartbeat_timeout",
            "tests/test_etcd_standby.py::test_standbys_take_a_lost_nodes_ranks_and_the_lost_writers_on_etcd",
        ),
    ),
    Mutation(
        id="job-key-not-run-scoped",
        section=CONTROL,
        promise="`ftrun status`/`inject` read an etcd-v3 job's record under its run's prefix",
        file="ftrun/client/jobref.py",
        find="        return f\"ftrun/{self.run_id}/job\" if self.etcd else \"ftrun/job\"",
        replace="        return \"ftrun/job\"  # MUTATION",
        tests=(
            "tests/test_etcd.py::test_status_and_inject_name_an_etcd_job_or_say_why_not",
        ),
    ),
    Mutation(
        id="promoted-writer-drops-job-record",
        section=CONTROL,
        promise="the agent that takes a dead etcd-v3 writer's place keeps the job's record",
        file="ftrun/agent/etcdwriter.py",
        find="    agent.injector.keep_job(job_record(agent))  # ftrun status and inject read it",
        replace="    pass  # MUTATION: the job's record not kept",
        tests=(
            "tests/test_etcd_standby.py::test_standbys_take_a_lost_nodes_ranks_and_the_lost_writers_on_etcd",
        ),
    ),
    Mutation(
        id="writer-offers-its-own-slot",
        section=CONTROL,
        promise=(
            "a writer killed during a join is replaced by a waiter that forms the generation "
            "without the dead writer's slot"
        ),
        file="ftrun/control/rendezvous.py",
        find="        if self.is_leader:  # its own slot is ``own`` to _collect; offered, it would outlive",
        replace="        if False:  # MUTATION: the writer offers its own slot",
        tests=(
            "tests/test_etcd.py::test_netns_etcd_writer_killed_while_the_others_wait_for_a_generation",
        ),
        note=(
            "ftrun/control/rendezvous.py `DynamicRendezvous._offer`: the writer offers its own "
            "slot (the row's first form, the code before 2ed0a6e, also left "
            "`rdzv.gone.add(election.previous)` out of `etcdwriter.promote`)"
        ),
        known_miss=(
            "not tried in this form: the row's breakage also took "
            "`rdzv.gone.add(election.previous)` out of `etcdwriter.promote`, which still guards "
            "one case"
        ),
    ),
    Mutation(
        id="inject-thread-ends-at-error",
        section=CONTROL,
        promise="the inject thread outlives a failed store request",
        file="ftrun/agent/inject.py",
        find=(
            "            except StoreError:\n"
            "                # one request that failed"
        ),
        replace=(
            "            except StoreError:\n"
            "                return  # MUTATION: the thread ends at the first failed request\n"
            "                # one request that failed"
        ),
        tests=(
            "tests/test_inject.py::test_the_inject_thread_outlives_a_failed_store_request",
        ),
    ),
    Mutation(
        id="store-module-imports-torch",
        section=CONTROL,
        promise="`ftrun inject` and `status` of an etcd-v3 job never import torch (issue 14)",
        file="ftrun/control/store.py",
        find=(
            "if TYPE_CHECKING:\n"
            "    from torch.distributed import TCPStore"
        ),
        replace=(
            "from torch.distributed import TCPStore  # MUTATION: torch imported with the store module\n"
            "if TYPE_CHECKING:\n"
            "    pass"
        ),
        tests=(
            "tests/test_etcd.py::test_status_and_inject_name_an_etcd_job_or_say_why_not",
        ),
        note=(
            "ftrun/control/store.py imports `TCPStore` at module level again (the code before "
            "1fbd25a, which also removed the CLI's quiet import before the agent)"
        ),
    ),
    Mutation(
        id="statuses-verified-every-read",
        section=CONTROL,
        promise=(
            "the regroup leader verifies and decodes a status again only when its bytes changed"
        ),
        file="ftrun/agent/membership.py",
        find="        records = self.store.read_records(keys, self._status_bytes)",
        replace="        records = self.store.read_records(keys)  # MUTATION: no bytes cache",
        tests=(
            "tests/test_supervisors.py::test_a_status_is_verified_again_only_when_its_bytes_changed",
        ),
    ),
    Mutation(
        id="end-unformed-none",
        section=CONTROL,
        promise=(
            "a member whose peer died after a joiner's member epoch was published (which the "
            "members had not reached) aborts the step and regroups, not leaving as for its own "
            "error"
        ),
        file="ftrun/agent/membership.py",
        find="    MAX_UNFORMED = 8",
        replace="    MAX_UNFORMED = 0  # MUTATION",
        tests=(
            "tests/test_worker_waits.py::test_a_fault_after_a_newer_epoch_was_published_is_a_fault_not_the_scripts_error",
        ),
    ),
    Mutation(
        id="end-given-epoch-only",
        section=CONTROL,
        promise=(
            "an agent that ends a member epoch also ends the ones before it back to the last that"
            " formed"
        ),
        file="ftrun/agent/membership.py",
        find="        new = [n for n in range(first, epoch + 1) if n not in self._ended_here]",
        replace="        new = [n for n in range(epoch, epoch + 1) if n not in self._ended_here]  # MUTATION",
        tests=(
            "tests/test_supervisors.py::test_an_end_of_an_epoch_not_formed_yet_also_ends_the_one_its_members_step_in",
        ),
    ),
    Mutation(
        id="arm-wait-does-nothing",
        section=CONTROL,
        promise=(
            "on etcd-v3 a joining agent arms its wait (watch stream, then read) before it offers "
            "its slot (issue 14)"
        ),
        file="ftrun/control/store.py",
        find="            self.wait_any(names, 0.0)",
        replace="            pass  # MUTATION: arm_wait does nothing",
        tests=(
            "tests/test_etcd.py::test_a_joining_agent_watches_for_its_assignment_before_it_offers_its_slot",
        ),
    ),
    Mutation(
        id="held-read-before-confirmation",
        section=CONTROL,
        promise=(
            "a held wait's read follows etcd's confirmation of its watches, which start at the "
            "store's revision (issue 14)"
        ),
        file="ftrun/control/etcdheld.py",
        find=(
            "        if not held.keys_read:\n"
            "            patience = max(deadline, held.opened + CONFIRM_S) - time.monotonic()"
        ),
        replace=(
            "        if not held.keys_read:\n"
            "            held.keys_read = True  # MUTATION: a read before etcd confirmed the watches\n"
            "            found = self._read(ekeys)\n"
            "            if found is not None or self.held is None:\n"
            "                return found\n"
            "            patience = max(deadline, held.opened + CONFIRM_S) - time.monotonic()"
        ),
        tests=(
            "tests/test_etcd.py::test_a_joining_agent_watches_for_its_assignment_before_it_offers_its_slot",
        ),
        note=(
            "ftrun/control/etcdheld.py `HeldWaits.wait`: a read before etcd confirmed the watches"
            " (8050e8f's order: a read, then the watch from its revision)"
        ),
    ),
    Mutation(
        id="held-url-lookup-in-caller",
        section=CONTROL,
        promise=(
            "a held wait begun at an endpoint it never used, frozen from the start, returns after"
            " `CONFIRM_S` and moves on once the member is found silent"
        ),
        file="ftrun/control/etcdheld.py",
        find="        body = \"\".join(json.dumps(r) for r in self.stream.requests())\n",
        replace=(
            "        body = \"\".join(json.dumps(r) for r in self.stream.requests())\n"
            "        gateway.get_url(\"/watch\")  # MUTATION: the API-path lookup in the caller's thread\n"
        ),
        tests=(
            "tests/test_rendezvous_scale.py::test_a_held_etcd_wait_whose_watch_etcd_never_confirms_moves_to_the_next_endpoint",
        ),
        note=(
            "ftrun/control/etcdheld.py `HeldWatch.__init__`: etcd3gw's API-path lookup "
            "(`get_url`) in the caller's thread (the first form of c9041f2)"
        ),
    ),
    Mutation(
        id="held-gives-up-at-confirm",
        section=CONTROL,
        promise=(
            "a stream etcd has not confirmed within `CONFIRM_S` is kept, not given up and made "
            "again on top of a busy member"
        ),
        file="ftrun/control/etcdheld.py",
        find=(
            "            if not held.settled.wait(max(patience, 0.0)):\n"
            "                return None  # not confirmed yet: the next slice waits on the same stream"
        ),
        replace=(
            "            if not held.settled.wait(max(patience, 0.0)):\n"
            "                self.close()  # MUTATION: closed and failed over at CONFIRM_S\n"
            "                self._failed_over(\"watch: not confirmed\")\n"
            "                return None"
        ),
        tests=(
            "tests/test_rendezvous_scale.py::test_a_held_etcd_wait_whose_watch_etcd_never_confirms_moves_to_the_next_endpoint",
        ),
        note=(
            "ftrun/control/etcdheld.py `HeldWaits.wait` closes a stream etcd has not confirmed "
            "and fails over at `CONFIRM_S` (as 0f97351 did)"
        ),
    ),
    Mutation(
        id="catch-up-bounded-by-heartbeat",
        section=CONTROL,
        promise=(
            "after an etcd-v3 takeover the regroup waits for the survivors' records up to the "
            "abort timeout plus the heartbeat timeout (issue 14; a CI run of ab2c7dc stopped the "
            "standby test's job with \"no surviving member holds the job's state\")"
        ),
        file="ftrun/agent/leader.py",
        find="                or self.clock() - self.waiting_since >= self._peer_write_s:",
        replace="                or self.clock() - self.waiting_since >= self.config.heartbeat_timeout_s:  # MUTATION",
        tests=(
            "tests/test_supervisors.py::test_after_a_takeover_the_survivors_state_is_waited_for_past_the_heartbeat_timeout",
        ),
    ),
    Mutation(
        id="join-line-elif-recovery",
        section=CONTROL,
        promise=(
            "a replacement admitted in the epoch that also recovers its fault (ready before the "
            "survivors' epoch of two formed) is recorded in the fault and its join line is said "
            "(issue 14, found under load: 11 of 30 runs)"
        ),
        file="ftrun/observe/faults.py",
        find="            joins = record.join_epoch == epoch and record.joined is None",
        replace=(
            "            joins = record.join_epoch == epoch and record.joined is None and not (  # MUTATION: an elif of the recovery\n"
            "                record.epoch is not None and epoch is not None and record.epoch <= epoch\n"
            "                and record.recovered is None)"
        ),
        tests=(
            "tests/test_faults.py::test_a_replacement_ready_before_the_survivors_epoch_formed_is_said_with_the_recovery",
        ),
        note=(
            "`FaultBook._formed`: the join branch taken only when the same epoch recovers nothing"
            " (as an `elif` of the recovery, b7a2de0's parent)"
        ),
    ),
    Mutation(
        id="keepalive-closed-at-timeout",
        section=CONTROL,
        promise=(
            "a renewal answered late keeps its gRPC keepalive stream (one endpoint: the next "
            "renewal is answered on it)"
        ),
        file="ftrun/control/etcdkeepalive.py",
        find=(
            "            except queue.Empty:\n"
            "                raise RuntimeError(f\"keepalive stream: no answer within {timeout_s:g} s\""
        ),
        replace=(
            "            except queue.Empty:\n"
            "                self.close()  # MUTATION: the stream closed at its timeout\n"
            "                raise RuntimeError(f\"keepalive stream: no answer within {timeout_s:g} s\""
        ),
        tests=(
            "tests/test_etcd_keepalive.py::test_a_silent_member_fails_a_renewal_in_its_timeout_keeps_the_stream_and_fails_over",
        ),
    ),
    Mutation(
        id="sender-leaves-keepalive-stream",
        section=CONTROL,
        promise=(
            "the heartbeat sender ends its keepalive stream when it stops (etcd sees none open)"
        ),
        file="ftrun/control/heartbeat.py",
        find="                self.lease.close()  # here: the beat's thread is the one that uses it",
        replace="                pass  # MUTATION: without lease.close()",
        tests=(
            "tests/test_etcd_keepalive.py::test_a_heartbeat_sender_renews_on_one_stream_and_closes_it_when_it_stops",
        ),
    ),
    Mutation(
        id="lease-beat-keeps-idle-connection",
        section=CONTROL,
        promise=(
            "an etcd-v3 lease beat holds no idle gateway connection once its key is put: the "
            "keepalive stream is its one connection to the member (issue 14: a member's "
            "descriptors per agent)"
        ),
        file="ftrun/control/election.py",
        find="            client.drop_idle()  # the renewals go on the stream: no idle gateway connection",
        replace="            pass  # MUTATION: without client.drop_idle()",
        tests=(
            "tests/test_etcd_keepalive.py::test_a_heartbeat_sender_renews_on_one_stream_and_closes_it_when_it_stops",
        ),
    ),
    Mutation(
        id="lease-renewed-every-beat",
        section=CONTROL,
        promise=(
            "an etcd-v3 lease is renewed once a third of its TTL passed, not at every beat (issue"
            " 14)"
        ),
        file="ftrun/control/election.py",
        find="                and self.clock() - self.renewed_at < self.granted_s / 3:",
        replace="                and self.clock() - self.renewed_at < 0:  # MUTATION: renewed at every beat",
        tests=(
            "tests/test_etcd_keepalive.py::test_a_heartbeat_sender_renews_on_one_stream_and_closes_it_when_it_stops",
        ),
    ),
    Mutation(
        id="lease-grant-without-backoff",
        section=CONTROL,
        promise=(
            "a failed etcd-v3 lease grant backs off: the beats within a random wait of up to 2, 4"
            " ... s raise BeatDeferred with no request (issue 14: 10,000 agents granting again at"
            " every beat kept one member from catching up)"
        ),
        file="ftrun/control/election.py",
        find="        if asked < self.grant_after:",
        replace="        if False:  # MUTATION: without the back-off check",
        tests=(
            "tests/test_etcd_keepalive.py::test_a_failed_lease_grant_backs_off_then_the_lease_is_granted",
        ),
    ),
    Mutation(
        id="all-valid-check-then-read",
        section=CONTROL,
        promise=(
            "a worker's check of the votes and its read of them go to the same store: when the "
            "store dies in between (the job's writer lost), the check is made again on the one "
            "that replaces it, and the missing votes are not waited for (issue 14: a writer-loss "
            "bench run lost 5 steps in 69 s, a survivor's output showing \"wait timeout after "
            "60000ms, keys: .../vote/5/0.0, ...\"; an earlier one, 6 steps in 23 s, kept no "
            "output)"
        ),
        file="ftrun/control/store.py",
        find=(
            "        values = self._read_present([self.key(n) for n in names])\n"
            "        return values is not None and all(\n"
            "            self.check_record(n, v) is not None for n, v in zip(names, values, strict=True))"
        ),
        replace=(
            "        return self.exist_all(names) and all(  # MUTATION: exist_all, then read_records\n"
            "            r is not None for r in self.read_records(names))"
        ),
        tests=(
            "tests/test_worker_waits.py::test_records_checked_on_a_store_that_then_dies_are_not_waited_for_on_the_next[all_valid]",
        ),
    ),
    Mutation(
        id="check-then-read-on-any-connection",
        section=CONTROL,
        promise=(
            "every check-then-read of `JsonStore` (`get`, `first_record`, `get_record`, "
            "`records_after`, `get_records`, `present_records`, `all_valid`) reads on the "
            "connection that answered the check, and checks again on a new one when the read "
            "fails or the check reconnected (issue 14: at ec1ac04 a writer-loss bench run with a "
            "standby took 68.7 s, a survivor's worker waiting 60 s on `.../decision/5` in "
            "`decide`: it had found the decision on the dying store and read it from the new one)"
        ),
        file="ftrun/control/store.py",
        find="                return self._multi_get(keys, client)",
        replace="                return self._multi_get(keys)  # MUTATION: the read may go to a new connection",
        tests=(
            "tests/test_worker_waits.py::test_records_checked_on_a_store_that_then_dies_are_not_waited_for_on_the_next[first_record]",
            "tests/test_worker_waits.py::test_records_checked_on_a_store_that_then_dies_are_not_waited_for_on_the_next[get_record]",
        ),
        note=(
            "ftrun/control/store.py `JsonStore._read_present` (what `first_record` and "
            "`get_record` read with) reads through `_call`, which may reconnect between the check"
            " and the read (first tried as `first_record` and `get_record` as at a1ec322: "
            "`exists`, then `_call(\"get\")`)"
        ),
    ),
    Mutation(
        id="reconnect-retries-refused",
        section=CONTROL,
        promise=(
            "a reconnect to a store gives up as soon as a plain connect to it is refused, instead"
            " of torch's client retrying refused connects for its whole second (issue 14: a "
            "worker spent 1-2 s connecting to its dead writer's store, the new address known)"
        ),
        file="ftrun/control/tcpstore.py",
        find=(
            "    return connect_store(host, port, min(1.0, timeout_s), op_timeout_s=op_timeout_s,\n"
            "                         give_up_if_refused=True)"
        ),
        replace="    return connect_store(host, port, min(1.0, timeout_s), op_timeout_s=op_timeout_s)  # MUTATION",
        tests=(
            "tests/test_store_connect.py::test_a_reconnect_to_a_store_gone_after_its_plain_connect_gives_up_at_the_refusal",
        ),
    ),
    Mutation(
        id="one-connect-lock-per-process",
        section=CONTROL,
        promise=(
            "a connect waits only for other connects to the same address, so one stuck on a "
            "frozen or dead host does not hold up a connect to the store that replaced it"
        ),
        file="ftrun/control/tcpstore.py",
        find="        return _ADDRESS_LOCKS.setdefault((host, port), threading.Lock())",
        replace="        return _ADDRESS_LOCKS.setdefault((\"\", 0), threading.Lock())  # MUTATION: one lock for every address",
        tests=(
            "tests/test_store_connect.py::test_a_connect_does_not_wait_for_one_stuck_on_a_frozen_host",
        ),
    ),
    Mutation(
        id="grpc-fork-support-on",
        section=CONTROL,
        promise=(
            "the agent imports grpcio with its fork support off, so a worker forked while a "
            "keepalive stream runs gets no gRPC poller between its fork and exec (CI: a worker "
            "killed by SIGABRT before it started, \"Epoll1Poller ... epoll_wait error: Bad file "
            "descriptor\", twice in about 70 runs of "
            "`test_etcd.py::test_netns_etcd_writer_killed_while_the_others_wait_for_a_generation`,"
            " at ec1ac04 too)"
        ),
        file="ftrun/control/etcdkeepalive.py",
        find="            os.environ[_FORK_SUPPORT] = \"false\"",
        replace="            pass  # MUTATION: grpcio imported with its fork support on",
        tests=(
            "tests/test_etcd_keepalive.py::test_an_agent_forks_its_workers_with_grpcs_fork_support_off",
        ),
    ),
    Mutation(
        id="grpc-module-half-made",
        section=CONTROL,
        promise=(
            "threads that load grpcio at once all get the whole module: one imports, the others "
            "wait (issue 14: on etcd 3.5.1 a second `HeartbeatSender` of one process failed its "
            "first renewal with \"partially initialized module 'grpc' has no attribute "
            "'insecure_channel'\"; "
            "`test_etcd.py::test_etcd_heartbeats_are_leases_a_foreign_delete_is_not_a_loss_and_a_pause_regrants`"
            " failed 3 of 3)"
        ),
        file="ftrun/control/etcdkeepalive.py",
        find="    with _IMPORTING:  # one import sets and takes out the variable",
        replace=(
            "    if \"grpc\" in sys.modules:  # MUTATION: without the lock\n"
            "        return sys.modules[\"grpc\"]\n"
            "    with _IMPORTING:  # one import sets and takes out the variable"
        ),
        tests=(
            "tests/test_etcd_keepalive.py::test_threads_that_load_grpc_at_once_all_get_the_whole_module",
        ),
    ),
    Mutation(
        id="goprofile-skips-locations",
        section=CONTROL,
        promise=(
            "the bench's member profile names its functions: `scripts/goprofile.py` reads each "
            "location's functions from the profile"
        ),
        file="scripts/goprofile.py",
        find="                elif field == 4 and isinstance(item, bytes):",
        replace="                elif False:  # MUTATION: locations' lines (field 4) skipped",
        tests=(
            "tests/test_infra.py::test_an_etcd_members_cpu_profile_is_summed_by_function",
        ),
    ),
    Mutation(
        id="sender-reconnects-when-deferred",
        section=CONTROL,
        promise=(
            "a heartbeat sender whose lease grant is held back (`BeatDeferred`: no request was "
            "made) keeps its client; only a failed beat makes it reconnect (issue 14, listed as "
            "untested since f5d111b)"
        ),
        file="ftrun/control/heartbeat.py",
        find="                if not isinstance(error, BeatDeferred):",
        replace="                if True:  # MUTATION: BeatDeferred too",
        tests=(
            "tests/test_etcd_keepalive.py::test_a_sender_keeps_its_client_while_its_lease_grant_is_held_back",
        ),
    ),
    Mutation(
        id="watch-request-key-in-range-end",
        section=CONTROL,
        promise="the watch-cost benchmark's hand-made `WatchRequest` names the key it watches",
        file="scripts/etcd_watch_grpc.py",
        find="    inner = b\"\\x0a\" + encode_varint(len(key)) + key",
        replace="    inner = b\"\\x12\" + encode_varint(len(key)) + key  # MUTATION: field 2",
        tests=(
            "tests/test_infra.py::test_the_watch_cost_benchmark_confirms_and_fires_watches_both_ways",
        ),
    ),
    Mutation(
        id="lingering-never-named",
        section=CONTROL,
        promise=(
            "A member asleep in its own code inside an ended member epoch is named hung by its "
            "agent after the hang timeout, not left to the stuck rule's 5 s floor"
        ),
        file="ftrun/agent/lingering.py",
        find="            if idle_s < timeout_s or (member, seen.epoch) in self._looked \\",
        replace="            if True or (member, seen.epoch) in self._looked \\",  # MUTATION: never idle long enough
        tests=(
            "tests/unit/test_lingering.py::test_a_member_asleep_in_its_code_is_named_once_idle_for_the_timeout",
            "tests/test_sharded.py::test_a_member_that_never_leaves_the_ended_epoch_is_replaced_not_those_waiting",
        ),
    ),
    Mutation(
        id="hang-set-aside-waits-a-timeout",
        section=CONTROL,
        promise=(
            "A hang verdict set aside because the culprit's status moved is looked at again when "
            "that lapses, not a whole timeout later"
        ),
        file="ftrun/agent/hangs.py",
        find="        self.next_check = min(self.next_check, when)",
        replace="        return  # MUTATION: the next look stays a timeout away",
        tests=(
            "tests/test_hangs.py::test_a_verdict_set_aside_is_looked_at_again_when_its_reason_lapses",
        ),
    ),
    Mutation(
        id="epoch-connections-not-recorded",
        section=CONTROL,
        promise=(
            "The worker API records its member epoch's backend connections as it builds them, so "
            "that leaving the epoch shuts them at once"
        ),
        file="ftrun/worker/sockets.py",
        find="        made |= connections() - before",
        replace="        pass  # MUTATION: nothing recorded",
        tests=(
            "tests/test_epoch_connections.py::test_shutting_the_recorded_connections_releases_a_peer_in_a_collective",
        ),
    ),
    Mutation(
        id="group-names-carried-over",
        section=CONTROL,
        promise=(
            "Survivors of a failed group build and fresh members meet under the same torch "
            "group name in the next member epoch"
        ),
        file="ftrun/worker/reentry.py",
        find='    if world is not None and hasattr(world, "group_count") and not dist.is_initialized():',
        replace="    if False:  # MUTATION: torch's group numbering carried over",
        tests=(
            "tests/test_reentry_groups.py::test_a_survivor_of_a_failed_build_and_a_fresh_peer_meet_under_one_name",
            "tests/test_sharded.py::test_survivors_of_a_failed_group_build_meet_fresh_members_under_one_name",
        ),
    ),
)

#: Rows of tests/MUTATIONS.md with no entry here (promise -> why not executable).
NOT_EXECUTABLE: dict[str, str] = {
    "etcd-v3: after the store moved, a member's silence counts from its beat's request bound (issue 14; second try)":
        "the same breakage as `moved-store-silence-from-now` (the first try, earlier in this table) plus a second edit, the test's `--liveness-timeout` lowered to 3 s; not caught either way",
}

BY_ID: dict[str, Mutation] = {m.id: m for m in MUTATIONS}
