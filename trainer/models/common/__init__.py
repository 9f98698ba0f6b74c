"""The layers every family builds from: attention and its kernels (attention.py, sdpa.py,
logits.py for QK-clip's maxima), RoPE and its scalings (rope.py), norms (layers.py), the MoE
feed-forward (moe.py), multi-head latent attention (mla.py), multi-token prediction (mtp.py),
the chunked and loss-parallel cross-entropy (loss.py), and the decoder they make up
(decoder.py). No module here knows which family uses it."""
