#!/usr/bin/env bash
# nftables, so that tests/test_firewall.py can check --firewall's rules
# inside simulated hosts.
exec bash "$(dirname "$0")/apt_install.sh" install_nftables "the --firewall tests" nftables
