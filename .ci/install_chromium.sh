#!/usr/bin/env bash
# Chromium, so that tests/test_tensorboard_page.py can look at TensorBoard
# in a real, headless browser.
exec bash "$(dirname "$0")/apt_install.sh" install_chromium "the TensorBoard page test" chromium
