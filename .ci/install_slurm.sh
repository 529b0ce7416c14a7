#!/usr/bin/env bash
# Slurm and MUNGE, so that tests/test_slurm.py and tests/test_slurm_nodes.py
# can start throwaway single-node and multi-node Slurm clusters.
exec bash "$(dirname "$0")/apt_install.sh" install_slurm "the real-Slurm tests" slurm-wlm munge
