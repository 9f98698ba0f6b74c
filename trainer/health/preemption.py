"""Stop cleanly on a signal: every rank agrees at a step boundary, saves, and exits.

SLURM sends SIGUSR1 ahead of a preemption or time limit (`--signal=USR1@<s>`), schedulers send
SIGTERM, and a user presses Ctrl-C (SIGINT). A handler only records the signal; at the end of
each step the ranks all-reduce the flag, so they all stop after the same step even when the
signal reached only some of them, then save a checkpoint and exit with PREEMPTED_EXIT_CODE
(which the SLURM script turns into a requeue).
"""

from __future__ import annotations

import signal

from trainer.errors import PREEMPTED_EXIT_CODE, STOP_SIGNALS


class Preempted(Exception):
    """Raised after the checkpoint of a signalled stop is saved."""

    exit_code = PREEMPTED_EXIT_CODE


class StopSignals:
    def __init__(self, names: list[str], early: list[int] = ()):
        """Handle `names` from now on; `early` are signals recorded before this existed."""
        self.received: str | None = None
        for name in names:
            signal.signal(getattr(signal, name), self._handler)
        for signum in dict.fromkeys(early):
            if signal.Signals(signum).name in names:
                self.received = self.received or signal.Signals(signum).name
            else:  # not a stop signal here: its default action, late
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)
        for name in STOP_SIGNALS:  # the early recorder's other signals: default again
            if name not in names and signal.getsignal(getattr(signal, name)) not in (
                signal.SIG_DFL,
                signal.SIG_IGN,
                signal.default_int_handler,
            ):
                signal.signal(getattr(signal, name), signal.SIG_DFL)

    def _handler(self, signum, frame) -> None:
        # Repeats are expected (SLURM may signal the whole step and the launcher forwards too);
        # the launcher handles "stop at once" on a second Ctrl-C by killing the ranks.
        self.received = self.received or signal.Signals(signum).name
