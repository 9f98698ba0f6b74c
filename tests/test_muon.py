"""Muon (trainer/optim/muon.py): torch.optim.Muon's math on one rank, exact on every layout,
resumable across layouts, and Newton-Schulz on whole matrices, never on a shard.

One process: the trainer's optimizer against torch.optim.Muon (the blocks' matrices) and
torch.optim.AdamW (the rest) on the same model and batches, bitwise. Through run_train.sh, fp32
with Newton-Schulz in fp32, 5 steps: TP 2 x FSDP 2, PP 2 x FSDP 2, PP 4 with 8 one-unit stages
(a rank without a block matrix), CP 2 x FSDP 2, HSDP 2 x 2
(dense, debugmodel-narrow) and EP 2 x FSDP 2 (debugmodel-moe-narrow) equal one rank's losses
and grad norms within 1e-4; the TP 2 x FSDP 2 checkpoint of step 3 resumes at FSDP 4 and on
one rank. tests/scripts/muon_probe.py: at TP 2 the update of wq equals the one-rank update and
is far from a per-shard orthogonalization.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import REPO, SYNTHETIC, run_train, scalars, stopped_after_save, torchrun
from trainer.config.job import load_config
from trainer.errors import ConfigError
from trainer.models.build import new_model
from trainer.models.flavors import model_args
from trainer.optim.muon import takes_muon
from trainer.optim.optimizer import build_optimizer
from trainer.parallel.pipeline import _SAME_RANK_STAGES, _SPLIT_BACKWARD_THROUGH_FUNCTIONS

MUON = ("--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32")


def test_one_rank_equals_torch_muon_and_adamw():
    """10 steps, fp32 weights, Newton-Schulz in bf16 (torch's): bitwise the same weights."""
    torch.manual_seed(0)
    a = model_args("debugmodel-narrow", vocab_size=256, max_seq_len=32)
    model = new_model(a)
    model.init_weights(seed=0)
    ref = copy.deepcopy(model)
    o = load_config(
        ["--optimizer.name", "Muon", "--optimizer.implementation", "for-loop"]
    ).optimizer
    opt = build_optimizer(model, o)
    names = dict(ref.named_parameters())
    muon = [p for n, p in names.items() if takes_muon(n, p)]
    rest = [p for n, p in names.items() if not takes_muon(n, p)]
    assert {n for n, p in names.items() if takes_muon(n, p)} == {
        n for n in names if n.startswith("layers.") and names[n].ndim == 2
    }
    assert "tok_embeddings.weight" not in {n for n, p in names.items() if takes_muon(n, p)}
    refs = [
        torch.optim.Muon(
            muon,
            lr=o.lr,
            weight_decay=o.weight_decay,
            momentum=0.95,
            nesterov=True,
            adjust_lr_fn="match_rms_adamw",
        ),
        torch.optim.AdamW(
            rest,
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            foreach=False,
        ),
    ]
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        t = torch.randint(0, 256, (2, 33), generator=gen)
        for m, opts in ((model, [opt]), (ref, refs)):
            F.cross_entropy(m(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten()).backward()
            for x in opts:
                x.step()
                x.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n
    state = opt.state_dict()["state"]
    assert sum("momentum_buffer" in s for s in state.values()) == len(muon)
    assert sum("exp_avg" in s for s in state.values()) == len(rest)


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--optimizer.muon_momentum", "0.9"],
            "optimizer.muon_momentum is a Muon key, but "
            "optimizer.name = 'AdamW'; set optimizer.name = 'Muon' or remove it",
        ),
        (
            ["--optimizer.name", "Muon", "--optimizer.muon_lr_adjust", "rms"],
            "optimizer.muon_lr_adjust = 'rms' is not valid; choose one of 'match_rms_adamw', "
            "'original', 'none'",
        ),
        (
            ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "fp16"],
            "optimizer.muon_ns_dtype = 'fp16' is not valid",
        ),
    ],
)
def test_muon_config_errors(args, needle):
    with pytest.raises(ConfigError) as e:
        load_config(args)
    assert needle in e.value.one_line()


def test_newton_schulz_runs_on_whole_matrices_under_tp():
    proc = torchrun(REPO / "tests/scripts/muon_probe.py", nproc=2, fork=True)
    assert "muon probe ok" in proc.stdout, proc.stdout + proc.stderr


def test_the_trainers_model_on_one_rank_equals_torch_muon():
    """FSDP over one rank (DTensor parameters, the distributed path) against a plain loop with
    torch.optim.Muon and AdamW: 10 steps within 1e-6."""
    proc = torchrun(REPO / "tests/scripts/muon_probe.py", nproc=1, fork=True)
    assert "muon probe ok: one rank" in proc.stdout, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------ end to end

