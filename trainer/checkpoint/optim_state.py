"""The model and optimizer in a checkpoint: at a resume the optimizer's state is the checkpoint's
and its settings are this run's config.

A checkpoint's optimizer part holds the state (AdamW's moments and step counts, Muon's momentum
buffers) and the param groups: every setting (lr, betas, eps, weight decay, Muon's momentum,
Nesterov, Newton-Schulz steps and dtype, lr adjustment, the kernel flags foreach/fused, ...).
torch's `Optimizer.load_state_dict` takes both. `ModelAndOptimizer` wraps that load
(`settings_from_config`): the state loads as before, exactly, and afterwards the optimizer holds
again the param groups this run's config built (the lr schedule then sets the resumed step's lr,
trainer/optim/optimizer.py). A setting that differs from the checkpoint's is named in one line
(`changed_line`), so a resume with another `optimizer.muon_momentum` trains with it, and any
kernel (`optimizer.implementation`) resumes under any other. A setting the checkpoint lacks
(saved before it existed) is not read: this run's, without a line.

It also hides param groups without parameters from the load: DCP's unflattening of per-parameter
param groups reads each group's first parameter (`_unflatten_optim_state_dict` in
torch/distributed/checkpoint/state_dict.py: `pg_state[-1]["params"][0]`), an IndexError on a
pipeline rank that holds no Muon matrix (Muon's group 0 is empty there). Such a group holds no
state, so nothing of it is loaded; it is put back after the load.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trainer.checkpoint import integrity
from trainer.errors import ConfigError

# Param-group keys that are not settings: the parameters, and the lr, which the schedule sets
# from this run's config and reports itself (LRSchedule.resume_note).
NOT_SETTINGS = ("params", "param_names", "lr", "initial_lr")

# DCP's flattened optimizer state dict: the settings' keys start so (the state's with "state.").
GROUPS = "param_groups."

# Param-group key -> the [optimizer] key that sets it (a key not listed is named as the group's).
CONFIG_KEYS = {
    "momentum": "muon_momentum",
    "nesterov": "muon_nesterov",
    "ns_steps": "muon_ns_steps",
    "ns_dtype": "muon_ns_dtype",
    "lr_adjust": "muon_lr_adjust",
    "weight_decay": "weight_decay",
    "eps": "eps",
    "foreach": "implementation",
    "fused": "implementation",
    "decoupled_weight_decay": "name",
}


class ModelAndOptimizer(Stateful):
    """Model and optimizer state as sharded DTensors, keyed by parameter FQNs.

    The optimizer's param groups are saved per parameter (grouped lists of names differ
    between pipeline stages, and DCP would keep one rank's list), as one entry per parameter:
    `param_groups.<fqn>` = ((setting, value), ...) (`grouped`). DCP's flattened form has an
    entry per parameter and setting (`param_groups.<fqn>.lr`, ...): 12 for AdamW, each a
    pickled object in the plans, the metadata and the files. On the MoE layout tests' model
    (FSDP 4) a load took twice the CPU that way, 0.70 against 0.36 s on rank 0, and a save 6%
    more (benchmarks/checkpoint/bench_checkpoint_entries.py). `grouped = False`
    reads a checkpoint saved so; `flat = False` one saved before that, with numbered groups.
    A load keeps this run's settings (the module docstring): `changes` lists those that
    differed on this rank."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer
        self.flat = True
        self.grouped = True  # a parameter's settings in one entry (the class docstring)
        self.model_only = False  # a load that starts the optimizer afresh (reset_optimizer)
        # During a load: the checkpoint's optimizer keys (DCP metadata keys after
        # `model_optim.optimizer.`); the param-group entries it lacks are not read but this
        # run's (`_unsaved`).
        self.saved_keys: set[str] | None = None
        self._unsaved: dict = {}
        self.changes: list[tuple[str, str, str]] = []

    def _options(self) -> StateDictOptions:
        return StateDictOptions(flatten_optimizer_state_dict=self.flat)

    def state_dict(self) -> dict:
        # The model's first: its state-dict hook reshards FSDP groups a forward without a
        # backward left unsharded (validation leaves the norm + head group so, whose
        # unsharded parameters the optimizer's FQN mapping would not find: KeyError).
        model = get_model_state_dict(self.model)
        if self.model_only:
            return {"model": model}
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=self._options())
        if not self.flat:
            return {"model": model, "optimizer": optim}
        settings = {k: optim.pop(k) for k in list(optim) if k.startswith(GROUPS)}
        if self.grouped:  # this run's settings stand for any the checkpoint lacks
            self._unsaved = settings
            optim.update(group_settings(settings))
        else:
            saved = self.saved_keys if self.saved_keys is not None else settings
            self._unsaved = {k: v for k, v in settings.items() if k not in saved}
            optim.update({k: v for k, v in settings.items() if k in saved})
        return {"model": model, "optimizer": optim}

    def load_state_dict(self, sd: dict) -> None:
        set_model_state_dict(self.model, sd["model"])
        if self.model_only:
            return
        optim = sd["optimizer"]
        if self.flat and self.grouped:
            optim = {**self._unsaved, **ungroup_settings(optim)}
        elif self.flat:
            optim = {**optim, **self._unsaved}
        with settings_from_config(self.optimizer, self.changes):
            set_optimizer_state_dict(
                self.model, self.optimizer, optim_state_dict=optim, options=self._options()
            )
        self._unsaved = {}


