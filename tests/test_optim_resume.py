"""Resuming the optimizer (trainer/checkpoint/optim_state.py): its state comes from the
checkpoint, exactly, in every layout; its settings come from the run's config.

Through run_train.sh, fp32, Newton-Schulz in fp32, Muon on debugmodel-narrow: an uninterrupted
TP 2 x FSDP 2 run of 10 steps, then a chain of resumes from its step 2, one step each, every
layout resuming its own checkpoint and handing one to another: TP 2 x FSDP 2 -> CP 2 x FSDP 2 ->
CP -> HSDP 2 x 2 -> HSDP -> PP 4 ZBVZeroBubble (8 one-unit stages: rank 0 holds the embedding
and the head, no Muon matrix) -> PP 4 -> one rank. Each resumed step's loss equals the
uninterrupted run's (<= 1e-4). EP 2 x FSDP 2 (debugmodel-moe-narrow, its first 3 blocks)
resumes its own step 2 in its layout and on one rank. Settings: a resume with another
muon_momentum trains with it (one process, against torch.optim.Muon at the new momentum from
the same state) and says so; AdamW
saved with one kernel (optimizer.implementation) resumes under another, with the uninterrupted
losses.
"""

import copy
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from tests.helpers import BASE_FP32, SYNTHETIC, run_train, scalars
from trainer.checkpoint.optim_state import ModelAndOptimizer, changed_line, saved_grouped
from trainer.config.job import load_config
from trainer.models.build import new_model
from trainer.models.flavors import model_args
from trainer.optim.muon import takes_muon
from trainer.optim.optimizer import build_optimizer
from trainer.parallel.pipeline import _SAME_RANK_STAGES, _SPLIT_BACKWARD_THROUGH_FUNCTIONS

