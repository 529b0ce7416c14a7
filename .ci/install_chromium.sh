#!/usr/bin/env bash
# Installs Chromium from the distribution (Debian/Ubuntu) so that
# tests/test_tensorboard_page.py can look at TensorBoard in a real, headless
# browser. Idempotent: does nothing when a chromium is already there.
# Without root or apt-get it says so in one line and exits 0; that test
# then skips.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    echo "install_chromium: chromium already installed"
    exit 0
fi
if [[ "$(id -u)" != 0 ]]; then
    echo "install_chromium: not root; skipping (the TensorBoard page test will be skipped)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_chromium: no apt-get; skipping (the TensorBoard page test will be skipped)"
    exit 0
fi
echo "install_chromium: installing chromium"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium >/dev/null
echo "install_chromium: done"
