"""The `[eval]` config section: downstream multiple-choice tasks scored in the training loop.

[eval]
enable = true
freq = 50
tasks = ["stdlib_next_line", "data/my_task.jsonl"]   # built-in names or JSONL files
limit = 200                                          # first N examples of each task

[[eval.hf_tasks]]                                    # a Hugging Face dataset
name = "hellaswag"
dataset = "Rowan/hellaswag"                          # or "json" + data_files
split = "validation"
context_field = "ctx"
choices_field = "endings"
gold_field = "label"
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.base import did_you_mean, opt
from trainer.data.config import SOURCE_NAME
from trainer.errors import ConfigError

BUILTIN_TASKS = ("stdlib_next_line",)


@dataclass
class HFTask:
    """One `[[eval.hf_tasks]]` table: a multiple-choice task read through `datasets`."""

    name: str = opt("", "Task name in logs and TensorBoard tags (eval/<name>/acc)")
    dataset: str = opt(
        "",
        "HF dataset name (from the local cache with HF_DATASETS_OFFLINE=1), "
        "or json/parquet/csv with data_files",
    )
    dataset_config: str = opt("", "HF dataset config name; '' = none")
    split: str = opt("validation", "Split to evaluate")
    data_files: list[str] = opt([], "Local files for json/parquet/csv")
    context_field: str = opt("context", "Column with the context (the prompt)")
    choices_field: str = opt("choices", "Column with the list of choice strings")
    gold_field: str = opt(
        "gold", "Column with the index of the correct choice (int or digit string)"
    )
    target_delimiter: str = opt(
        " ",
        "Put between the context and each choice (lm-eval's "
        "target_delimiter; a JSONL task uses its choices verbatim)",
    )


@dataclass
class Eval:
    """Downstream multiple-choice evals in the loop (docs/evals.md)."""

    enable: bool = opt(
        False,
        "Score multiple-choice tasks (acc, acc_norm by log-likelihood, as "
        "lm-evaluation-harness does) every freq steps and at the last step",
    )
    freq: int = opt(500, "Evaluate every this many steps", min=1)
    tasks: list[str] = opt(
        ["stdlib_next_line"],
        "Built-in task names (stdlib_next_line) or "
        'JSONL files (one {"context", "choices", "gold"} per line)',
    )
    limit: int = opt(0, "Evaluate the first N examples of each task; 0 = all", min=0)
    local_batch_size: int = opt(
        8, "Scored sequences (context + one choice) per forward pass per dp rank", min=1
    )
    hf_tasks: list[HFTask] = opt(
        [],
        "Hugging Face datasets as tasks: [[eval.hf_tasks]] tables "
        "with name, dataset, split and a field mapping",
    )

    def validate(self) -> None:
        names = []
        for task in self.tasks:
            if not task:
                raise ConfigError(
                    "eval.tasks has an empty entry; name a built-in task "
                    f"({', '.join(BUILTIN_TASKS)}) or a .jsonl file"
                )
            if not is_jsonl_path(task) and task not in BUILTIN_TASKS:
                raise ConfigError(
                    f"eval.tasks: unknown built-in task {task!r}"
                    f"{did_you_mean(task, BUILTIN_TASKS)}; built-in tasks: "
                    f"{', '.join(BUILTIN_TASKS)}; a task file must end in .jsonl"
                )
            names.append(task_name(task))
        for i, hf in enumerate(self.hf_tasks):
            where = f"eval.hf_tasks[{i}]"
            if not SOURCE_NAME.fullmatch(hf.name):
                raise ConfigError(
                    f"{where}.name = {hf.name!r} is not valid; use letters, "
                    "digits, '_', '.' or '-' (it names TensorBoard tags)"
                )
            if not hf.dataset:
                raise ConfigError(
                    f"{where}.dataset is empty; name a HF dataset or a builder "
                    "(json, parquet, csv) with data_files"
                )
            names.append(hf.name)
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(
                f"eval: two tasks are named {dup[0]!r} (a JSONL task is named "
                "after its file); task names must be unique"
            )
        if self.enable and not names:
            raise ConfigError("eval.enable = true but eval.tasks and eval.hf_tasks are empty")


def is_jsonl_path(task: str) -> bool:
    return task.endswith(".jsonl")


def task_name(task: str) -> str:
    """A built-in task's name, or a JSONL file's stem (e.g. 'arc' for data/arc.jsonl)."""
    if not is_jsonl_path(task):
        return task
    return task.replace("\\", "/").rsplit("/", 1)[-1][: -len(".jsonl")]
