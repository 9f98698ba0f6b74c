"""The model family contract: every question the shared code asks about a model that depends
on its family. Building it, its FLOPs, how tensor parallelism splits its blocks, what the
memory plan books for its blocks, how it goes to and from Hugging Face, and what the startup
lines say. The shared code asks `trainer.models.registry.hooks(args)` and never tests which
family a model is.

`DecoderHooks` answers for the plain decoder (trainer/models/common/decoder.py: GQA or MLA
attention, a dense or MoE feed-forward, optional MTP modules): the llama3 and deepseek_v3 families.
A family package subclasses it in its own `hooks.py` (`HOOKS = TheFamilysHooks()`) and overrides
what its model does differently. An answer of None means "as the plain decoder": the caller then
runs the shared code for it.
"""

from __future__ import annotations


class DecoderHooks:
    """The contract, and the plain decoder's answers to it."""

    # ------------------------------------------------------------------ the model

    def build(self, args):
        """The model of `args` (ModelArgs), called under the meta device."""
        from trainer.models.common.decoder import Transformer

        return Transformer(args)

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

    #: The traced work of one layer needs the whole model built (its layers differ in kind
    #: in ways a cut-down model cannot keep): trainer/plan/work.py.
    whole_model_for_a_layer = False

    # ------------------------------------------------------------------ Hugging Face

    def hf_param_shapes(self, args) -> dict | None:
        """Our parameter names and shapes as a Hugging Face folder holds them, or None for
        the decoder's (trainer/hf/mapping.py)."""
        return None

    def hf_export_problem(self, args) -> str | None:
        """Why no Hugging Face architecture holds this model, or None."""
        from trainer.hf.mapping import decoder_export_problem

        return decoder_export_problem(args)

    def hf_load(self, model, hf, folder: str, flavor: str, log):
        """(parameter of `model`, its full tensor from the folder) pairs, if this family reads
        its own release format, else None for the decoder's reader (trainer/hf/load.py)."""
        return None

    def hf_export(self, out_dir: str, args, fetch, *, dtype, max_shard_bytes, log):
        """(config.json's maker, the files written) if this family writes its own release
        format into `out_dir`, else None for the decoder's writer (trainer/hf/export.py)."""
        return None


HOOKS = DecoderHooks()
