"""The product speaks of the product: README, docs, code, tests, configs, scripts and benchmarks
say what the trainer does and how it was measured, never how or in which sitting it was built
(no work-log numbering, tracker numbers or hand-off vocabulary). What changed and when belongs in
CHANGELOG.md; a measurement's date, revision and machine class in benchmarks/RESULTS.md."""

import re
from pathlib import Path

import pytest

from tests.helpers import REPO

ROOTS = ["README.md", "CONTRIBUTING.md", "pyproject.toml", "docs", "trainer", "tests", "configs"]
ROOTS += ["scripts", "benchmarks", ".ci", "run_train.sh"]
SUFFIXES = {".md", ".py", ".toml", ".sh", ".txt", ".cfg", ".yaml", ".yml", ""}

# Each pattern names a way a build diary leaks into the product. Case-insensitive, whole words.
PATTERNS = [
    r"sessions? \d+",  # a numbered work sitting
    r"(this|previous|last|earlier|next|later|prior|first|second|third|fourth) (gpu )?sessions?",
    r"issues? #?\d+",  # a tracker number; external trackers are cited as owner/repo#N
    r"(first|second|third|fourth|fifth|next|last|this) (wave|round)(?!\()",
    r"rounds? \d+",
    r"review rounds?",
    r"(the )?lent (gpu|machine|device)s?",
    r"stops? \d+",
    r"sub-?agents?",
    r"closing notes?",
    r"filed by",
    r"ENGINEERING\.md",
    r"DEVELOPERS\.md",
]
PROCESS = re.compile(r"\b(" + "|".join(PATTERNS) + r")\b", re.IGNORECASE)


def product_files(root: Path = REPO) -> list[Path]:
    out = []
    for name in ROOTS:
        path = root / name
        if path.is_file():
            out.append(path)
        elif path.is_dir():
            out += [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in SUFFIXES]
    here = Path(__file__).resolve()
    return [p for p in out if p.resolve() != here and "__pycache__" not in p.parts]


def process_words(path: Path, root: Path = REPO) -> list[str]:
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return []
    return [
        f"{path.relative_to(root)}:{no}: {m.group(0)!r}"
        for no, line in enumerate(text.splitlines(), 1)
        for m in PROCESS.finditer(line)
    ]


@pytest.mark.parametrize(
    "line",
    [
        "Measured in session 18 on the Xeon.",
        "The fix for issue 62's budget.",
        "Second round: forked ranks.",
        "Left for the next session.",
        "Run on the lent GPU.",
    ],
)
def test_the_check_finds_a_planted_diary_line(tmp_path, line):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(f"# A page\n\n{line}\n")
    assert product_files(tmp_path) == [page]
    assert process_words(page, tmp_path) != []


@pytest.mark.parametrize(
    "line",
    [
        "scope='session' fixtures are built once per test session.",
        "torchft#329 measured 948 s per restart.",
        "The elastic agent restarts the worker group.",
        "Round-robin over the ranks; a stop signal saves first.",
    ],
)
def test_the_check_leaves_the_product_vocabulary_alone(tmp_path, line):
    page = tmp_path / "README.md"
    page.write_text(line)
    assert process_words(page, tmp_path) == []


def test_no_process_words_in_the_product():
    found = [hit for path in product_files() for hit in process_words(path)]
    assert found == [], "\n".join(found)
