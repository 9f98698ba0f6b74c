"""block_causal attention and document positions, in one process on the CPU (fp32).

The windows are real packed windows: documents framed by BOS (1) and EOS (2) as a store
frames them, several per row, the first one cut by the window's start. What must hold:
- no leak: the gradient of one document's loss (the positions whose input is in it) with
  respect to the input embeddings of every other document of the window is exactly zero, and
  it is not under `causal` (the test would fail on the code before block_causal existed);
- per-token losses of the packed window equal those of each document run alone as its own
  sequence (positions 'document': from 0; 'sequence': at its offset in the window);
- op-level selective AC saves the new path's attention output, and compile + AC give the
  eager results; FlexAttention (the CUDA path) gives the same forward here (its backward does
  not exist on the CPU).
"""

import pytest
import torch
import torch.nn.functional as F

from tests.data_fixtures import (
    store_path,  # noqa: F401
)
from trainer.data.documents import (
    IGNORE_INDEX,
    Delimiters,
    check_documents,
    document_ids,
    split_window,
)
from trainer.errors import ConfigError, DataError
from trainer.models.build import build_model
from trainer.models.common.attention import document_positions, resolve_implementation
from trainer.models.flavors import model_args
from trainer.parallel.parallelize import _SAVE_OPS, apply_ac, apply_compile

BOS, EOS, VOCAB, SEQ = 1, 2, 256, 48
DELIMS = Delimiters(BOS, EOS)
# Documents of each row (lengths include BOS/EOS); the first starts before the window.
ROWS = [
    [("tail", 9), ("doc", 17), ("doc", 6), ("doc", 17)],
    [("tail", 3), ("doc", 30), ("doc", 16)],
]


