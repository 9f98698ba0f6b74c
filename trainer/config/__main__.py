"""`python -m trainer.config --check ...` (the SLURM script) and `--help`.

`--show-checkpointing` (with `--check`): after the ranks per node, print checkpoint.enable and
job.dump_folder, one per line: what the SLURM script's log and requeue decision need, from the
same interpreter start as the check (a second Python start cost a job ~2 s before srun).

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

SHOW = "--show-checkpointing"


def main(argv: list[str], checks=()) -> int:
    """`--help` prints the reference; `--check ...` validates a launch up front (check_launch,
    then each of `checks` on the config) and prints the ranks per node when `--nproc-per-node`
    is given, then, with `--show-checkpointing`, checkpoint.enable and job.dump_folder."""
    if "--help" in argv or "-h" in argv:
        print(reference.text())
        return 0
    args = [a for a in argv if a not in ("--check", SHOW)]
    checked = []
    try:
        ranks = check_launch(args, (*checks, lambda cfg, world, ranks: checked.append(cfg)))
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return e.exit_code
    if ranks is not None:
        print(ranks)
    if SHOW in argv:
        cfg = checked[0]
        print(f"{cfg.checkpoint.enable}\n{cfg.job.dump_folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], checks=LAUNCH_CHECKS))
