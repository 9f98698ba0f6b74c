"""Qwen3-Next trained by this trainer (docs/qwen3_next.md).

In one process: each flavor's parameter count equals its built model's; a packed window's
loss per document equals each document's alone (the DeltaNet's state and convolution restart,
the full-attention layers masked); a run's export imports back into a plain model bit for bit.
Through run_train.sh (configs/debug_qwen3_next.toml, fp32, block_causal on the stdlib corpus,
5 steps, one MTP module): EP 2 x FSDP 2, TP 2 x FSDP 2, PP 2 x FSDP 2, CP 2 x FSDP 2 and TP 2 x
CP 2 give the 1-rank losses, MTP losses and gradient norms; the EP run's export
(checkpoint.last_save_in_hf, its mtp.* tensors included) loads in transformers as
Qwen3NextForCausalLM with the checkpoint's logits and imports back bit for bit, and its step-3
checkpoint resumes at CP 2 on 2 ranks with the 1-rank steps 4 and 5; a flavor of another family
is one line.
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

CONFIG = str(REPO / "configs" / "debug_qwen3_next.toml")
FLAVOR = "debugmodel-qwen3-next"


@pytest.mark.parametrize("mtp", [0, 1])
@pytest.mark.parametrize(
    "flavor", ["debugmodel-qwen3-next", "qwen3-next-80b-a3b", "qwen3.5-35b-a3b"]
)
def test_the_parameter_count_is_the_models(flavor, mtp):
    args = model_args(flavor, mtp_layers=mtp)
    model = build_model(args)
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    if flavor == "qwen3-next-80b-a3b" and not mtp:  # the release: 80B total
        assert 79e9 < args.num_params() < 81e9


def _model(vocab_size=None, **attention):
    torch.manual_seed(0)
    args = model_args(FLAVOR, vocab_size=vocab_size, max_seq_len=160, **attention)
    model = build_model(args).to_empty(device="cpu")
    model.init_weights(0)
    return model.eval()


def test_packed_documents_give_each_documents_own_loss():
    """Three documents (lengths 70, 1, 89: a chunk boundary inside the first and the third)
    packed in one 160-token window: the per-token loss of each equals its loss alone."""
    model = _model(attn_mask_type="block_causal", attn_implementation="per_document")
    lengths = (70, 1, 89)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 8192, (1, sum(lengths) + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = torch.nn.functional.cross_entropy(
            model(inputs, doc_ids=doc_ids)[0], labels[0], reduction="none"
        )
        start = 0
        for n in lengths:
            piece = slice(start, start + n)
            alone = model(inputs[:, piece], doc_ids=torch.zeros(1, n, dtype=torch.long))
            own = torch.nn.functional.cross_entropy(alone[0], labels[0, piece], reduction="none")
            assert (packed[piece] - own).abs().max() < 1e-6, (n, (packed[piece] - own).abs())
            start += n
    causal = _model()  # without documents the later ones see the earlier: not the same
    with torch.no_grad():
        mixed = causal(inputs)[0, 71:]
        alone = causal(inputs[:, 71:])[0]
    assert (mixed - alone).abs().max() > 1e-3


# ------------------------------------------------------------------------------ end to end

# the debug hybrid's first 2 blocks: a Gated DeltaNet and a gated-attention block (and the MTP
# module's), each layout's code paths once, at half the blocks to run, gather and save
COMMON = (
    "--model.n_layers",
    "2",
    "--training.seq_len",
    "64",
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
    # one save at the last step (the weights compared); the EP run also saves step 3
    "--checkpoint.interval",
    "5",
    "--checkpoint.keep_latest_k",
    "0",
    "--validation.enable",
    "false",
    "--model.mtp_layers",
    "1",
    # the release routes by its scores alone: an exact export needs no balancing bias
    "--moe.load_balance_coeff",
    "0",
)
EP = "--parallelism.expert_parallel_degree"
LAYOUTS = {  # name: (ranks, overrides); the config's EP 2 is set per layout
    "ref": (1, (EP, "1")),
    "ep2_fsdp2": (
        4,
        (EP, "2", "--checkpoint.last_save_in_hf", "true", "--checkpoint.interval", "3"),
    ),  # step 3: resumed under CP
    "tp2_fsdp2": (4, (EP, "1", "--parallelism.tensor_parallel_degree", "2")),
    "pp2_fsdp2": (4, (EP, "1", "--parallelism.pipeline_parallel_degree", "2")),
    "cp2_fsdp2": (4, (EP, "1", "--parallelism.context_parallel_degree", "2")),
    "tp2_cp2": (
        4,
        (
            EP,
            "1",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.context_parallel_degree",
            "2",
        ),
    ),
}
TAGS = ("loss_metrics/global_avg_loss", "grad_norm", "loss_metrics/mtp_loss")
# Under CP the DeltaNet composes its pieces' state transitions (SplitDeltaNet): the same
# function (equal to 1e-17 in float64), but the fp32 gradients of the decay's parameters
# (A_log, dt_bias, its input projection wa) differ from one rank's by ~5e-4 relative (the
# transitions' exp(cumulative decay) products), so after 5 AdamW steps those weights agree
# to 1e-3, the rest to 1e-4.
DECAY = ("linear_attention.A_log", "linear_attention.dt_bias", "linear_attention.wa.weight")
CP = ("cp2_fsdp2", "tp2_cp2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, short_docs_store):  # noqa: F811
    """Every layout on short documents (several per 64-token window: the DeltaNet restarts
    inside windows and across chunk and rank boundaries)."""
    root = tmp_path_factory.mktemp("qwen3_next")
    data = ("--data.dataset", "json", "--data.store_path", short_docs_store)
    out = {}
    for name, (nproc, overrides) in LAYOUTS.items():
        env = {"OMP_NUM_THREADS": "1"} if nproc == 1 else None
        proc = run_train(
            root / name, *COMMON, *data, *overrides, nproc=nproc, config=CONFIG, env=env
        )
        out[name] = (root / name, proc.stdout)
    return out


@pytest.mark.needs_datasets
@pytest.mark.parametrize("name", ["ep2_fsdp2", "tp2_fsdp2", "pp2_fsdp2", "cp2_fsdp2", "tp2_cp2"])
def test_each_layout_trains_as_one_rank(runs, name):
    """The losses and gradient norms of 5 steps, and the weights after them."""
    ref, got = runs["ref"][0], runs[name][0]
    for tag in TAGS:
        want, have = scalars(ref, tag), scalars(got, tag)
        assert sorted(have) == [1, 2, 3, 4, 5], (tag, have)
        assert all(abs(have[s] - want[s]) <= 1e-4 * max(1.0, abs(want[s])) for s in want), (
            tag,
            have,
            want,
        )
    want, have = _checkpoint_state(ref), _checkpoint_state(got)
    worst = max(
        ((have[n] - t).abs().max().item(), n)
        for n, t in want.items()
        if not (name in CP and n.endswith(DECAY))
    )
    print(name, "largest weight difference", worst)
    assert worst[0] < 1e-4, worst
    if name in CP:  # the decay's gradients by the composed pieces: fp32 rounding
        decay = max((have[n] - t).abs().max().item() for n, t in want.items() if n.endswith(DECAY))
        print(name, "largest decay-parameter difference", decay)
        assert decay < 1e-3
    assert scalars(ref, TAGS[0])[5] < scalars(ref, TAGS[0])[1]
    assert "Gated DeltaNet: torch chunked gated delta rule" in runs[name][1]


@pytest.mark.needs_datasets
def test_an_ep_checkpoint_resumes_under_cp_on_two_ranks(runs, short_docs_store, tmp_path):  # noqa: F811
    """EP 2 x FSDP 2's step-3 checkpoint, resumed at CP 2 on 2 ranks, gives the 1-rank
    steps 4 and 5."""
    dump = stopped_after_save(runs["ep2_fsdp2"][0], tmp_path / "resumed", 5)
    out = run_train(
        dump,
        *COMMON,
        "--data.dataset",
        "json",
        "--data.store_path",
        short_docs_store,
        EP,
        "1",
        "--parallelism.context_parallel_degree",
        "2",
        nproc=2,
        config=CONFIG,
    ).stdout
    assert "resumed from" in out and "step-3" in out
    for tag in TAGS:
        want, have = scalars(runs["ref"][0], tag), scalars(dump, tag)
        assert sorted(have) == [4, 5], (tag, have)
        assert all(abs(have[s] - want[s]) <= 1e-4 * max(1.0, abs(want[s])) for s in have), (
            tag,
            have,
            want,
        )


def _checkpoint_state(dump):
    from trainer.convert import dcp_fetch, saved_shapes

    ckpt = str(dump / "checkpoint" / "step-5")
    shapes = saved_shapes(ckpt)
    return dcp_fetch(ckpt, shapes)(list(shapes))


@pytest.mark.needs_datasets
def test_the_export_loads_in_transformers_with_our_logits(runs):
    from transformers import AutoModelForCausalLM

    dump = runs["ep2_fsdp2"][0]
    config = json.loads((dump / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    assert config["layer_types"] == ["linear_attention", "full_attention"]
    assert config["num_nextn_predict_layers"] == 1
    theirs = AutoModelForCausalLM.from_pretrained(dump / "hf", dtype=torch.float32).eval()
    state = _checkpoint_state(dump)
    vocab = state["tok_embeddings.weight"].shape[0]  # the short documents' tokenizer's
    ours = _model(vocab, mtp_layers=1, n_layers=2)  # the runs' model: 2 blocks, one MTP module
    ours.load_state_dict(state, strict=True)
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours(tokens)).abs().max() < 1e-4


@pytest.mark.needs_datasets
def test_the_export_imports_back_bit_for_bit(runs):
    from safetensors import safe_open

    from trainer.hf.load import load_hf

    dump = runs["ep2_fsdp2"][0]
    state = _checkpoint_state(dump)
    with safe_open(str(dump / "hf" / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("mtp.fc.weight"), state["mtp.0.proj.weight"])
        assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in f.keys()
    model = _model(state["tok_embeddings.weight"].shape[0], mtp_layers=1, n_layers=2)
    model.init_weights(1)  # not the run's: every tensor must come from the folder
    load_hf(model, str(dump / "hf"), flavor=FLAVOR)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert any(n.startswith("mtp.0.block.") for n in model.state_dict())


def test_a_flavor_of_another_family_is_one_line(tmp_path):
    proc = run_train(tmp_path, "--model.name", "llama3", config=CONFIG, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith(
        "config error: model.flavor = 'debugmodel-qwen3-next' is a qwen3_next model"
    ), last


def test_qk_clip_holds_the_largest_logit_over_twenty_steps(tmp_path):
    """Muon with QK-clip on the hybrid: its gated attention records the maxima and clips through
    the zero-centred q/k norms, so after the first step's clip the largest logit stays near tau
    (each step's update may push it a little past before the clip brings it back)."""
    tau = 0.5
    run_train(
        tmp_path,
        *("--optimizer.name", "Muon", "--optimizer.muon_qk_clip", str(tau)),
        *("--training.steps", "20", "--metrics.log_freq", "1", "--checkpoint.enable", "false"),
        *("--parallelism.expert_parallel_degree", "1"),
        config=CONFIG,
        nproc=1,
    )
    peak, clipped = (
        scalars(tmp_path, "qk_clip/max_logit"),
        scalars(tmp_path, "qk_clip/heads_clipped"),
    )
    assert sorted(peak) == list(range(1, 21)) and peak[1] > 2 * tau, peak
    assert all(v <= 1.2 * tau for s, v in peak.items() if s > 1), peak
    assert clipped[1] > 0 and sum(clipped.values()) > clipped[1], clipped
    losses = scalars(tmp_path, "loss_metrics/global_avg_loss")
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses.values()), losses