def windows() -> torch.Tensor:
    """[2, SEQ + 1] token windows of BOS text EOS documents (text ids >= 3)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for row in ROWS:
        toks = []
        for kind, n in row:
            body = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
            if kind == "doc":
                body[0] = BOS
            body[-1] = EOS
            toks += body
        rows.append(toks[: SEQ + 1])
    return torch.tensor(rows)


def tiny(mask="block_causal", positions="sequence", impl="sdpa", flavor="debugmodel-tiny"):
    args = model_args(
        flavor,
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        attn_mask_type=mask,
        positions=positions,
        attn_implementation=impl,
    )
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model


def token_losses(model, inputs, labels, **kw) -> torch.Tensor:
    logits = model(inputs, **kw)
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    ).view(labels.shape)


def test_document_ids_and_positions_for_each_framing():
    toks = torch.tensor([[7, 2, 1, 5, 6, 2, 1, 8]])
    assert document_ids(toks, Delimiters(1, 2)).tolist() == [[0, 0, 1, 1, 1, 1, 2, 2]]
    assert document_ids(toks, Delimiters(1, None)).tolist() == [[0, 0, 1, 1, 1, 1, 2, 2]]
    eos_only = torch.tensor([[7, 2, 5, 6, 2, 8, 9, 2]])
    ids = document_ids(eos_only, Delimiters(None, 2))
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 2, 2]]  # nothing starts after the last EOS
    assert document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]


def test_predict_document_start_masks_only_the_targets_that_start_a_document():
    w = torch.tensor([[7, 2, 1, 5, 6, 2, 1, 8, 9]])
    x, y = split_window(w, DELIMS, True)
    assert torch.equal(x, w[:, :-1]) and torch.equal(y, w[:, 1:])
    _, masked = split_window(w, DELIMS, False)
    assert masked.tolist() == [[2, IGNORE_INDEX, 5, 6, 2, IGNORE_INDEX, 8, 9]]  # the BOS targets
    _, eos_only = split_window(torch.tensor([[7, 2, 5, 6, 2, 8]]), Delimiters(None, 2), False)
    assert eos_only.tolist() == [[2, IGNORE_INDEX, 6, 2, IGNORE_INDEX]]  # first text tokens


IMPLS = ["per_document", "sdpa"]  # the CPU's two (flex has no backward here)


@pytest.mark.parametrize("flavor", ["debugmodel-tiny", "debugmodel-dsv3"])  # GQA, MLA
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("positions", ["sequence", "document"])
def test_no_gradient_crosses_documents(positions, impl, flavor):
    inputs, labels = split_window(windows(), DELIMS, True)
    ids = document_ids(inputs, DELIMS)

    def grads(model):
        """{(row, doc): d loss_doc / d input embeddings} for every document of the window."""
        kept = {}
        model.tok_embeddings.register_forward_hook(
            lambda m, i, out: kept.setdefault("e", out.detach().requires_grad_())
        )
        losses = token_losses(model, inputs, labels, doc_ids=ids)
        out = {}
        for b in range(inputs.shape[0]):
            for d in ids[b].unique().tolist():
                loss = losses[b][ids[b] == d].sum()
                out[b, d] = torch.autograd.grad(loss, kept["e"], retain_graph=True)[0]
        return out

    for (b, d), g in grads(tiny("block_causal", positions, impl, flavor)).items():
        mine = torch.zeros_like(ids, dtype=torch.bool)
        mine[b] = ids[b] == d
        assert g[~mine].abs().max() == 0, (b, d)  # exactly zero outside the document
        assert g[mine].abs().max() > 0, (b, d)
    leaks = [
        g[b][ids[b] < d].abs().max()
        for (b, d), g in grads(tiny("causal", flavor=flavor)).items()
        if d
    ]
    assert min(leaks) > 0  # causal: every later document depends on the earlier ones


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("positions", ["document", "sequence"])
def test_packed_window_equals_each_document_alone(positions, impl):
    inputs, labels = split_window(windows(), DELIMS, True)
    ids = document_ids(inputs, DELIMS)
    model = tiny("block_causal", positions, impl)
    with torch.no_grad():
        packed = token_losses(model, inputs, labels, doc_ids=ids)
        for b in range(inputs.shape[0]):
            for d in ids[b].unique().tolist():
                where = (ids[b] == d).nonzero().flatten()
                x, y = inputs[b : b + 1, where], labels[b : b + 1, where]
                at = where[None] if positions == "sequence" else where[None] - where[0]
                alone = token_losses(model, x, y, doc_ids=torch.zeros_like(x), positions=at)
                assert (packed[b, where] - alone[0]).abs().max() <= 1e-5, (b, d)
        ref = token_losses(tiny("causal"), inputs[:1, :9], labels[:1, :9])  # the cut document
        assert (packed[0, :9] - ref[0]).abs().max() <= 1e-5  # = causal when it is alone


def test_flex_forward_equals_sdpa():
    """The CUDA path's mask (a BlockMask of the same documents) and GQA mapping, checked on the
    CPU where FlexAttention runs forward only."""
    inputs, labels = split_window(windows(), DELIMS, True)
    ids = document_ids(inputs, DELIMS)
    with torch.no_grad():
        ref = token_losses(tiny("block_causal", "document"), inputs, labels, doc_ids=ids)
        got = token_losses(tiny("block_causal", "document", "flex"), inputs, labels, doc_ids=ids)
    assert (got - ref).abs().max() <= 1e-5


def attention_calls(model, inputs, ids) -> tuple[int, dict]:
    """(attention kernel calls in one forward + backward, the gradients)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in _SAVE_OPS and "attention" in str(func):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        model(inputs, doc_ids=ids).float().square().mean().backward()
    return Count.n, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("impl, calls", [("sdpa", 2), ("per_document", 14)])
