"""Generate text from a training checkpoint, on one process (CPU or one GPU).

    python -m trainer.generate --checkpoint outputs/debug_model/checkpoint/step-100 \\
        --prompt "def " --max_new_tokens 64 [--temperature 0] [--top_k 50] [--seed 0]

The model shape and the tokenizer come from the run's saved `config.toml` (found next to the
checkpoint folder, or given with --config). The DCP checkpoint, saved sharded on any number of
ranks, loads into one unsharded model (only the model weights are read). --checkpoint may also
be a Hugging Face folder (config.json and safetensors, e.g. the run's `last_save_in_hf`
export), read as `checkpoint.initial_load_in_hf` reads it. Either may be at an s3:// or gs://
URL (read where it is: DCP's fsspec reader, or ranged reads of the safetensors; a run's
config.toml stays in its local dump folder, so a URL needs --config); a tokenizer of a token
store at a URL is copied into data.cache_dir once. Tokens past the tokenizer's vocab (the model
vocab's padding) are never generated.

Decoding: `--temperature 0` (the default) is greedy: deterministic, and each new token is the
argmax of a full forward over the sequence so far. A KV cache (attention keys and values of the
earlier positions) makes each new token cost one position instead of the whole sequence;
`--no_cache` runs the full forward every time (the reference the cache is tested against).
With a temperature > 0, tokens are sampled from the top-k logits with a generator seeded by
--seed. For a `synthetic` run (no tokenizer) the prompt and output are token ids.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from trainer.errors import ConfigError, UserError


def find_config(checkpoint: str) -> Path:
    """The run's config.toml: in the first parent of the checkpoint folder that has one."""
    from trainer.checkpoint import storage

    if storage.is_url(checkpoint):
        raise ConfigError(
            f"--checkpoint {checkpoint} is in an object store, away from its "
            "run's config.toml: pass --config {dump_folder}/config.toml"
        )
    for parent in list(Path(checkpoint).resolve().parents)[:4]:
        if (parent / "config.toml").is_file():
            return parent / "config.toml"
    raise ConfigError(
        f"no config.toml of the run found above {checkpoint}; pass --config "
        "{dump_folder}/config.toml"
    )


def load_tokenizer(data_cfg):
    """The run's tokenizer (None for synthetic data), without re-checking the store."""
    from trainer.data.tokenizer import Tokenizer

    if data_cfg.dataset == "synthetic":
        return None
    if data_cfg.tokenizer_path:
        return Tokenizer(os.path.expanduser(data_cfg.tokenizer_path))
    if data_cfg.store_path:
        from trainer.data.store import TOKENIZER_FILE

        if "://" in data_cfg.store_path:  # the store's copy, fetched once into the cache
            return Tokenizer(
                remote_store_tokenizer(data_cfg.store_path.rstrip("/"), data_cfg.cache_dir)
            )
        return Tokenizer(Path(os.path.expanduser(data_cfg.store_path)) / TOKENIZER_FILE)
    from trainer.data.cache import ensure_stdlib  # the stdlib default: cached at training

    return Tokenizer(ensure_stdlib(data_cfg, show_progress=False)[0])


def remote_store_tokenizer(url: str, cache_dir: str) -> str:
    """The local copy of a URL store's tokenizer.model (checked against its manifest)."""
    from trainer.checkpoint import storage
    from trainer.data import remote
    from trainer.data.store import TOKENIZER_FILE, read_remote_manifest

    storage.check_path(url, "data.store_path")
    storage.probe(url, "data.store_path")
    sha256 = read_remote_manifest(url)["tokenizer"]["sha256"]
    return remote.cached_tokenizer(f"{url}/{TOKENIZER_FILE}", sha256, cache_dir)


