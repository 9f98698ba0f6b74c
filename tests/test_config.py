"""Config loading, overrides, validation messages and the saved effective config."""

import sys

import pytest
import torch

from trainer.config.job import JobConfig, load_config, parse_cli
from trainer.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 32\n")
    cfg = load_config(["--job.config_file", path, "--training.seq_len=64"])
    assert cfg.training.steps == 7  # TOML over default
    assert cfg.training.seq_len == 64  # CLI over TOML
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size  # default


def test_cli_forms_and_types():
    cfg = load_config(
        [
            "--checkpoint.enable",
            "--optimizer.lr",
            "1e-3",
            "--metrics.enable_tensorboard=false",
            "--data.dataset",
            "json",
            "--data.data_files",
            "a.jsonl,b.jsonl",
            "--optimizer.weight_decay=0",
        ]
    )
    assert cfg.checkpoint.enable is True
    assert cfg.optimizer.lr == 1e-3
    assert cfg.metrics.enable_tensorboard is False
    assert cfg.data.data_files == ["a.jsonl", "b.jsonl"]
    assert cfg.optimizer.weight_decay == 0.0 and isinstance(cfg.optimizer.weight_decay, float)
    assert parse_cli(["--a.b", "--c.d", "x"]) == {"a.b": None, "c.d": "x"}


@pytest.mark.parametrize(
    "args, toml, needle",
    [
        (
            ["--training.setps", "3"],
            None,
            "unknown key 'training.setps' (did you mean 'training.steps'?)",
        ),
        (["--trainig.steps", "3"], None, "did you mean 'training'?"),
        (["--training.steps", "many"], None, "training.steps must be an int, got 'many'"),
        (["--checkpoint.enable", "yes"], None, "checkpoint.enable must be true or false"),
        (
            ["--training.mixed_precision_param", "fp16"],
            None,
            "training.mixed_precision_param = 'fp16' is not valid; choose one of 'auto', "
            "'bfloat16', 'float32'",
        ),
        (["--training.steps", "0"], None, "training.steps = 0 is out of range; it must be >= 1"),
        (["--model.flavor", "8b"], None, "did you mean '8B'?"),
        (["--training.global_batch_size", "0"], None, "training.global_batch_size = 0"),
        (["oops"], None, "unexpected argument 'oops'"),
        ([], '[training]\nsteps = "ten"\n', "training.steps must be an int, got str 'ten'"),
        ([], "[training]\nstep = 3\n", "did you mean 'training.steps'?"),
        ([], "[traning]\nsteps = 3\n", "unknown section [traning] (did you mean 'training'?)"),
        ([], "[training]\nsteps = 3\nseq_len = \n", "TOML syntax error"),
        ([], "[training]\nsteps = 3\nseq_len = \n", "line 3"),
        (
            [],
            "[training]\nlocal_batch_size = true\n",
            "training.local_batch_size must be an int, got bool",
        ),
        (
            ["--model.sdpa_backends", "cudnn,fash"],
            None,
            "model.sdpa_backends = 'cudnn,fash': 'fash' is not a backend; use 'auto' or a "
            "comma-separated order of cudnn, flash, efficient, math",
        ),
        (["--model.sdpa_backends", "math,flash,math"], None, "names a backend twice"),
        (
            ["--model.flavor", "debugmodel-narrow", "--model.n_layers", "7"],
            None,
            "model.n_layers = 7 is above the 6 blocks of model.flavor 'debugmodel-narrow'; valid: "
            "1 to 6, or 0 for all of them",
        ),
        (
            ["--model.flavor", "debugmodel-moe-narrow", "--model.n_layers", "1"],
            None,
            "model.n_layers = 1 keeps only dense blocks of model.flavor 'debugmodel-moe-narrow', "
            "whose first MoE block is block 1; valid: 2 to 4, or 0 for all",
        ),
        (["--job.dump_folder", ""], None, "job.dump_folder = '' names no folder; name one"),
        ([], '[job]\ndump_folder = "  "\n', "job.dump_folder = '  ' names no folder"),
        (
            ["--checkpoint.folder", "s3://"],
            None,
            "checkpoint.folder = 's3://' names no bucket; use s3://bucket/prefix",
        ),
        (
            ["--checkpoint.initial_load_path", "gs:///step-3"],
            None,
            "checkpoint.initial_load_path = 'gs:///step-3' names no bucket",
        ),
        (["--checkpoint.store_lease", "off"], None, "choose one of 'required', 'unchecked'"),
        (
            ["--compile.mode", "reduce-overhead"],
            None,  # CUDA graphs: FSDP re-allocates the params
            "compile.mode = 'reduce-overhead' is not valid; choose one of 'default', "
            "'max-autotune-no-cudagraphs'",
        ),
    ],
)
def test_errors_name_the_key(tmp_path, args, toml, needle):
    if toml is not None:
        args = ["--job.config_file", write(tmp_path, toml), *args]
    with pytest.raises(ConfigError) as e:
        load_config(args)
    assert needle in e.value.one_line()
    assert "\n" not in e.value.one_line() and e.value.one_line().startswith("config error: ")


def test_missing_config_file():
    with pytest.raises(ConfigError, match="no such file"):
        load_config(["--job.config_file", "/nonexistent/x.toml"])


@pytest.mark.parametrize(
    "world, overrides, needle",
    [
        (
            2,
            ["--parallelism.data_parallel_shard_degree", "4"],
            "multiply to 4, but the world size is 2",
        ),
        (4, ["--parallelism.data_parallel_replicate_degree", "3"], "world size 4"),
        (
            2,
            ["--training.local_batch_size", "3", "--training.global_batch_size", "8"],
            "training.global_batch_size = 8 is not divisible by training.local_batch_size (3) * "
            "dp size (2) = 6",
        ),
    ],
)
def test_world_size_dependent_errors(world, overrides, needle):
    cfg = load_config(overrides)
    with pytest.raises(ConfigError) as e:
        cfg.validate(world)
    assert needle in str(e.value)


