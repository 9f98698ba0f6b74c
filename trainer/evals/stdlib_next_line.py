"""`stdlib_next_line`: a built-in task that needs no download and means something for the
default run (the debug model trained on the Python standard library).

Given up to CONTEXT_LINES preceding lines of a Python function and the first half of the
next line, pick how that line really ends among N_CHOICES: its true end and the ends of body
lines of other modules' functions. Built deterministically from this Python's stdlib, from
the last modules of the corpus order (the store's held-out validation tail comes first; later
examples reach modules that training may see).

Why the line is cut in the middle (at the start of its middle word or symbol): with whole
lines as choices, the debug model stayed at its untrained score through 200 steps (it cannot
yet relate a line to the function around it), while how a statement goes on after
`self._pos = ` or `isinstance(` is what it learns first (measured: benchmarks/RESULTS.md).

What keeps it from being solvable by surface cues:
- each distractor has as many words and symbols (LEXEME) as the true end and a length
  within ~15% of it; "pick the longest/shortest" scores below chance (tests/test_evals.py);
- the untrained model, which prefers the choice with the fewest tokens, scores about chance;
- no distractor equals the true end, and each comes from another module.
"""

from __future__ import annotations

import ast
import bisect
import random
import re
from functools import lru_cache

from trainer.evals.examples import Example

N_EXAMPLES = 500
N_CHOICES = 4
CONTEXT_LINES = 8
MIN_CHARS, MAX_CHARS = 12, 72  # the stripped line
SEED = 1234
LEXEME = re.compile(r"\w+|[^\w\s]")


def _candidate(line: str) -> bool:
    s = line.strip()
    return (
        MIN_CHARS <= len(s) <= MAX_CHARS
        and s.isascii()
        and not s.startswith(("#", '"', "'"))
        and not s.endswith(("\\", '"""', "'''"))
    )


def _functions(source: str) -> list[tuple[int, int]]:
    """(first, last) 0-based line numbers of every function, nested ones included."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    return [
        (n.lineno - 1, n.end_lineno - 1)
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def _split(line: str) -> tuple[str, str]:
    """(head, end) of a line, cut where its middle lexeme starts."""
    starts = [m.start() for m in LEXEME.finditer(line)]
    pos = starts[len(starts) // 2]
    return line[:pos], line[pos:]


def _file_examples(lines: list[str], rng: random.Random) -> tuple[list, list]:
    """(context, line) pairs of one module, at most one per function (a body line at least
    two lines after the def, its context inside the function); and the ends of every body
    line of its functions that could be a target (the distractor pool: the same kind)."""
    pairs, body = [], set()
    for first, last in sorted(_functions("\n".join(lines))):
        targets = [i for i in range(first + 2, last + 1) if _candidate(lines[i])]
        body.update(targets)
        if not targets:
            continue
        i = rng.choice(targets)
        ctx = lines[max(first, i - CONTEXT_LINES) : i]
        pairs.append(("\n".join(ctx) + "\n", lines[i]))
    return pairs, [_split(lines[i])[1] for i in sorted(body)]


@lru_cache(maxsize=1)
def build_examples() -> list[Example]:
    """The task's N_EXAMPLES examples (deterministic for a given stdlib)."""
    from trainer.data.sources import _read_text, stdlib_files

    rng = random.Random(SEED)
    pairs, pool = [], []  # pool: (lexemes, length, line end, module index)
    for fi, path in enumerate(reversed(stdlib_files())):
        file_pairs, ends = _file_examples(_read_text(path).split("\n"), rng)
        pool += [(len(LEXEME.findall(end)), len(end), end, fi) for end in ends]
        pairs += [(ctx, line, fi) for ctx, line in file_pairs]
        if len(pairs) >= 2 * N_EXAMPLES and fi >= 20:
            break
    pool.sort()
    rng.shuffle(pairs)
    examples = []
    for context, line, fi in pairs:
        head, end = _split(line)
        choices = _distractors(end, fi, pool, rng)
        if choices is None:
            continue
        gold = rng.randrange(N_CHOICES)
        choices.insert(gold, end)
        examples.append(Example(context + head, tuple(choices), gold))
        if len(examples) == N_EXAMPLES:
            break
    return examples


def _distractors(end: str, fi: int, pool: list, rng: random.Random) -> list[str] | None:
    """N_CHOICES - 1 distinct line ends of other modules with as many lexemes as `end` and a
    length within ~15% of it."""
    n, k = len(end), len(LEXEME.findall(end))
    d = max(1, round(0.15 * n))
    lo = bisect.bisect_left(pool, (k, n - d))
    hi = bisect.bisect_left(pool, (k, n + d + 1))
    picked: list[str] = []
    for _ in range(50):
        if len(picked) == N_CHOICES - 1 or hi <= lo:
            break
        _, _, text, other = pool[rng.randrange(lo, hi)]
        if other != fi and text != end and text not in picked:
            picked.append(text)
    return picked if len(picked) == N_CHOICES - 1 else None
