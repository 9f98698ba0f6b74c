"""The README is part of the product: its config reference must match the code."""

from scripts.update_readme import render
from tests.helpers import REPO


def test_readme_config_reference_is_current():
    assert render() in (REPO / "README.md").read_text(), \
        "README config reference is stale: run python scripts/update_readme.py"
