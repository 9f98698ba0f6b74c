"""Pipeline parallelism: the model cut into stages over the `pp` mesh dimension, run by one of
torch.distributed.pipelining's schedules.

On each pp rank the meta model is pruned to the units of its stages (trainer/parallel/
pp_layout.py decides which: the first stage keeps the embedding, the last the final norm, the
output head and the loss). The pruned model keeps its class's attribute names, so parameter
names, and with them checkpoints, the seeded init and the HF mapping, are those of the whole
model: a checkpoint moves between pp degrees and layouts like any other. Each stage is a
`StageModule`, a view that shares the pruned model's submodules; FSDP's root is the stage (the
schedule drives FSDP's gradient sync per stage), the optimizer, clipping and checkpoints see
the pruned model.

`PipelineLoop` is the step's seam under pp (a `ForwardBackward`: trainer/parallel/
microbatches.py): each of the step's microbatches (gradient accumulation) is one schedule
step over `local_batch_size / pipeline_parallel_microbatch_size` pipeline microbatches. The
last stage computes the summed token loss in its head (the chunked or loss-parallel loss, no
logits); the schedule's loss function scales it by dp / the global token count, with
`scale_grads=False`: the gradients are exactly those of one large batch, whatever the
schedule, its microbatches and the accumulation. The loss is then summed over pp, so every
stage logs and guards the same value.

`PipelinedModel.forward` runs validation, evals and any other forward-only call: the stages
in order, the activations sent point to point, the last stage's result broadcast to every pp
rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainer.distributed import log0, to_device
from trainer.errors import ConfigError
from trainer.health import faults, heartbeat
from trainer.models.common.decoder import Transformer
from trainer.models.common.mtp import future_labels, mtp_streams
from trainer.models.flavors import model_args
from trainer.models.flops import unit_flops
from trainer.parallel.context_parallel import ContextSplit
from trainer.parallel.fsdp import fsdp_param_groups
from trainer.parallel.microbatches import Losses
from trainer.parallel.pp_layout import (
    StageSpec,
    bubble_fraction,
    check_microbatches,
    check_pipeline,
    describe_split,
    rank_stages,
    stage_rank,
)
from trainer.parallel.pp_layout import (
    schedule as find_schedule,
)
from trainer.parallel.tp import sum_partial_grads

try:  # torch >= 2.12: two stages on one rank pass activations without p2p (V schedules)
    from torch.distributed.pipelining._utils import InferenceMode  # noqa: F401

    _SAME_RANK_STAGES = True
except ImportError:
    _SAME_RANK_STAGES = False
# torch >= 2.13: the zero-bubble schedules' weight pass walks a custom autograd Function's node
# (the chunked loss's); 2.11 and 2.12 fail there ("Attribute '_input_metadata' is invalid").
_SPLIT_BACKWARD_THROUGH_FUNCTIONS = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 13)


class StageModule(nn.Module):
    """One stage: the embedding (first stage), a run of layers, the norm and head (last stage)
    of the pruned model, under the same attribute names."""

    def __init__(self, model: Transformer, spec: StageSpec):
        super().__init__()
        self.spec = spec
        self.tok_embeddings = model.tok_embeddings if spec.embedding else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in spec.layers})
        self.norm = model.norm if spec.head else None
        self.output = model.output if spec.head else None
        self.mtp = model.mtp if spec.head else None  # multi-token prediction: the last stage
        object.__setattr__(self, "_root", model)  # the RoPE tables and masks; not a child
        self.loss_fn = None  # the training loss (PipelineLoop sets it)
        self.cp = None  # under PP x CP, the ContextSplit (PipelineLoop sets it)

    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        loss_fn=None,
        positions: torch.Tensor | None = None,
        future: torch.Tensor | None = None,
        attention=None,
    ) -> torch.Tensor:
        """Tokens (first stage) or the previous stage's activations -> activations, or (last
        stage) the summed token loss with labels, the logits without. Under PP x CP a
        training step passes this rank's `positions` [b, local] and the whole samples'
        `doc_ids`: the layers attend through context parallelism's attention.

        With MTP modules (on the last stage), a training step's activations carry, after
        the hidden state, each depth's input token embeddings, looked up by the first stage
        (the embedding's gradient comes back the same way): [b, s, dim x (1 + depth)].
        `future` [b, depth, s]: the MTP targets past `labels`. `attention`: a forward-only
        pass's own context-parallel attention (evals: sequences of another width)."""
        root = self._root
        first = self.tok_embeddings is not None
        fn = loss_fn or self.loss_fn
        mtp = root.trains_mtp(labels, fn)
        if future is not None:
            future = future.transpose(0, 1)  # the schedule splits microbatches on dim 0
        extra = []
        if first:
            h = self.tok_embeddings(x)
            if mtp:
                extra = [
                    self.tok_embeddings(tokens)
                    for tokens, _ in mtp_streams(
                        labels,
                        future_labels(labels, root.args.mtp_layers) if future is None else future,
                    )
                ]
        else:
            h, *extra = x.chunk(1 + root.args.mtp_layers, dim=-1) if mtp else (x,)
        if positions is not None and (self.cp is not None or attention is not None):
            cos, sin = root.rope_cos[positions], root.rope_sin[positions]
            mask = attention if attention is not None else self.cp.attention(doc_ids)
        else:
            # Under sequence parallelism (TP) the activations hold seq / tp positions per rank.
            seq = x.shape[1] if first else x.shape[1] * root.sequence_multiple
            cos, sin, mask = root.attention_inputs(seq, doc_ids, None, h.dtype)
        # The hybrid's DeltaNet layers take the documents they restart at (qwen3_next.py)
        docs = (root.linear_documents(doc_ids),) if hasattr(root, "linear_documents") else ()
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask, *docs)
        if self.norm is None:
            return torch.cat([h, *extra], dim=-1) if extra else h
        h = self.norm(h)  # the MTP modules take the normed state (trainer/models/common/decoder.py)
        main = self.output(h, labels if fn is not None else None, fn)
        if not mtp:
            return main
        return main + root.mtp_loss(h, labels, fn.for_mtp(), (cos, sin, mask), future, extra)


