"""The GPU scripts, checked here on the CPU: a short GPU allocation must not
go to a stale config key or a check that cannot tell right from wrong (benchmarks/gpu/gpu_suite.sh,
gpu_paths.py, gpu_mla_attention.py)."""

import re
from pathlib import Path

import pytest

from trainer.config.job import JobConfig, _lookup, load_config
from trainer.errors import ConfigError

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
# `--section.key value` in a shell script; a value made of shell expansions is not literal
OVERRIDE = re.compile(r"(--[a-z_0-9]+\.[a-z_0-9]+)[ =]+\"?([^\s\"\\);]+)")


def valid(argv: list[str]) -> None:
    """load_config(argv), where float8 may need torchao, which the GPU machines have."""
    try:
        load_config(argv)
    except ConfigError as err:
        if "needs torchao, which is not installed" not in str(err):
            raise


@pytest.fixture
def bench_modules():
    from benchmarks.gpu import gpu_mla_attention, gpu_paths

    return gpu_paths, gpu_mla_attention


def test_every_override_the_gpu_suite_passes_is_a_key_with_a_valid_value():
    """Each line's literal overrides together (a line is one run's, or part of it)."""
    lines = [OVERRIDE.findall(line) for line in (BENCH / "gpu_suite.sh").read_text().splitlines()]
    pairs = [pair for line in lines for pair in line]
    assert len(pairs) > 30  # the regex still reads the script
    keys = {
        "parallelism.fsdp_reshard_after_forward",
        "optimizer.name",
        "compile.mode",
        "float8.recipe",
        "model.sdpa_backends",
    }
    assert keys <= {flag[2:] for flag, _ in pairs}
    for line in lines:
        for flag, _ in line:
            _lookup(JobConfig(), flag[2:])  # raises ConfigError naming an unknown key
        valid([arg for flag, value in line if "$" not in value for arg in (flag, value)])


def test_every_gpu_path_is_a_valid_config(bench_modules):
    gpu_paths, _ = bench_modules
    assert any(p.name == "dsv3-flex-muon-qkclip" for p in gpu_paths.PATHS)
    for p in gpu_paths.PATHS:
        valid(["--job.config_file", p.config, *gpu_paths.FAST, *p.overrides])
    with pytest.raises(ConfigError, match="unknown key"):  # what a stale key would do
        load_config(["--job.config_file", gpu_paths.DEBUG, "--optimizer.muon_qkclip", "1"])


TINY = ["--device", "cpu", "--heads", "2", "--seq", "64", "--dim", "128", "--repeats", "1"]


def test_the_mla_check_passes_the_kernels_and_fails_a_wrong_one(bench_modules, monkeypatch, capsys):
    """On the CPU: every kernel there (math, the auto order, the additive mask, per document)
    within the tolerance of the hand-written fp32 reference, YaRN's gain included; a kernel
    whose softmax scale is off by 2% (e.g. a default scale taken from the value width) fails."""
    _, mla = bench_modules
    assert mla.main(TINY) == 0
    out = capsys.readouterr().out
    assert "YaRN softmax gain 1.8739" in out and "q/k 192 v 128" in out
    rows = [line for line in out.splitlines() if line.endswith(" ok")]
    assert [r.split()[0] + " " + r.split()[1] for r in rows] == [
        "causal sdpa[math]",
        "causal sdpa[auto]",
        "block_causal sdpa-mask",
        "block_causal per_document",
    ]
    real = mla.attend
    monkeypatch.setattr(mla, "attend", lambda q, k, v, mask, **kw: real(q * 1.02, k, v, mask, **kw))
    assert mla.main(TINY) == 1
    assert capsys.readouterr().out.count("FAIL") == 4

    def refused(*args, **kwargs):
        raise RuntimeError("No available kernel. Aborting execution.")

    # torch refusing a forced backend is n/a; the same error on a path a run takes fails
    monkeypatch.setattr(mla, "attend", refused)
    assert mla.main(TINY) == 1
    rows = {line.split("  ")[0].strip(): line for line in capsys.readouterr().out.splitlines()}
    assert "n/a" in rows["causal sdpa[math]"]
    assert all(
        "FAIL" in rows[k]
        for k in ("causal sdpa[auto]", "block_causal sdpa-mask", "block_causal per_document")
    )
