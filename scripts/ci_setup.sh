#!/usr/bin/env bash
# CI machine setup beyond pip (run as root on a fresh Debian/Ubuntu machine, before pytest):
# SLURM and munge for tests/test_slurm.py, which then starts and stops its own local cluster
# (scripts/slurm_local.sh up/down). Node names that do not resolve are added to /etc/hosts as
# 127.0.0.1 (the jobs use them as rendezvous addresses).
set -euo pipefail
cd "$(dirname "$0")/.."
SLURM_LOCAL_EDIT_HOSTS=1 scripts/slurm_local.sh install
