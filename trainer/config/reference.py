"""The config reference, from the dataclasses themselves: every key with its type, default and
one-line doc, grouped by TOML section.

One source, two renderings: `text()` is what `./run_train.sh --help` and
`python -m trainer.config --help` print; `markdown()` is docs/config.md, written by
`python scripts/gen_config_docs.py` (tests/test_docs.py fails when the page is stale).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from dataclasses import dataclass

from trainer.config.base import toml_value, type_name
from trainer.config.job import JobConfig, sections


@dataclass(frozen=True)
class Key:
    """One config key: `[section] name` (or `[[section.table]] name` for a key of a table)."""

    section: str
    name: str
    type: str
    default: str
    doc: str
    table: str = ""  # set for the keys of a [[section.table]] entry


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _table_keys(section: str, table_name: str, table) -> list[Key]:
    hints = typing.get_type_hints(table)
    return [
        Key(
            section,
            g.name,
            type_name(hints[g.name]),
            toml_value(_default(g)),
            g.metadata.get("help", ""),
            table=table_name,
        )
        for g in dataclasses.fields(table)
    ]


def keys() -> list[Key]:
    """Every key, in the order of the dataclasses (sections as in JobConfig)."""
    cfg, out = JobConfig(), []
    for section in sections(cfg):
        obj = getattr(cfg, section)
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            tp = hints[f.name]
            out.append(
                Key(
                    section,
                    f.name,
                    type_name(tp),
                    toml_value(getattr(obj, f.name)),
                    f.metadata.get("help", ""),
                )
            )
            args = typing.get_args(tp)
            if args and dataclasses.is_dataclass(args[0]):  # [[section.key]] tables
                out.extend(_table_keys(section, f.name, args[0]))
    return out


def section_docs() -> dict[str, str]:
    """Each section's dataclass docstring, joined into one paragraph ('' where the class has
    none: dataclasses then make up `Name(field: type = default, ...)`, which is no doc)."""
    cfg, out = JobConfig(), {}
    for s in sections(cfg):
        cls = type(getattr(cfg, s))
        doc = " ".join((inspect.getdoc(cls) or "").split())
        out[s] = "" if doc.startswith(f"{cls.__name__}(") else doc
    return out


def text() -> str:
    """The plain-text reference (`--help`)."""
    lines, section = [], None
    for k in keys():
        if k.section != section:
            section = k.section
            lines.append(f"[{section}]")
        indent = "    " if k.table else "  "
        lines.append(f"{indent}{k.name} ({k.type}, default {k.default}): {k.doc}")
    return "\n".join(lines)


def _linked(s: str) -> str:
    """'docs/x.md' in a doc -> a link to that page (the reference is itself in docs/)."""
    return re.sub(r"docs/([\w-]+\.md)", r"[\1](\1)", s)


def _cell(s: str) -> str:
    return s.replace("|", "\\|")


TABLE_HEAD = ["| key | type | default | what it does |", "|---|---|---|---|"]


def _row(k: Key) -> str:
    return f"| `{k.name}` | `{_cell(k.type)}` | `{_cell(k.default)}` | {_linked(_cell(k.doc))} |"


def markdown() -> str:
    """docs/config.md: a section per TOML table, a row per key."""
    all_keys, docs = keys(), section_docs()
    names = list(dict.fromkeys(k.section for k in all_keys))
    out = [
        "# Configuration reference",
        "",
        "Every key of the TOML config, with its type, default and what it does, grouped by "
        "section. Set a key in the TOML file (`[section]` then `key = value`) or on the "
        "command line as `--section.key value` (command line > TOML > defaults). "
        "`./run_train.sh --help` prints the same list.",
        "",
        "Generated from the config dataclasses by `python scripts/gen_config_docs.py`; "
        "`tests/test_docs.py` fails when this page is out of date. Do not edit it by hand.",
        "",
        "Sections: " + ", ".join(f"[`[{n}]`](#{n})" for n in names) + ".",
        "",
    ]
    for name in names:
        own = [k for k in all_keys if k.section == name]
        out += [
            f"## {name}",
            "",
            *([_linked(docs[name]), ""] if docs.get(name) else []),
            *TABLE_HEAD,
            *(_row(k) for k in own if not k.table),
        ]
        for table in dict.fromkeys(k.table for k in own if k.table):  # [[section.table]] keys
            out += [
                "",
                f"Each `[[{name}.{table}]]` entry:",
                "",
                *TABLE_HEAD,
                *(_row(k) for k in own if k.table == table),
            ]
        out.append("")
    return "\n".join(out)
