"""Host syncs per step of a real CPU run: on a GPU every `.item()`, `.tolist()` or
`bool(tensor)` makes the host wait for the device, so the loop may read the device once per
step, at its step-end agreement, and never per microbatch. tests/scripts/sync_probe.py counts
every such call of a real 2-rank `trainer.train` (the loader's own host tensors aside)."""

import json

from tests.helpers import BASE_FP32, REPO, torchrun


def test_one_host_sync_per_non_logging_step_and_none_per_microbatch(tmp_path):
    out = tmp_path / "syncs.json"
    torchrun(
        REPO / "tests" / "scripts" / "sync_probe.py",
        str(out),
        *BASE_FP32,
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.steps",
        "6",
        "--metrics.log_freq",
        "3",
        "--checkpoint.enable",
        "false",
        nproc=2,
        fork=True,
    )
    got = json.loads(out.read_text())
    assert got["code"] == 0
    where = got["where"]
    # 2 ranks x 2 sequences, global batch 8: two microbatches per step
    for step in ("2", "4", "5"):  # not logged (log_freq 3; step 1 and the last are)
        assert got["steps"][step] == 1, where[step]
        assert where[step][0].startswith("tolist step_end loop.py"), where[step]
    for step in map(str, range(1, 7)):
        phases = got["phases"][step]
        assert not {"step_start", "forward", "backward", "clip", "optimizer"} & set(phases), where[
            step
        ]


def test_moe_with_ep_syncs_only_for_the_all_to_all_split_sizes(tmp_path):
    """debugmodel-moe (3 MoE layers) at EP 2: the only syncs of a non-logging step besides the
    step end are the all-to-all split sizes, one per MoE layer per microbatch. Counting the
    experts' loads (no bincount), sorting the received rows and the balancing bias with its
    load metrics (read at logging steps only) ask the device nothing."""
    out = tmp_path / "syncs.json"
    torchrun(
        REPO / "tests" / "scripts" / "sync_probe.py",
        str(out),
        *BASE_FP32,
        "--model.flavor",
        "debugmodel-moe",
        "--parallelism.expert_parallel_degree",
        "2",
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.steps",
        "4",
        "--metrics.log_freq",
        "3",
        "--checkpoint.enable",
        "false",
        nproc=2,
        fork=True,
    )
    got = json.loads(out.read_text())
    assert got["code"] == 0
    where = got["where"]
    for step in ("2",):  # not logged (log_freq 3; step 1, 3 and the last are)
        # 2 ranks x 2 sequences, global batch 8: two microbatches of 3 MoE layers each
        assert got["steps"][step] == 1 + 2 * 3, where[step]
        assert where[step][-1].startswith("tolist step_end loop.py"), where[step]
        assert all(
            w.startswith("tolist forward parallel/ep_dispatch.py") for w in where[step][:-1]
        ), where[step]
