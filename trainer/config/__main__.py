"""`python -m trainer.config --check ...` (run_train.sh, the SLURM script) and `--help`.

Besides the config itself, `--check` refuses a dump folder that a live run holds
(trainer/checkpoint/lease.py), so a second launch stops before any process starts, and a
LOG_RANK that names no rank of the launch."""

import os
import sys

from trainer.checkpoint.lease import check_free
from trainer.config.job import main
from trainer.distributed import log_ranks


def _lease_is_free(cfg, world_size: int) -> None:
    check_free(cfg.job.dump_folder, cfg.job.lease_timeout_seconds)


def _log_rank(cfg, world_size: int) -> None:
    log_ranks(os.environ.get("LOG_RANK", ""), world_size)


sys.exit(main(sys.argv[1:], checks=(_lease_is_free, _log_rank)))
