"""Downstream evals, in one process: lm-eval's tokenization of a (context, continuation)
pair, log-likelihood scoring on a model whose answer is known, acc/acc_norm, the built-in
task, and the JSONL / Hugging Face task readers with their one-line errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainer.config.job import load_config
from trainer.errors import ConfigError, DataError
from trainer.evals.config import HFTask
from trainer.evals.scoring import (
    Request,
    build_requests,
    choice_metrics,
    encode_pair,
    make_request,
    score_batch,
)
from trainer.evals.tasks import Example, Task, load_hf_task, read_jsonl
from trainer.models.common.loss import IGNORE_INDEX, scoring_loss


def char_encode(texts):
    """A tokenizer without merges: one id per character."""
    return [[ord(c) for c in t] for t in texts]


def merging_encode(texts):
    """A tokenizer that merges ' b' into one token: the boundary matters."""
    out = []
    for t in texts:
        ids, i = [], 0
        while i < len(t):
            if t[i : i + 2] == " b":
                ids.append(1000)
                i += 2
            else:
                ids.append(ord(t[i]))
                i += 1
        out.append(ids)
    return out


def test_encode_pair_moves_trailing_space_and_splits_the_whole_string():
    # Trailing whitespace of the context goes to the continuation (lm-eval's _encode_pair).
    ctx, cont = encode_pair(char_encode, "ab ", "cd", prefix=[], prefix_token=1)
    assert ctx == [ord("a"), ord("b")] and cont == [ord(" "), ord("c"), ord("d")]
    # The continuation is the whole string's tokens after the context's: ' b' stays merged.
    ctx, cont = encode_pair(merging_encode, "a ", "b", prefix=[5], prefix_token=5)
    assert ctx == [5, ord("a")] and cont == [1000]
    # An empty context is the prefix token; the continuation is encoded alone.
    assert encode_pair(char_encode, "", "xy", prefix=[], prefix_token=7) == ([7], [120, 121])


def test_left_truncation_keeps_the_last_seq_len_plus_one_tokens():
    r = make_request(list(range(10)), [10, 11, 12], seq_len=5)
    assert r.tokens == (7, 8, 9, 10, 11, 12) and r.n_cont == 3
    r = make_request([1], [2, 3, 4, 5, 6, 7, 8], seq_len=4)  # continuation longer than the window
    assert r.tokens == (4, 5, 6, 7, 8) and r.n_cont == 4


class Bigram(torch.nn.Module):
    """logits[b, t] = table[tokens[b, t]]: every log-likelihood is known in closed form."""

    def __init__(self, vocab=16, seed=0):
        super().__init__()
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed))

    def forward(self, tokens, labels=None, loss_fn=None):
        # hidden = one-hot tokens, head weight = table^T: the head's logits are table[tokens]
        hidden = F.one_hot(tokens, self.table.shape[0]).float()
        weight = self.table.t()
        return F.linear(hidden, weight) if labels is None else loss_fn(hidden, weight, labels)

    def ll(self, tokens, n_cont):
        logp = torch.log_softmax(self.table.double(), -1)
        return sum(
            float(logp[tokens[i - 1], tokens[i]]) for i in range(len(tokens) - n_cont, len(tokens))
        )


CHUNKED = scoring_loss(chunk_size=3)  # smaller than a row: rows span chunks


def test_score_batch_sums_the_continuation_log_probs_whatever_the_padding():
    model = Bigram()
    reqs = [Request((1, 2, 3, 4), 2), Request((5, 6), 1), Request((7, 8, 9, 10, 11, 12, 13), 3)]
    got = score_batch(model, reqs, torch.device("cpu"), CHUNKED)
    want = [model.ll(r.tokens, r.n_cont) for r in reqs]
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(want, abs=1e-5)
    alone = [score_batch(model, [r], torch.device("cpu"), CHUNKED).item() for r in reqs]
    assert alone == pytest.approx(got.tolist(), abs=1e-6)  # right padding changes nothing


def test_acc_and_acc_norm_on_known_log_likelihoods():
    examples = [
        Example("c", ("a", "bbbb"), 1),  # raw: a wins (-2 > -4); per char: bbbb wins
        Example("c", ("aa", "b", "cc"), 0),  # raw: b wins; per char: aa (-0.5) wins
        Example("c", ("x", "y"), 0),
    ]  # a tie goes to the first choice (np.argmax)
    lls = np.array([-2.0, -4.0, -1.0, -0.9, -3.0, -1.0, -1.0])
    assert choice_metrics(lls, examples) == {
        "acc": pytest.approx(1 / 3),
        "acc_norm": pytest.approx(1.0),
    }


def test_scoring_a_task_end_to_end_picks_the_model_s_favourite():
    """A bigram model that makes 'ab' likely and everything else not: the choice 'b' after
    the context 'a' wins; build_requests uses the tokenizer's BOS as lm-eval's prefix."""

    class Tok:
        bos_id, eos_id = 1, 2

        def encode_docs(self, texts, add_bos, add_eos):
            assert not add_bos and not add_eos
            return [[3 + ord(c) - ord("a") for c in t] for t in texts]

    model = Bigram(vocab=8)
    model.table.zero_()
    model.table[3, 4] = 10.0  # after 'a', 'b' is likely
    task = Task("t", [Example("a", ("c", "b", "d"), 1)])
    reqs = build_requests(task, Tok(), seq_len=16, add_bos=True)
    assert reqs[1] == Request((1, 3, 4), 1)
    lls = score_batch(model, reqs, torch.device("cpu"), CHUNKED).numpy()
    assert np.argmax(lls) == 1
    assert lls[1] == pytest.approx(10 - math.log(math.exp(10) + 7), abs=1e-5)
    assert choice_metrics(lls, task.examples) == {"acc": 1.0, "acc_norm": 1.0}


def test_builtin_task_is_deterministic_and_not_solvable_by_length():
    from trainer.evals.stdlib_next_line import N_CHOICES, N_EXAMPLES, build_examples

    examples = build_examples()
    assert len(examples) == N_EXAMPLES
    assert all(len(e.choices) == N_CHOICES and len(set(e.choices)) == N_CHOICES for e in examples)
    assert all(e.context.count("\n") >= 1 and e.context[-1] != "\n" for e in examples)
    build_examples.cache_clear()
    assert build_examples() == examples
    gold = np.array([e.gold for e in examples])
    size = np.array([[len(c.encode()) for c in e.choices] for e in examples])
    chance = 1 / N_CHOICES
    assert (size.argmax(1) == gold).mean() < chance + 0.03  # pick the longest
    assert (size.argmin(1) == gold).mean() < chance + 0.03  # pick the shortest
    assert abs(np.bincount(gold).max() / len(gold) - chance) < 0.05  # gold positions balanced


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GOOD = {"context": "1 + 1 =", "choices": [" 2", " 3"], "gold": 0}


def test_jsonl_task_reads_examples_and_limit(tmp_path):
    path = write_jsonl(tmp_path / "arith.jsonl", [GOOD, "", {**GOOD, "gold": 1}])
    assert read_jsonl(path) == [
        Example("1 + 1 =", (" 2", " 3"), 0),
        Example("1 + 1 =", (" 2", " 3"), 1),
    ]
    assert len(read_jsonl(path, limit=1)) == 1


@pytest.mark.parametrize(
    "row, message",
    [
        ("{not json", r"line 2: not valid JSON"),
        ({"context": "x", "choices": ["a", "b"]}, r"line 2: missing key 'gold'"),
        ({**GOOD, "gold": 2}, r"line 2: gold index 2 is out of range for 2 choices"),
        ({**GOOD, "gold": -1}, r"line 2: gold index -1 is out of range"),
        ({**GOOD, "choices": ["only"]}, r"line 2: 'choices' must be a list of at least 2"),
        ({**GOOD, "gold": "zero"}, r"line 2: 'gold' must be an integer index"),
        ([1, 2], r"line 2: expected a JSON object"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, row])
    with pytest.raises(DataError, match=message) as e:
        read_jsonl(path)
    assert e.value.one_line().startswith(f"data error: eval task {path} line 2: ")


def test_missing_or_empty_task_file(tmp_path):
    with pytest.raises(DataError, match=r"eval task file not found: .*nope.jsonl \(eval.tasks\)"):
        read_jsonl(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="has no examples"):
        read_jsonl(write_jsonl(tmp_path / "empty.jsonl", [""]))


def test_config_errors():
    with pytest.raises(
        ConfigError,
        match=r"unknown built-in task 'stdlib_next_lin' \(did you "
        r"mean 'stdlib_next_line'\?\)",
    ):
        load_config(["--eval.tasks", "stdlib_next_lin"])
    with pytest.raises(ConfigError, match="two tasks are named 'a'"):
        load_config(["--eval.tasks", "x/a.jsonl,y/a.jsonl"])
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        load_config(["--eval.enable", "true", "--data.dataset", "synthetic"])
    with pytest.raises(ConfigError, match=r"eval.hf_tasks\[0\].dataset is empty"):
        load_config(["--eval.hf_tasks", '[{name = "h"}]'])
    cfg = load_config(["--eval.enable", "true", "--eval.tasks", "stdlib_next_line,d/arc.jsonl"])
    assert cfg.eval.tasks == ["stdlib_next_line", "d/arc.jsonl"]


@pytest.mark.needs_datasets
def test_hf_task_from_local_files_offline(tmp_path, monkeypatch):
    """The `datasets` path with HF_DATASETS_OFFLINE=1 on local JSON: a field mapping, a
    digit-string label (as HellaSwag's), lm-eval's ' ' delimiter and the limit."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [
        {"ctx": f"q{i}", "endings": ["yes", "no", "maybe"], "label": str(i % 3)} for i in range(5)
    ]
    path = write_jsonl(tmp_path / "hs.json", rows)
    spec = HFTask(
        name="hs",
        dataset="json",
        split="train",
        data_files=[path],
        context_field="ctx",
        choices_field="endings",
        gold_field="label",
    )
    task = load_hf_task(spec, limit=4)
    assert task.name == "hs" and task.target_delimiter == " "
    assert task.examples == [Example(f"q{i}", ("yes", "no", "maybe"), i % 3) for i in range(4)]
    bad = HFTask(
        name="hs",
        dataset="json",
        split="train",
        data_files=[path],
        gold_field="y",
        context_field="ctx",
        choices_field="endings",
    )
    with pytest.raises(DataError, match=r"example 0: missing key 'y'"):
        load_hf_task(bad)
    with pytest.raises(DataError, match="data file not found"):
        load_hf_task(HFTask(name="hs", dataset="json", data_files=[str(tmp_path / "no.json")]))