def test_n_layers_keeps_the_flavors_first_blocks_in_every_model_a_config_builds():
    """model.n_layers reaches each place a run's model is built from its config: the trained
    model (attention_args), the plan's, and the pipeline's split (refused where it has fewer
    blocks than stages)."""
    from trainer.models.build import build_model
    from trainer.models.common.attention import attention_args
    from trainer.models.flavors import model_args
    from trainer.plan.planned import plan_args

    cfg = load_config(["--model.flavor", "debugmodel-moe-narrow", "--model.n_layers", "2"])
    args = model_args(
        cfg.model.flavor, vocab_size=64, max_seq_len=16, **attention_args(cfg.model, "cpu")
    )
    assert (args.n_layers, args.moe_layer_ids) == (2, [1])
    assert plan_args(cfg, 64).n_layers == 2
    with torch.device("meta"):
        model = build_model(args)
    assert sorted(model.layers.keys()) == ["0", "1"]
    pp = [
        "--model.flavor",
        "debugmodel-narrow",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "Interleaved1F1B",
    ]
    load_config([*pp, "--model.n_layers", "2"]).validate(2)  # 4 units: 2 blocks, embedding, head
    with pytest.raises(ConfigError, match=r"only 3 units to place \(1 layers"):
        load_config([*pp, "--model.n_layers", "1"]).validate(2)


def test_moe_losses_are_refused_under_pp_before_any_process_group():
    with pytest.raises(ConfigError) as e:
        load_config(
            [
                "--model.flavor",
                "debugmodel-moe",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--moe.seq_aux_loss_weight",
                "1e-4",
            ]
        )
    assert (
        "moe.seq_aux_loss_weight = 0.0001, but moe.aux_loss_weight, moe.seq_aux_loss_weight "
        "and moe.router_z_loss_weight are losses of every stage" in str(e.value)
    )


def test_effective_config_round_trips(tmp_path):
    cfg = load_config(
        [
            "--training.steps",
            "5",
            "--job.description",
            'a "quoted" \\ text,\nanother line, a tab\t and a bell\x07',
            "--data.dataset",
            "json",
            "--data.data_files",
            "x.json",
        ]
    )
    path = tmp_path / "out" / "config.toml"
    cfg.save(str(path))
    data = tomllib.loads(path.read_text())
    again = load_config(["--job.config_file", str(path)])
    assert again.job.config_file == str(path)
    again.job.config_file = cfg.job.config_file
    assert again == cfg
    assert data["training"]["steps"] == 5


def test_shipped_configs_are_valid():
    from tests.helpers import REPO

    for path in sorted((REPO / "configs").glob("*.toml")):
        cfg = load_config(["--job.config_file", str(path)])
        # the 405B layout, PP 8 x TP 8 x FSDP 8, and DeepSeek-V3 / Kimi K2 (EP 64) need 512 ranks
        cfg.validate(
            {
                "debug_model.toml": 2,
                "llama3_405b.toml": 512,
                "deepseek_v3_671b.toml": 512,
                "kimi_k2.toml": 512,
            }.get(path.name, 8)
        )


def test_check_shows_the_checkpointing_for_the_slurm_script(capsys, tmp_path):
    """`--check --show-checkpointing` (scripts/multinode_trainer.slurm reads its three lines):
    the ranks per node, then the effective checkpoint.enable and dump folder; without the flag
    only the ranks."""
    from trainer.config.__main__ import main

    dump = str(tmp_path / "a folder")
    base = [
        "--check",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--training.device",
        "cpu",
        "--job.dump_folder",
        dump,
    ]
    assert main([*base, "--show-checkpointing", "--checkpoint.enable", "false"]) == 0
    assert capsys.readouterr().out == f"2\nFalse\n{dump}\n"
    assert main([*base, "--show-checkpointing", "--checkpoint.enable", "true"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["True", dump]
    assert main(base) == 0
    assert capsys.readouterr().out == "2\n"


def test_the_ranks_configs_are_compared_and_a_difference_named(monkeypatch):
    """check_same_config as rank 0 sees a 2-rank gather: rank 1 launched with another
    seq_len, or by a trainer version with a key this one lacks (was a KeyError traceback)."""
    import trainer.distributed as d

    cfg = load_config([])

    def as_rank0(rank1: dict):
        calls = []

        def gather(out, obj):
            calls.append(obj)
            out[:] = [obj, "another digest" if isinstance(obj, str) else rank1]

        monkeypatch.setattr(d.dist, "get_world_size", lambda *a: 2)
        monkeypatch.setattr(d.dist, "all_gather_object", gather)
        with pytest.raises(ConfigError) as e:
            d.check_same_config(cfg)
        assert e.value.agreed and len(calls) == 2
        return e.value.one_line()

    theirs = {
        k: v
        for k, v in load_config(["--training.seq_len", "64"]).flat().items()
        if k not in d.LOCAL_KEYS
    }
    assert as_rank0(theirs) == (
        f"config error: the ranks run different configs: rank 1 has training.seq_len = 64 "
        f"where rank 0 has {cfg.training.seq_len}; launch every node with the same config "
        "file and overrides"
    )
    newer = {**{k: v for k, v in cfg.flat().items() if k not in d.LOCAL_KEYS}, "a.new_key": "1"}
    assert "rank 1 has a.new_key = 1 where rank 0 has (no such key)" in as_rank0(newer)
    monkeypatch.setattr(
        d.dist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [obj, obj])
    )
    d.check_same_config(cfg)  # the same everywhere: nothing
