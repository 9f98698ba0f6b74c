"""`python -m trainer.config --check ...` (run_train.sh, the SLURM script) and `--help`."""

import sys

from trainer.config.job import main

sys.exit(main(sys.argv[1:]))
