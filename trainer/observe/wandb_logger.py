"""`[metrics] enable_wandb`: the run's scalars and effective config in a Weights & Biases run.

Off by default. It needs the wandb package (`pip install -e ".[wandb]"`); enabling it without
the package is one `config error:` line from the torch-free config check, before any process
starts. Only rank 0 imports wandb and opens a run; it gets every scalar TensorBoard gets
(`MetricsProcessor.log` and `log_scalars`), with TensorBoard on or off.

Names: `metrics.wandb_project`, `wandb_entity` and `wandb_run_name`, each '' = the usual
WANDB_PROJECT, WANDB_ENTITY and WANDB_NAME, else 'trainer', your default entity and the dump
folder's name; `job.description` becomes the run's notes. The other WANDB_* variables work as
wandb documents them (WANDB_MODE=offline or disabled, WANDB_API_KEY, WANDB_RESUME, ...). The
local run files go to `{WANDB_DIR, else job.dump_folder}/wandb/`.

One dump folder is one W&B run: the first launch writes the run id to
`{dump_folder}/wandb_run_id` (WANDB_RUN_ID overrides it), and every launch opens that id with
`resume="allow"`, so a resumed training run continues its W&B run.

Steps: W&B's own step (`_step`) only increases; `run.log(..., step=s)` below the run's last
step is dropped with nothing but a warning. A resume from a checkpoint older than the last
logged step (a crash at step 60 with the last checkpoint at 50, or `checkpoint.load_step`)
logs steps 51-60 again, and those must not vanish. So the trainer's step is logged as the
metric `step`, every metric is plotted against it (`define_metric("*", step_metric="step")`),
and `_step` merely counts the rows. After such a rollback steps 51-60 have two points each,
the lost launch's and the replay's, as in TensorBoard (which overlays a folder per launch).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import secrets
import string

from trainer.errors import PREEMPTED_EXIT_CODE, ConfigError

INSTALL_HINT = 'pip install -e ".[wandb]"'
RUN_ID_FILE = "wandb_run_id"
STEP_METRIC = "step"
DEFAULT_PROJECT = "trainer"
PROJECT_FORBIDDEN = "/\\#?%:"  # what wandb refuses in a project name, and at most 128 characters
PROJECT_MAX_LEN = 128


# --------------------------------------------------------------------------- config check


def check_config(metrics) -> None:
    """Torch-free, at the config check: a valid project name, and wandb installed if enabled."""
    check_project(metrics.wandb_project)
    if metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "metrics.enable_wandb = true needs the wandb package, which is not "
            f"installed: {INSTALL_HINT} (or pip install wandb)"
        )


def check_project(name: str) -> None:
    bad = sorted(set(name) & set(PROJECT_FORBIDDEN))
    if bad or len(name) > PROJECT_MAX_LEN:
        why = f"it has {' '.join(bad)}" if bad else f"it has {len(name)} characters"
        raise ConfigError(
            f"metrics.wandb_project = {name!r} is not a valid W&B project name "
            f"({why}); use at most {PROJECT_MAX_LEN} characters, none of "
            f"{' '.join(PROJECT_FORBIDDEN)}"
        )


# --------------------------------------------------------------------------- run identity


def run_id(dump_folder: str, env=os.environ) -> tuple[str, bool]:
    """(this dump folder's W&B run id, whether an earlier launch used it): WANDB_RUN_ID, else
    the id in `{dump_folder}/wandb_run_id`, else a new one."""
    saved = _read_id(os.path.join(dump_folder, RUN_ID_FILE))
    rid = env.get("WANDB_RUN_ID") or saved or _new_id()
    return rid, rid == saved


def save_run_id(dump_folder: str, rid: str) -> None:
    """Record the id of the run this dump folder's launches continue (atomically)."""
    path = os.path.join(dump_folder, RUN_ID_FILE)
    if _read_id(path) != rid:
        _write_id(path, rid)


def _new_id() -> str:
    alphabet = string.ascii_lowercase + string.digits  # as wandb's own generated ids
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _read_id(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip() or None
    except FileNotFoundError:
        return None


def _write_id(path: str, rid: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(rid + "\n")
    os.replace(tmp, path)


def init_kwargs(cfg, rid: str, env=os.environ) -> dict:
    """wandb.init's naming and placement: the config's names, else WANDB_*, else defaults."""
    m, dump = cfg.metrics, os.path.abspath(cfg.job.dump_folder)
    return {
        "project": m.wandb_project or env.get("WANDB_PROJECT") or DEFAULT_PROJECT,
        "entity": m.wandb_entity or env.get("WANDB_ENTITY") or None,
        "name": m.wandb_run_name or env.get("WANDB_NAME") or os.path.basename(dump),
        "notes": cfg.job.description or env.get("WANDB_NOTES") or None,
        "dir": env.get("WANDB_DIR") or dump,
        "id": rid,
        "resume": env.get("WANDB_RESUME") or "allow",
    }


def run_config(cfg, derived: dict) -> dict:
    """The effective config as the run config: a table per section (W&B shows `section.key`),
    plus the `derived` figures (FLOPs/token, peak, parameters, mesh...)."""
    return {**dataclasses.asdict(cfg), "derived": dict(derived)}


# --------------------------------------------------------------------------- the run


class WandbLogger:
    """Rank 0's W&B run: `write(step, scalars)` per log call, `close(exit_code)` at the end."""

    def __init__(self, cfg, derived: dict):
        wandb = _import_wandb()
        rid, self.continued = run_id(cfg.job.dump_folder)
        try:
            self.run = wandb.init(
                **init_kwargs(cfg, rid), config=run_config(cfg, derived), allow_val_change=True
            )  # a resume may change the config
            self.run.define_metric(STEP_METRIC)
            self.run.define_metric("*", step_metric=STEP_METRIC)
        except Exception as e:  # rank 0 alone: a user error, so every rank stops (train.py)
            raise ConfigError(
                f"metrics.enable_wandb = true, but wandb.init failed: "
                f"{type(e).__name__}: {e} (to log without a server: "
                "WANDB_MODE=offline)"
            ) from None
        save_run_id(cfg.job.dump_folder, rid)  # only an id that wandb accepted

    def describe(self) -> str:
        how = "continues this dump folder's run" if self.continued else "first in this dump folder"
        settings = self.run.settings
        return (
            f"wandb: {settings.mode} run {self.run.name!r}, id {self.run.id} ({how}), "
            f"project {self.run.project}; local files {settings.sync_dir}"
        )

    def write(self, step: int, values: dict[str, float]) -> None:
        """One history row: the values and the trainer's step as the `step` metric."""
        self.run.log({**values, STEP_METRIC: step})

    def close(self, exit_code: int = 0) -> None:
        """Finish the run with the trainer's exit code (0 = finished; a signalled stop, 3, is
        marked preempting first); idempotent."""
        run, self.run = self.run, None
        if run is None:
            return
        if exit_code == PREEMPTED_EXIT_CODE:
            run.mark_preempting()
        run.finish(exit_code=exit_code)
        # Stop this process's wandb service too: it flushes the run files now. The trainer
        # ends with os._exit (no atexit handlers), and a second run of the same id in one
        # process (a relaunch in tests) otherwise found its files not yet written.
        _import_wandb().teardown()


def _import_wandb():
    try:
        import wandb
    except ImportError as e:  # installed but broken (the config check saw the package)
        raise ConfigError(
            f"metrics.enable_wandb = true, but wandb cannot be imported ({e}): {INSTALL_HINT}"
        ) from None
    return wandb
