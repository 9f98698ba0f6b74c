"""The nccl flight recorder under run_train.sh's settings, read back with torchfrtrace (1 GPU).

    python benchmarks/gpu/gpu_flight_recorder.py

One nccl rank with TORCH_NCCL_TRACE_BUFFER_SIZE=2000 (what run_train.sh and the SLURM script
set) runs a few all-reduces and one all-gather, dumps its recorder the way a timeout would
(TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>), and `python -m torch.distributed.flight_recorder.fr_trace`
must list those collectives from the file. One GPU cannot make a real cross-rank hang (nccl
refuses two ranks on one GPU), so the dump is asked for instead of waited for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist


def main() -> int:
    folder = tempfile.mkdtemp(prefix="fr_")
    prefix = os.path.join(folder, "nccl_trace_rank_")
    os.environ.update(
        TORCH_NCCL_TRACE_BUFFER_SIZE="2000",
        TORCH_NCCL_DUMP_ON_TIMEOUT="1",
        TORCH_NCCL_DEBUG_INFO_TEMP_FILE=prefix,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29533",
    )
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(3):
        dist.all_reduce(x)
    out = torch.empty(1 << 20, device="cuda")
    dist.all_gather_into_tensor(out, x)
    torch.cuda.synchronize()
    dump = torch._C._distributed_c10d._dump_nccl_trace()
    with open(prefix + "0", "wb") as f:
        f.write(dump)
    dist.destroy_process_group()
    print(f"dump: {len(dump)} bytes at {prefix}0")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.flight_recorder.fr_trace",
            "-p",
            "nccl_trace_rank_",
            "-j",
            folder,
        ],
        capture_output=True,
        text=True,
    )
    text = proc.stdout + proc.stderr
    print(text[-4000:])
    seen = {op: text.count(op) for op in ("allreduce", "all_reduce", "allgather", "_allgather")}
    print(f"fr_trace exit {proc.returncode}; mentions: {seen}")
    ok = proc.returncode == 0 and (seen["allreduce"] + seen["all_reduce"]) >= 3
    print("flight recorder:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
