"""Multiple-choice tasks: where examples come from (built-in, JSONL, Hugging Face datasets).

An example is a context, two or more choices and the index of the correct one. A choice is
scored as the continuation `target_delimiter + choice` of the context (trainer/evals/scoring.py);
JSONL and built-in tasks use their choices verbatim (delimiter ''), HF tasks lm-eval's ' '.

Every problem with a task's data is one `DataError` naming the file (and line) or dataset.
"""

from __future__ import annotations

import json
import os

from trainer.errors import DataError
from trainer.evals.config import HFTask, is_jsonl_path, task_name
from trainer.evals.examples import Example, Task
from trainer.evals.stdlib_next_line import build_examples


def load_task(spec: str, limit: int = 0) -> Task:
    """A task of `eval.tasks`: a built-in name or a .jsonl file (config.py checked which)."""
    if is_jsonl_path(spec):
        return Task(task_name(spec), read_jsonl(spec, limit))
    examples = build_examples()
    return Task(spec, examples[:limit] if limit else examples)


def read_jsonl(path: str, limit: int = 0) -> list[Example]:
    """The examples of a JSONL task: one {"context": str, "choices": [str, ...], "gold": int}
    per line (blank lines skipped); the first `limit` of them when limit > 0."""
    full = os.path.expanduser(path)
    if not os.path.isfile(full):
        raise DataError(f"eval task file not found: {path} (eval.tasks)")
    examples: list[Example] = []
    with open(full, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"eval task {path} line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            examples.append(parse_example(obj, where))
            if limit and len(examples) == limit:
                break
    if not examples:
        raise DataError(f"eval task {path} has no examples (eval.tasks)")
    return examples


def parse_example(obj, where: str, fields=("context", "choices", "gold")) -> Example:
    """Check one record and build its Example; `fields` names the context, choices and gold
    keys (a HF task's field mapping)."""
    ctx_key, choices_key, gold_key = fields
    if not isinstance(obj, dict):
        raise DataError(
            f"{where}: expected a JSON object with keys {ctx_key!r}, "
            f"{choices_key!r}, {gold_key!r}, got {type(obj).__name__}"
        )
    missing = [k for k in fields if k not in obj]
    if missing:
        raise DataError(
            f"{where}: missing key {missing[0]!r} (keys are: {', '.join(sorted(map(str, obj)))})"
        )
    context, choices, gold = obj[ctx_key], obj[choices_key], obj[gold_key]
    if not isinstance(context, str):
        raise DataError(f"{where}: {ctx_key!r} must be a string, got {type(context).__name__}")
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise DataError(
            f"{where}: {choices_key!r} must be a list of at least 2 non-empty "
            f"strings, got {_short(choices)}"
        )
    if isinstance(gold, str) and gold.strip().isdigit():  # e.g. HellaSwag's label "3"
        gold = int(gold)
    if isinstance(gold, bool) or not isinstance(gold, int):
        raise DataError(f"{where}: {gold_key!r} must be an integer index, got {_short(gold)}")
    if not 0 <= gold < len(choices):
        raise DataError(
            f"{where}: gold index {gold} is out of range for {len(choices)} "
            f"choices (0..{len(choices) - 1})"
        )
    return Example(context, tuple(choices), gold)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def load_hf_task(spec: HFTask, limit: int = 0) -> Task:
    """A `[[eval.hf_tasks]]` task, streamed through `datasets` (local files, or the local
    cache with HF_DATASETS_OFFLINE=1); the first `limit` examples when limit > 0."""
    from trainer.data.config import LOCAL_BUILDERS
    from trainer.data.sources import import_datasets

    datasets = import_datasets(f"eval.hf_tasks {spec.name!r}")

    kwargs: dict = {"split": spec.split, "streaming": True}
    where = f"eval.hf_tasks {spec.name!r} ({spec.dataset}"
    if spec.data_files:
        files = [os.path.expanduser(f) for f in spec.data_files]
        missing = [f for f in files if spec.dataset in LOCAL_BUILDERS and not os.path.exists(f)]
        if missing:
            raise DataError(f"{where}): data file not found: {missing[0]}")
        kwargs["data_files"] = files
        where += f" {', '.join(spec.data_files)}"
    args = [spec.dataset] + ([spec.dataset_config] if spec.dataset_config else [])
    try:
        ds = datasets.load_dataset(*args, **kwargs)
        rows = _take(ds, limit)
    except (FileNotFoundError, ConnectionError, ValueError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{where}): cannot read split {spec.split!r}: {msg}") from None
    fields = (spec.context_field, spec.choices_field, spec.gold_field)
    examples = [parse_example(row, f"{where}) example {i}", fields) for i, row in enumerate(rows)]
    if not examples:
        raise DataError(f"{where}) split {spec.split!r} has no examples")
    return Task(spec.name, examples, target_delimiter=spec.target_delimiter)


def _take(ds, limit: int) -> list[dict]:
    rows = []
    for row in ds:
        rows.append(row)
        if limit and len(rows) == limit:
            break
    return rows


def load_tasks(cfg_eval) -> list[Task]:
    """Every task of the `[eval]` section, in config order (eval.tasks, then hf_tasks)."""
    tasks = [load_task(spec, cfg_eval.limit) for spec in cfg_eval.tasks]
    return tasks + [load_hf_task(spec, cfg_eval.limit) for spec in cfg_eval.hf_tasks]