def checkpoint_kind(checkpoint: str) -> str:
    """'dcp' (a step-N folder: .metadata) or 'hf' (config.json), local or at a URL."""
    from trainer.checkpoint import storage

    if storage.is_url(checkpoint):
        storage.check_path(checkpoint, "--checkpoint")
        storage.probe(checkpoint, "--checkpoint")
    if storage.exists(storage.join(checkpoint, ".metadata")):
        return "dcp"
    if storage.exists(storage.join(checkpoint, "config.json")):
        return "hf"
    raise ConfigError(
        f"--checkpoint {checkpoint} is neither a checkpoint (no .metadata) nor a "
        "Hugging Face folder (no config.json); use a committed "
        "{dump_folder}/checkpoint/step-N folder or an exported one"
    )


def load_model(
    checkpoint: str, cfg, *, token_vocab: int, max_len: int, device, allow_pickle: bool = False
):
    """An unsharded fp32 Transformer with the checkpoint's weights, in eval mode."""
    from trainer.checkpoint import safe_load
    from trainer.data import padded_vocab_size
    from trainer.models.build import build_model
    from trainer.models.common.attention import rope_args
    from trainer.models.flavors import model_args

    vocab = cfg.model.vocab_size or padded_vocab_size(token_vocab, cfg.model.vocab_size_multiple_of)
    args = model_args(
        cfg.model.flavor,
        vocab_size=vocab,
        max_seq_len=max(cfg.training.seq_len, max_len),
        n_layers=cfg.model.n_layers,
        moe_config=cfg.moe,
        **rope_args(cfg.model),
    )
    model = build_model(args).to_empty(device=device)
    model.init_rope()  # with the flavor's RoPE scaling, as in training
    if checkpoint_kind(checkpoint) == "hf":  # its shapes checked against the flavor there
        from trainer.hf.load import load_hf

        with torch.no_grad():
            load_hf(
                model,
                checkpoint,
                flavor=cfg.model.flavor,
                log=lambda line: print(line, file=sys.stderr),
            )
        return model.eval()
    saved = safe_load.read_metadata(str(checkpoint), allow_pickle).state_dict_metadata
    weights = model.state_dict()
    for name, tensor in weights.items():
        meta = saved.get(f"model_optim.model.{name}")
        if meta is None or tuple(getattr(meta, "size", ())) != tuple(tensor.shape):
            raise ConfigError(
                f"checkpoint {checkpoint} does not fit the model of its "
                f"config.toml: {name} differs; pass the run's --config"
            )
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*single process")
        safe_load.load(
            {"model_optim": {"model": weights}}, str(checkpoint), allow_pickle=allow_pickle
        )
    return model.eval()


class KVCache:
    """Keys and values of every layer for positions [0, length), preallocated."""

    def __init__(self, model, batch: int, max_len: int):
        a = model.args
        k_shape = (batch, max_len, a.n_kv_heads, a.head_dim)
        v_shape = (batch, max_len, a.n_kv_heads, a.v_head_dim)  # MLA: narrower values
        p = next(model.parameters())
        self.k = [torch.zeros(k_shape, dtype=p.dtype, device=p.device) for _ in model.layers]
        self.v = [torch.zeros(v_shape, dtype=p.dtype, device=p.device) for _ in model.layers]
        self.length = 0