# 2 blocks of the debug model's shapes at dim 64 (what a layout does to Muon's matrices and
# QK-clip's heads is in every block alike); PP 4's 8 one-unit stages need its 6
BASE = (
    "--training.device",
    "cpu",
    "--model.flavor",
    "debugmodel-narrow",
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
    *SYNTHETIC,
    "--training.steps",
    "5",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "3",
    "--checkpoint.keep_latest_k",
    "0",
    "--optimizer.lr",
    "0.01",
)
# QK-clip on every layout: the debug models' largest logits are ~0.16, so most heads clip
QK_CLIP = ("--optimizer.muon_qk_clip", "0.1")
DENSE = (*BASE, *MUON, *QK_CLIP)
MOE = (*DENSE[:3], "debugmodel-moe-narrow", *DENSE[4:], "--model.n_layers", "3")  # 2 MoE blocks
SIX = ("--model.n_layers", "6")
P = "--parallelism."
LAYOUTS = {  # name: (ranks, args)
    "ref": (1, DENSE),
    "tp2_fsdp2": (4, (*DENSE, P + "tensor_parallel_degree", "2")),
    "pp2_fsdp2": (4, (*DENSE, P + "pipeline_parallel_degree", "2")),
    "ref6": (1, (*DENSE, *SIX)),
    # 8 one-unit stages: rank 0 holds the embedding and the head, no Muon matrix at all
    "pp4_v": (
        4,
        (
            *DENSE,
            *SIX,
            P + "pipeline_parallel_degree",
            "4",
            P + "pipeline_parallel_schedule",
            "ZBVZeroBubble" if _SAME_RANK_STAGES else "Interleaved1F1B",
            *(
                ()
                if _SPLIT_BACKWARD_THROUGH_FUNCTIONS or not _SAME_RANK_STAGES
                else ("--training.loss", "eager")
            ),  # torch 2.12 (pipeline.check_torch)
            "--training.local_batch_size",
            "8",
        ),
    ),
    "cp2_fsdp2": (4, (*DENSE, P + "context_parallel_degree", "2")),
    "hsdp2x2": (4, (*DENSE, P + "data_parallel_replicate_degree", "2")),
    "moe_ref": (1, MOE),
    "moe_ep2_fsdp2": (4, (*MOE, P + "expert_parallel_degree", "2")),
}
TAGS = ("loss_metrics/global_avg_loss", "grad_norm", "qk_clip/max_logit", "qk_clip/heads_clipped")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon")
    for name, (nproc, args) in LAYOUTS.items():
        run_train(root / name, *args, nproc=nproc)
    return root


def close(got: dict, want: dict, tol: float = 1e-4) -> bool:
    return sorted(got) == sorted(want) and all(
        abs(got[s] - want[s]) <= tol * max(1.0, abs(want[s])) for s in want
    )


@pytest.mark.parametrize("name", [n for n in LAYOUTS if "ref" not in n])
def test_every_layout_equals_one_rank(runs, name):
    ref = runs / ("moe_ref" if name.startswith("moe") else "ref6" if name == "pp4_v" else "ref")
    for tag in TAGS:
        want, got = scalars(ref, tag), scalars(runs / name, tag)
        assert len(want) == 5 and close(got, want), (name, tag, got, want)


def test_qk_clip_acted_in_every_run(runs):
    """QK-clip acted in the runs the layouts compare (a layout whose clip scaled other heads or
    other rows than one rank's fails above): on the dense model heads clip at every step; the
    MoE model's attention has q/k norms, whose weights the clip scales, so after the first
    step's clip its largest logit stays near tau."""
    tau = float(QK_CLIP[1])
    for ref in ("ref", "ref6"):
        clipped = scalars(runs / ref, "qk_clip/heads_clipped")
        assert len(clipped) == 5 and all(n > 0 for n in clipped.values()), (ref, clipped)
    clipped = scalars(runs / "moe_ref", "qk_clip/heads_clipped")
    peak = scalars(runs / "moe_ref", "qk_clip/max_logit")
    assert clipped[1] > 0 and peak[1] > tau, (clipped, peak)
    assert all(v <= 1.2 * tau for s, v in peak.items() if s > 1), peak


def test_a_tp_checkpoint_resumes_at_fsdp4_and_on_one_rank(runs, tmp_path):
    want = scalars(runs / "ref", TAGS[0])
    for name, nproc in (("fsdp4", 4), ("one", 1)):
        dump = stopped_after_save(runs / "tp2_fsdp2", tmp_path / name, 5)
        out = run_train(dump, *DENSE, nproc=nproc).stdout
        assert "resumed from" in out and "(step 3)" in out, out
        got = scalars(dump, TAGS[0])
        assert close({s: got[s] for s in (4, 5)}, {s: want[s] for s in (4, 5)}), (name, got)


