#!/usr/bin/env bash
# The OpenSSH server and client, so that tests/test_ssh_launcher.py can run
# a real sshd in each simulated host. Installing starts no sshd on this
# machine's network in CI (no init system there); the tests start their
# own, inside network namespaces.
exec bash "$(dirname "$0")/apt_install.sh" install_sshd "the ssh launcher tests" openssh-server openssh-client
