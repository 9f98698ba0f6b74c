"""The [model] and [moe] sections of the job configuration: the architecture, its attention
mask and kernels, and the mixture-of-experts training knobs (trainer/config/sections.py has
the others; trainer/config/job.py collects them)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.base import did_you_mean, opt
from trainer.errors import ConfigError
from trainer.models import registry

ATTN_MASK_TYPES = ("causal", "block_causal")
POSITIONS = ("sequence", "document")
ATTN_IMPLEMENTATIONS = ("auto", "flex", "sdpa", "per_document")


@dataclass
class Model:
    """The architecture: family, flavor (size), vocabulary, attention mask and kernel
    (docs/data.md for documents, docs/moe.md for the MoE flavors)."""

    name: str = opt(
        "llama3",
        f"Model family: {registry.describe_names()}",
        choices=registry.names(),
    )
    flavor: str = opt(
        "debugmodel",
        f"Model size, by family (docs/moe.md for the MoE ones): {registry.describe_flavors()}",
    )
    n_layers: int = opt(
        0,
        "Transformer blocks: the flavor's first n_layers (a shallower model of "
        "the same widths, for quick runs and tests); 0 = all of the flavor's",
        min=0,
    )
    vocab_size: int = opt(
        0, "Model vocab; 0 = the tokenizer's, padded to vocab_size_multiple_of", min=0
    )
    vocab_size_multiple_of: int = opt(64, "Pad the model vocab up to a multiple of this", min=1)
    attn_mask_type: str = opt(
        "causal",
        "causal: every earlier token of the window; block_causal: "
        "only earlier tokens of the same document (documents from the "
        "data's BOS/EOS; docs/data.md)",
        choices=ATTN_MASK_TYPES,
    )
    positions: str = opt(
        "sequence",
        "RoPE positions: sequence (0..seq_len-1 across the window) "
        "or document (restart at 0 at each document; needs block_causal)",
        choices=POSITIONS,
    )
    attn_implementation: str = opt(
        "auto",
        "block_causal kernel: auto (flex on CUDA, per_document on CPU), flex "
        "(FlexAttention, compiled, one BlockMask per microbatch; CUDA only), sdpa (SDPA with "
        "an additive [batch, 1, seq, seq] mask) or per_document (one causal SDPA per document); "
        "causal always uses SDPA's causal kernel",
        choices=ATTN_IMPLEMENTATIONS,
    )
    mtp_layers: int = opt(
        0,
        "Multi-token prediction modules after the last layer (DeepSeek-V3 "
        "and Qwen3-Next use 1; docs/deepseek.md, docs/qwen3_next.md); 0 = off",
        min=0,
    )
    mtp_loss_weight: float = opt(
        0.3,
        "Weight of the MTP modules' mean loss in the training "
        "loss (logged apart as loss_metrics/mtp_loss)",
        min=0.0,
    )
    mtp_loss_weight_until_step: int = opt(
        0,
        "Train with mtp_loss_weight up to this step, then with mtp_loss_weight_later "
        "(DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1); 0 = mtp_loss_weight throughout",
        min=0,
    )
    mtp_loss_weight_later: float = opt(
        0.1, "The MTP loss weight after mtp_loss_weight_until_step (when that is set)", min=0.0
    )
    rope_scaling: str = opt(
        "flavor",
        "RoPE frequency scaling: flavor (as the flavor is "
        "released: Llama 3.1/3.2's, DeepSeek-V3's and Kimi K2's YaRN) or "
        "none (plain RoPE, e.g. to pretrain a DeepSeek-V3 shape at 4K "
        "from scratch as DeepSeek did) or yarn (YaRN with the two keys below, "
        "e.g. Kimi K2 0905's factor 64, or a Qwen3-Next model card's edit)",
        choices=("flavor", "none", "yarn"),
    )
    yarn_factor: float = opt(
        0.0,
        "rope_scaling = 'yarn': the context extension factor (config.json's "
        "rope_scaling.factor); 0 = the flavor's own YaRN factor",
        min=0.0,
    )
    yarn_original_max_position_embeddings: int = opt(
        0,
        "rope_scaling = 'yarn': the context the model was trained at before the "
        "extension (rope_scaling.original_max_position_embeddings); 0 = the flavor's",
        min=0,
    )
    sdpa_backends: str = opt(
        "auto",
        "SDPA kernels to allow, in the order to try: auto (cuDNN "
        "first on Hopper GPUs, torch's order elsewhere) or a comma list "
        "of cudnn, flash, efficient, math (docs/performance.md)",
    )

    def validate(self) -> None:
        from trainer.models.common.sdpa import parse
        from trainer.models.flavors import FLAVORS

        parse(self.sdpa_backends)

        if self.flavor not in FLAVORS:
            raise ConfigError(
                f"model.flavor = {self.flavor!r} is not valid; choose one of "
                f"{', '.join(repr(f) for f in FLAVORS)}{did_you_mean(self.flavor, FLAVORS)}"
            )
        family = FLAVORS[self.flavor].family
        if self.name != family:
            same = [f for f, a in FLAVORS.items() if a.family == self.name]
            raise ConfigError(
                f"model.flavor = {self.flavor!r} is a {family} model, not "
                f"model.name = {self.name!r}; set model.name = {family!r}, or "
                f"choose a {self.name} flavor: {', '.join(same)}"
            )
        self.check_depth(FLAVORS[self.flavor])
        self.check_yarn(FLAVORS[self.flavor])
        if self.mtp_loss_weight_until_step and not self.mtp_layers:
            raise ConfigError(
                f"model.mtp_loss_weight_until_step = "
                f"{self.mtp_loss_weight_until_step} schedules the MTP loss, but "
                "model.mtp_layers = 0; set model.mtp_layers >= 1 or leave it 0"
            )
        if self.positions == "document" and self.attn_mask_type == "causal":
            raise ConfigError(
                "model.positions = 'document' needs model.attn_mask_type = "
                "'block_causal': under a causal mask a token also sees earlier "
                "documents, whose restarted positions would put them at wrong "
                "relative distances"
            )

    def check_yarn(self, flavor) -> None:
        """The YaRN keys go with rope_scaling = 'yarn', and name what the flavor lacks."""
        from trainer.models.common.rope import YarnScaling

        keys = ("yarn_factor", "yarn_original_max_position_embeddings")
        if self.rope_scaling != "yarn":
            for key in keys:
                if getattr(self, key):
                    raise ConfigError(
                        f"model.{key} = {getattr(self, key)} applies only with "
                        f"model.rope_scaling = 'yarn' (it is {self.rope_scaling!r}); set it"
                    )
            return
        if isinstance(flavor.rope_scaling, YarnScaling):
            return
        if self.yarn_factor <= 1.0 or not self.yarn_original_max_position_embeddings:
            raise ConfigError(
                f"model.rope_scaling = 'yarn' on model.flavor {self.flavor!r}, which has no "
                "YaRN of its own, needs model.yarn_factor > 1 and "
                "model.yarn_original_max_position_embeddings (e.g. 4 and 262144 for "
                "Qwen3-Next's model card; config.json's rope_scaling says them)"
            )

    def check_depth(self, flavor) -> None:
        """model.n_layers keeps the flavor's first blocks: at most all of them, and in a MoE
        flavor at least one MoE block (else the [moe] and expert-parallel settings would
        apply to a dense model)."""
        if self.n_layers > flavor.n_layers:
            raise ConfigError(
                f"model.n_layers = {self.n_layers} is above the {flavor.n_layers} "
                f"blocks of model.flavor {self.flavor!r}; valid: 1 to "
                f"{flavor.n_layers}, or 0 for all of them"
            )
        moe_blocks = [i for i in range(self.n_layers) if flavor.is_moe_layer(i)]
        if self.n_layers and flavor.moe is not None and not moe_blocks:
            first = next(i for i in range(flavor.n_layers) if flavor.is_moe_layer(i))
            raise ConfigError(
                f"model.n_layers = {self.n_layers} keeps only dense blocks of "
                f"model.flavor {self.flavor!r}, whose first MoE block is block "
                f"{first}; valid: {first + 1} to {flavor.n_layers}, or 0 for all"
            )

    def mtp_weight_at(self, step: int) -> float:
        """The MTP loss weight of `step` (a function of the step alone: exact across resumes)."""
        until = self.mtp_loss_weight_until_step
        return self.mtp_loss_weight_later if until and step > until else self.mtp_loss_weight


@dataclass
class MoE:
    """Mixture-of-experts training knobs: routing, capacity, balancing and aux losses; the
    flavor fixes the experts' shape (docs/moe.md)."""

    load_balance_coeff: float = opt(
        1e-3,
        "Aux-loss-free balancing (DeepSeek-V3): after each optimizer step every expert's "
        "routing bias moves by this toward balance, sign(mean load - load); 0 = off",
        min=0.0,
    )
    load_balance_coeff_until_step: int = opt(
        0,
        "Move the balancing bias by load_balance_coeff up to this step, then not at all "
        "(DeepSeek-V3: 0.001, then 0 for the last 500B tokens); 0 = throughout",
        min=0,
    )
    aux_loss_weight: float = opt(
        0.0,
        "Weight of the global load-balancing loss (E x sum_i "
        "f_i P_i per microbatch, raw scores); 0 = off",
        min=0.0,
    )
    seq_aux_loss_weight: float = opt(
        0.0,
        "Weight (alpha) of DeepSeek-V3's complementary sequence-wise balance loss (scores "
        "normalised over the experts, f_i P_i per sequence; 1e-4 in the 671B training); 0 = off",
        min=0.0,
    )
    router_z_loss_weight: float = opt(
        0.0,
        "Weight of the router z-loss (mean logsumexp of the router logits, squared); 0 = off",
        min=0.0,
    )
    num_experts: int = opt(0, "Routed experts per MoE layer; 0 = the flavor's", min=0)
    top_k: int = opt(0, "Experts each token is routed to; 0 = the flavor's", min=0)
    n_group: int = opt(
        0,
        "Expert groups of group-limited routing (DeepSeek-V3: 8); 0 = the "
        "flavor's, 1 = plain top-k",
        min=0,
    )
    topk_group: int = opt(
        0,
        "Groups each token may route to, picked by the sum of each "
        "group's two best scores; 0 = the flavor's",
        min=0,
    )
    capacity_factor: float = opt(
        0.0,
        "0 = dropless (every routed token computed); c > 0: an "
        "expert takes at most ceil(c x tokens x top_k / experts) and "
        "the rest are dropped (counted)",
        min=0.0,
    )
    dispatch: str = opt(
        "auto",
        "Expert parallelism's token dispatch: 'flat' (one all-to-all, a row per "
        "(token, expert)), 'node' (node-limited: expert group g = node g's experts, a token "
        "crosses to each chosen node once and fans out there; needs n_group = the ep group's "
        "nodes), 'auto' (node when the ep group spans several nodes and n_group matches, flat "
        "otherwise)",
        choices=("auto", "flat", "node"),
    )
    save_dispatch: bool = opt(
        True,
        "Under activation checkpointing the node-limited dispatch's recompute reuses the "
        "rows its inter-node stage received instead of sending them again (memory for bytes; "
        "the flat dispatch, top_k rows a token, always sends again); false: send again",
    )

    def balance_coeff_at(self, step: int) -> float:
        """The bias update speed after `step`'s optimizer step (a function of the step alone)."""
        until = self.load_balance_coeff_until_step
        return 0.0 if until and step > until else self.load_balance_coeff
