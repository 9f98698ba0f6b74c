"""StepProfiler: which steps get traces, that they are valid Chrome traces, and the no-op paths."""

from __future__ import annotations

import json
import os

import pytest
import torch

from trainer.config.job import JobConfig
from trainer.observe.profiling import StepProfiler

CPU = torch.device("cpu")


def config(tmp_path, **profiling) -> JobConfig:
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    for k, v in profiling.items():
        setattr(cfg.profiling, k, v)
    return cfg


def train(cfg, *, start, stop, device=CPU):
    """Steps start+1..stop of a tiny matmul 'training', as the loop drives the profiler."""
    x = torch.randn(32, 32)
    with StepProfiler(cfg, rank=0, device=device, start_step=start) as prof:
        for _ in range(start + 1, stop + 1):
            x = torch.tanh(x @ x)
            prof.step()


def traced_steps(tmp_path) -> list[int]:
    root = tmp_path / "profile_traces"
    if not root.exists():
        return []
    return sorted(int(d.name.removeprefix("iteration_")) for d in root.iterdir())


@pytest.mark.parametrize(
    "start,stop,freq,expected",
    [
        (0, 8, 3, [3, 6]),  # not 9: the run ends before it, and no half-recorded trace is saved
        (4, 10, 3, [6, 9]),  # a resumed run traces the same step numbers
        (0, 3, 1, [1, 2, 3]),
    ],
)
def test_traces_the_chosen_steps(tmp_path, capsys, start, stop, freq, expected):
    train(config(tmp_path, enable_profiling=True, profile_freq=freq), start=start, stop=stop)
    assert traced_steps(tmp_path) == expected
    for step in expected:
        path = tmp_path / "profile_traces" / f"iteration_{step}" / "rank0_trace.json"
        trace = json.loads(path.read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any("mm" in n for n in names), f"no matmul in the trace of step {step}"
    assert f"trace of step {expected[-1]} saved" in capsys.readouterr().out


def test_disabled_writes_nothing(tmp_path):
    train(config(tmp_path), start=0, stop=4)
    assert list(tmp_path.iterdir()) == []


def test_memory_snapshot_is_cuda_only(tmp_path, capsys):
    train(config(tmp_path, enable_memory_snapshot=True, profile_freq=1), start=0, stop=2)
    assert list(tmp_path.iterdir()) == []
    assert "memory snapshots are CUDA-only" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_snapshot_on_cuda(tmp_path):
    cfg = config(tmp_path, enable_memory_snapshot=True, profile_freq=2)
    x = torch.randn(64, 64, device="cuda")
    with StepProfiler(cfg, rank=0, device=torch.device("cuda"), start_step=0) as prof:
        for _ in range(4):
            x = torch.tanh(x @ x)
            prof.step()
    folder = tmp_path / "memory_snapshot"
    assert sorted(os.listdir(folder)) == ["iteration_2", "iteration_4"]
    assert (folder / "iteration_4" / "rank0_memory_snapshot.pickle").stat().st_size > 0


def test_a_run_that_dies_of_an_oom_dumps_the_snapshot(tmp_path, monkeypatch):
    """The loop turns torch.OutOfMemoryError into its one-line OutOfMemory before the profiler
    exits: that still counts as dying of an OOM (the allocator history is dumped). CUDA-only
    in a run; here the snapshot machinery is stood in for."""
    from trainer.health.oom import OutOfMemory

    dumped = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)
    monkeypatch.setattr(StepProfiler, "_dump_snapshot", lambda self, name: dumped.append(name))
    for error, expected in (
        (OutOfMemory("CUDA out of memory at step 3 on rank 0"), True),
        (torch.OutOfMemoryError("raw"), True),
        (ValueError("bug"), False),
    ):
        dumped.clear()
        with pytest.raises(type(error)):
            with StepProfiler(
                config(tmp_path, enable_memory_snapshot=True),
                rank=0,
                device=CPU,
                start_step=0,
            ) as prof:
                prof.snapshot = True  # as on CUDA
                prof.step(), prof.step()
                raise error
        assert dumped == (["iteration_3_exit"] if expected else []), (error, dumped)
