"""gpt-oss trained by this trainer through run_train.sh (configs/debug_gpt_oss.toml, fp32,
block_causal on short documents, 5 steps; docs/gpt_oss.md).

EP 2 x FSDP 2, TP 2 x FSDP 2, EP 2 x TP 2, PP 2 x FSDP 2 and CP 2 x FSDP 2 give the 1-rank
losses, gradient norms and weights, with AdamW and (EP 2 x TP 2) with Muon; the EP run's step-3
checkpoint resumes under TP 2 on 2 ranks with the 1-rank steps 4 and 5; its export
(checkpoint.last_save_in_hf) loads in transformers as GptOssForCausalLM with the checkpoint's
logits and imports back bit for bit; QK-clip holds the largest logit near tau.
"""

import json
import math

import pytest
import torch

from tests.data_fixtures import stdlib_texts, tokenizer_path  # noqa: F401
from tests.helpers import REPO, run_train, scalars, stopped_after_save
from tests.test_doc_mask_e2e import short_docs_store  # noqa: F401
from trainer.models.build import build_model
from trainer.models.flavors import model_args

CONFIG = str(REPO / "configs" / "debug_gpt_oss.toml")
FLAVOR = "debugmodel-gpt-oss"

COMMON = (
    "--training.seq_len",
    "64",  # 4 windows of 16 in the sliding layers
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "8",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--lr_scheduler.min_lr_factor",
    "1.0",
    "--training.steps",
    "5",
    "--checkpoint.interval",
    "5",
    "--checkpoint.keep_latest_k",
    "0",
    "--validation.enable",
    "false",
    # the release routes by its scores alone: an exact export needs no balancing bias
    "--moe.load_balance_coeff",
    "0",
)
EP, TP = "--parallelism.expert_parallel_degree", "--parallelism.tensor_parallel_degree"
# Newton-Schulz in fp32: in bf16 the layouts' fp32 gradients, equal to rounding, round to
# different bf16 values, and the updates differ by a bf16 step
MUON = ("--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32")
LAYOUTS = {  # name: (ranks, overrides)
    "ref": (1, (EP, "1")),
    "ep2_fsdp2": (
        4,
        (EP, "2", "--checkpoint.last_save_in_hf", "true", "--checkpoint.interval", "3"),
    ),
    "tp2_fsdp2": (4, (EP, "1", TP, "2")),
    "ep2_tp2": (4, (EP, "2", TP, "2")),
    "pp2_fsdp2": (4, (EP, "1", "--parallelism.pipeline_parallel_degree", "2")),
    "cp2_fsdp2": (4, (EP, "1", "--parallelism.context_parallel_degree", "2")),
    "muon_ref": (1, (EP, "1", *MUON)),
    "muon_ep2_tp2": (4, (EP, "2", TP, "2", *MUON)),
}
TAGS = ("loss_metrics/global_avg_loss", "grad_norm")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, short_docs_store):  # noqa: F811
    """Every layout on short documents (several per 64-token window, so windows and
    documents both cut the attention)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    data = ("--data.dataset", "json", "--data.store_path", short_docs_store)
    out = {}
    for name, (nproc, overrides) in LAYOUTS.items():
        env = {"OMP_NUM_THREADS": "1"} if nproc == 1 else None
        proc = run_train(
            root / name, *COMMON, *data, *overrides, nproc=nproc, config=CONFIG, env=env
        )
        out[name] = (root / name, proc.stdout)
    return out


def _checkpoint_state(dump):
    from trainer.convert import dcp_fetch, saved_shapes

    ckpt = str(dump / "checkpoint" / "step-5")
    shapes = saved_shapes(ckpt)
    return dcp_fetch(ckpt, shapes)(list(shapes))


def _same(ref, got, steps=(1, 2, 3, 4, 5)):
    for tag in TAGS:
        want, have = scalars(ref, tag), scalars(got, tag)
        assert sorted(have) == list(steps), (tag, have)
        assert all(abs(have[s] - want[s]) <= 1e-4 * max(1.0, abs(want[s])) for s in have), (
            tag,
            have,
            want,
        )


@pytest.mark.needs_datasets
@pytest.mark.parametrize(
    "name, ref",
    [
        ("ep2_fsdp2", "ref"),
        ("tp2_fsdp2", "ref"),
        ("ep2_tp2", "ref"),
        ("pp2_fsdp2", "ref"),
        ("cp2_fsdp2", "ref"),
        ("muon_ep2_tp2", "muon_ref"),
    ],
)
def test_each_layout_trains_as_one_rank(runs, name, ref):
    """The losses and gradient norms of 5 steps, and the weights after them."""
    _same(runs[ref][0], runs[name][0])
    want, have = _checkpoint_state(runs[ref][0]), _checkpoint_state(runs[name][0])
    worst = max(((have[n] - t).abs().max().item(), n) for n, t in want.items())
    print(name, "largest weight difference", worst)
    assert worst[0] < 1e-4, worst
    losses = scalars(runs[ref][0], TAGS[0])
    assert losses[5] < losses[1]
    assert "attention: GQA with a sink logit per head" in runs[name][1]


@pytest.mark.needs_datasets
def test_an_ep_checkpoint_resumes_under_tp_on_two_ranks(runs, short_docs_store, tmp_path):  # noqa: F811
    dump = stopped_after_save(runs["ep2_fsdp2"][0], tmp_path / "resumed", 5)
    out = run_train(
        dump,
        *COMMON,
        *("--data.dataset", "json", "--data.store_path", short_docs_store),
        *(EP, "1", TP, "2"),
        nproc=2,
        config=CONFIG,
    ).stdout
    assert "resumed from" in out and "step-3" in out
    _same(runs["ref"][0], dump, steps=(4, 5))


@pytest.mark.needs_datasets
def test_the_export_loads_in_transformers_with_our_logits(runs):
    from transformers import AutoModelForCausalLM

    dump = runs["ep2_fsdp2"][0]
    config = json.loads((dump / "hf" / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert "quantization_config" not in config
    theirs = AutoModelForCausalLM.from_pretrained(dump / "hf", dtype=torch.float32).eval()
    state = _checkpoint_state(dump)
    ours = _model(state)
    tokens = torch.randint(0, ours.args.vocab_size, (2, 64), generator=torch.Generator())
    with torch.no_grad():
        assert (theirs(tokens).logits - ours(tokens)).abs().max() < 1e-4
    assert "the experts are written unquantized" in runs["ep2_fsdp2"][1]


@pytest.mark.needs_datasets
def test_the_export_imports_back_bit_for_bit(runs):
    from trainer.hf.load import load_hf

    dump = runs["ep2_fsdp2"][0]
    state = _checkpoint_state(dump)
    model = _model(state)
    model.init_weights(1)  # not the run's: every tensor must come from the folder
    load_hf(model, str(dump / "hf"), flavor=FLAVOR, log=lambda line: None)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def _model(state):
    """The runs' model with the checkpoint's weights."""
    vocab = state["tok_embeddings.weight"].shape[0]  # the short documents' tokenizer's
    args = model_args(FLAVOR, vocab_size=vocab, max_seq_len=64)
    model = build_model(args).to_empty(device="cpu")
    model.init_weights(0)
    model.load_state_dict(state, strict=True)
    return model.eval()


def test_qk_clip_holds_the_largest_logit(tmp_path):
    """Muon with QK-clip: the layers record their maxima (windows and documents masked) and
    clip the query rows and their biases, so after the first step's clip the largest logit
    stays near tau (a step's update may push it past before the clip brings it back)."""
    tau = 0.06  # below the debug model's first logits (~0.13)
    run_train(
        tmp_path,
        *(*MUON, "--optimizer.muon_qk_clip", str(tau)),
        *("--training.steps", "12", "--metrics.log_freq", "1", "--checkpoint.enable", "false"),
        *(EP, "1", "--training.seq_len", "64"),
        config=CONFIG,
        nproc=1,
    )
    peak = scalars(tmp_path, "qk_clip/max_logit")
    clipped = scalars(tmp_path, "qk_clip/heads_clipped")
    assert sorted(peak) == list(range(1, 13)) and peak[1] > 1.5 * tau, peak
    assert all(v <= 2 * tau for s, v in peak.items() if s > 1), peak
    assert clipped[1] > 0 and sum(clipped.values()) > clipped[1], clipped
    losses = scalars(tmp_path, "loss_metrics/global_avg_loss")
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses.values()), losses


