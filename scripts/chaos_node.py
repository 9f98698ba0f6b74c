"""The lost node of scripts/chaos.py (`--layout node`): an elastic job of two torchrun "nodes"
on this machine loses one node whole, goes on smaller, and grows back; nothing is lost.

    python scripts/chaos.py --layout node --faults 4 --min-during-save 2 --seed 0

First an uninterrupted run of the same global batch on one rank (accumulation 4: within 1e-6
of a 4-rank run's losses over 22 steps, for ~24% less CPU; run_train.sh, the debug
model, chaos.py's train_args; no saves, which change nothing it logs). Then ONE elastic job of
the same config: two launchers
(`python -m trainer.launch --nnodes 1:2 --nproc_per_node 2 --max-restarts ...`, c10d
rendezvous on 127.0.0.1, as tests/test_multinode.py starts them), each in its own session; the
rendezvous is served by a process of its own (a host that stays up: with c10d the node serving
it cannot be lost). A seeded schedule loses a node `faults` times, a few steps after the job
grew back to 4 ranks or while a save is in progress (a fresh `step-N.partial`; at least
`min_during_save` times): one of the two nodes, at random, is SIGKILLed whole (launcher and
ranks at once; never while one node is left). The survivor restarts alone (`dp=2, world=2`,
accumulation 2: the same global batch) from the newest committed checkpoint; once it trained a
step, a new launcher is started, as a replacement host would be, and the job grows back to
`world=4` at the next rendezvous, again from the newest checkpoint (the survivor saves first).

Checked: every shrink and grow-back resumed from the newest committed checkpoint; the steps a
loss redid (the last step logged before the kill less the resumed step) are at most the
interval (see `allowance`); the two launchers left exit 0; every step's TensorBoard loss is
within 1e-4 of the uninterrupted run (the world sizes differ: not bitwise); every folder left
in the checkpoint folder is a committed `step-N` that loads.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.chaos_common import (
    SAVE_HOLD,
    Launch,
    committed,
    partials,  # noqa: E402
    train_args,
)
from scripts.chaos_report import per_kind, tb_losses  # noqa: E402
from tests.helpers import process_tree  # noqa: E402
from trainer.checkpoint.safe_load import load_tensors  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4  # the losses of the whole run against the uninterrupted one
RDZV_CONF = (
    "join_timeout=120,last_call_timeout=2,is_host=false,"  # the store is apart
    "keep_alive_interval=1,keep_alive_max_attempt=5"
)  # a lost node: gone in 5 s
MAX_RESTARTS = 1000  # every shrink is one restart of the survivor
# Seconds every rank sleeps after each step (TRAINER_TEST_SLOW_RANK=all:NODE_PACE): the job's
# pace, whatever the model's (the tiny one's steps take a few ms), so the survivor trains on
# while a new node starts. Costs no CPU.
NODE_PACE = 0.3  # chaos_common.PACE (0.25) is chaos.py's; the survivor needs a little more
# Steps a run needs per fault: a few at 4 ranks, and the survivor's at 2 ranks while the new
# launcher starts and joins: ~5 s on an idle 2-core machine, 11 s seen on one busy with the
# rest of the suite, where the survivor logs ~1 step a second (a save every 2 steps). Twice
# the busy figure, so the run does not end at 2 ranks before the new node is in.
STEPS_PER_FAULT = 16
# A rendezvous store of its own, on loopback only; prints its port, then serves until SIGTERM.
STORE = """
import datetime, signal, socket
from torch.distributed import TCPStore
sock = socket.socket(); sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", 0)); sock.listen(1024)
store = TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, wait_for_workers=False,
                 master_listen_fd=sock.fileno(), use_libuv=True,
                 timeout=datetime.timedelta(seconds=300))
