"""User-facing errors.

A user error (bad config, bad data) is reported as one line, ``<kind> error: <message>``, and a
non-zero exit code; anything else is a bug and keeps its traceback. The exit codes of every
way a run ends are here, in one table, for the launcher, the loop and the SLURM script alike.
"""

USER_ERROR_EXIT_CODE = 2  # bad config, data or checkpoint: one `<kind> error:` line
PREEMPTED_EXIT_CODE = 3  # a clean, checkpointed stop on a signal (trainer.health.preemption)
TRAINING_ERROR_EXIT_CODE = 4  # too many non-finite steps: one `training error:` line
OUT_OF_MEMORY_EXIT_CODE = 5  # an OOM in a step: one `training error:` line (trainer.health.oom)
HANG_EXIT_CODE = 6  # a collective timed out: one line naming the silent ranks (health.heartbeat)
GAVE_UP_EXIT_CODE = 7  # the same failure at the same step, restart after restart (health.restarts)
# The signals `job.stop_signals` may name: each stops the run at a step boundary with a save.
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")


class UserError(Exception):
    """An error caused by the user's input, reported as one line without a traceback."""

    kind = "user"
    exit_code = USER_ERROR_EXIT_CODE

    def one_line(self) -> str:
        return f"{self.kind} error: {self}".replace("\n", " ")


class ConfigError(UserError):
    """Unknown keys, wrong types, out-of-range values, impossible combinations."""

    kind = "config"


class DataError(UserError):
    """Missing or corrupt data, tokenizer mismatches, corpora too small for the request."""

    kind = "data"


class TrainingError(UserError):
    """The run cannot go on: e.g. non-finite losses for more steps than the user allows."""

    kind = "training"
    exit_code = TRAINING_ERROR_EXIT_CODE


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded as asked (missing, damaged, not fitting), or a save
    the storage refused."""

    kind = "checkpoint"