LOSS = "loss_metrics/global_avg_loss"
CKPT = ("--checkpoint.enable", "true", "--checkpoint.keep_latest_k", "0")
DENSE = (
    "--model.flavor",
    "debugmodel-narrow",
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
    "--optimizer.lr",
    "0.01",
    *CKPT,
    "--optimizer.name",
    "Muon",
    "--optimizer.muon_ns_dtype",
    "float32",
)
MOE = ("--model.flavor", "debugmodel-moe-narrow", "--model.n_layers", "3", *DENSE[2:])
P = "--parallelism."
LAYOUTS = {  # name: (ranks, args)
    "one": (1, ()),
    "tp2_fsdp2": (4, (P + "tensor_parallel_degree", "2")),
    "cp2_fsdp2": (4, (P + "context_parallel_degree", "2")),
    "hsdp2x2": (4, (P + "data_parallel_replicate_degree", "2")),
    "pp4_v": (
        4,
        (
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
    "ep2_fsdp2": (4, (P + "expert_parallel_degree", "2")),
}
# Steps 3..10, one per launch, from the uninterrupted run's step 2 (saved by TP 2 x FSDP 2).
CHAIN = ("tp2_fsdp2", "cp2_fsdp2", "cp2_fsdp2", "hsdp2x2", "hsdp2x2", "pp4_v", "pp4_v", "one")


def launch(dump, base, layout, steps, *extra, interval=100):
    nproc, args = LAYOUTS[layout]
    return run_train(
        dump,
        *base,
        *args,
        "--training.steps",
        str(steps),
        "--checkpoint.interval",
        str(interval),
        *extra,
        nproc=nproc,
    ).stdout


def resumable_at(run, dest, step):
    """A copy of a finished run as if it had stopped after saving `step`: the later checkpoints
    and every TensorBoard event removed (what is logged next is the resume's)."""
    shutil.copytree(run, dest)
    for later in (dest / "checkpoint").glob("step-*"):
        if int(later.name.split("-")[1]) > step:
            shutil.rmtree(later)
    shutil.rmtree(dest / "tb")
    return dest


def close(got: dict, want: dict, tol: float = 1e-4) -> bool:
    return sorted(got) == sorted(want) and all(
        abs(got[s] - want[s]) <= tol * max(1.0, abs(want[s])) for s in want
    )


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The uninterrupted run, and the chain's losses and startup output per step."""
    root = tmp_path_factory.mktemp("optim_resume")
    launch(root / "straight", DENSE, "tp2_fsdp2", 10, interval=2)
    chain = resumable_at(root / "straight", root / "chain", 2)
    outs = {}
    for step, layout in enumerate(CHAIN, start=3):
        outs[step] = launch(chain, DENSE, layout, step)
    return root, outs


def test_every_layout_resumes_its_own_and_anothers_checkpoint(dense):
    root, outs = dense
    want = scalars(root / "straight", LOSS)
    got = scalars(root / "chain", LOSS)
    for step, layout in enumerate(CHAIN, start=3):
        assert f"(step {step - 1})" in outs[step], (layout, outs[step])
        assert "optimizer settings changed" not in outs[step], outs[step]
        assert close({step: got[step]}, {step: want[step]}), (step, layout, got, want)
    assert sorted(got) == list(range(3, 11))


def test_expert_parallel_resumes_in_its_layout_and_on_one_rank(tmp_path):
    launch(tmp_path / "straight", MOE, "ep2_fsdp2", 4, interval=2)
    want = scalars(tmp_path / "straight", LOSS)
    for layout in ("ep2_fsdp2", "one"):
        dump = resumable_at(tmp_path / "straight", tmp_path / layout, 2)
        assert "(step 2)" in launch(dump, MOE, layout, 4)
        got = scalars(dump, LOSS)
        assert close(got, {s: want[s] for s in (3, 4)}), (layout, got, want)


def test_a_changed_momentum_applies_and_is_named(dense, tmp_path):
    """From the uninterrupted run's step 2 on one rank at muon_momentum 0.8: step 3 (the loaded
    weights) the same loss, steps 4 and 5 (after steps at the new momentum) others: 6.7e-4 and
    1.7e-3 apart, where a resume at 0.95 gives the uninterrupted losses within 1e-6."""
    root, _ = dense
    dump = resumable_at(root / "straight", tmp_path / "m08", 2)
    out = launch(dump, DENSE, "one", 5, "--optimizer.muon_momentum", "0.8")
    assert (
        "optimizer settings changed at the resume: optimizer.muon_momentum 0.95 -> 0.8 "
        "(this run's config applies; the optimizer state resumes as saved)"
    ) in out, out
    want, got = scalars(root / "straight", LOSS), scalars(dump, LOSS)
    assert close({3: got[3]}, {3: want[3]}), (got, want)
    assert abs(got[4] - want[4]) > 3e-4 and abs(got[5] - want[5]) > 1e-3, (got, want)


def test_changed_lrs_of_muon_and_adamw_are_named_and_logged_apart(dense, tmp_path):
    """From step 2 on one rank at optimizer.lr 0.005 and muon_lr 0.02 (0.01 both, saved): one
    line names both lrs beside the checkpoint's; TensorBoard's `lr` is optimizer.lr's (AdamW's
    parameters) and `lr_muon` the matrices', each x the schedule's factor (1 after warmup)."""
    root, _ = dense
    dump = resumable_at(root / "straight", tmp_path / "lrs", 2)
    out = launch(dump, DENSE, "one", 3, "--optimizer.lr", "0.005", "--optimizer.muon_lr", "0.02")
    assert (
        "lr schedule changed at the resume: step 3 trains at lr 0.005 and Muon's matrices "
        "(optimizer.muon_lr) at lr 0.02 (this run's optimizer.lr, muon_lr, [lr_scheduler] "
        "and training.steps); the checkpoint's run would have used 0.01 and 0.01"
    ) in out, out
    assert scalars(dump, "lr") == {3: pytest.approx(0.005)}
    assert scalars(dump, "lr_muon") == {3: pytest.approx(0.02)}
    straight = scalars(root / "straight", "lr")
    assert scalars(root / "straight", "lr_muon") == straight and straight[3] == pytest.approx(0.01)


def test_any_adamw_kernel_resumes_under_any_other(tmp_path):
    """A for-loop AdamW run of 4 steps; from its step 2: auto (fused), then for-loop, a step
    each, with the uninterrupted losses."""
    base = (*BASE_FP32, *CKPT)
    launch(
        tmp_path / "straight", base, "one", 4, "--optimizer.implementation", "for-loop", interval=2
    )
    want = scalars(tmp_path / "straight", LOSS)
    dump = resumable_at(tmp_path / "straight", tmp_path / "chain", 2)
    for step, impl, change in (
        (3, "auto", "for-loop -> fused"),
        (4, "for-loop", "fused -> for-loop"),
    ):
        out = launch(dump, base, "one", step, "--optimizer.implementation", impl)
        assert (
            f"optimizer settings changed at the resume: optimizer.implementation {change} ("
        ) in out, out
    got = scalars(dump, LOSS)
    assert close(got, {s: want[s] for s in (3, 4)}), (got, want)


# ------------------------------------------------------------------------------ one process


def _batches(seed: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 33), generator=gen) for _ in range(n)]


