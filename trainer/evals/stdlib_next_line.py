"""`stdlib_next_line`: a built-in task that needs no download and means something for the
default run (the debug model trained on the Python standard library).

Given up to CONTEXT_LINES preceding lines of a Python function, pick the true next line among
N_CHOICES: the true one and lines drawn from other modules. Built deterministically from this
Python's stdlib, starting from the last modules of the corpus order (the store's held-out
validation tail comes first; later examples reach modules training may have seen).

What keeps it from being solvable by surface cues:
- distractors are re-indented to the true line's indentation (indentation is not a cue);
- each distractor is within ~15% of the true line's length (in characters, hence bytes for
  ASCII), so "pick the longest/shortest" scores about chance (tests/test_evals.py measures it);
- no distractor equals the true line, and each comes from another module.
"""

from __future__ import annotations

import ast
import bisect
import random
import re
from functools import lru_cache

from trainer.evals.tasks import Example

N_EXAMPLES = 500
N_CHOICES = 4
CONTEXT_LINES = 8
MIN_CHARS, MAX_CHARS = 12, 72  # the stripped target line
SEED = 1234
LEXEME = re.compile(r"\w+|[^\w\s]")


def _candidate(line: str, lo: int = MIN_CHARS, hi: int = MAX_CHARS) -> bool:
    s = line.strip()
    return (lo <= len(s) <= hi and s.isascii() and not s.startswith(("#", '"', "'"))
            and not s.endswith(("\\", '"""', "'''")))


def _functions(source: str) -> list[tuple[int, int]]:
    """(first, last) 0-based line numbers of every function, nested ones included."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    return [(n.lineno - 1, n.end_lineno - 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _lexemes(text: str) -> int:
    """Words, numbers and punctuation marks: a tokenizer-independent proxy of token count."""
    return len(LEXEME.findall(text))


def _file_examples(lines: list[str], rng: random.Random) -> tuple[list, list]:
    """(context, true line) pairs of one module, at most one per function (a body line at
    least two lines after the def, its context inside the function); and every body line of
    its functions that could be a target (the distractor pool: the same kind of line)."""
    pairs, body = [], set()
    for first, last in sorted(_functions("\n".join(lines))):
        targets = [i for i in range(first + 2, last + 1) if _candidate(lines[i])]
        body.update(targets)
        if not targets:
            continue
        i = rng.choice(targets)
        ctx = lines[max(first, i - CONTEXT_LINES):i]
        pairs.append(("\n".join(ctx) + "\n", lines[i]))
    return pairs, [lines[i].strip() for i in sorted(body)]


@lru_cache(maxsize=1)
def build_examples() -> list[Example]:
    """The task's N_EXAMPLES examples (deterministic for a given stdlib)."""
    from trainer.data.sources import _read_text, stdlib_files

    rng = random.Random(SEED)
    pairs, pool = [], []  # pool: (lexemes, length, stripped line, module index)
    for fi, path in enumerate(reversed(stdlib_files())):
        file_pairs, body = _file_examples(_read_text(path).split("\n"), rng)
        pool += [(_lexemes(text), len(text), text, fi) for text in body]
        pairs += [(ctx, line, fi) for ctx, line in file_pairs]
        if len(pairs) >= 2 * N_EXAMPLES and fi >= 20:
            break
    pool.sort()
    rng.shuffle(pairs)
    examples = []
    for context, line, fi in pairs:
        distractors = _distractors(line, fi, pool, rng)
        if distractors is None:
            continue
        indent = line[:len(line) - len(line.lstrip())]
        choices = [indent + d for d in distractors]
        gold = rng.randrange(N_CHOICES)
        choices.insert(gold, line)
        examples.append(Example(context, tuple(choices), gold))
        if len(examples) == N_EXAMPLES:
            break
    return examples


def _distractors(line: str, fi: int, pool: list, rng: random.Random) -> list[str] | None:
    """N_CHOICES - 1 distinct body lines of other modules with as many lexemes as the line
    and a length within ~15% of it."""
    target = line.strip()
    n, k = len(target), _lexemes(target)
    d = max(1, round(0.15 * n))
    lo = bisect.bisect_left(pool, (k, n - d))
    hi = bisect.bisect_left(pool, (k, n + d + 1))
    picked: list[str] = []
    for _ in range(50):
        if len(picked) == N_CHOICES - 1 or hi <= lo:
            break
        _, _, text, other = pool[rng.randrange(lo, hi)]
        if other != fi and text != target and text not in picked:
            picked.append(text)
    return picked if len(picked) == N_CHOICES - 1 else None
