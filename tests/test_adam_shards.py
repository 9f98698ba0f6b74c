"""trainer.optim.optimizer's Adam/AdamW step each DTensor's local shard: equal to the bit to
torch.optim's, which step through DTensor (tests/scripts/adam_probe.py: FSDP 2 and TP 2, fused
and foreach, a step skipped on the device), with the moments DTensors as the checkpoint saves
them."""

from tests.helpers import REPO, torchrun


def test_local_shard_steps_equal_torchs_dtensor_steps():
    out = torchrun(REPO / "tests" / "scripts" / "adam_probe.py", nproc=2, fork=True).stdout
    cases = [
        f"{layout} {impl} {cls}"
        for layout in ("fsdp", "tp")
        for impl in ("fused", "foreach")
        for cls in ("AdamW", "Adam")
    ]
    assert [
        line.removeprefix("adam probe ok ")
        for line in out.splitlines()
        if line.startswith("adam probe ok")
    ] == cases, out