def _built(*overrides: str):
    """debugmodel-narrow at vocab 256 and the optimizer of `overrides` (for-loop kernels):
    (model, optimizer, its config)."""
    model = new_model(model_args("debugmodel-narrow", vocab_size=256, max_seq_len=32))
    model.init_weights(seed=0)
    cfg = load_config(["--optimizer.implementation", "for-loop", *overrides]).optimizer
    return model, build_optimizer(model, cfg), cfg


def _train(model, optimizers, batches):
    for t in batches:
        F.cross_entropy(model(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten()).backward()
        for o in optimizers:
            o.step()
            o.zero_grad()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_resumed_momentum_is_the_configs_against_torch_muon(tmp_path):
    """Muon at 0.95 for 3 steps, saved; loaded by an optimizer built at momentum 0.8, 2 more
    steps: bitwise torch.optim.Muon at 0.8 (and AdamW) started from the saved weights and
    state."""
    batches = _batches(seed=1, n=5)

    def built(momentum):
        return _built("--optimizer.name", "Muon", "--optimizer.muon_momentum", str(momentum))

    model, opt, _ = built(0.95)
    _train(model, [opt], batches[:3])
    dcp.save({"model_optim": ModelAndOptimizer(model, opt)}, checkpoint_id=str(tmp_path))
    ref = copy.deepcopy(model)
    named = dict(ref.named_parameters())
    state = {n: opt.state[p] for n, p in model.named_parameters()}

    resumed, opt2, cfg = built(0.8)
    holder = ModelAndOptimizer(resumed, opt2)
    dcp.load({"model_optim": holder}, checkpoint_id=str(tmp_path))
    assert holder.changes == [("muon_momentum", "0.95", "0.8")]
    assert changed_line(holder.changes).startswith(
        "optimizer settings changed at the resume: optimizer.muon_momentum 0.95 -> 0.8 ("
    )
    assert opt2.param_groups[0]["momentum"] == 0.8

    muon = torch.optim.Muon(
        [p for n, p in named.items() if takes_muon(n, p)],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=0.8,
        nesterov=True,
        adjust_lr_fn="match_rms_adamw",
    )
    adamw = torch.optim.AdamW(
        [p for n, p in named.items() if not takes_muon(n, p)],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=False,
    )
    for n, p in named.items():
        (muon if takes_muon(n, p) else adamw).state[p] = copy.deepcopy(state[n])
    _train(resumed, [opt2], batches[3:])
    _train(ref, [muon, adamw], batches[3:])
    for (n, p), q in zip(resumed.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_settings_are_one_entry_per_parameter_and_older_checkpoints_still_load(tmp_path):
    """AdamW's settings are saved as one DCP entry per parameter, not one per parameter and
    setting (12 for AdamW); a checkpoint saved the older way still loads, found by its keys.
    Either way the state loads exactly and a changed setting (weight decay) is this run's and
    named."""
    from torch.distributed.checkpoint import FileSystemReader

    batches = _batches(seed=2, n=2)

    def built(weight_decay):
        return _built("--optimizer.weight_decay", str(weight_decay))[:2]

    model, opt = built(0.1)
    _train(model, [opt], batches)
    names = [n for n, _ in model.named_parameters()]
    prefix = "model_optim.optimizer.param_groups."
    for grouped in (True, False):
        folder = tmp_path / ("grouped" if grouped else "per_setting")
        holder = ModelAndOptimizer(model, opt)
        holder.grouped = grouped
        dcp.save({"model_optim": holder}, checkpoint_id=str(folder))
        keys = {
            k
            for k in FileSystemReader(str(folder)).read_metadata().state_dict_metadata
            if k.startswith(prefix)
        }
        per_setting = {f"{prefix}{n}.{s}" for n in names for s in ("lr", "betas", "eps")}
        if grouped:
            assert keys == {prefix + n for n in names}
        else:
            assert per_setting <= keys and len(keys) >= 10 * len(names)
        assert saved_grouped({k[len("model_optim.optimizer.") :] for k in keys}) == grouped

        resumed, opt2 = built(0.05)
        holder = ModelAndOptimizer(resumed, opt2)
        holder.grouped = grouped
        dcp.load({"model_optim": holder}, checkpoint_id=str(folder))
        assert holder.changes == [("weight_decay", "0.1", "0.05")], (grouped, holder.changes)
        assert {g["weight_decay"] for g in opt2.param_groups} == {0.05}
        for (n, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
            assert torch.equal(p, q), n
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[p][k], opt2.state[q][k]), (n, k)
