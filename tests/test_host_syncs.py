"""Host syncs per step of a real CPU run (issue 30): on a GPU every `.item()`, `.tolist()` or
`bool(tensor)` makes the host wait for the device, so the loop may read the device once per
step, at its step-end agreement, and never per microbatch. tests/scripts/sync_probe.py counts
every such call of a real 2-rank `trainer.train` (the loader's own host tensors aside)."""

import json

from tests.helpers import BASE_FP32, REPO, torchrun


def test_one_host_sync_per_non_logging_step_and_none_per_microbatch(tmp_path):
    out = tmp_path / "syncs.json"
    torchrun(REPO / "tests" / "scripts" / "sync_probe.py", str(out), *BASE_FP32,
             "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "6",
             "--metrics.log_freq", "3", "--checkpoint.enable", "false", nproc=2, fork=True)
    got = json.loads(out.read_text())
    assert got["code"] == 0
    where = got["where"]
    # 2 ranks x 2 sequences, global batch 8: two microbatches per step
    for step in ("2", "4", "5"):  # not logged (log_freq 3; step 1 and the last are)
        assert got["steps"][step] == 1, where[step]
        assert where[step][0].startswith("tolist step_end loop.py"), where[step]
    for step in map(str, range(1, 7)):
        phases = got["phases"][step]
        assert not {"step_start", "forward", "backward", "clip", "optimizer"} & set(phases), \
            where[step]