def test_op_level_ac_saves_the_attention_output(impl, calls):
    """Kernel calls: one per layer (sdpa) or one per document and layer (per_document: 4 + 3
    documents in the two rows, 2 layers); op-level AC replays them, full AC reruns them."""
    inputs, _ = split_window(windows(), DELIMS, True)
    ids = document_ids(inputs, DELIMS)
    counts, grads = {}, {}
    for mode, option in (("none", "2"), ("selective", "op"), ("full", "2")):
        model = tiny("block_causal", "document", impl)
        if mode != "none":
            apply_ac(model, mode, option)
        counts[mode], grads[mode] = attention_calls(model, inputs, ids)
    assert counts == {"none": calls, "selective": calls, "full": 2 * calls}
    for mode in ("selective", "full"):
        for name, g in grads["none"].items():
            assert torch.equal(grads[mode][name], g), (mode, name)
    assert torch.ops.higher_order.flex_attention in _SAVE_OPS  # the CUDA path's op


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_and_op_level_ac_give_the_eager_results(impl):
    inputs, labels = split_window(windows(), DELIMS, True)
    ids = document_ids(inputs, DELIMS)
    out = {}
    for name in ("eager", "compiled"):
        model = tiny("block_causal", "document", impl)
        if name == "compiled":
            apply_ac(model, "selective", "op")
            apply_compile(model)
        loss = token_losses(model, inputs, labels, doc_ids=ids).sum()
        loss.backward()
        out[name] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    assert torch.allclose(out["compiled"][0], out["eager"][0], rtol=1e-5)
    for n, g in out["eager"][1].items():
        assert torch.allclose(out["compiled"][1][n], g, rtol=1e-4, atol=1e-6), n


