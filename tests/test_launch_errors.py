"""Bad input through ./run_train.sh: one line naming the culprit, non-zero exit, no hang."""

import time

import pytest

from tests.helpers import run_train

CASES = {
    "unknown key": ([], "--training.setps=3", "config error: unknown key 'training.setps' "
                    "(did you mean 'training.steps'?)"),
    "wrong type": ([], "--training.steps=ten", "config error: training.steps must be an int"),
    "degree mismatch": ([], "--parallelism.data_parallel_shard_degree=4",
                        "config error: parallelism.data_parallel_replicate_degree = 1 and "
                        "parallelism.data_parallel_shard_degree = 4 multiply to 4, but the "
                        "world size is 2"),
    "indivisible global batch": ([], "--training.global_batch_size=6",
                                 "config error: training.global_batch_size = 6 is not divisible"),
    "toml syntax error": (["[training]", "steps = 3", "seq_len = = 4"], None,
                          "config error: TOML syntax error in"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line(tmp_path, case):
    toml_lines, override, expected = CASES[case]
    config = None
    if toml_lines:
        config = tmp_path / "bad.toml"
        config.write_text("\n".join(toml_lines) + "\n")
    t0 = time.monotonic()
    proc = run_train(tmp_path / "out", *([override] if override else []), nproc=2,
                     config=str(config) if config else None, check=False, timeout=30)
    assert time.monotonic() - t0 < 30
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(expected), lines[0]
    if case == "toml syntax error":
        assert "line 3" in lines[0]


def test_data_error_inside_the_ranks_is_one_line(tmp_path):
    """A user error found by the ranks themselves (after the process group exists) is also one
    line, printed once, and every rank exits instead of waiting for the others."""
    proc = run_train(tmp_path / "out", f"--data.store_path={tmp_path}/missing_store", nproc=2,
                     check=False, timeout=60)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [f"data error: token store not found: {tmp_path}/missing_store "
                     "(data.store_path)"], proc.stderr
