#!/usr/bin/env bash
# Install the real services that ftrun's infrastructure tests start: Slurm (slurm-wlm 22.05 on
# Debian 12) with munge for authentication, and iproute2/iptables for network-namespace hosts.
#
# Why a script: CI machines and fresh sessions start with none of this installed, and the
# test fixtures skip (with a reason naming this script) rather than install anything
# themselves.  The script is idempotent and fast when everything is already present, so
# the suite's set-up can call it every time.
#
# Usage: sudo bash scripts/install_test_services.sh        (needs root; non-interactive)
#        WITH_ETCD=1 bash scripts/install_test_services.sh  (also etcd-client)
set -euo pipefail

if [[ $(id -u) -ne 0 ]]; then
    echo "install_test_services.sh: must run as root (apt-get, /etc/munge)" >&2
    exit 1
fi

# Debian package -> a command it provides (checked first so a warm machine costs ~no time).
declare -A PROVIDES=(
    [slurm-wlm]=slurmctld     # pulls slurmctld, slurmd and slurm-client (srun, sinfo)
    [munge]=munged
    [iproute2]=ip
    [iptables]=iptables
    [etcd-server]=etcd       # the etcd-v3 backend's tests: a 3-member cluster on netns hosts
)
if [[ ${WITH_ETCD:-0} == 1 ]]; then
    PROVIDES[etcd-client]=etcdctl
fi

have() {
    # A command may live in /usr/sbin, which is not on every PATH (non-root shells).
    command -v "$1" >/dev/null 2>&1 || [[ -x /usr/sbin/$1 || -x /sbin/$1 ]]
}

missing=()
for pkg in "${!PROVIDES[@]}"; do
    if ! have "${PROVIDES[$pkg]}" || ! dpkg -s "$pkg" >/dev/null 2>&1; then
        missing+=("$pkg")
    fi
done

if ((${#missing[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    # Wait for a concurrent apt/dpkg (another session's installer) instead of failing.
    apt_get() { apt-get -o DPkg::Lock::Timeout=120 "$@"; }
    # `apt-get update` only when the package lists are absent: a fresh image has none, and
    # refreshing them on every run would cost tens of seconds.
    if ! compgen -G "/var/lib/apt/lists/*_Packages*" >/dev/null; then
        apt_get update -q
    fi
    if ! apt_get install -y -q --no-install-recommends "${missing[@]}"; then
        # Stale lists (a package version gone from the mirror): refresh once and retry.
        apt_get update -q
        apt_get install -y -q --no-install-recommends "${missing[@]}"
    fi
fi

# munge: directories and permissions munged insists on (it refuses to start otherwise).
# Packages normally create these, but /run is a tmpfs on real machines and containers
# often start without the postinst having created the runtime directory.
mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    # Debian ships a key; create one if the image stripped it.
    if have mungekey; then
        mungekey --create --keyfile=/etc/munge/munge.key --force
    else
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    fi
fi
chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
chmod 0700 /etc/munge /var/log/munge /var/lib/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key

# This sandbox's resolver drops a few percent of queries, and torch's TCPStore names every
# peer with getnameinfo(), which asks DNS for ::ffff:127.0.0.1 (/etc/hosts lists only
# 127.0.0.1): 3-8% of store connects stalled exactly 5 s, and tests and benchmarks timed the
# resolver (../shared/TEST-INFRA.md). The test machine answers that name from /etc/hosts
# (measured: 0 of 150 connects stalled, no DNS query left), under a name of its own so that
# "localhost" still resolves as before. ftrun itself does nothing about
# it; benchmarks say whether the line was there (their config's hosts_v4_mapped_loopback).
if ! grep -qE '^::ffff:127\.0\.0\.1[[:space:]]' /etc/hosts; then
    [[ -z $(tail -c1 /etc/hosts) ]] || echo >> /etc/hosts  # end the last entry first
    echo '::ffff:127.0.0.1 v4mapped-localhost' >> /etc/hosts ||
        echo "install_test_services.sh: /etc/hosts not writable: 5 s DNS stalls may remain" >&2
fi

echo "install_test_services.sh: slurm-wlm, munge, iproute2, iptables, etcd-server ready"
