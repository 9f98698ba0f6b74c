"""Cross-check the in-loop evals against lm-evaluation-harness on the same model and task.

    python benchmarks/evals/eval_crosscheck.py
        --checkpoint outputs/debug_model/checkpoint/step-200 \
        --limit 500 --out /tmp/xcheck [--lm-eval lm_eval] [--tasks-jsonl TASK.jsonl]

1. writes the task (default: the first --limit examples of the built-in stdlib_next_line) as
   JSONL and a local lm-eval task config for it (output_type multiple_choice, target_delimiter
   '', the JSONL's context/choices/gold columns);
2. scores it with the trainer's own scoring code (trainer/evals/scoring.py) on the checkpoint,
   one process, fp32: the values the in-loop evaluator computes with the same weights;
3. exports the checkpoint with `python -m trainer.convert to-hf` and runs `lm_eval --model hf`
   (fp32, CPU, add_bos_token per data.add_bos, max_length = training.seq_len) on it;
4. prints both acc / acc_norm, the largest per-request log-likelihood difference (from
   lm-eval's --log_samples), and, with --run-dump, the in-loop values TensorBoard holds for
   the checkpoint's step.

lm_eval is not a dependency of the trainer: `pip install lm_eval` (0.4.13 here) in any
environment that has torch and transformers; --lm-eval names its CLI.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.convert import read_run_config  # noqa: E402
from trainer.evals.evaluator import _blocks  # noqa: E402
from trainer.evals.scoring import build_requests, choice_metrics, score_batch  # noqa: E402
from trainer.evals.tasks import Task, read_jsonl  # noqa: E402

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def write_task(args, out: Path) -> Path:
    path = out / "task" / f"{args.name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.tasks_jsonl:
        examples = read_jsonl(args.tasks_jsonl, args.limit)
    else:
        from trainer.evals.stdlib_next_line import build_examples

        examples = build_examples()[: args.limit]
    with open(path, "w") as fh:
        for e in examples:
            fh.write(
                json.dumps({"context": e.context, "choices": list(e.choices), "gold": e.gold})
                + "\n"
            )
    (out / "task" / f"{args.name}.yaml").write_text(TASK_YAML.format(name=args.name, path=path))
    return path


def ours(args, cfg, task_path: Path) -> tuple[dict, np.ndarray]:
    """acc/acc_norm and per-request log-likelihoods with the trainer's scoring, fp32."""
    from trainer.generate import load_model, load_tokenizer
    from trainer.models.common.loss import scoring_loss

    tok = load_tokenizer(cfg.data)
    model = load_model(
        Path(args.checkpoint),
        cfg,
        token_vocab=tok.vocab_size,
        max_len=cfg.training.seq_len,
        device="cpu",
    )
    task = Task(args.name, read_jsonl(str(task_path)))
    reqs = build_requests(task, tok, cfg.training.seq_len, cfg.data.add_bos)
    lls = np.zeros(len(reqs))
    with torch.no_grad():
        for block in _blocks(reqs, 16):
            lls[block] = score_batch(
                model,
                [reqs[i] for i in block],
                torch.device("cpu"),
                scoring_loss(cfg.training.loss_chunk_size),
            ).numpy()
    return choice_metrics(lls, task.examples), lls


def lm_eval(args, cfg, out: Path) -> tuple[dict, np.ndarray | None]:
    hf = out / "hf"
    if not (hf / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "trainer.convert", "to-hf", args.checkpoint, str(hf)], check=True
        )
    model_args = (
        f"pretrained={hf},dtype=float32,max_length={cfg.training.seq_len},"
        f"add_bos_token={cfg.data.add_bos}"
    )
    cmd = [
        args.lm_eval,
        "--model",
        "hf",
        "--model_args",
        model_args,
        "--tasks",
        args.name,
        "--include_path",
        str(out / "task"),
        "--device",
        "cpu",
        "--batch_size",
        "16",
        "--output_path",
        str(out / "lm_eval"),
        "--log_samples",
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(
        cmd,
        check=True,
        env={
            **os.environ,
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        },
    )
    result = sorted(
        glob.glob(str(out / "lm_eval" / "**" / "results_*.json"), recursive=True),
        key=os.path.getmtime,
    )[-1]
    metrics = json.loads(Path(result).read_text())["results"][args.name]
    samples = sorted(
        glob.glob(str(out / "lm_eval" / "**" / f"samples_{args.name}_*.jsonl"), recursive=True),
        key=os.path.getmtime,
    )
    lls = None
    if samples:
        rows = sorted((json.loads(ln) for ln in open(samples[-1])), key=lambda r: r["doc_id"])
        lls = np.array([float(resp[0][0]) for r in rows for resp in r["resps"]])
    return {"acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"]}, lls


def in_loop(run_dump: str, step: int, name: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for run in glob.glob(os.path.join(run_dump, "tb", "*")):
        acc = EventAccumulator(run, size_guidance={"scalars": 0})
        acc.Reload()
        for metric in ("acc", "acc_norm"):
            tag = f"eval/{name}/{metric}"
            if tag in acc.Tags()["scalars"]:
                out.update((metric, e.value) for e in acc.Scalars(tag) if e.step == step)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="a {dump_folder}/checkpoint/step-N folder")
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=500)
    p.add_argument("--name", default="stdlib_next_line")
    p.add_argument("--tasks-jsonl", default="", help="a JSONL task instead of the built-in one")
    p.add_argument("--lm-eval", default="lm_eval", help="the lm_eval CLI")
    p.add_argument("--run-dump", default="", help="the run's dump folder: print its in-loop values")
    args = p.parse_args()
    torch.manual_seed(0)
    out = Path(args.out)
    cfg = read_run_config(args.checkpoint, None)
    task_path = write_task(args, out)
    t0 = time.monotonic()
    mine, my_lls = ours(args, cfg, task_path)
    t1 = time.monotonic()
    theirs, their_lls = lm_eval(args, cfg, out)
    t2 = time.monotonic()
    n = sum(1 for _ in open(task_path))
    print(f"\n{args.name}: {n} examples, checkpoint {args.checkpoint}")
    print(
        f"trainer scoring (fp32, 1 process): acc {mine['acc']:.4f} acc_norm "
        f"{mine['acc_norm']:.4f}  ({t1 - t0:.0f}s)"
    )
    print(
        f"lm_eval --model hf (fp32, CPU):     acc {theirs['acc']:.4f} acc_norm "
        f"{theirs['acc_norm']:.4f}  ({t2 - t1:.0f}s)"
    )
    if their_lls is not None and len(their_lls) == len(my_lls):
        diff = np.abs(their_lls - my_lls)
        print(
            f"per-request log-likelihoods: {len(diff)}, max |diff| {diff.max():.2e}, "
            f"mean {diff.mean():.2e}"
        )
    if args.run_dump:
        step = int(Path(args.checkpoint).name.split("-")[-1])
        print(f"in-loop (TensorBoard, step {step}): {in_loop(args.run_dump, step, args.name)}")


if __name__ == "__main__":
    main()
