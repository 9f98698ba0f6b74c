"""User-facing errors.

A user error (bad config, bad data) is reported as one line, ``<kind> error: <message>``, and a
non-zero exit code; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """An error caused by the user's input, reported as one line without a traceback."""

    kind = "user"
    exit_code = 2

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
    exit_code = 4


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded as asked (missing, damaged, not fitting), or a save
    the storage refused."""

    kind = "checkpoint"
