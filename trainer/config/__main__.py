"""`python -m trainer.config --check ...` (the SLURM script) and `--help`.

Besides the config itself, `--check` runs the launch checks of trainer/plan/preflight.py: a
dump folder that a live run holds, a LOG_RANK that names no rank of the launch, CPU ranks
whose memory plan exceeds the node's RAM (refused); GPU ranks with gradient sync 'last' that
would not fit where 'every' would (one warning line). run_train.sh runs the same checks inside
its launcher (`python -m trainer.launch --check`)."""

import sys

from trainer.config import reference
from trainer.config.job import check_launch
from trainer.errors import UserError
from trainer.plan.preflight import LAUNCH_CHECKS


def main(argv: list[str], checks=()) -> int:
    """`--help` prints the reference; `--check ...` validates a launch up front (check_launch,
    then each of `checks` on the config) and prints the ranks per node when `--nproc-per-node`
    is given."""
    if "--help" in argv or "-h" in argv:
        print(reference.text())
        return 0
    args = [a for a in argv if a != "--check"]
    try:
        ranks = check_launch(args, checks)
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return e.exit_code
    if ranks is not None:
        print(ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], checks=LAUNCH_CHECKS))
