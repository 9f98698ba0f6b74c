"""The model families: each a name (`model.name`), its flavors, and its implementation of the
family contract (trainer/models/hooks.py), found by module path and imported when the run
first asks for it, so that checking a config never imports torch.

Every family is a package (trainer/models/<family>/) registered here with one line; only
this module imports a family package's own `__init__`, and nothing outside the package
imports its other modules. The plain decoder family (llama3: Llama 3 and the Qwen3 flavors)
answers the contract with its defaults (trainer/models/hooks.py's `DecoderHooks`).
docs/architecture.md#where-new-things-go has the template a new family copies.
"""

from __future__ import annotations

import importlib
from functools import cache

from trainer.models import deepseek_v3, gpt_oss, llama3, qwen3_next

# Every family, one line each, in the order the docs list them.
PACKAGES = (llama3.FAMILY, deepseek_v3.FAMILY, qwen3_next.FAMILY, gpt_oss.FAMILY)


def names() -> tuple[str, ...]:
    """Every model.name, in the order the docs list them."""
    return tuple(f.name for f in PACKAGES)


def describe_names() -> str:
    """The [model] name key's help: every family and what it covers."""
    return "; ".join(f"{f.name} ({f.about})" if f.about else f.name for f in PACKAGES)


def describe_flavors() -> str:
    """The [model] flavor key's help: every family's flavors."""
    return "; ".join(f"{f.name}: {', '.join(f.flavors)}" for f in PACKAGES)


def package_flavors() -> dict:
    """Every family's flavors (trainer/models/flavors.py's FLAVORS)."""
    return {k: v for family in PACKAGES for k, v in family.flavors.items()}


@cache
def _hooks(module: str):
    return importlib.import_module(module).HOOKS


def hooks(args):
    """The contract implementation of the family `args` (ModelArgs) belongs to."""
    for family in PACKAGES:
        if family.name == args.family:
            return _hooks(family.hooks)
    raise KeyError(f"no family registered as {args.family!r}")
