"""The model families: each a name (`model.name`), its flavors, and its implementation of the
family contract (trainer/models/hooks.py), found by module path and imported when the run
first asks for it, so that checking a config never imports torch.

A family that is a package (trainer/models/<family>/) is registered here with one line; only
this module imports a family package's own `__init__`, and nothing outside the package
imports its other modules. The plain decoder family (llama3: Llama 3 and the Qwen3 flavors)
is the contract's defaults themselves (trainer/models/hooks.py's `DecoderHooks`).
docs/architecture.md#where-new-things-go has the template a new family copies.
"""

from __future__ import annotations

import importlib
from functools import cache

from trainer.models import deepseek_v3, qwen3_next

# The families that are packages: one line each.
PACKAGES = (deepseek_v3.FAMILY, qwen3_next.FAMILY)
# model.name values of the plain decoder, whose flavors are trainer/models/flavors.py's.
DECODER_NAMES = ("llama3",)
DECODER_HOOKS = "trainer.models.hooks"


def names() -> tuple[str, ...]:
    """Every model.name, in the order the docs list them."""
    return (*DECODER_NAMES, *(f.name for f in PACKAGES))


def package_flavors() -> dict:
    """The flavors of the families that are packages (flavors.py adds them to FLAVORS)."""
    return {k: v for family in PACKAGES for k, v in family.flavors.items()}


@cache
def _hooks(module: str):
    return importlib.import_module(module).HOOKS


def hooks(args):
    """The contract implementation of the family `args` (ModelArgs) belongs to."""
    for family in PACKAGES:
        if family.name == args.family:
            return _hooks(family.hooks)
    return _hooks(DECODER_HOOKS)