def test_a_flavor_of_another_family_is_one_line(tmp_path):
    proc = run_train(tmp_path, "--model.name", "llama3", config=CONFIG, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("config error: model.flavor = 'debugmodel-gpt-oss' is a gpt_oss model")


def test_an_mxfp4_release_loads_into_each_rank_as_into_one(tmp_path):
    """An MXFP4 folder (tests/test_gpt_oss.py's quantizer) as checkpoint.initial_load_path:
    on EP 2 x FSDP 2 (each rank reading and dequantizing only its experts) and on TP 2 the
    first steps' losses are the 1-rank run's from the same folder."""
    from tests.test_gpt_oss import _ours, _write_folder

    model = _ours(vocab=1024)
    _write_folder(tmp_path / "release", model, mxfp4=True)
    load = (
        *("--checkpoint.initial_load_path", str(tmp_path / "release")),
        *("--checkpoint.initial_load_in_hf", "true", "--checkpoint.enable", "false"),
        *("--data.dataset", "synthetic", "--data.vocab_size", "1024", "--training.steps", "2"),
        *("--model.attn_mask_type", "causal"),
    )
    got = {}
    for name, nproc, layout in [
        ("one", 1, (EP, "1")),
        ("ep2_fsdp2", 4, (EP, "2")),
        ("tp2", 2, (EP, "1", TP, "2")),
    ]:
        env = {"OMP_NUM_THREADS": "1"} if nproc == 1 else None
        out = run_train(
            tmp_path / name, *COMMON, *load, *layout, nproc=nproc, config=CONFIG, env=env
        ).stdout
        assert "holds its experts in MXFP4" in out, out[-2000:]
        got[name] = scalars(tmp_path / name, TAGS[0])
    for name in ("ep2_fsdp2", "tp2"):
        assert all(abs(got[name][s] - got["one"][s]) < 1e-4 for s in (1, 2)), got