print(sock.getsockname()[1], flush=True)
signal.pause()
"""


def node_steps(faults: int, steps: int = 0) -> int:
    """The steps of a node chaos run of `faults` faults: at least STEPS_PER_FAULT a fault."""
    return max(steps, STEPS_PER_FAULT * faults + 4)


@dataclass
class NodeFault:
    during_save: bool  # wait for a save in progress (else: `offset` steps after the resume)
    offset: int
    delay: float  # seconds after the moment is reached
    victim: int  # 0: the older of the two nodes in the job, 1: the newer


def node_schedule(seed: int, faults: int, min_during_save: int) -> list[NodeFault]:
    rng = random.Random(seed)
    saves = set(rng.sample(range(faults), min(faults, max(min_during_save, 0))))
    return [
        NodeFault(
            i in saves or rng.random() < 0.2,
            rng.randint(1, 3),
            rng.uniform(0, 0.3),
            rng.randrange(2),
        )
        for i in range(faults)
    ]


@dataclass
class NodeRecord:
    fault: NodeFault
    victim: int = -1  # the node killed (its number: node{N}.log)
    in_save: int = 0  # the step of the save in progress at the kill (0: none)
    last_step: int = 0  # the last step logged before the kill
    committed: int = 0  # the newest committed step when the survivor resumed
    resumed: int | None = None  # the step the survivor resumed from at 2 ranks
    grow_committed: int = 0  # the newest committed step when the job grew back
    grown: int | None = None  # the step the job resumed from at 4 ranks
    redone: int = 0  # last_step - resumed
    grow_redone: int = 0  # steps logged at 2 ranks and redone at 4 (the survivor saves)
    shrink_s: float = 0.0  # seconds from the kill to the resume at 2 ranks
    grow_s: float = 0.0  # seconds from the new node's start to the resume at 4 ranks

    @property
    def survived(self) -> bool:
        return self.resumed == self.committed and self.grown == self.grow_committed


@dataclass
class Attempt:
    """One start of a node's ranks, as its output shows it."""

    t: float
    world: int
    stale: set = field(default_factory=set)  # the partial folders there when it began
    resumed: int | None = None
    steps: list = field(default_factory=list)


