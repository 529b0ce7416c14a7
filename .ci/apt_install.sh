#!/usr/bin/env bash
# Installs Debian/Ubuntu packages for tests that need them, the one way
# every .ci/install_*.sh does it:
#
#   apt_install.sh NAME WHAT_SKIPS [--recommends] PACKAGE...
#
# Idempotent: installs only the packages dpkg does not list as installed.
# Without root or apt-get it says so in one line and exits 0, and the tests
# that need them (WHAT_SKIPS) skip. --recommends keeps apt's recommended
# packages (podman's networking comes with them). Package scripts that try
# to start a service fail harmlessly where there is no init system.
set -euo pipefail

name=$1 skips=$2
shift 2
recommends=(--no-install-recommends)
if [[ "${1:-}" == --recommends ]]; then
    recommends=()
    shift
fi

if [[ "$(id -u)" != 0 ]]; then
    echo "$name: not root; skipping ($skips will be skipped)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "$name: no apt-get; skipping ($skips will be skipped)"
    exit 0
fi
missing=()
for pkg in "$@"; do
    # dpkg-query prints "install ok installed" only for a fully installed package.
    if [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" != "install ok installed" ]]; then
        missing+=("$pkg")
    fi
done
if [[ ${#missing[@]} == 0 ]]; then
    echo "$name: $* already installed"
    exit 0
fi
echo "$name: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${recommends[@]}" "${missing[@]}" >/dev/null
echo "$name: done"
