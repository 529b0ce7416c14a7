#!/usr/bin/env bash
# Installs the OpenSSH server and client from the distribution
# (Debian/Ubuntu) so that tests/test_ssh_launcher.py can run a real sshd in
# each simulated host. Idempotent: does nothing when /usr/sbin/sshd, ssh and
# ssh-keygen are already there. Installing does not start an sshd on this
# machine's network (no init system runs in CI; the tests start their own,
# inside network namespaces). Without root or apt-get it says so in one
# line and exits 0; those tests then skip.
set -euo pipefail

if [[ -x /usr/sbin/sshd ]] && command -v ssh >/dev/null 2>&1 \
        && command -v ssh-keygen >/dev/null 2>&1; then
    echo "install_sshd: sshd and ssh already installed"
    exit 0
fi
if [[ "$(id -u)" != 0 ]]; then
    echo "install_sshd: not root; skipping (the ssh launcher tests will be skipped)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_sshd: no apt-get; skipping (the ssh launcher tests will be skipped)"
    exit 0
fi
echo "install_sshd: installing openssh-server openssh-client"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends openssh-server openssh-client >/dev/null
echo "install_sshd: done"
