"""What a multiple-choice task is: examples with a context, choices and the gold answer's index.
A leaf module: the task readers (tasks.py) and the built-in task (stdlib_next_line.py) both
build these, and the scorer (scoring.py) reads them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    gold: int


@dataclass
class Task:
    name: str
    examples: list[Example]
    target_delimiter: str = ""