def saved_grouped(saved_keys: set[str]) -> bool:
    """Whether a checkpoint with these optimizer keys (after `model_optim.optimizer.`) holds
    its settings grouped per parameter: one saved before has `param_groups.<fqn>.lr`."""
    return not any(k.startswith(GROUPS) and k.endswith(".lr") for k in saved_keys)


def group_settings(settings: dict) -> dict:
    """DCP's flattened settings ({"param_groups.<fqn>.<setting>": value}) as one entry per
    parameter: {"param_groups.<fqn>": ((setting, value), ...)}. A tuple is one entry to DCP (a
    dict or list would be flattened again) and loads with torch.load(weights_only=True)."""
    per_param: dict[str, list] = {}
    for key, value in settings.items():
        fqn, setting = key[len(GROUPS) :].rsplit(".", 1)
        per_param.setdefault(GROUPS + fqn, []).append((setting, value))
    return {key: tuple(pairs) for key, pairs in per_param.items()}


def ungroup_settings(optim: dict) -> dict:
    """group_settings undone: the optimizer state dict in DCP's flattened form."""
    out = {}
    for key, value in optim.items():
        if key.startswith(GROUPS) and isinstance(value, tuple):
            out.update({f"{key}.{setting}": v for setting, v in value})
        else:
            out[key] = value
    return out


@contextlib.contextmanager
def settings_from_config(
    optimizer: torch.optim.Optimizer, changes: list[tuple[str, str, str]]
) -> Iterator[None]:
    """Load the optimizer's state inside; on leaving, the optimizer's param groups are the ones
    it had before (this run's config), and `changes` gets (config key, checkpoint's value, this
    run's value) for each setting that differed on this rank."""
    groups = optimizer.param_groups
    optimizer.param_groups = _nonempty(groups)
    try:
        yield
        for loaded, mine in zip(optimizer.param_groups, _nonempty(groups), strict=True):
            for change in _differences(loaded, mine):
                if change not in changes:
                    changes.append(change)
    finally:
        optimizer.param_groups = groups
    _steps_where_the_kernel_wants_them(optimizer)


def _nonempty(groups: list[dict]) -> list[dict]:
    return [g for g in groups if g["params"]]


