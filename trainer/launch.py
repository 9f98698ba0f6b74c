"""torchrun with a readable failure report and signals passed on to the workers.

    python -m trainer.launch [torchrun options] -m trainer.train [trainer overrides]

This is `torch.distributed.run` (the code behind `torchrun`) with two differences:

- Failures: when a worker fails, torchrun raises ChildFailedError and prints a long report plus
  its own traceback. A worker that stopped on a user error has already printed its one line
  (`config error: ...`), and one stopped by a signal has saved and said so, so we exit with
  its code silently; for any other failure we print one short summary naming the rank, host
  and exit code (the worker's own traceback is above it).
- Signals: SLURM delivers SIGUSR1/SIGTERM to the launcher (srun's task), not to the workers.
  torchrun would die of SIGUSR1, or SIGTERM its workers and SIGKILL them 30 s later, possibly
  mid-save. We forward SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 to the workers and keep
  waiting: they save at the next step and exit with code 3. A second SIGINT or SIGTERM kills
  the workers at once.
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import socket
import sys

# The agents' own C++ warnings (e.g. a TCPStore peer gone at shutdown after a failed or stopped
# worker group) are noise in the launcher; c10 reads the level once, when torch loads, so set it
# for this process only and give the workers the user's setting back.
_user_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
import torch  # noqa: E402,F401

if _user_level is None:
    del os.environ["TORCH_CPP_LOG_LEVEL"]
else:
    os.environ["TORCH_CPP_LOG_LEVEL"] = _user_level

from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.run import config_from_args, elastic_launch, parse_args  # noqa: E402

USER_ERROR_EXIT_CODE = 2
PREEMPTED_EXIT_CODE = 3  # a clean, checkpointed stop on a signal (see trainer.train)
TRAINING_ERROR_EXIT_CODE = 4  # too many non-finite steps: one `training error:` line printed
OUT_OF_MEMORY_EXIT_CODE = 5  # a CUDA OOM in a step: one `training error:` line (trainer.oom)
QUIET_CODES = (USER_ERROR_EXIT_CODE, PREEMPTED_EXIT_CODE, TRAINING_ERROR_EXIT_CODE,
               OUT_OF_MEMORY_EXIT_CODE)


FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")


def _children() -> list[int]:
    pids: list[int] = []
    for path in glob.glob("/proc/self/task/*/children"):
        with open(path) as fh:
            pids += [int(p) for p in fh.read().split()]
    return pids


def _forward(signum, frame) -> None:
    _received[signum] = _received.get(signum, 0) + 1
    if signum in (signal.SIGINT, signal.SIGTERM) and _received[signum] > 1:
        _signal_children(signal.SIGKILL)  # the ranks would only record it: stop them now
        raise SignalException(f"second {signal.Signals(signum).name}: stopping now",
                              signal.Signals(signum))
    _signal_children(signum)


def _signal_children(signum: int) -> None:
    for pid in _children():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


_received: dict[int, int] = {}


def install_forwarding() -> None:
    """Our handlers for the forwarded signals; torchrun keeps its own for the rest."""
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGQUIT"
    for name in FORWARDED:
        signal.signal(getattr(signal, name), _forward)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    config, cmd, cmd_args = config_from_args(args)
    # launch_agent exports config.signals_to_handle as TORCHELASTIC_SIGNALS_TO_HANDLE (default
    # SIGTERM,SIGINT,SIGHUP,SIGQUIT), which would replace our handlers when the workers start.
    config.signals_to_handle = "SIGQUIT"
    install_forwarding()
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except SignalException as err:  # a second SIGINT/SIGTERM: torchrun tore the workers down
        print(f"error: training stopped at once on {signal.Signals(err.sigval).name}",
              file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
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
    logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous").setLevel(
        logging.ERROR)
    sys.exit(main(sys.argv[1:]))
