"""What registers a model family (trainer/models/registry.py): its `model.name`, its flavors,
and where its implementation of the family contract is (trainer/models/hooks.py). Without
torch: a config check reads the names and flavors before any process starts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFamily:
    """`name`: the model.name of the family; `flavors`: model.flavor -> ModelArgs; `hooks`:
    the module path of its contract implementation (a module whose `HOOKS` is a
    trainer.models.hooks.DecoderHooks), imported when a run first asks for it; `about`: what
    the family is, for the [model] section's help (the releases it covers, its doc)."""

    name: str
    flavors: dict
    hooks: str
    about: str = ""
