#!/usr/bin/env bash
# podman, runc and mmdebstrap, so that tests/test_container.py can build the
# image of deploy/Dockerfile and train in containers of it. With apt's
# recommended packages: the test's podman network needs netavark and
# aardvark-dns, which come with them.
exec bash "$(dirname "$0")/apt_install.sh" install_podman "the container tests" --recommends podman runc mmdebstrap
