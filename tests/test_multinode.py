"""Two torchrun "nodes" on localhost: HSDP across them, a rank killed mid-run, and lost nodes.

Each node is its own `python -m trainer.launch --nnodes 2 --nproc_per_node 2` process (the
launcher SLURM starts once per node); they meet through a c10d rendezvous on 127.0.0.1, as real
nodes meet on the first node of an allocation.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.helpers import REPO, TINY, fork_python, free_port, losses, run_train
from tests.helpers import subprocess_env as env_for

PROBE = REPO / "tests" / "scripts" / "multinode_probe.py"
# fp32, a global batch of 8 sequences (2 per rank on 4 ranks), constant lr after warmup.
BASE = [*TINY, "--training.global_batch_size", "8", "--lr_scheduler.min_lr_factor", "1.0"]
HSDP = ["--parallelism.data_parallel_replicate_degree", "2"]
# What run_train.sh launches: the trainer on the default config.
TRAIN = ["-m", "trainer.train", "--job.config_file", str(REPO / "configs" / "debug_model.toml")]
THREADS = {"OMP_NUM_THREADS": "1", "LOG_RANK": "0"}  # as run_train.sh gives 4 ranks on 2 cores


class Node:
    """One launcher process: a "node" of `nproc` ranks; output goes to a log file."""

    def __init__(self, proc: subprocess.Popen, log: Path):
        self.proc, self.log = proc, log

    @property
    def output(self) -> str:
        return self.log.read_text()

    def workers(self) -> dict[int, int]:
        """{global rank: pid} of this launcher's worker processes: a forked CPU rank is named
        trainer-rank<N>; a fresh process has RANK in its environment."""
        out = {}
        for path in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            for pid in map(int, path.read_text().split()):
                try:
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                ranks = [e[5:] for e in env if e.startswith(b"RANK=")]
                if name.startswith("trainer-rank"):
                    out[int(name[len("trainer-rank") :])] = pid
                elif ranks:
                    out[int(ranks[0])] = pid
        return out


def launch_nodes(
    tmp: Path,
    *target: str,
    nnodes: int = 2,
    nproc: int = 2,
    env: dict | None = None,
    elastic: tuple | None = None,
    first: int = 0,
    forked: bool = False,
) -> list[Node]:
    """Start `nnodes` launchers that rendezvous on 127.0.0.1 and run `target` (torchrun's
    trailing arguments: a script or `-m module`, then its arguments). `elastic`: (the
    rendezvous endpoint and id to share, torchrun's options) for `--nnodes 1:2`-style jobs;
    `first`: the log number of the first node; `forked`: the launchers forked from the tests'
    zygote (tests/helpers.py fork_python: no imports of their own; their ranks are then not
    the Popen's children, which Node.workers reads)."""
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"test-{uuid.uuid4().hex[:8]}"
    sizes, extra = [str(nnodes)], []
    if elastic is not None:
        (endpoint, run_id), sizes, extra = elastic[0], [elastic[1]], list(elastic[2])
    nodes = []
    for i in range(first, first + nnodes):
        log = tmp / f"node{i}.log"
        python, run_env = (
            fork_python({**THREADS, **(env or {})})
            if forked
            else (sys.executable, env_for({**THREADS, **(env or {})}))
        )
        cmd = [
            python,
            "-m",
            "trainer.launch",
            "--nnodes",
            *sizes,
            "--nproc_per_node",
            str(nproc),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            endpoint,
            "--rdzv_id",
            run_id,
            *extra,
            *target,
        ]
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, env=run_env, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
        nodes.append(Node(proc, log))
    return nodes


def wait_all(nodes: list[Node], timeout: float = 240) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for node in nodes:
        try:
            codes.append(node.proc.wait(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            for n in nodes:
                n.proc.kill()
            raise AssertionError(
                "launchers did not finish:\n" + "\n".join(n.output[-3000:] for n in nodes)
            ) from None
    return codes


def train_two_nodes(tmp: Path, dump: Path, *overrides: str) -> list[Node]:
    nodes = launch_nodes(tmp, *TRAIN, "--job.dump_folder", str(dump), *overrides, forked=True)
    codes = wait_all(nodes)
    assert codes == [0, 0], "\n".join(n.output[-4000:] for n in nodes)
    return nodes


def test_two_nodes_hsdp_replicates_across_nodes_and_matches_one_node(tmp_path):
    # Which ranks share a node, and which groups span nodes.
    (tmp_path / "probe").mkdir()
    nodes = launch_nodes(tmp_path, str(PROBE), "2", str(tmp_path / "probe"))
    assert wait_all(nodes, timeout=120) == [0, 0], "\n".join(n.output for n in nodes)
    info = {
        i["rank"]: i
        for i in (json.loads(p.read_text()) for p in (tmp_path / "probe").glob("rank*.json"))
    }
    assert sorted(info) == [0, 1, 2, 3]
    launchers = {n.proc.pid for n in nodes}
    node_of = {r: i["launcher_pid"] for r, i in info.items()}
    assert set(node_of.values()) == launchers  # two real launcher processes, 2 ranks each
    assert node_of[0] == node_of[1] != node_of[2] == node_of[3]
    assert [info[r]["node_rank"] for r in range(4)] == [0, 0, 1, 1]
    for r, i in info.items():
        # replicate groups {0,2}, {1,3}: one rank on each node; shard groups stay in a node
        assert i["replicate_group"] == [r % 2, r % 2 + 2]
        assert {node_of[m] for m in i["replicate_group"]} == launchers
        assert i["shard_group"] == [r - r % 2, r - r % 2 + 1]
        assert len({node_of[m] for m in i["shard_group"]}) == 1
        assert i["replicate_sum"] == sum(i["replicate_group"])  # they talk across nodes
        assert i["shard_sum"] == sum(i["shard_group"])
        assert i["dp_rank"] == r

    # Training on the two nodes gives the fp32 losses of one node with 4 ranks, exactly.
    steps = ["--training.steps", "4"]
    nodes = train_two_nodes(tmp_path, tmp_path / "two_nodes", *BASE, *HSDP, *steps)
    # rank 0's line, on whichever node the rendezvous made node 0 (the first to join)
    assert (
        "mesh: HSDP mesh (dp_replicate=2, dp_shard=2), dp=4, world=4"
        in nodes[0].output + nodes[1].output
    )
    run_train(tmp_path / "one_node", *BASE, *HSDP, *steps, nproc=4)
    two, one = losses(tmp_path / "two_nodes"), losses(tmp_path / "one_node")
    assert sorted(one) == [1, 2, 3, 4]
    assert two == one


def test_nodes_launched_with_other_overrides_are_refused(tmp_path):
    """One node launched with another seq_len (it trained on, with other windows, or aborted
    in gloo): every node exits 2 and rank 0's one line names the key and both values."""
    shared = ((f"127.0.0.1:{free_port()}", f"test-{uuid.uuid4().hex[:8]}"), "2", [])
    run = [*TRAIN, "--job.dump_folder", str(tmp_path / "run"), *BASE, "--training.steps", "2"]
    nodes = [
        *launch_nodes(tmp_path, *run, nnodes=1, nproc=1, elastic=shared, forked=True),
        *launch_nodes(
            tmp_path,
            *run,
            "--training.seq_len",
            "32",
            nnodes=1,
            nproc=1,
            elastic=shared,
            first=1,
            forked=True,
        ),
    ]
    codes = wait_all(nodes, timeout=120)
    out = "".join(n.output for n in nodes)
    assert codes == [2, 2], out
    found = re.search(
        r"config error: the ranks run different configs: rank 1 has "
        r"training.seq_len = (\d+) where rank 0 has (\d+); launch every node "
        r"with the same config file and overrides\n",
        out,
    )
    assert found and {found[1], found[2]} == {"32", "64"}, out  # rank 0: the first node to join
    assert out.count("config error") == 1 and "Traceback" not in out, out


def test_a_killed_rank_stops_every_node_and_the_rerun_resumes(tmp_path):
    timeout = 5
    dump = tmp_path / "dump"
    common = [
        *BASE,
        *HSDP,
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
        "--comm.train_timeout_seconds",
        str(timeout),
    ]
    nodes = launch_nodes(
        tmp_path, *TRAIN, "--job.dump_folder", str(dump), *common, "--training.steps", "40"
    )
    ckpt = dump / "checkpoint"
    deadline = time.monotonic() + 180
    while not (ckpt / "step-4").exists():  # mid-run: two checkpoints are committed
        assert time.monotonic() < deadline and all(n.proc.poll() is None for n in nodes), "\n".join(
            n.output[-3000:] for n in nodes
        )
        time.sleep(0.1)
    workers = {**nodes[0].workers(), **nodes[1].workers()}
    assert sorted(workers) == [0, 1, 2, 3]
    victim = 3 if 3 in nodes[1].workers() else 1  # a rank on the second node
    t0 = time.monotonic()
    os.kill(workers[victim], signal.SIGKILL)

    codes = wait_all(nodes, timeout=4 * timeout + 30)
    gone = time.monotonic() - t0
    for pid in workers.values():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in _state(pid), pid
    print(f"all processes gone {gone:.1f}s after the SIGKILL (train timeout {timeout}s)")
    # the train timeout twice (a peer lost, then its peer) and a loaded machine's teardown:
    # far below the launcher's 30 s SIGTERM wait and the 100 s default timeout
    assert gone < 2 * timeout + 10, "\n".join(n.output[-4000:] for n in nodes)
    assert all(code != 0 for code in codes), codes
    summary = [ln for ln in nodes[1].output.splitlines() if ln.startswith("error: training failed")]
    assert summary == [
        f"error: training failed: rank {victim} (local rank {victim % 2} on "
        f"{socket.gethostname()}) ended with signal SIGKILL; its output is above"
    ]

    # The rerun (one node, 4 ranks: a checkpoint reshards across layouts) resumes from the last
    # committed checkpoint; an interrupted save (step-N.partial) is ignored.
    committed = sorted(
        int(m.group(1)) for p in ckpt.iterdir() if (m := re.fullmatch(r"step-(\d+)", p.name))
    )
    last = committed[-1]
    assert last >= 4
    out = run_train(dump, *common, "--training.steps", str(last + 2), nproc=4).stdout
    assert f"resumed from {ckpt}/step-{last} (step {last})" in out, out
    assert f"training done at step {last + 2}" in out
    assert sorted(losses(dump))[-1] == last + 2


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "zombie"


def test_chaos_lost_nodes_shrink_the_job_and_new_nodes_grow_it_back(tmp_path):
    """`scripts/chaos.py --layout node` (scripts/chaos_node.py): an elastic job of two nodes
    (`--nnodes 1:2`, 2 ranks each) loses a whole node (launcher and ranks, SIGKILL) twice, once
    during a save. Each time the survivor goes on alone at world size 2 from the newest
    committed checkpoint with the same global batch (accumulation 2), and a node started later
    grows the job back to 4 ranks from the newest checkpoint. Every loss is within 1e-4 of an
    uninterrupted run of the same global batch (on one rank); every checkpoint left is
    committed and loads."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "chaos.py"),
            "--layout",
            "node",
            "--faults",
            "2",
            "--min-during-save",
            "1",
            "--seed",
            "0",
            "--workdir",
            str(tmp_path),
        ],
        env=env_for(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-3000:]
    lines = {line.split(":")[0]: line for line in out.splitlines() if ":" in line}
    assert lines["faults injected"] == "faults injected: 2 (2 node)", out
    assert lines["faults survived"].startswith("faults survived: 2 (shrunk"), out
    assert lines["during a save"] in ("during a save:   1", "during a save:   2"), out
    assert "those left exited [0, 0]" in lines["healed in-job"], out
    assert lines["final state"].startswith("final state:     every step's loss within 0.0001"), out
    assert "beyond it at steps none" in lines["final state"], out
    assert "all committed and loading" in lines["final state"], out
    assert lines["data lost"] == "data lost:       none", out
    assert re.search(r"^\| node \| node \| 2 of 2 \| [12] \| [0-2] \| within 0.0001", out, re.M)
    # Per fault: the shrink and the grow-back each resumed from the newest committed step.
    faults = re.findall(
        r"^fault \d: node \d lost .*?at step (\d+); 2 ranks resumed from step "
        r"(\d+) \(newest committed: step-(\d+)\), redoing (\d), .*; grown back "
        r"to 4 from step (\d+) \(newest committed: step-(\d+)\)",
        out,
        re.M,
    )
    assert len(faults) == 2, out
    for last, shrunk, newest, redone, grown, newest_then in faults:
        assert shrunk == newest and grown == newest_then and int(grown) > int(shrunk)
        assert int(redone) == int(last) - int(shrunk) <= 2
    # The nodes' own words: 4 ranks; 2 with accumulation 2 (the same global batch); the end.
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("node*.log")))
    assert "dp=2, world=2; gradient accumulation steps: 2" in logs
    assert "dp=4, world=4; gradient accumulation steps: 1" in logs
    assert re.search(r"training done at step \d+", logs)
