"""torchrun with a readable failure report.

    python -m trainer.launch [torchrun options] -m trainer.train [trainer overrides]

This is `torch.distributed.run` (the code behind `torchrun`) with one difference: when a worker
fails, torchrun raises ChildFailedError and prints a long report plus its own traceback. A
worker that stopped on a user error has already printed its one line (`config error: ...`), so
we exit with its code silently; for any other failure we print one short summary naming the
rank, host and exit code (the worker's own traceback is above it).
"""

from __future__ import annotations

import logging
import socket
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import config_from_args, elastic_launch, parse_args

USER_ERROR_EXIT_CODE = 2
PREEMPTED_EXIT_CODE = 3  # a clean, checkpointed stop on a signal (see trainer.train)
QUIET_CODES = (USER_ERROR_EXIT_CODE, PREEMPTED_EXIT_CODE)


def _first_failure(err: ChildFailedError):
    rank, failure = err.get_first_failure()
    return rank, failure


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    config, cmd, cmd_args = config_from_args(args)
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as err:
        rank, failure = _first_failure(err)
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        if code not in QUIET_CODES:
            how = f"exit code {failure.exitcode}"
            if failure.exitcode < 0:
                how = f"signal {failure.signal_name()}"
            print(f"error: training failed: rank {rank} (local rank {failure.local_rank} on "
                  f"{socket.gethostname()}) ended with {how}; its output is above",
                  file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    # The elastic agent logs every worker failure at ERROR level before raising; the summary
    # above says the same in one line.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.CRITICAL)
    sys.exit(main(sys.argv[1:]))