def test_configuration_errors_name_the_problem(tmp_path):
    from trainer.config.job import load_config

    with pytest.raises(ConfigError, match="synthetic' has none"):
        load_config(["--model.attn_mask_type", "block_causal", "--data.dataset", "synthetic"])
    with pytest.raises(ConfigError, match="positions = 'document' needs"):
        load_config(["--model.positions", "document"])
    with pytest.raises(ConfigError, match="flex' needs CUDA"):
        load_config(
            [
                "--model.attn_mask_type",
                "block_causal",
                "--model.attn_implementation",
                "flex",
                "--training.device",
                "cpu",
            ]
        )
    with pytest.raises(ConfigError, match="flex' needs CUDA"):
        resolve_implementation("block_causal", "flex", "cpu")
    assert resolve_implementation("block_causal", "auto", "cuda") == "flex"
    assert resolve_implementation("block_causal", "auto", "cpu") == "per_document"
    assert resolve_implementation("causal", "flex", "cuda") == "sdpa"
    model = tiny("block_causal")
    with pytest.raises(ValueError, match="needs doc_ids"):
        model(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.needs_datasets
def test_a_store_without_delimiters_is_refused(json_cfg, tmp_path):
    """A store prepared with add_bos = add_eos = false has no documents: block_causal on it is
    one data error naming the store and why; with its default framing it has them."""
    from dataclasses import replace

    from trainer.config.job import Model
    from trainer.data import build_dataloader
    from trainer.data.prepare import prepare_store

    plain = str(tmp_path / "plain")
    prepare_store(
        replace(json_cfg, add_bos=False, add_eos=False),
        json_cfg.tokenizer_path,
        plain,
        workers=1,
        show_progress=False,
    )
    kw = dict(seq_len=32, local_batch_size=2, global_batch_size=2, dp_rank=0, dp_size=1, seed=0)
    loader = build_dataloader(replace(json_cfg, store_path=plain, tokenizer_path=""), **kw)
    assert loader.delimiters is None and loader.document_ids(torch.zeros(1, 2)) is None
    with pytest.raises(
        DataError,
        match=r"needs document boundaries, but token store .*plain was "
        r"prepared with add_bos = false and add_eos = false",
    ):
        check_documents(Model(attn_mask_type="block_causal"), loader)
    check_documents(Model(), loader)  # causal needs nothing
    loader.predict_document_start = False
    with pytest.raises(DataError, match="data.predict_document_start = false needs document"):
        check_documents(Model(), loader)


def test_store_loader_frames_and_masks_as_its_manifest_says(store_cfg):
    from dataclasses import replace

    from tests.data_fixtures import build

    kw = dict(seq_len=2048, local_batch_size=4, global_batch_size=4)  # documents are long
    loader = build(store_cfg, **kw)
    assert loader.delimiters == Delimiters(1, 2)  # the fixture tokenizer's BOS / EOS
    assert "documents start at each BOS (id 1) and after each EOS (id 2)" in loader.describe()
    masked = build(replace(store_cfg, predict_document_start=False), **kw)
    seen = 0
    for _ in range(20):
        (x, y), (x2, y2) = loader.next_microbatch(), masked.next_microbatch()
        assert torch.equal(x, x2)
        starts = (y == BOS) | (x == EOS)
        assert torch.equal(y2, y.masked_fill(starts, IGNORE_INDEX))
        seen += int(starts.sum())
    assert seen >= 3, seen


@pytest.mark.parametrize(
    "impl, positions, dtype",
    [
        ("sdpa", "sequence", "bfloat16"),
        ("sdpa", "document", "float32"),
        ("per_document", "sequence", "bfloat16"),
        ("per_document", "document", "float32"),
    ],
)
def test_plan_counts_the_mask_and_document_tables(impl, positions, dtype):
    """What forward leaves for backward under block_causal (the CPU's kernels), against the
    memory plan's formulas, within 0.5% (as tests/test_plan.py for causal). The per-block bf16
    copies of document cos/sin are made by FSDP's input cast, absent here: fp32 for those."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from trainer.config.job import load_config
    from trainer.models.common.attention import memory_bytes
    from trainer.plan.activations import head_saved
    from trainer.plan.memory import blocks_activations

    args = model_args(
        "debugmodel-tiny",
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        attn_mask_type="block_causal",
        positions=positions,
        attn_implementation=impl,
    )
    inputs, _ = split_window(windows(), DELIMS, True)
    ids = document_ids(inputs, DELIMS)
    p = torch.finfo(getattr(torch, dtype)).bits // 8
    model = build_model(args)
    model.to_empty(device="cpu")
    for param in model.parameters():
        param.data = param.data.to(getattr(torch, dtype)).normal_(0, 0.02)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        logits = model(inputs, doc_ids=ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), inputs.flatten())
        snap = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
    assert loss.grad_fn is not None
    measured = next(v for k, v in snap.items() if getattr(k, "value", "") == "Activation")
    tokens = inputs.numel()
    expected = (
        blocks_activations(load_config([]), args, p, tokens)
        + head_saved(args, p) * tokens
        + memory_bytes(args, inputs.shape[0], SEQ, p)
        + (p + 4) * VOCAB * tokens
    )
    assert abs(expected / measured - 1) < 0.005, (expected, measured)


def test_a_single_document_computes_as_the_causal_model():
    """Generation and the HF export run the plain causal forward: for one document (a prompt
    starting with BOS) a block_causal, document-positions model gives the same logits."""
    prompt = windows()[:1, 9 : 9 + 17]  # the first whole document: BOS ... EOS
    assert prompt[0, 0] == BOS and prompt[0, -1] == EOS
    with torch.no_grad():
        ref = tiny("causal")(prompt)
        for impl in IMPLS:
            got = tiny("block_causal", "document", impl)(
                prompt, doc_ids=document_ids(prompt, DELIMS)
            )
            assert (got - ref).abs().max() <= 1e-5, impl


@pytest.mark.needs_datasets
def test_streamed_and_blended_sources_know_their_documents(json_cfg):
    """A streamed source frames by data.add_bos / add_eos; a blend's delimiters are its
    sources' together, and one source without any leaves the blend without documents."""
    from dataclasses import replace
    from types import SimpleNamespace

    from tests.data_fixtures import build
    from trainer.data.mix_loader import _blend_delimiters

    assert build(json_cfg).delimiters == Delimiters(1, 2)
    eos_only = build(
        replace(json_cfg, add_bos=False, predict_document_start=False),
        seq_len=4096,
        global_batch_size=2,
    )
    assert eos_only.delimiters == Delimiters(None, 2)
    x, y = eos_only.next_microbatch()
    assert (x == EOS).any() and torch.equal(y == IGNORE_INDEX, x == EOS)  # after each EOS
    none = build(replace(json_cfg, add_bos=False, add_eos=False))
    assert none.delimiters is None and "framed by neither BOS nor EOS" in none.no_documents
    src = {
        "a": SimpleNamespace(delimiters=Delimiters(1, None), no_documents=""),
        "b": SimpleNamespace(delimiters=Delimiters(None, 2), no_documents=""),
    }
    assert _blend_delimiters(src) == (Delimiters(1, 2), "")
    src["c"] = SimpleNamespace(delimiters=None, no_documents="token store c was prepared ...")
    assert _blend_delimiters(src) == (None, "data.mix source 'c': token store c was prepared ...")
