"""Regenerate the configuration reference in README.md from the config dataclasses.

    python scripts/update_readme.py
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config.job import reference  # noqa: E402

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def render() -> str:
    return f"{START}\n```\n{reference()}\n```\n{END}"


def main() -> None:
    path = Path(__file__).resolve().parents[1] / "README.md"
    text = path.read_text()
    new = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: render(), text, flags=re.S)
    path.write_text(new)


if __name__ == "__main__":
    main()
