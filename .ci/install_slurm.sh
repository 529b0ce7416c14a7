#!/usr/bin/env bash
# Installs Slurm and MUNGE from the distribution (Debian/Ubuntu) so that
# tests/test_slurm.py and tests/test_slurm_nodes.py can start throwaway
# single-node and multi-node Slurm clusters. Idempotent:
# does nothing when both are already installed. Without root or apt-get it
# says so in one line and exits 0; the real-Slurm test then skips itself.
set -euo pipefail

packages=(slurm-wlm munge)

if [[ "$(id -u)" != 0 ]]; then
    echo "install_slurm: not root; skipping (the real-Slurm test will be skipped)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm: no apt-get; skipping (the real-Slurm test will be skipped)"
    exit 0
fi

missing=()
for pkg in "${packages[@]}"; do
    # dpkg-query prints "install ok installed" only for a fully installed package.
    if [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" != "install ok installed" ]]; then
        missing+=("$pkg")
    fi
done
if [[ ${#missing[@]} == 0 ]]; then
    echo "install_slurm: ${packages[*]} already installed"
    exit 0
fi

echo "install_slurm: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# The packages' postinst scripts try to start munge/slurm services; in a
# container without systemd that fails harmlessly (policy-rc.d or no init).
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install_slurm: done"