def _differences(saved: dict, mine: dict) -> list[tuple[str, str, str]]:
    """The settings of a loaded param group that differ from this run's, as config keys."""
    out = []
    for key in mine:
        if key in NOT_SETTINGS or key not in saved or saved[key] == mine[key]:
            continue
        if key == "betas":
            out += [
                (f"beta{i + 1}", _text(a), _text(b))
                for i, (a, b) in enumerate(zip(saved[key], mine[key], strict=True))
                if a != b
            ]
        elif key in ("foreach", "fused"):
            out.append(("implementation", _kernel(saved), _kernel(mine)))
        elif key == "decoupled_weight_decay":
            out.append(
                ("name", "AdamW" if saved[key] else "Adam", "AdamW" if mine[key] else "Adam")
            )
        else:
            out.append(
                (
                    CONFIG_KEYS.get(key, f"(param group key {key!r})"),
                    _text(saved[key]),
                    _text(mine[key]),
                )
            )
    return out


def _kernel(group: dict) -> str:
    return "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"


def _text(value) -> str:
    if value is None:
        return "unset"
    return format(value, "g") if isinstance(value, float) else str(value)


def _steps_where_the_kernel_wants_them(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's step counts where this run's kernel keeps them: on the parameter's device in
    float32 for fused and capturable (as a fresh optimizer and torch's load policy put them),
    on the CPU otherwise. torch's load moves them by the checkpoint's flags, not this run's."""
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if not torch.is_tensor(step):
                continue
            local = p.to_local() if hasattr(p, "to_local") else p
            optimizer.state[p]["step"] = (
                step.to(device=local.device, dtype=torch.float32)
                if on_device
                else step.to(device="cpu")
            )


def changed_line(changes: list[tuple[str, str, str]]) -> str | None:
    """One line naming every setting that differs on any rank (collective: each rank sees only
    its own groups, e.g. a pipeline rank without Muon matrices sees no Muon setting); None if
    none does."""
    seen: list = [None] * dist.get_world_size() if dist.is_initialized() else [changes]
    if dist.is_initialized():
        dist.all_gather_object(seen, changes)
    union: list[tuple[str, str, str]] = []
    for rank_changes in seen:
        union += [c for c in rank_changes if c not in union]
    if not union:
        return None
    listed = ", ".join(f"optimizer.{key} {old} -> {new}" for key, old, new in union)
    return (
        f"optimizer settings changed at the resume: {listed} (this run's config applies; "
        "the optimizer state resumes as saved)"
    )


def optimizer_switched(saved, optimizer) -> bool:
    """The checkpoint (its DCP metadata's keys, `saved`) holds Muon's state (a momentum buffer)
    and `optimizer` is AdamW's (two moments), or the reverse."""
    was_muon = any(k.endswith(".momentum_buffer") for k in saved)
    return was_muon != (type(optimizer).__name__ == "Muon")


def check_fits(
    path: str, saved, model_optim: "ModelAndOptimizer", fingerprint, reset_optimizer: bool
) -> None:
    """Before a resume: a checkpoint of another model shape, another set of parameters, or
    another optimizer (without checkpoint.reset_optimizer) is a config error, not a DCP
    traceback."""
    for name, param in model_optim.model.named_parameters():
        meta = saved.get(f"model_optim.model.{name}")
        shape = tuple(meta.size) if meta is not None and hasattr(meta, "size") else None
        if shape != tuple(param.shape):
            raise ConfigError(
                f"checkpoint {path} does not fit this model: {name} has shape {shape} "
                f"there and {tuple(param.shape)} here; resume with the model.flavor, "
                "model.vocab_size and tokenizer it was saved with, or use another "
                "checkpoint.folder"
            )
    if not reset_optimizer and optimizer_switched(saved, model_optim.optimizer):
        now = type(model_optim.optimizer).__name__
        was = "Muon" if now != "Muon" else "AdamW or Adam"
        raise ConfigError(
            f"checkpoint {path} holds {was} state and this run's optimizer is "
            f"{now}; keep the optimizer.name it was saved with, or set "
            "checkpoint.reset_optimizer = true to resume the model with a fresh "
            "optimizer"
        )
    saved_print = integrity.saved_fingerprint(path)  # also catches parameters we lack
    if saved_print not in (None, fingerprint):
        raise ConfigError(
            f"checkpoint {path} does not fit this model: it holds another set "
            "of parameters (model fingerprint differs); resume with the "
            "model.flavor it was saved with, or use another checkpoint.folder"
        )
