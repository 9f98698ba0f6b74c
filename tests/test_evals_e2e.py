"""Downstream evals through ./run_train.sh on the stdlib default data: the built-in task and
a JSONL task logged at the configured steps, the same values on 1 and 2 ranks, and a task
error as one line before training."""

import json

import pytest

from tests.helpers import CPU, run_train, scalars

TAGS = [
    f"eval/{task}/{metric}"
    for task in ("stdlib_next_line", "tiny")
    for metric in ("acc", "acc_norm")
]


def eval_args(task_file) -> list[str]:
    # lr 0 and fp32: every evaluation sees the same weights on any number of ranks. 47
    # examples x 4 choices in blocks of 4 (47 blocks: a padded pass on 2 ranks); the JSONL
    # task has 5 examples x 3 choices (a short last block).
    return [
        *CPU,
        "--model.flavor",
        "debugmodel-tiny",
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "2",
        "--training.mixed_precision_param",
        "float32",
        "--optimizer.lr",
        "0",
        "--checkpoint.enable",
        "false",
        "--metrics.log_freq",
        "1",
        "--eval.enable",
        "true",
        "--eval.freq",
        "2",
        "--eval.limit",
        "47",
        "--eval.local_batch_size",
        "4",
        "--eval.tasks",
        f"stdlib_next_line,{task_file}",
    ]


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tasks") / "tiny.jsonl"
    rows = [
        {
            "context": f"def f{i}(x):\n    return",
            "choices": [" x", " x + 1", " None"],
            "gold": i % 3,
        }
        for i in range(5)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_evals_logged_at_the_configured_steps_and_equal_on_1_and_2_ranks_and_under_cp(
    task_file, tmp_path
):
    two = run_train(tmp_path / "two", *eval_args(task_file), "--training.steps", "4")
    for tag in TAGS:
        values = scalars(tmp_path / "two", tag)
        assert sorted(values) == [2, 4], (tag, values)
        assert all(0.0 <= v <= 1.0 for v in values.values())
    assert (
        "eval: stdlib_next_line (47 examples, 188 sequences), tiny (5 examples, 15 "
        "sequences) every 2 steps" in two.stdout
    )
    lines = [ln for ln in two.stdout.splitlines() if ln.startswith("eval: step")]
    assert len(lines) == 2 and "stdlib_next_line acc " in lines[0] and "tiny acc " in lines[0]
    run_train(tmp_path / "one", *eval_args(task_file), "--training.steps", "2", nproc=1)
    # CP 2 x DP 2: each cp rank scores its share of every request (widths padded to 2 x cp
    # chunks), the sums added over cp; 47 blocks over 2 dp ranks: one padding pass under CP
    cp = run_train(
        tmp_path / "cp",
        *eval_args(task_file),
        "--training.steps",
        "2",
        "--parallelism.context_parallel_degree",
        "2",
        nproc=4,
    )
    assert "each cp rank scores its share of every request" in cp.stdout
    # PP 2 x CP 2: the pipeline's forward-only pass attends through the eval's split
    pp_cp = run_train(
        tmp_path / "pp_cp",
        *eval_args(task_file),
        "--training.steps",
        "2",
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
        nproc=4,
    )
    assert "each cp rank scores its share of every request" in pp_cp.stdout
    for tag in TAGS:
        for other in ("two", "cp", "pp_cp"):
            assert scalars(tmp_path / "one", tag)[2] == pytest.approx(
                scalars(tmp_path / other, tag)[2], abs=1e-6
            ), (tag, other)


def test_missing_task_file_is_one_line_before_training(tmp_path):
    missing = tmp_path / "nope.jsonl"
    proc = run_train(
        tmp_path / "run", *eval_args(missing), "--training.steps", "2", check=False, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    # (The shared stdlib cache may add a "waiting for another process" line while another
    # run builds it: only error lines count.)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "waiting for" not in ln]
    assert lines == [f"data error: eval task file not found: {missing} (eval.tasks)"], proc.stderr
    assert "step:" not in proc.stdout