class PipelinedModel(Transformer):
    """The pruned model of one pp rank (its class swapped in by `split_model`): its forward
    runs the whole pipeline, forward only (validation, evals)."""

    pipeline_stages: list[StageModule]
    activation_dtype = torch.float32  # what stages pass on: the compute dtype (parallelize)
    pp_group = None
    stage_ranks: list[int]  # stage -> pp rank
    family: type = Transformer  # the unsplit model's class (its init_weights, its documents)

    def whole_model_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter of the unsplit model, in its order (a checkpoint's
        fingerprint: trainer/checkpoint/integrity.py)."""
        with torch.device("meta"):
            whole = self.family(self.args)
        return [(name, tuple(p.shape)) for name, p in whole.named_parameters()]

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_fn=None,
        *,
        doc_ids: torch.Tensor | None = None,
        positions=None,
        attention=None,
    ):
        """`positions` and `attention`: context parallelism's, for this rank's share of every
        sequence (validation and evals under PP x CP): every stage attends through it."""
        if (positions is None) != (attention is None):
            raise ValueError("context parallel forward needs both positions and attention")
        group, me = self.pp_group, dist.get_rank(self.pp_group)
        mine = {m.spec.index: m for m in self.pipeline_stages}
        h, out = tokens, None
        for s, owner in enumerate(self.stage_ranks):
            if owner != me:
                continue
            if s > 0 and self.stage_ranks[s - 1] != me:
                h = _recv(dist.get_global_rank(group, self.stage_ranks[s - 1]), group)
            h = mine[s](
                h,
                labels=labels,
                doc_ids=doc_ids,
                loss_fn=loss_fn,
                positions=positions,
                attention=attention,
            )
            if s + 1 < len(self.stage_ranks) and self.stage_ranks[s + 1] != me:
                _send(h, dist.get_global_rank(group, self.stage_ranks[s + 1]), group)
            out = h if s == len(self.stage_ranks) - 1 else None
        return _broadcast(out, dist.get_global_rank(group, self.stage_ranks[-1]), group)


def _defer_reduction(stage, loop: "PipelineLoop") -> None:
    """Make a PipelineStage's end-of-schedule gradient reduction (`perform_reduce_grad`, which
    torch 2.13's schedules call once per schedule step) wait for `loop.reduce_now`: before the
    step's last microbatch the stage only reshards its parameters and keeps its unsharded
    gradients accumulating, as FSDP does under `set_requires_gradient_sync(False)`. A torch
    without `perform_reduce_grad` reduces per schedule step, as before."""
    from torch.distributed.fsdp import FSDPModule

    original = getattr(stage, "perform_reduce_grad", None)
    if original is None or not isinstance(stage.submod, FSDPModule):
        return

    def perform_reduce_grad(grad_scale_factor: int):
        if loop.reduce_now:
            return original(grad_scale_factor)
        reduce_stage(stage.submod, now=False)

    stage.perform_reduce_grad = perform_reduce_grad


def reduce_stage(module, now: bool) -> None:
    """A stage's FSDP post-backward at the end of a schedule step, as torch's
    `perform_reduce_grad` runs it (the schedule's backwards neither reshard nor reduce):
    reshard, and reduce-scatter the accumulated gradients only when `now`."""
    from torch.distributed.fsdp import fully_shard

    module.set_is_last_backward(now)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(now)
    state = fully_shard.state(module)
    for each in state._state_ctx.all_states:
        for group in fsdp_param_groups(each):
            group.post_backward()
    state._root_post_backward_final_callback()


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]


def _header(t: torch.Tensor) -> torch.Tensor:
    return torch.tensor(
        [_DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (6 - t.dim())],
        dtype=torch.int64,
        device=t.device,
    )


def _from_header(header: torch.Tensor, device) -> torch.Tensor:
    dtype, ndim, *shape = header.tolist()
    return torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)


def _send(t: torch.Tensor, dst: int, group) -> None:
    t = t.contiguous()
    dist.send(_header(t), dst, group=group)
    dist.send(t, dst, group=group)


def _recv(src: int, group) -> torch.Tensor:
    device = _device(group)
    header = torch.empty(8, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    t = _from_header(header, device)
    dist.recv(t, src, group=group)
    return t


def _broadcast(t: torch.Tensor | None, src: int, group) -> torch.Tensor:
    device = _device(group)
    header = (
        _header(t.contiguous())
        if t is not None
        else torch.empty(8, dtype=torch.int64, device=device)
    )
    dist.broadcast(header, src, group=group)
    out = t.contiguous() if t is not None else _from_header(header, device)
    dist.broadcast(out, src, group=group)
    return out


def _device(group) -> torch.device:
    backend = dist.get_backend(group)
    if "nccl" in str(backend):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def split_model(model: Transformer, cfg, pp_mesh) -> list[StageModule]:
    """Prune the meta `model` to this pp rank's stages (in place; its class becomes
    PipelinedModel) and return their StageModules."""
    par = cfg.parallelism
    specs = check_pipeline(
        par,
        cfg.training,
        model.args.n_layers,
        model.args.tie_word_embeddings,
        cfg.model.flavor,
        unit_flops(model.args, cfg.training.seq_len),
    )
    sched, pp = find_schedule(par.pipeline_parallel_schedule), par.pipeline_parallel_degree
    me = pp_mesh.get_local_rank()
    mine = [specs[s] for s in rank_stages(me, pp, len(specs), sched.style)]
    layers = {i for spec in mine for i in spec.layers}
    for key in [k for k in model.layers if int(k) not in layers]:
        del model.layers[key]
    if not any(spec.embedding for spec in mine):
        model.tok_embeddings = None
    if not any(spec.head for spec in mine):
        model.norm = model.output = model.mtp = None
    family = type(model)  # Qwen3Next keeps its own init and documents under the pipeline
    model.__class__ = (
        PipelinedModel
        if family is Transformer
        else type(f"Pipelined{family.__name__}", (PipelinedModel, family), {"family": family})
    )
    model.pp_group = pp_mesh.get_group()
    model.stage_ranks = [stage_rank(s, pp, sched.style) for s in range(len(specs))]
    model.pipeline_stages = [StageModule(model, spec) for spec in mine]
    return model.pipeline_stages


def describe(cfg, n_microbatches: int, args=None) -> str:
    """One line: the schedule, its ideal bubble, every pp rank's stages and how the model
    was cut (`args`: the model's, whose units' work balances the default split)."""
    par = cfg.parallelism
    pp, sched = par.pipeline_parallel_degree, find_schedule(par.pipeline_parallel_schedule)
    args = args or model_args(cfg.model.flavor, n_layers=cfg.model.n_layers)
    weights = unit_flops(args, cfg.training.seq_len)
    specs = check_pipeline(
        par, cfg.training, args.n_layers, args.tie_word_embeddings, cfg.model.flavor, weights
    )
    per_rank = len(specs) // pp
    where = "; ".join(
        f"rank {r}: "
        + " + ".join(
            f"stage {s} ({specs[s].describe()})"
            for s in rank_stages(r, pp, len(specs), sched.style)
        )
        for r in range(pp)
    )
    bubble = bubble_fraction(sched, pp, n_microbatches, per_rank)
    return (
        f"pipeline: {sched.name}, {len(specs)} stages over pp {pp}, {n_microbatches} "
        f"microbatches of {par.pipeline_parallel_microbatch_size} per schedule step "
        f"(ideal bubble {bubble:.1%}); {where}; "
        + describe_split(
            specs,
            weights,
            "balanced by model FLOPs"
            if not (par.pipeline_parallel_split_points or par.pipeline_parallel_layers_per_stage)
            else "as configured",
        )
    )


def check_torch(sched, cfg, pp_group) -> None:
    """What this torch's pipelining cannot do (V schedules over gloo before 2.12, the
    chunked loss under a split backward before 2.13), as config errors."""
    if sched.style == "v" and not _SAME_RANK_STAGES and dist.get_backend(pp_group) == "gloo":
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule = {sched.name!r} on CPU "
            f"ranks (gloo) needs torch >= 2.12: torch {torch.__version__}'s "
            "V schedules send a stage's activations to its own rank, which "
            "gloo cannot; use Interleaved1F1B or 1F1B here"
        )
    if (
        sched.split_backward
        and not _SPLIT_BACKWARD_THROUGH_FUNCTIONS
        and cfg.training.loss == "chunked"
    ):
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule = {sched.name!r} with "
            f"training.loss = 'chunked' needs torch >= 2.13: torch "
            f"{torch.__version__}'s split backward cannot walk the chunked "
            "loss's autograd function; set training.loss = 'eager' (the same "
            "loss, with the logits held) or choose 1F1B / Interleaved1F1B"
        )


def overlap_dualpipe(schedule, model: PipelinedModel, cfg, device_type: str) -> str:
    """Register DualPipeV's overlap function (trainer/parallel/dualpipe.py) where the layout
    allows it, the ep groups' backward-lane twins created on every rank; returns the startup
    line that says whether the overlapped actions overlap. The traced dry run's fake process
    group creates no twins (it drives the stages itself: trainer/plan/stages.py)."""
    from trainer.parallel import dualpipe

    overlap, line = dualpipe.plan_overlap(cfg, schedule, device_type=device_type)
    if overlap and dist.get_backend() != "fake":
        dualpipe.install(schedule, dualpipe.stage_groups(model))
    return line


class PipelineLoop:
    """The step's forward and backward through a pipeline schedule (see the module docstring)."""

    def __init__(
        self,
        model: PipelinedModel,
        loss_fn,
        cfg,
        *,
        dp_size: int,
        device: torch.device,
        documents=None,
        cp_mesh=None,
    ):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import (
            PipelineScheduleSingle,
            get_schedule_class,
        )

        par = cfg.parallelism
        sched = find_schedule(par.pipeline_parallel_schedule)
        n_stages = len(model.stage_ranks)
        self.n_microbatches = check_microbatches(
            par, cfg.training, sched, n_stages, par.pipeline_parallel_degree
        )
        self.model, self.loss_fn, self.device = model, loss_fn, device
        self.dp_size, self.documents = dp_size, documents
        self.pp_group = model.pp_group
        self.scale = None  # dp / the step's global token count
        # PP x CP: each stage attends over its cp rank's share of the sequence
        self.cp = (
            ContextSplit(cp_mesh, cfg.training.seq_len, device, cfg.model)
            if cp_mesh is not None
            else None
        )
        for stage in model.pipeline_stages:
            stage.loss_fn, stage.cp = loss_fn, self.cp
        # Zero-bubble schedules run each backward twice: input gradients, later the weights'.
        loss_fn.split_backward = sched.split_backward
        check_torch(sched, cfg, self.pp_group)
        stages = [
            PipelineStage(
                m,
                m.spec.index,
                n_stages,
                device,
                group=self.pp_group,
                **self._shapes(m, cfg, device),
            )
            for m in model.pipeline_stages
        ]
        # With accumulation, reduce-scatter once per optimizer step (sync 'last'), not once per
        # schedule step: the stages' own reduction waits for the step's last microbatch.
        self.reduce_now, self.sync_mode = True, cfg.training.gradient_accumulation_sync
        for stage in stages:
            _defer_reduction(stage, self)
        cls = get_schedule_class(sched.name)
        single = issubclass(cls, PipelineScheduleSingle)
        self.schedule = cls(
            stages[0] if single else stages,
            self.n_microbatches,
            loss_fn=self._scaled,
            scale_grads=False,
        )
        overlap = (
            overlap_dualpipe(self.schedule, model, cfg, device.type)
            if sched.name == "DualPipeV"
            else None
        )
        self.first = any(m.spec.embedding for m in model.pipeline_stages)
        self.z_loss = bool(getattr(loss_fn, "z_loss_weight", 0.0))
        self.mtp_layers = model.args.mtp_layers
        log0(describe(cfg, self.n_microbatches, model.args))
        if overlap:
            log0(overlap)
        if self.cp is not None:
            log0(self.cp.describe())

    def _shapes(self, stage: StageModule, cfg, device) -> dict[str, torch.Tensor]:
        """Each stage's input and output, given up front: the schedule then skips its shape
        inference (a forward, on torch 2.13 also a backward, of the first microbatch whose
        loss would count in the step's z-loss)."""
        model, mbs = self.model, cfg.parallelism.pipeline_parallel_microbatch_size
        seq = cfg.training.seq_len // (self.cp.cp if self.cp else 1)
        width = model.args.dim * (1 + model.args.mtp_layers)  # + MTP's input embeddings
        act = torch.empty(
            mbs,
            seq // model.sequence_multiple,
            width,
            dtype=model.activation_dtype,
            device=device,
            requires_grad=True,
        )
        return {
            "input_args": (
                torch.empty(mbs, seq, dtype=torch.long, device=device)
                if stage.spec.embedding
                else act
            ),
            "output_args": (
                torch.empty((), dtype=torch.float32, device=device) if stage.spec.head else act
            ),
        }

    def schedule_step(self, inputs, labels, losses: list, kwargs: dict) -> None:
        """One schedule step over the microbatch (the traced dry run drives the stages itself:
        trainer/plan/stages.py)."""
        self.schedule.step(
            *((inputs,) if self.first else ()),
            target=labels,
            losses=losses,
            return_outputs=False,
            **kwargs,
        )

    def _scaled(self, output: torch.Tensor, target) -> torch.Tensor:
        """The schedule's loss: the last stage's summed token loss times dp / global tokens
        (FSDP averages the gradients over dp; the product is a plain sum / global tokens)."""
        return output * self.scale

    def __call__(self, batches, global_tokens: torch.Tensor, step: int) -> Losses:
        cp = self.cp.cp if self.cp else 1
        self.scale = self.dp_size * cp / global_tokens  # FSDP averages over dp x cp
        total = torch.zeros((), device=self.device)
        for i, (inputs, labels) in enumerate(batches):
            self.reduce_now = self.sync_mode != "last" or i == len(batches) - 1
            inputs, labels = to_device(inputs, self.device), to_device(labels, self.device)
            doc_ids, window = self.documents(inputs, labels) if self.documents else (None, None)
            kwargs, whole_labels = {"labels": labels}, labels
            if self.cp is not None:  # this cp rank's tokens; the whole samples' documents
                inputs, kwargs["labels"], kwargs["positions"] = self.cp.split(
                    inputs, labels, doc_ids
                )
                labels = kwargs["labels"]
            if doc_ids is not None:
                kwargs["doc_ids"] = doc_ids
            if self.mtp_layers:  # MTP targets [b, depth, s] (from the whole sequence under cp)
                future = (
                    self.cp.future(whole_labels, self.mtp_layers, window)
                    if self.cp
                    else future_labels(labels, self.mtp_layers, window)
                )
                kwargs["future"] = future.transpose(0, 1).contiguous()
            heartbeat.phase("pipeline", step)
            losses: list[torch.Tensor] = []
            self.schedule_step(inputs, labels, losses, kwargs)
            if i == 0:
                faults.armed().first_forward(step)  # a testing hook; nothing unless asked
            for loss in losses:
                total += loss.detach()
        total = total / (self.dp_size * cp)
        sum_partial_grads(self.model)  # tp ranks' shares of the MoE gradients (tp.py)
        # None without a z-loss / MTP, or on a stage without the head
        z, mtp = self.loss_fn.take_z_loss(), self.loss_fn.take_mtp_loss()
        # Only the last stage knows the loss: summed over pp, every stage logs and guards it;
        # under CP, also summed over the cp ranks' shares of the sequence.
        zero = torch.zeros_like(total)
        both = torch.stack([total, zero if z is None else z, zero if mtp is None else mtp])
        dist.all_reduce(both, group=self.pp_group)
        if self.cp is not None:
            dist.all_reduce(both, group=self.cp.group)
        return Losses(
            both[0],
            both[1] if self.z_loss else None,
            None,
            both[2] / global_tokens if self.mtp_layers else None,
        )
