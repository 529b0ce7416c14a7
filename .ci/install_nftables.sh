#!/usr/bin/env bash
# Installs nftables from the distribution (Debian/Ubuntu) so that
# tests/test_firewall.py can check --firewall's rules inside simulated
# hosts. Idempotent: does nothing when `nft` is already there. Without root
# or apt-get it says so in one line and exits 0; those tests then skip.
set -euo pipefail

if command -v nft >/dev/null 2>&1; then
    echo "install_nftables: nft already installed"
    exit 0
fi
if [[ "$(id -u)" != 0 ]]; then
    echo "install_nftables: not root; skipping (the --firewall tests will be skipped)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_nftables: no apt-get; skipping (the --firewall tests will be skipped)"
    exit 0
fi
echo "install_nftables: installing nftables"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends nftables >/dev/null
echo "install_nftables: done"