def test_a_block_causal_model_scores_like_the_causal_one():
    """Eval requests are one document each: a model with block_causal attention and document
    positions is given one document id per row and scores what the causal model scores
    (it would refuse a forward without document ids)."""
    from trainer.models.build import build_model
    from trainer.models.flavors import model_args

    models = {}
    for mask, positions in (("causal", "sequence"), ("block_causal", "document")):
        args = model_args(
            "debugmodel-tiny",
            vocab_size=64,
            max_seq_len=32,
            attn_mask_type=mask,
            positions=positions,
            attn_implementation="per_document",
        )
        models[mask] = build_model(args).to_empty(device="cpu")
        models[mask].init_weights(seed=0)
    reqs = [Request((1, 2, 3, 4), 2), Request((5, 6), 1), Request((7, 8, 9, 10, 11), 3)]
    with pytest.raises(ValueError, match="needs doc_ids"):
        models["block_causal"](torch.tensor([[1, 2, 3]]))
    want = score_batch(models["causal"], reqs, torch.device("cpu"), CHUNKED)
    got = score_batch(models["block_causal"], reqs, torch.device("cpu"), CHUNKED)
    assert got.tolist() == pytest.approx(want.tolist(), abs=1e-5)


class VocabRows(TorchDispatchMode):
    """The most rows any tensor made by an op had with the vocabulary as its last dimension
    (views of a parameter, such as the head's transposed weight, left out)."""

    def __init__(self, vocab: int, params):
        super().__init__()
        self.vocab, self.rows = vocab, 0
        self.params = {p.untyped_storage().data_ptr() for p in params}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and t.dim()
                and t.shape[-1] == self.vocab
                and t.untyped_storage().data_ptr() not in self.params
            ):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_validation_and_evals_never_hold_a_batch_of_full_vocabulary_logits():
    """Validation's summed loss and the evals' log-likelihoods go through the chunked head:
    no tensor with the vocabulary as a dimension has more rows than one chunk (the batch's
    logits would have 4 x 48), and the values are those of the full logits."""
    from trainer.models.build import build_model
    from trainer.models.flavors import model_args

    vocab, chunk = 1000, 16
    model = build_model(model_args("debugmodel-tiny", vocab_size=vocab, max_seq_len=64))
    model = model.to_empty(device="cpu")
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, vocab, (4, 48), generator=gen)
    labels = torch.randint(0, vocab, (4, 48), generator=gen)
    labels[:, :5] = IGNORE_INDEX
    loss_fn = scoring_loss(chunk)
    with torch.no_grad():
        want = F.cross_entropy(
            model(inputs).flatten(0, 1),
            labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        with VocabRows(vocab, model.parameters()) as seen:
            got = model(inputs, labels, loss_fn)  # what validation calls
    assert seen.rows == chunk
    assert got.item() == pytest.approx(want.item(), rel=1e-5)

    reqs = [Request(tuple(range(1 + i, 40 + i)), 7) for i in range(4)]
    with torch.no_grad():
        full = F.log_softmax(model(torch.tensor([r.tokens[:-1] for r in reqs])), dim=-1)
    want = [
        sum(full[i, t - 1, r.tokens[t]].item() for t in range(len(r.tokens) - 7, len(r.tokens)))
        for i, r in enumerate(reqs)
    ]
    with VocabRows(vocab, model.parameters()) as seen:
        got = score_batch(model, reqs, torch.device("cpu"), loss_fn)
    assert 0 < seen.rows <= chunk
    assert got.tolist() == pytest.approx(want, rel=1e-5)


def test_context_parallel_flex_is_scored_at_fixed_shapes_in_2cp_chunks():
    """Under CP the split's kernel decides: FlexAttention (CUDA, any mask) gets the fixed
    power-of-two widths, in whole 2 x cp chunks; SDPA (the CPU) only the chunks."""
    import types

    import trainer.evals.scoring as scoring
    from trainer.models.build import build_model
    from trainer.models.flavors import model_args

    model = build_model(model_args("debugmodel-tiny", vocab_size=64, max_seq_len=512))
    for kernel, want in (("flex", (4, 128)), ("sdpa", (3, 60))):
        split = types.SimpleNamespace(cp=2, kernel=kernel)
        multiple = scoring.width_multiple(model, split)
        assert multiple == 4
        assert scoring.eval_shape(model, 3, 58, 4, multiple, split) == want


def test_a_model_compiled_per_shape_is_scored_at_a_few_fixed_shapes(monkeypatch):
    """Compiled FlexAttention (dynamic=False) recompiles for every new (batch, width): for such
    a model an eval batch is padded to the eval batch size and a power-of-two width of at least
    128 (the padding pass too), and every score stays what it was."""
    import trainer.evals.scoring as scoring
    from trainer.models.build import build_model
    from trainer.models.flavors import model_args

    args = model_args(
        "debugmodel-tiny",
        vocab_size=64,
        max_seq_len=512,
        attn_mask_type="block_causal",
        positions="document",
        attn_implementation="per_document",
    )
    model = build_model(args).to_empty(device="cpu")
    model.init_weights(seed=0)
    shapes = []
    model.register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    reqs = [Request((1, 2, 3, 4), 2), Request((5, 6), 1), Request(tuple(range(1, 60)), 3)]
    want = score_batch(model, reqs, torch.device("cpu"), CHUNKED, batch=4)
    assert shapes == [(3, 58)]
    monkeypatch.setattr(scoring, "fixed_shapes", lambda m, context=None: True)
    got = score_batch(model, reqs, torch.device("cpu"), CHUNKED, batch=4)
    alone = score_batch(model, reqs[:1], torch.device("cpu"), CHUNKED, batch=4)
    scoring.padding_pass(model, torch.device("cpu"), CHUNKED, batch=4)
    assert shapes[1:] == [(4, 128)] * 3
    assert got.tolist() == pytest.approx(want.tolist(), abs=1e-5)
    assert alone.tolist() == pytest.approx(want.tolist()[:1], abs=1e-5)
    assert scoring.eval_shape(model, 2, 300, 4) == (4, 512)  # capped at max_seq_len
