"""trainer.generate on a checkpoint saved by 2 FSDP ranks, loaded on one process: prints text,
greedy decoding is deterministic, the KV cache equals the full-forward reference, and every
new token is the argmax of a full forward over the sequence before it."""

import subprocess

import pytest
import torch

from tests.data_fixtures import (
    store_path,  # noqa: F401
)
from tests.helpers import REPO, fork_python
from tests.test_validation import val_run  # noqa: F401  (a 4-step FSDP run with checkpoints)
from trainer import generate as gen


@pytest.mark.needs_datasets
def test_generate_prints_text_deterministic_and_exact(val_run):  # noqa: F811
    ckpt = val_run[0] / "checkpoint" / "step-4"
    args = ["--checkpoint", str(ckpt), "--prompt", "def ", "--max_new_tokens", "24"]
    python, env = fork_python()
    proc = subprocess.run(
        [python, "-m", "trainer.generate", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    # After 4 steps the text is mostly newlines; a 200-step stdlib model writes code.
    assert proc.stdout.startswith("def ") and len(proc.stdout) > len("def \n"), proc.stdout
    assert proc.stderr == ""

    # In process: the same text, the KV cache equals the no-cache reference, and each new
    # token is the argmax of one full forward over the final sequence.
    from trainer.config.job import load_config

    cfg = load_config(["--job.config_file", str(gen.find_config(ckpt))])
    tok = gen.load_tokenizer(cfg.data)
    model = gen.load_model(
        ckpt, cfg, token_vocab=tok.vocab_size, max_len=64, device=torch.device("cpu")
    )
    prompt = tok.encode_docs(["def "], add_bos=True, add_eos=False)[0]
    new = gen.generate(
        model, prompt, max_new_tokens=24, token_vocab=tok.vocab_size, eos_id=tok.eos_id
    )
    assert tok.decode(prompt + new) + "\n" == proc.stdout
    assert (
        gen.generate(
            model,
            prompt,
            max_new_tokens=24,
            token_vocab=tok.vocab_size,
            eos_id=tok.eos_id,
            use_cache=False,
        )
        == new
    )
    with torch.no_grad():
        logits = model(torch.tensor([prompt + new[:-1]]))[0, len(prompt) - 1 :, : tok.vocab_size]
    assert logits.argmax(-1).tolist() == new

    # Sampling: reproducible for a seed, and another seed gives another text.
    sample = [
        gen.generate(
            model,
            prompt,
            max_new_tokens=24,
            token_vocab=tok.vocab_size,
            temperature=1.0,
            top_k=50,
            seed=s,
        )
        for s in (0, 0, 1)
    ]
    assert sample[0] == sample[1] != sample[2]


def test_kv_cache_is_exact_for_a_tied_flavor():
    """Tied flavors (no output module: the head is the embedding) decode the same with the
    KV cache as with a full forward per token."""
    from trainer.generate import generate
    from trainer.models.build import build_model
    from trainer.models.flavors import model_args

    model = build_model(model_args("debugmodel-3.2", vocab_size=512, max_seq_len=64))
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.eval()
    kw = dict(max_new_tokens=12, token_vocab=512)
    assert generate(model, [1, 5, 9], use_cache=True, **kw) == generate(
        model, [1, 5, 9], use_cache=False, **kw
    )


def test_load_model_keeps_the_flavors_rope_scaling(tmp_path):
    """A scaled-RoPE flavor (Llama-3.2) loaded for generation computes the logits of the model
    that was trained: its RoPE tables carry the flavor's scaling."""
    import torch.distributed.checkpoint as dcp

    from trainer.config.job import load_config
    from trainer.models.build import build_model
    from trainer.models.common.decoder import rope_tables
    from trainer.models.flavors import model_args

    args = model_args("debugmodel-3.2", vocab_size=512, max_seq_len=64)
    trained = build_model(args)
    trained.to_empty(device="cpu")
    trained.init_weights(0)
    dcp.save(
        {"model_optim": {"model": trained.state_dict()}},
        checkpoint_id=str(tmp_path / "step-1"),
        no_dist=True,
    )
    cfg = load_config(
        [
            "--model.flavor",
            "debugmodel-3.2",
            "--model.vocab_size",
            "512",
            "--training.seq_len",
            "64",
        ]
    )
    loaded = gen.load_model(
        tmp_path / "step-1", cfg, token_vocab=512, max_len=64, device=torch.device("cpu")
    )
    unscaled, _ = rope_tables(args.head_dim, 64, args.rope_theta)
    assert not torch.equal(loaded.rope_cos, unscaled)  # the scaling changes these tables
    tokens = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens), trained.eval()(tokens))
