"""`python -m trainer.config --check ...` (the SLURM script) and `--help`.

Besides the config itself, `--check` runs the launch checks of trainer/plan/preflight.py: a
dump folder that a live run holds, a LOG_RANK that names no rank of the launch, CPU ranks
whose memory plan exceeds the node's RAM (refused); GPU ranks with gradient sync 'last' that
would not fit where 'every' would (one warning line). run_train.sh runs the same checks inside
its launcher (`python -m trainer.launch --check`)."""

import sys

from trainer.config.job import main
from trainer.plan.preflight import LAUNCH_CHECKS

sys.exit(main(sys.argv[1:], checks=LAUNCH_CHECKS))
