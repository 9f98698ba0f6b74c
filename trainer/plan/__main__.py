"""`python -m trainer.plan --config CONFIG --ngpu N ...`: see trainer/plan/report.py."""

import sys

from trainer.plan.report import main

sys.exit(main(sys.argv[1:]))
