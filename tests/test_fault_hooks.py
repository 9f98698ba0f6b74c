"""The testing hooks that pace and hold runs (trainer/health/faults.py): a slow rank that sleeps
only while its gate file exists, and a save held open like a slow disk's. The chaos runs and
tests/test_lease.py rely on them; here each is checked alone, in one process."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint import integrity
from trainer.health import faults


def test_the_slow_ranks_spec_takes_a_gate_path_with_colons():
    env = {"RANK": "1", faults.SLOW_ENV: "1:2.5:/tmp/a:b/gate", faults.SAVE_HOLD_ENV: "0.4"}
    f = faults.Faults.from_env(env)
    assert (f.delay_s, f.delay_gate, f.save_hold_s) == (2.5, "/tmp/a:b/gate", 0.4)
    other = faults.Faults.from_env({**env, "RANK": "0"})
    assert (other.delay_s, other.save_hold_s) == (0.0, 0.4)  # the hold is every rank's
    plain = faults.Faults.from_env({"RANK": "0", faults.SLOW_ENV: "0:0.5"})
    assert (plain.delay_s, plain.delay_gate, plain.save_hold_s) == (0.5, "", 0.0)
    paced = [faults.Faults.from_env({"RANK": r, faults.SLOW_ENV: "all:0.25"}) for r in "03"]
    assert [f.delay_s for f in paced] == [0.25, 0.25]  # every rank: a pace


def test_a_gated_slow_rank_sleeps_until_its_gate_is_removed(tmp_path):
    gate = tmp_path / "gate"
    gate.touch()
    f = faults.Faults(delay_s=30.0, delay_gate=str(gate))
    threading.Timer(0.3, gate.unlink).start()
    t0 = time.monotonic()
    f.step_end()
    took = time.monotonic() - t0
    assert 0.25 <= took < 5, took  # held while the gate was there, released when it went
    t0 = time.monotonic()
    f.step_end()  # no gate: no sleep at all
    assert time.monotonic() - t0 < 0.5
    capped = faults.Faults(delay_s=0.2, delay_gate=str(tmp_path / "kept"))
    (tmp_path / "kept").touch()
    t0 = time.monotonic()
    capped.step_end()  # a gate left in place: at most the seconds given
    assert 0.15 <= time.monotonic() - t0 < 2


def test_a_held_save_takes_the_hold_and_writes_the_same_checkpoint(tmp_path, monkeypatch):
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}
    times = {}
    for name, hold in (("plain", "0"), ("held", "0.6")):
        monkeypatch.setenv(faults.SAVE_HOLD_ENV, hold)
        faults.arm()
        writer = integrity.storage_writer(str(tmp_path / name), 1, 0)
        t0 = time.monotonic()
        dcp.save(state, storage_writer=writer, no_dist=True)
        times[name] = time.monotonic() - t0
        loaded = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(loaded, checkpoint_id=str(tmp_path / name), no_dist=True)
        assert all(torch.equal(loaded[k], state[k]) for k in state)
        assert integrity.written_files(writer)  # still hashed as written
    monkeypatch.delenv(faults.SAVE_HOLD_ENV)
    faults.arm()
    assert times["held"] >= 0.6 > times["plain"], times
