"""Building blocks for config sections: a field helper and the rules every section follows.

Each TOML section is a dataclass whose fields are declared with `opt(default, help, ...)`:
the default and the one-line doc live next to each other, and simple constraints (choices,
bounds) are checked generically with messages that name the key. Section-specific rules go in
the section's `validate()` method, which raises `ConfigError` naming `section.key`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainer.errors import ConfigError


def opt(default: Any, help: str, *, choices: tuple | None = None, min: float | None = None,
        max: float | None = None) -> Any:
    """Declare a config field: its default, its one-line doc and optional simple constraints."""
    meta = {"help": help, "choices": choices, "min": min, "max": max}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check_field(section: str, f: dataclasses.Field, value: Any) -> None:
    """Check the generic constraints declared with `opt` for one field value."""
    key = f"{section}.{f.name}"
    choices, lo, hi = f.metadata.get("choices"), f.metadata.get("min"), f.metadata.get("max")
    if choices is not None and value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{key} = {value!r} is not valid; choose one of {valid}")
    if lo is not None and value < lo:
        raise ConfigError(f"{key} = {value!r} is out of range; it must be >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key} = {value!r} is out of range; it must be <= {hi}")
