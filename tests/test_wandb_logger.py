"""`[metrics] enable_wandb` in one process: the config check, the names and run id, and a real
offline W&B run read back from its run files next to the TensorBoard events."""

from __future__ import annotations

import string
import sys

import pytest
import torch

from tests.helpers import scalars, wandb_launches, wandb_offline_env, wandb_or_skip, wandb_series
from trainer.config.__main__ import main as config_main
from trainer.config.job import JobConfig
from trainer.errors import ConfigError
from trainer.health.preemption import Preempted
from trainer.models.flavors import model_args
from trainer.observe.metrics import MetricsProcessor
from trainer.observe.wandb_logger import RUN_ID_FILE, init_kwargs, run_id, save_run_id

MISSING = (
    "config error: metrics.enable_wandb = true needs the wandb package, which is not "
    'installed: pip install -e ".[wandb]" (or pip install wandb)'
)


@pytest.fixture
def no_wandb(monkeypatch):
    """wandb as if not installed: find_spec gives None, `import wandb` fails."""
    monkeypatch.setitem(sys.modules, "wandb", None)


@pytest.fixture
def offline(monkeypatch, tmp_path_factory):
    """Offline W&B, quiet, without wrapping pytest's captured console."""
    wandb_or_skip()
    env = {
        **wandb_offline_env(tmp_path_factory.mktemp("wandb_home")),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
    }
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key)
        else:
            monkeypatch.setenv(key, value)
    import wandb

    # wandb keeps one service and its settings per process: a test that used wandb earlier in
    # this worker (e.g. reading run files) must not leave them to this one.
    wandb.teardown()
    yield
    wandb.teardown()


def config(tmp_path, **metrics) -> JobConfig:
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    for key, value in metrics.items():
        setattr(cfg.metrics, key, value)
    return cfg


def make(cfg: JobConfig, rank: int = 0) -> MetricsProcessor:
    args = model_args("debugmodel-tiny")
    mp = MetricsProcessor(
        cfg,
        model_args=args,
        seq_len=64,
        device=torch.device("cpu"),
        rank=rank,
        parallel_desc="1 process",
        accumulation_steps=1,
        num_params=args.num_params(),
    )
    mp.open()
    return mp


def log_steps(mp: MetricsProcessor, steps) -> None:
    for step in steps:
        mp.step_timer()
        mp.count_tokens(128)
        mp.log(
            step,
            global_avg_loss=10.0 - step,
            global_max_loss=11.0 - step,
            grad_norm=0.5,
            lr=1e-3,
            tokens_seen=128 * step,
        )
        mp.log_scalars(step, {"batch_metrics/global_batch_size": 2})


# --------------------------------------------------------------------------- config check


def test_missing_package_is_one_config_error_line(no_wandb, capsys):
    JobConfig().validate()  # off: no package needed
    cfg = JobConfig()
    cfg.metrics.enable_wandb = True
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert e.value.one_line() == MISSING
    assert config_main(["--check", "--metrics.enable_wandb", "true"]) == 2
    assert capsys.readouterr().err == MISSING + "\n"


def test_project_name_that_wandb_refuses_is_a_config_error():
    cfg = JobConfig()
    cfg.metrics.wandb_project = "team/llama"
    with pytest.raises(
        ConfigError,
        match=r"^metrics.wandb_project = 'team/llama' is not a "
        r"valid W&B project name \(it has /\); use at most "
        r"128 characters, none of / \\ # \? % :$",
    ):
        cfg.validate()
    cfg.metrics.wandb_project = "x" * 129
    with pytest.raises(ConfigError, match=r"\(it has 129 characters\)"):
        cfg.validate()


# --------------------------------------------------------------------------- names and run id


def test_names_come_from_the_config_then_the_environment_then_defaults(tmp_path):
    cfg = config(tmp_path / "llama_run")
    kw = init_kwargs(cfg, "abc", env={})
    assert kw == {
        "project": "trainer",
        "entity": None,
        "name": "llama_run",
        "notes": None,
        "dir": str(tmp_path / "llama_run"),
        "id": "abc",
        "resume": "allow",
    }
    env = {
        "WANDB_PROJECT": "p-env",
        "WANDB_ENTITY": "e-env",
        "WANDB_NAME": "n-env",
        "WANDB_DIR": "/scratch/wandb",
        "WANDB_RESUME": "must",
        "WANDB_NOTES": "env notes",
    }
    kw = init_kwargs(cfg, "abc", env=env)
    assert (kw["project"], kw["entity"], kw["name"], kw["dir"], kw["resume"], kw["notes"]) == (
        "p-env",
        "e-env",
        "n-env",
        "/scratch/wandb",
        "must",
        "env notes",
    )
    cfg.metrics.wandb_project, cfg.metrics.wandb_entity = "p-cfg", "e-cfg"
    cfg.metrics.wandb_run_name, cfg.job.description = "n-cfg", "what this run tries"
    kw = init_kwargs(cfg, "abc", env=env)
    assert (kw["project"], kw["entity"], kw["name"], kw["notes"]) == (
        "p-cfg",
        "e-cfg",
        "n-cfg",
        "what this run tries",
    )


