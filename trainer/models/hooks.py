"""The model family contract: every question the shared code asks about a model that depends
on its family. Building it, its FLOPs, how tensor parallelism splits its blocks, what the
memory plan books for its blocks, how it goes to and from Hugging Face, and what the startup
lines say. The shared code asks `trainer.models.registry.hooks(args)` and never tests which
family a model is.

`DecoderHooks` answers for the plain decoder (trainer/models/common/decoder.py: GQA attention,
a dense or MoE feed-forward, optional MTP modules), whose family (trainer/models/llama3/)
only adds the build.
A family package subclasses it in its own `hooks.py` (`HOOKS = TheFamilysHooks()`) and overrides
what its model does differently. An answer of None means "as the plain decoder": the caller then
runs the shared code for it.
"""

from __future__ import annotations

from trainer.models.args import MoEArgs

NO_HF_MOE = f"this MoE flavor ({MoEArgs.NO_HF})"


class DecoderHooks:
    """The contract, and the plain decoder's answers to it."""

    # ------------------------------------------------------------------ the model

    def build(self, args):
        """The model of `args` (ModelArgs), called under the meta device. Every family answers
        it (the plain decoder's: trainer/models/llama3/hooks.py)."""
        raise NotImplementedError(f"{type(self).__name__} does not build its model")

    def attention_line(self, args) -> str:
        """What the startup's attention line says of this family's attention layer before
        its mask ("" for GQA, which needs no words)."""
        return ""

    def attention_summary(self, args, device_type: str) -> str:
        """The startup's attention line: the layer (`attention_line`), its mask, kernel and
        positions. A family whose layers run kernels of their own says so here."""
        from trainer.models.common.attention import describe

        return describe(args, self.attention_line(args))

    def kernel_note(self, device_type: str) -> str:
        """What the startup's attention-kernel line adds for this family's own kernels."""
        return ""

    def layer_kind(self, args, block: int) -> str:
        """The mixer of `block` (blocks of one kind and one FFN kind do the same work)."""
        return "attention"

    # ------------------------------------------------------------------ FLOPs

    def block_matmul_params(self, args, block: int) -> int | None:
        """Block `block`'s matmul weights one token goes through (trainer/models/flops.py)."""
        return None

    def block_attention_flops(self, args, block: int, seq_len: int, causal_half: bool):
        """Block `block`'s token-mixing FLOPs per token beyond its matmuls, forward and
        backward, or None for softmax attention's score and value products."""
        return None

    # ------------------------------------------------------------------ tensor parallelism

    def tp_dims(self, args) -> dict[str, int]:
        """Sizes of the model the tensor-parallel degree must divide, beyond the heads, the
        FFN width and the vocab every family has: {what (for the message): size}."""
        return {}

    def tp_mixer_styles(self, block, tp_mesh, model, colwise, prepare_input):
        """(the block's mixer attribute, its parallelize_module styles) where this family's
        block mixes tokens by its own layer, or None for attention's."""
        return None

    # ------------------------------------------------------------------ the memory plan

    def plan_blocks_activations(self, a, p, tokens, **how):
        """Saved activations of all blocks for one microbatch of `tokens` at `p` bytes per
        value (trainer/plan/activations.py), or None for the decoder's formula. `how`: mode,
        option, every_other (the AC settings), tp, ep, documents (block-causal), seq."""
        return None

    def plan_largest_block(self, a, p, tokens, tp, ep, documents, seq):
        """Bytes of the largest block's saved activations (its AC recompute), or None."""
        return None

    def plan_attention_saved(self, a, p: int, tp: int, kernel: str) -> int | None:
        """Bytes the attention layer saves per token without AC at `p` bytes per value, or
        None for GQA's (trainer/plan/activations.py's block_split)."""
        return None

    def plan_attention_kept(self, a, tp: int, every_other: bool) -> tuple[int, int] | None:
        """Under op-level selective AC: (values per token the attention's matmuls output and
        AC keeps, the width of its SDPA output), or None for GQA's."""
        return None

    def plan_cp_attention(self, a, p: int, batch: int, seq: int, tp: int) -> int | None:
        """Bytes one layer's attention saves of the whole sequence a cp rank gathers (K and V
        for GQA), or None for GQA's."""
        return None

    def plan_cp_gathered(self, a) -> int | None:
        """Values per token one layer's attention all-gathers over cp, or None for GQA's K and
        V (trainer/plan/comm.py)."""
        return None

    #: The traced work of one layer needs the whole model built (its layers differ in kind
    #: in ways a cut-down model cannot keep): trainer/plan/work.py.
    whole_model_for_a_layer = False

    # ------------------------------------------------------------------ Hugging Face

    def hf_adapter(self):
        """This family's subclass of trainer/hf/mapping.py's `DecoderHF` (its Hugging Face
        names, layouts and config.json), or None for the plain decoder's."""
        return None

    def hf_param_shapes(self, args) -> dict | None:
        """Our parameter names and shapes as a Hugging Face folder holds them, or None for
        the decoder's (trainer/hf/mapping.py)."""
        return None

    def hf_export_problem(self, args) -> str | None:
        """Why no Hugging Face architecture holds this model, or None. Without torch."""
        return args.mtp_export_problem() or self.hf_router_problem(args)

    def hf_router_problem(self, args) -> str | None:
        """Why no Hugging Face architecture holds this model's router, or None (a config check
        asks it before any process starts). Without torch."""
        if args.moe is not None and not args.moe.hf_exportable:
            return NO_HF_MOE
        return None

    def hf_load(self, model, hf, folder: str, flavor: str, log):
        """(parameter of `model`, its full tensor from the folder) pairs, if this family reads
        its own release format, else None for the decoder's reader (trainer/hf/load.py)."""
        return None

    def hf_export(self, out_dir: str, args, fetch, *, dtype, max_shard_bytes, log):
        """(config.json's maker, the files written) if this family writes its own release
        format into `out_dir`, else None for the decoder's writer (trainer/hf/export.py)."""
        return None
