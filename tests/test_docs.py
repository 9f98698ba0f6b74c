"""The docs are part of the product: the README stays one short front door, docs/config.md is
the code's own reference, and no link or #anchor in README.md or docs/ leads nowhere."""

import re
from pathlib import Path

import pytest

from scripts.gen_config_docs import PAGE
from scripts.gen_config_docs import main as gen_config_docs
from tests.helpers import REPO
from trainer.config.reference import keys, markdown, text

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_ID = re.compile(r"""<a\s+(?:name|id)=["']([^"']+)["']""")


def prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked out."""
    out, fenced = [], False
    for no, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((no, re.sub(r"`[^`]*`", "``", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (link targets and markup dropped),
    lowercased, everything but letters, digits, spaces, '-' and '_' removed, spaces -> '-'."""
    heading = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    heading = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every #anchor a page offers: its headings (repeats get -1, -2, ...) and <a name/id>."""
    text, seen, out = path.read_text(), {}, set()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m and not fenced:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
        out.update(HTML_ID.findall(line))
    return out


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    bad = []
    for no, line in prose(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}:{no}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no heading with that anchor in {dest.name})")
    return bad


def test_slug_follows_github():
    assert slug("Weights & Biases") == "weights--biases"
    assert (
        slug("Documents in packed windows (`block_causal`)")
        == "documents-in-packed-windows-block_causal"
    )
    assert slug("At scale: traced peak per GPU") == "at-scale-traced-peak-per-gpu"
    assert slug("See [the plan](plan.md) first") == "see-the-plan-first"


def test_checker_finds_a_broken_link_and_anchor(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n## A section\n## A section\n")
    page.write_text(
        "# Page\n[ok](other.md#a-section-1) [self](#page) "
        "[gone](missing.md) [bad](other.md#nope)\n"
        "```\n[in code](nowhere.md)\n```\n`[inline](nowhere.md)`\n"
    )
    bad = broken_links(page, root=tmp_path)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "missing.md (no such file)",
        "other.md#nope (no heading with that anchor in other.md)",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_and_anchor_resolves(page):
    assert broken_links(page) == []


def test_readme_is_one_short_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300: move it to docs/)"
    first_screen = "\n".join(lines[:60])
    for what in ("./run_train.sh", "python -m pytest -q", "docs/config.md"):
        assert what in first_screen, f"{what!r} is not on the README's first screen"
    linked = set(re.findall(r"\(docs/([\w.-]+\.md)", first_screen))
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages - linked == set(), "docs pages not linked from the README's first screen"


def test_config_page_is_generated_and_current():
    assert gen_config_docs(["--check"]) == 0, (
        "docs/config.md is stale: run python scripts/gen_config_docs.py"
    )
    assert PAGE.read_text() == markdown()


def test_every_key_of_help_is_on_the_config_page():
    """`./run_train.sh --help` prints reference.text() (tests/test_launch_errors.py); every
    `[section] key` it lists has its row, with its default, on docs/config.md."""
    page = PAGE.read_text()
    listed = re.findall(r"^  (?:  )?(\w+) \((.+?), default (.*?)\): ", text(), re.M)
    assert len(listed) == len(keys()) > 100
    sections = re.split(r"^## ", page, flags=re.M)[1:]
    by_section = {s.split("\n", 1)[0]: s for s in sections}
    for k in keys():
        row = f"| `{k.name}` | `{k.type}` | `{k.default.replace('|', chr(92) + '|')}` |"
        assert row in by_section[k.section], f"[{k.section}] {k.name} missing from docs/config.md"