class Node:
    """One launcher (`python -m trainer.launch --nnodes 1:2`) in its own session; its output
    goes to node{N}.log and is read into attempts."""

    def __init__(
        self,
        number: int,
        workdir: Path,
        endpoint: str,
        run_id: str,
        nproc: int,
        args: list[str],
        ckpt: Path,
        t0: float,
    ):
        self.number, self.attempts, self.done, self.ckpt, self.t0 = number, [], False, ckpt, t0
        cmd = [
            sys.executable,
            "-m",
            "trainer.launch",
            "--nnodes",
            "1:2",
            "--nproc_per_node",
            str(nproc),
            "--max-restarts",
            str(MAX_RESTARTS),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            endpoint,
            "--rdzv_id",
            run_id,
            "--rdzv-conf",
            RDZV_CONF,
            "-m",
            "trainer.train",
            "--job.config_file",
            str(REPO / "configs" / "debug_model.toml"),
            *args,
        ]
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            LOG_RANK=f"0,{nproc}",  # a rank per node
            HF_DATASETS_OFFLINE="1",
            TRAINER_TEST_SAVE_HOLD=str(SAVE_HOLD),
            TRAINER_TEST_SLOW_RANK=f"all:{NODE_PACE}",
            PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        self.log = open(workdir / f"node{number}.log", "w")
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            now = time.monotonic()
            self.log.write(f"{now - self.t0:7.2f}  {line}")  # seconds since the job began
            self.log.flush()
            if m := re.match(r"mesh: .*dp=\d+, world=(\d+)", line):
                self.attempts.append(Attempt(now, int(m.group(1)), partials(self.ckpt)))
            elif (m := re.match(r"resumed from \S+ \(step (\d+)\)", line)) and self.attempts:
                self.attempts[-1].resumed = int(m.group(1))
            elif (m := re.match(r"step:\s+(\d+)", line)) and self.attempts:
                self.attempts[-1].steps.append(int(m.group(1)))
            elif line.startswith("training done at step"):
                self.done = True

    def kill(self) -> None:
        """SIGKILL the launcher and every process under it at once (its session)."""
        tree = process_tree(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in tree:  # any that left the session
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.wait()
        self.reader.join(timeout=10)
        self.log.close()
        return code


class Job:
    """The nodes of the elastic job and what their output says."""

    def __init__(self, workdir: Path, args: list[str], nproc: int, ckpt: Path):
        self.workdir, self.args, self.per_node, self.ckpt = workdir, args, nproc // 2, ckpt
        self.store = subprocess.Popen(
            [sys.executable, "-c", STORE], text=True, stdout=subprocess.PIPE, start_new_session=True
        )
        port = self.store.stdout.readline().strip()
        assert port.isdigit(), "the rendezvous store did not start"
        self.endpoint, self.run_id = f"127.0.0.1:{port}", f"chaos-node-{uuid.uuid4().hex[:8]}"
        self.nodes: list[Node] = []
        self.t0 = time.monotonic()
        self.live: list[Node] = []  # the nodes not killed, oldest first

    def start_node(self) -> Node:
        node = Node(
            len(self.nodes),
            self.workdir,
            self.endpoint,
            self.run_id,
            self.per_node,
            self.args,
            self.ckpt,
            self.t0,
        )
        self.nodes.append(node)
        self.live.append(node)
        return node

    def current(self) -> Attempt | None:
        """The newest attempt any live node logged."""
        found = [a for n in self.live for a in n.attempts[-1:]]
        return max(found, key=lambda a: a.t, default=None)

    def attempt_after(self, t: float, world: int) -> Attempt | None:
        """The first attempt at `world` begun after `t` that resumed (or trained: the first
        attempt of a run without a checkpoint)."""
        found = [
            a
            for n in self.live
            for a in n.attempts
            if a.t > t and a.world == world and (a.resumed is not None or a.steps)
        ]
        return min(found, key=lambda a: a.t, default=None)

    def last_step(self, nodes: list[Node], before: float) -> int:
        """The last step the nodes' newest attempts begun before `before` logged."""
        latest = [[a for a in n.attempts if a.t < before][-1:] for n in nodes]
        return max((s for a in latest for x in a for s in x.steps[-1:]), default=0)

    def ended(self) -> bool:
        return all(n.proc.poll() is not None for n in self.live)

    def close(self) -> None:
        self.store.kill()  # the rendezvous store process, started here
        self.store.wait()


def describe(number: int, rec: NodeRecord) -> str:
    out = (
        f"fault {number}: node {rec.victim} lost "
        f"{f'during the save of step-{rec.in_save} ' if rec.in_save else ''}"
        f"at step {rec.last_step}; "
    )
    if rec.resumed is None:
        return out + "the job did not shrink"
    out += (
        f"2 ranks resumed from step {rec.resumed} (newest committed: step-{rec.committed}), "
        f"redoing {rec.redone}, {rec.shrink_s:.1f}s after the kill; "
    )
    if rec.grown is None:
        return out + "it did not grow back"
    return out + (
        f"grown back to 4 from step {rec.grown} (newest committed: "
        f"step-{rec.grow_committed}), redoing {rec.grow_redone}, {rec.grow_s:.1f}s "
        "after the new node started"
    )


def _wait(cond, job: Job, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not job.ended():
        if found := cond():
            return found
        time.sleep(0.01)
    return cond()


def _saving(ckpt: Path, stale: set, after: int, reached: int) -> int:
    """The step of a save in progress made by the running attempt, else 0."""
    steps = [int(name[5:-8]) for name, _ in partials(ckpt) - stale]
    return max((s for s in steps if after < s <= reached), default=0)


def _lose_a_node(job: Job, fault: NodeFault, ckpt: Path, steps: int, log) -> NodeRecord | None:
    """Wait for the fault's moment with both nodes in the job, kill one, and follow the
    shrink and the grow-back. None if the run ended before the moment came."""
    rec, attempt, deadline = NodeRecord(fault), None, time.monotonic() + 300
    while not job.ended() and time.monotonic() < deadline:  # a few steps, or the next save
        attempt = job.current()
        if (
            len(job.live) == 2
            and attempt is not None
            and attempt.world == 2 * job.per_node
            and attempt.steps
            and committed(ckpt)
        ):  # a checkpoint to lose work back to
            start, reached = attempt.resumed or 0, attempt.steps[-1]
            moment = (
                _saving(ckpt, attempt.stale, start, reached)
                if fault.during_save
                else reached >= min(start + fault.offset, steps - 1)
            )
            if moment:
                time.sleep(fault.delay)
                in_save = _saving(ckpt, attempt.stale, start, attempt.steps[-1])
                if not fault.during_save or in_save:
                    break
        time.sleep(0.01)
    else:
        return None
    victim, both = job.live[fault.victim], list(job.live)
    killed = time.monotonic()
    victim.kill()
    job.live.remove(victim)
    victim.finish(timeout=30)  # its output up to the kill is read
    rec.in_save, rec.last_step, rec.victim = in_save, job.last_step(both, killed), victim.number

    shrunk = _wait(lambda: job.attempt_after(killed, job.per_node), job, 120)
    if shrunk is None:
        return rec
    rec.resumed, rec.committed = shrunk.resumed or 0, max(committed(ckpt), default=0)
    rec.redone = max(0, rec.last_step - rec.resumed)
    rec.shrink_s = time.monotonic() - killed
    _wait(lambda: shrunk.steps, job, 120)  # it goes on at the smaller size
    joined = time.monotonic()
    if job.ended() or any(n.done for n in job.live):
        log("the run ended at 2 ranks, before a new node could join: give it more steps")
        return rec
    job.start_node()
    grown = _wait(lambda: job.attempt_after(joined, 2 * job.per_node), job, 180)
    if grown is not None:
        small = [
            s
            for n in job.live
            for a in n.attempts
            if a.t >= shrunk.t and a.world == job.per_node
            for s in a.steps
        ]
        rec.grown, rec.grow_committed = grown.resumed or 0, max(committed(ckpt), default=0)
        rec.grow_redone = max(0, max(small, default=0) - rec.grown)
        rec.grow_s = time.monotonic() - joined
    return rec


def run_node_chaos(
    workdir: Path,
    *,
    faults: int,
    min_during_save: int,
    steps: int,
    interval: int,
    seed: int = 0,
    nproc: int = 4,
    async_mode: str = "disabled",
    log=print,
) -> dict:
    """The uninterrupted run, then the elastic job of two nodes of nproc/2 ranks that loses a
    node `faults` times (see the module's docstring); the figures of chaos_report.report."""
    workdir.mkdir(parents=True, exist_ok=True)
    ref, dump, t0 = workdir / "reference", workdir / "chaos", time.monotonic()
    # No hang is injected: a lost node's peers fail at once on the closed connections. A
    # longer train timeout than chaos.py's keeps a loaded machine's slow step from being one.
    common = ["--training.device", "cpu", "--comm.train_timeout_seconds", "30"]
    # Its saves are left out: they change nothing it logs, and only its losses are compared.
    # On one rank, the job's global batch by accumulation: the world sizes differ anyway.
    code = Launch(
        [*train_args(ref, steps, interval, nproc), *common, "--checkpoint.enable", "false"], 1
    ).finish(timeout=3600)
    assert code == 0, f"the reference run failed with exit code {code}"
    log(
        f"reference run: {steps} steps on 1 rank (the global batch of {nproc}) in "
        f"{time.monotonic() - t0:.1f}s"
    )

    ckpt, records = dump / "checkpoint", []
    job = Job(
        workdir, [*train_args(dump, steps, interval, nproc, async_mode), *common], nproc, ckpt
    )
    try:
        job.start_node()
        job.start_node()
        for fault in node_schedule(seed, faults, min_during_save):
            rec = _lose_a_node(job, fault, ckpt, steps, log)
            if rec is None:
                log(f"the run ended after {len(records)} of {faults} faults: give it more steps")
                break
            records.append(rec)
            log(describe(len(records), rec))
            if rec.grown is None:
                break
        codes = [n.finish(timeout=max(300, 10 * steps)) for n in list(job.live)]
    finally:
        for node in job.live:
            if node.proc.poll() is None:
                node.kill()
        job.close()
    return node_figures(
        records, ref, dump, steps, interval, time.monotonic() - t0, codes, len(job.nodes)
    )


def node_figures(
    records: list[NodeRecord],
    ref: Path,
    dump: Path,
    steps: int,
    interval: int,
    seconds: float,
    codes: list[int],
    launchers: int,
) -> dict:
    """chaos_report._figures' keys for the lost node, with the losses compared within
    TOLERANCE and every checkpoint folder left checked."""
    want, have = tb_losses(ref), tb_losses(dump)
    diffs = {s: abs(have[s] - want[s]) for s in range(1, steps + 1) if s in have and s in want}
    beyond = [s for s in range(1, steps + 1) if s not in diffs or diffs[s] > TOLERANCE]
    folders = sorted((dump / "checkpoint").iterdir()) if (dump / "checkpoint").exists() else []
    bad = [f.name for f in folders if not re.fullmatch(r"step-\d+", f.name) or not _loads(f)]
    final = (
        load_tensors(dump / "checkpoint" / f"step-{steps}")
        if (dump / "checkpoint" / f"step-{steps}").exists()
        else {}
    )
    survived = [r for r in records if r.survived]
    return {
        "faults": len(records),
        "survived": len(survived),
        "during_save": sum(bool(r.in_save) for r in records),
        "kinds": {"node": len(records)},
        "per_kind": per_kind([("node", r.survived, r.in_save, r.redone) for r in records]),
        "healed_in_job": len(survived),
        "launches": launchers,
        "redone": [r.redone for r in records],
        "redone_total": sum(r.redone for r in records),
        "grow_redone": [r.grow_redone for r in records],
        "max_redone_ok": all(r.redone <= allowance(r, interval) for r in records),
        "redone_beyond_interval": [
            f"node {r.redone} (the steps an async save of step-{r.in_save} let run)"
            for r in records
            if r.redone > interval
        ],
        "tensors": len(final),
        "tensors_differing": [],
        "tolerance": TOLERANCE,
        "loss_max_diff": max(diffs.values(), default=0.0),
        "loss_steps_differing": beyond,
        "checkpoints": len(folders),
        "checkpoints_bad": bad,
        "exit_codes": codes,
        "data_lost": len(records)
        - len(survived)
        + len(beyond)
        + len(bad)
        + (not final)
        + sum(c != 0 for c in codes),
        "seconds": round(seconds, 1),
    }


def allowance(rec: NodeRecord, interval: int) -> int:
    """Steps a lost node may cost: the interval, and, lost during an async save (which lets
    training go on), the steps run since the step it saves."""
    return interval + (max(0, rec.last_step - rec.in_save) if rec.in_save else 0)


def _loads(folder: Path) -> bool:
    try:
        return bool(load_tensors(folder))
    except Exception:  # noqa: BLE001 (any failure to load is the finding)
        return False