def forward_cached(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits of `tokens` [b, s] placed after the cache's positions; appends to the cache.
    The same computation as Transformer.forward, with the earlier keys/values reused."""
    start, seq = cache.length, tokens.shape[1]
    end = start + seq
    cos, sin = model.rope_cos[start:end], model.rope_sin[start:end]
    # Query at position start+i sees keys at positions <= start+i.
    mask = (
        torch.arange(end, device=tokens.device)[None, :]
        <= torch.arange(start, end, device=tokens.device)[:, None]
    )
    h = model.tok_embeddings(tokens)
    for i, layer in enumerate(model.layers.values()):
        attn, x = layer.attention, layer.attention_norm(h)
        b = x.shape[0]
        q, k, v = attn.project(x, cos, sin)  # GQA or MLA (the per-head keys and values)
        cache.k[i][:, start:end], cache.v[i][:, start:end] = k, v
        keys, values = cache.k[i][:, :end], cache.v[i][:, :end]
        groups = attn.n_heads // attn.n_kv_heads
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=2)
            values = values.repeat_interleave(groups, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
        )
        h = h + attn.wo(out.transpose(1, 2).reshape(b, seq, -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    cache.length = end
    h = model.norm(h)
    # Tied flavors (llama3.2-*) have no output module: the head is the embedding matrix.
    return model.output(h) if model.output is not None else F.linear(h, model.tok_embeddings.weight)


def pick(
    logits: torch.Tensor,
    *,
    token_vocab: int,
    temperature: float,
    top_k: int,
    generator: torch.Generator | None,
) -> int:
    """The next token from the last position's logits [vocab]: argmax, or a top-k sample."""
    logits = logits[:token_vocab].float()
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.no_grad()
def generate(
    model,
    prompt: list[int],
    *,
    max_new_tokens: int,
    token_vocab: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    use_cache: bool = True,
    eos_id: int = -1,
) -> list[int]:
    """The new token ids after `prompt` (stops early at `eos_id`)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    ids, new = list(prompt), []
    cache = KVCache(model, 1, len(prompt) + max_new_tokens) if use_cache else None
    pending = ids
    for _ in range(max_new_tokens):
        tokens = torch.tensor([pending if use_cache else ids], device=device)
        logits = forward_cached(model, tokens, cache) if use_cache else model(tokens)
        token = pick(
            logits[0, -1],
            token_vocab=token_vocab,
            temperature=temperature,
            top_k=top_k,
            generator=generator,
        )
        ids.append(token)
        new.append(token)
        pending = [token]
        if token == eos_id:
            break
    return new


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainer.generate", description="Generate text from a training checkpoint."
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help="{dump_folder}/checkpoint/step-N, or a "
        "Hugging Face folder; either may be an s3:// or gs:// URL",
    )
    p.add_argument(
        "--config", default="", help="the run's config.toml (default: found above the checkpoint)"
    )
    p.add_argument("--prompt", default="", help="text (token ids for a synthetic run)")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=50, help="sample among the k most likely; 0 = all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_cache", action="store_true", help="full forward for every token")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument(
        "--allow_pickle",
        "--allow-pickle",
        action="store_true",
        help="load a checkpoint whose metadata names classes outside DCP's own "
        "(older torch): it can run code, so only for your own checkpoints",
    )
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    from trainer.config.job import load_config

    a = parse_args(argv)
    try:
        if a.max_new_tokens < 1 or a.temperature < 0 or a.top_k < 0:
            raise ConfigError("--max_new_tokens must be >= 1, --temperature and --top_k >= 0")
        checkpoint = a.checkpoint if "://" in a.checkpoint else os.path.expanduser(a.checkpoint)
        cfg = load_config(["--job.config_file", str(a.config or find_config(checkpoint))])
        tok = load_tokenizer(cfg.data)
        if tok is None:
            prompt = [int(t) for t in a.prompt.split()] or [0]
            token_vocab, eos = cfg.data.vocab_size, -1
        else:
            prompt = tok.encode_docs([a.prompt], add_bos=cfg.data.add_bos, add_eos=False)[0]
            token_vocab, eos = tok.vocab_size, tok.eos_id
        if not prompt:
            raise ConfigError("--prompt is empty and the tokenizer adds no BOS; give a prompt")
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(auto if a.device == "auto" else a.device)
        model = load_model(
            checkpoint,
            cfg,
            token_vocab=token_vocab,
            max_len=len(prompt) + a.max_new_tokens,
            device=device,
            allow_pickle=a.allow_pickle,
        )
    except (UserError, ValueError) as e:
        print(e.one_line() if isinstance(e, UserError) else f"config error: {e}", file=sys.stderr)
        return 2
    new = generate(
        model,
        prompt,
        max_new_tokens=a.max_new_tokens,
        token_vocab=token_vocab,
        temperature=a.temperature,
        top_k=a.top_k,
        seed=a.seed,
        use_cache=not a.no_cache,
        eos_id=eos,
    )
    print(" ".join(map(str, prompt + new)) if tok is None else tok.decode(prompt + new))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
