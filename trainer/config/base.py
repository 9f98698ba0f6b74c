"""Building blocks for config sections: a field helper and the rules every section follows.

Each TOML section is a dataclass whose fields are declared with `opt(default, help, ...)`:
the default and the one-line doc live next to each other, and simple constraints (choices,
bounds) are checked generically with messages that name the key. Section-specific rules go in
the section's `validate()` method, which raises `ConfigError` naming `section.key`.

Also here: the value conversions shared by TOML loading and CLI overrides.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from typing import Any

from trainer.errors import ConfigError


def opt(
    default: Any,
    help: str,
    *,
    choices: tuple | None = None,
    min: float | None = None,
    max: float | None = None,
    int_as_str: bool = False,
) -> Any:
    """Declare a config field: its default, its one-line doc and optional simple constraints.
    `int_as_str`: a str field whose value may also be an integer (TOML `key = 2` reads as
    "2"); the section's `validate` checks the value."""
    meta = {"help": help, "choices": choices, "min": min, "max": max, "int_as_str": int_as_str}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check_field(section: str, f: dataclasses.Field, value: Any) -> None:
    """Check the generic constraints declared with `opt` for one field value."""
    key = f"{section}.{f.name}"
    choices, lo, hi = f.metadata.get("choices"), f.metadata.get("min"), f.metadata.get("max")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} = {value!r} is not a finite number")
    if choices is not None and value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{key} = {value!r} is not valid; choose one of {valid}")
    if lo is not None and value < lo:
        raise ConfigError(f"{key} = {value!r} is out of range; it must be >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key} = {value!r} is out of range; it must be <= {hi}")


def parse_cli(argv: list[str]) -> dict[str, str | None]:
    """`--a.b v`, `--a.b=v` and bare `--a.b` (boolean true) into {'a.b': 'v'}."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(
                f"unexpected argument {arg!r}; overrides look like "
                "--section.key value or --section.key=value"
            )
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            key, value = arg[2:], argv[i + 1]
            i += 1
        else:
            key, value = arg[2:], None
        out[key] = value
        i += 1
    return out


def did_you_mean(word: str, options) -> str:
    by_lower = {o.lower(): o for o in options}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


def type_name(tp) -> str:
    """int, list[str], list[MixSource]: short names for messages and the reference."""
    origin = typing.get_origin(tp)
    if origin is None:
        return getattr(tp, "__name__", str(tp))
    return f"{origin.__name__}[{', '.join(type_name(a) for a in typing.get_args(tp))}]"


def coerce(key: str, value: Any, tp, int_as_str: bool = False) -> Any:
    """Check a TOML value against the field type (ints are accepted for floats, and for str
    fields declared with `int_as_str`)."""
    if int_as_str and tp is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if dataclasses.is_dataclass(item_tp):
            if not isinstance(value, list):
                raise ConfigError(
                    f"{key} must be a list of tables ([[{key}]] in TOML), got {value!r}"
                )
            return [coerce_table(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list of {item_tp.__name__}, got {value!r}")
        return [coerce(key, v, item_tp) for v in value]
    ok = (isinstance(value, tp) and not (tp is int and isinstance(value, bool))) or (
        tp is float and isinstance(value, int) and not isinstance(value, bool)
    )
    if not ok:
        raise ConfigError(
            f"{key} must be {_article(tp)} {type_name(tp)}, got {type(value).__name__} {value!r}"
        )
    return float(value) if tp is float else value


def coerce_table(key: str, value: Any, tp) -> Any:
    """A TOML table (dict) into the dataclass `tp`: unknown keys, wrong types and the fields'
    declared constraints fail with the key named, e.g. data.mix[1].weight."""
    if not isinstance(value, dict):
        raise ConfigError(
            f"{key} must be a table with keys "
            f"{', '.join(f.name for f in dataclasses.fields(tp))}, got {value!r}"
        )
    fields = {f.name: f for f in dataclasses.fields(tp)}
    hints = typing.get_type_hints(tp)
    kwargs = {}
    for name, v in value.items():
        if name not in fields:
            raise ConfigError(
                f"unknown key {key}.{name}{did_you_mean(name, fields)}; valid "
                f"keys: {', '.join(fields)}"
            )
        kwargs[name] = coerce(f"{key}.{name}", v, hints[name])
        check_field(key, fields[name], kwargs[name])
    return tp(**kwargs)


def from_cli(key: str, raw: str | None, tp) -> Any:
    """Parse a CLI string into the field's type. A list of tables is a TOML inline array:
    --data.mix '[{name = "web", store_path = "/s/web", weight = 0.7}, ...]'."""
    if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        import tomllib

        try:
            value = tomllib.loads(f"value = {raw or '[]'}")["value"]
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(
                f"{key} must be a TOML inline array of tables, e.g. "
                f"'[{{name = \"a\", ...}}]'; got {raw!r} ({e})"
            ) from None
        return coerce(key, value, tp)
    if typing.get_origin(tp) is list:
        (item_tp,) = typing.get_args(tp)
        items = [] if not raw else [s.strip() for s in raw.split(",")]
        return [from_cli(key, s, item_tp) for s in items]
    if tp is bool:
        if raw is None or raw.lower() == "true":
            return True
        if raw.lower() == "false":
            return False
        raise ConfigError(f"{key} must be true or false, got {raw!r}")
    if raw is None:
        raise ConfigError(f"{key} needs a value ({type_name(tp)})")
    if tp is str:
        return raw
    try:
        return tp(raw)
    except ValueError:
        raise ConfigError(f"{key} must be {_article(tp)} {type_name(tp)}, got {raw!r}") from None


def _article(tp) -> str:
    return "an" if type_name(tp)[0] in "aeiou" else "a"


def check_folder(key: str, path: str) -> None:
    """A folder key names a folder, existing or to create; ConfigError otherwise."""
    if not path.strip():
        raise ConfigError(
            f"{key} = {path!r} names no folder; name one (e.g. "
            "'./outputs/my_run'; it is created if missing)"
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(
            f"{key} = {path!r} is a file, not a folder; name a folder (it is created if missing)"
        )


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if dataclasses.is_dataclass(v):  # an inline table
        return (
            "{"
            + ", ".join(
                f"{f.name} = {toml_value(getattr(v, f.name))}" for f in dataclasses.fields(v)
            )
            + "}"
        )
    return (
        '"'
        + "".join(
            _TOML_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if _control(c) else c) for c in str(v)
        )
        + '"'
    )


# A TOML basic string escapes these, and every other control character as \uXXXX.
_TOML_ESCAPES = {
    "\\": "\\\\",
    '"': '\\"',
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def _control(c: str) -> bool:
    return ord(c) < 0x20 or ord(c) == 0x7F
