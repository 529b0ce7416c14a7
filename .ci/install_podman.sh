#!/usr/bin/env bash
# Installs podman, runc and mmdebstrap from the distribution (Debian/Ubuntu)
# so that tests/test_container.py can build the image of deploy/Dockerfile
# and train in containers of it. Idempotent: does nothing when `podman`,
# `mmdebstrap` and /usr/sbin/runc are already there. Without root or apt-get
# it says so in one line and exits 0; those tests then skip.
set -euo pipefail

if command -v podman >/dev/null 2>&1 && command -v mmdebstrap >/dev/null 2>&1 \
        && [[ -x /usr/sbin/runc ]]; then
    echo "install_podman: podman, runc and mmdebstrap already installed"
    exit 0
fi
if [[ "$(id -u)" != 0 ]]; then
    echo "install_podman: not root; skipping (the container tests will be skipped)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_podman: no apt-get; skipping (the container tests will be skipped)"
    exit 0
fi
echo "install_podman: installing podman runc mmdebstrap"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# With apt's recommended packages: podman's networking (netavark,
# aardvark-dns, ...) for the test's podman network comes with them.
apt-get install -y -qq podman runc mmdebstrap >/dev/null
echo "install_podman: done"
