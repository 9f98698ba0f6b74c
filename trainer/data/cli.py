"""Command-line plumbing shared by `prepare` and `train_tokenizer`: the `[data]` fields as
flags (same names as the TOML keys), optionally on top of a TOML file's `[data]` section."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

import tomllib

from trainer.config.base import check_field, coerce, from_cli
from trainer.data.config import DataConfig, MixSource
from trainer.errors import ConfigError, UserError

_FIELDS = {f.name: f for f in dataclasses.fields(DataConfig)}
_TYPES = typing.get_type_hints(DataConfig)


def add_data_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a TOML file whose [data] section is the starting point")
    for name, f in _FIELDS.items():
        kind = _TYPES[name]
        if kind is bool:
            parser.add_argument(
                f"--{name}",
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f.metadata["help"],
            )
        elif kind is list[MixSource]:  # a TOML inline array of tables, as for the trainer
            parser.add_argument(f"--{name}", default=None, help=f.metadata["help"])
        elif kind in (list[str], list[int]):
            parser.add_argument(
                f"--{name}", nargs="*", default=None, help=f.metadata["help"], type=kind.__args__[0]
            )
        else:
            parser.add_argument(f"--{name}", type=kind, default=None, help=f.metadata["help"])


def data_config_from_args(args: argparse.Namespace) -> DataConfig:
    """Defaults, then the TOML file's [data] section, then flags; checked like the trainer."""
    values: dict = {}
    if args.config:
        try:
            with open(args.config, "rb") as f:
                values.update(tomllib.load(f).get("data", {}))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config {args.config}: {e}") from None
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown key data.{unknown[0]} in {args.config}")
    values = {
        k: coerce(f"data.{k}", v, _TYPES[k], _FIELDS[k].metadata.get("int_as_str", False))
        for k, v in values.items()
    }
    for name in _FIELDS:
        if getattr(args, name, None) is not None:
            value = getattr(args, name)
            values[name] = (
                from_cli(f"data.{name}", value, _TYPES[name])
                if _TYPES[name] is list[MixSource]
                else value
            )
    cfg = DataConfig(**values)
    for name, f in _FIELDS.items():
        check_field("data", f, getattr(cfg, name))
    cfg.validate()
    return cfg


def run_main(main: typing.Callable[[], None]) -> None:
    """User errors print one line and exit non-zero; bugs keep their traceback."""
    try:
        main()
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
