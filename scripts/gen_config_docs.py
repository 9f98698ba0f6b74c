"""Write docs/config.md, the reference of every config key, from the config dataclasses.

    python scripts/gen_config_docs.py            # rewrite the page
    python scripts/gen_config_docs.py --check    # exit 1 if the page is out of date

`./run_train.sh --help` prints the same keys (trainer/config/reference.py is the one source).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config.reference import markdown  # noqa: E402

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def main(argv: list[str]) -> int:
    page = markdown()
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE} is out of date: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE} ({page.count(chr(10)) + 1} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