def test_switching_optimizers_at_a_resume_is_refused_unless_reset(runs, tmp_path):
    """The AdamW run resuming a Muon checkpoint: one config line, exit 2; with
    checkpoint.reset_optimizer it resumes the model and trains on with a fresh AdamW."""
    dump = stopped_after_save(runs / "ref", tmp_path / "adamw", 5)
    adamw = BASE
    proc = run_train(dump, *adamw, nproc=1, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"config error: checkpoint {dump / 'checkpoint' / 'step-3'} holds Muon state and this "
        "run's optimizer is AdamW; keep the optimizer.name it was saved with, or set "
        "checkpoint.reset_optimizer = true to resume the model with a fresh optimizer"
    )
    out = run_train(dump, *adamw, "--checkpoint.reset_optimizer", "true", nproc=1).stdout
    assert "(step 3)" in out and "the optimizer starts afresh" in out, out
    assert sorted(scalars(dump, TAGS[0])) == [4, 5]


def test_a_step_skipped_on_the_device_changes_nothing():
    """found_inf (the fused kernels' skip, decided on the device: trainer/optim/optimizer.py
    step_unless): parameters, momentum and AdamW's moments stay bitwise; then a real step."""
    from trainer.optim.optimizer import skips_on_device, step_unless

    torch.manual_seed(0)
    model = new_model(model_args("debugmodel-narrow", vocab_size=256, max_seq_len=16))
    model.init_weights(seed=0)
    opt = build_optimizer(model, load_config(["--optimizer.name", "Muon"]).optimizer)
    assert skips_on_device(opt)  # auto: fused AdamW for the rest
    t = torch.randint(0, 256, (2, 17))
    for _ in range(2):
        F.cross_entropy(model(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten()).backward()
    step_unless(opt, torch.tensor([False]))  # a step, so that every state exists
    state = copy.deepcopy(opt.state_dict()["state"])
    weights = [p.detach().clone() for p in model.parameters()]
    step_unless(opt, torch.tensor([True]))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    after = opt.state_dict()["state"]
    for k, s in state.items():
        for name, v in s.items():
            assert torch.equal(after[k][name], v), (k, name)
    step_unless(opt, torch.tensor([False]))
    assert not all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


def test_mtp_matrices_take_muon_and_muon_lr_follows_the_schedule():
    """The MTP module's projection and block matrices take Muon (its norms AdamW); Muon's
    group starts at optimizer.muon_lr and the lr schedule scales it as it scales AdamW's."""
    from trainer.optim.optimizer import build_lr_scheduler

    model = new_model(model_args("debugmodel-moe", mtp_layers=1, vocab_size=256, max_seq_len=32))
    mtp = {n: p for n, p in model.named_parameters() if n.startswith("mtp.")}
    assert {n for n, p in mtp.items() if takes_muon(n, p)} == {
        n for n, p in mtp.items() if p.ndim >= 2
    } and "mtp.0.proj.weight" in mtp
    cfg = load_config(
        [
            "--optimizer.name",
            "Muon",
            "--optimizer.lr",
            "3e-4",
            "--optimizer.muon_lr",
            "0.02",
            "--lr_scheduler.warmup_steps",
            "4",
            "--lr_scheduler.decay_type",
            "cosine",
            "--training.steps",
            "12",
        ]
    )
    opt = build_optimizer(model, cfg.optimizer)
    sched = build_lr_scheduler(opt, cfg.lr_scheduler, 12)
    muon_params = {id(p) for p in opt.param_groups[0]["params"]}
    assert all(id(p) in muon_params for n, p in mtp.items() if p.ndim >= 2)
    seen = set()
    for _ in range(12):
        muon_lr, adamw_lr = opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]
        assert abs(muon_lr * 3e-4 - adamw_lr * 0.02) <= 1e-9 * muon_lr, (muon_lr, adamw_lr)
        seen.add(round(muon_lr, 9))
        opt.step()  # no gradients: nothing moves
        sched.step()
    assert len(seen) > 6 and max(seen) <= 0.02  # warmup and decay reached Muon's lr
    assert load_config(["--optimizer.name", "Muon"]).optimizer.muon_lr == -1
    with pytest.raises(ConfigError) as e:
        load_config(["--optimizer.name", "Muon", "--optimizer.muon_lr", "0"])
    assert "optimizer.muon_lr = 0.0 is not valid" in e.value.one_line()