def test_run_id_is_kept_in_the_dump_folder(tmp_path):
    dump = str(tmp_path / "new_dump")
    rid, continued = run_id(dump, env={})
    assert not continued and len(rid) == 8
    assert set(rid) <= set(string.ascii_lowercase + string.digits)
    save_run_id(dump, rid)
    assert (tmp_path / "new_dump" / RUN_ID_FILE).read_text() == rid + "\n"
    assert run_id(dump, env={}) == (rid, True)
    # WANDB_RUN_ID wins, and once a run was opened with it, later launches continue it.
    assert run_id(dump, env={"WANDB_RUN_ID": "mine"}) == ("mine", False)
    save_run_id(dump, "mine")
    assert run_id(dump, env={}) == ("mine", True)


def test_other_ranks_never_import_wandb(tmp_path, no_wandb):
    mp = make(config(tmp_path, enable_wandb=True), rank=1)
    log_steps(mp, [1])
    mp.close()
    assert mp.sinks == [] and not (tmp_path / RUN_ID_FILE).exists()


# --------------------------------------------------------------------------- a real offline run


def test_same_scalars_as_tensorboard_config_and_exit_code(tmp_path, offline, capsys):
    cfg = config(tmp_path, enable_wandb=True, peak_tflops=0.5)
    cfg.job.description = "unit test"
    with pytest.raises(Preempted):
        with make(cfg) as mp:
            mp.log_startup()
            log_steps(mp, [1, 2, 3])
            raise Preempted("stopped at step 3 on a signal")
    rid = (tmp_path / RUN_ID_FILE).read_text().strip()
    assert (
        f"wandb: offline run '{tmp_path.name}', id {rid} (first in this dump folder), "
        f"project trainer; local files {tmp_path}/wandb/offline-run-" in capsys.readouterr().out
    )
    (launch,) = wandb_launches(tmp_path / "wandb")
    assert launch["id"] == rid
    assert launch["exit_code"] == 3 and launch["preempting"]  # a signalled stop
    tags = {tag for row in launch["history"] for tag in row} - {"step"}
    assert "mfu(%)" in tags and "memory/max_rss(GiB)" in tags
    assert tags == {tag for tag in tags if scalars(tmp_path, tag)}  # each one in TensorBoard
    for tag in tags:
        assert wandb_series([launch], tag) == pytest.approx(scalars(tmp_path, tag), rel=1e-6)
    assert launch["config"]["metrics"]["peak_tflops"] == 0.5
    assert launch["config"]["model"]["flavor"] == "debugmodel"
    assert launch["config"]["derived"]["peak_tflops"] == 0.5


def test_wandb_alone_and_a_relaunch_continues_the_run_with_lower_steps_kept(tmp_path, offline):
    cfg = config(tmp_path, enable_wandb=True, enable_tensorboard=False)
    with make(cfg) as mp:
        log_steps(mp, [1, 2, 3])
    cfg.training.steps = 20  # a resumed launch may change the config
    with make(cfg) as mp:
        log_steps(mp, [2, 3, 4])  # a resume from the checkpoint of step 1: 2 and 3 again
    assert not (tmp_path / "tb").exists()
    first, second = wandb_launches(tmp_path / "wandb")
    assert first["id"] == second["id"] and (first["exit_code"], second["exit_code"]) == (0, 0)
    assert [row["step"] for row in second["history"] if "grad_norm" in row] == [2, 3, 4]
    assert second["config"]["training"]["steps"] == 20


def test_a_run_that_cannot_start_is_one_config_error(tmp_path, offline, monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ConfigError) as e:
        make(config(tmp_path, enable_wandb=True))
    assert e.value.one_line() == (
        "config error: metrics.enable_wandb = true, but wandb.init failed: UsageError: "
        "api_key not configured (no-tty) (to log without a server: WANDB_MODE=offline)"
    )
    # W&B opens first: no TensorBoard folder, and no run id that was never used.
    assert not (tmp_path / "tb").exists() and not (tmp_path / RUN_ID_FILE).exists()
