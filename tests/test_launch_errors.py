"""Bad input through ./run_train.sh: one line naming the culprit, non-zero exit, no hang."""

import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import (
    REPO,
    free_port,
    listening_addresses,
    process_tree,
    run_train,
    subprocess_env,
    zygote_env,
)

CASES = {
    "unknown key": (
        [],
        "--training.setps=3",
        "config error: unknown key 'training.setps' (did you mean 'training.steps'?)",
    ),
    "wrong type": ([], "--training.steps=ten", "config error: training.steps must be an int"),
    "degree mismatch": (
        [],
        "--parallelism.data_parallel_shard_degree=4",
        "config error: parallelism.data_parallel_replicate_degree = 1 and "
        "parallelism.data_parallel_shard_degree = 4 multiply to 4, but the "
        "world size is 2",
    ),
    "indivisible global batch": (
        [],
        "--training.global_batch_size=6",
        "config error: training.global_batch_size = 6 is not divisible",
    ),
    "toml syntax error": (
        ["[training]", "steps = 3", "seq_len = = 4"],
        None,
        "config error: TOML syntax error in",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line(tmp_path, case):
    toml_lines, override, expected = CASES[case]
    config = None
    if toml_lines:
        config = tmp_path / "bad.toml"
        config.write_text("\n".join(toml_lines) + "\n")
    zygote_env(None)  # the launch zygote (a worker's first use starts it) outside the timing
    t0 = time.monotonic()
    proc = run_train(
        tmp_path / "out",
        *([override] if override else []),
        nproc=2,
        config=str(config) if config else None,
        check=False,
        timeout=30,
    )
    assert time.monotonic() - t0 < 30
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(expected), lines[0]
    if case == "toml syntax error":
        assert "line 3" in lines[0]


def test_help_prints_every_config_key_and_starts_nothing(tmp_path):
    """`./run_train.sh --help`: the config reference (the keys `python -m trainer.config --help`
    lists), exit 0, no run (it used to become NGPU in the shell and fail)."""
    from trainer.config.reference import text as reference

    proc = run_train(tmp_path / "out", "--help", nproc=None, timeout=60)
    assert proc.stdout.strip() == reference().strip() and proc.stderr == ""
    assert not (tmp_path / "out").exists()


def test_data_error_inside_the_ranks_is_one_line(tmp_path):
    """A user error found by the ranks themselves (after the process group exists) is also one
    line, printed once, and every rank exits instead of waiting for the others."""
    proc = run_train(
        tmp_path / "out",
        f"--data.store_path={tmp_path}/missing_store",
        nproc=2,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [
        f"data error: token store not found: {tmp_path}/missing_store (data.store_path)"
    ], proc.stderr


def lone_node(tmp_path, host: str, *options: str) -> list[str]:
    """The launcher of node 1 of 2 (the other never comes), its rendezvous on a free port."""
    port = free_port()
    return [
        sys.executable,
        "-m",
        "trainer.launch",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"{host}:{port}",
        "--rdzv_id",
        "t",
        *options,
        "-m",
        "trainer.train",
        "--training.device",
        "cpu",
        "--job.dump_folder",
        str(tmp_path / "out"),
    ]


def test_sigterm_while_the_rendezvous_waits(tmp_path):
    """A launch whose rendezvous never completes (the second node never comes) ends within
    5 s of a SIGTERM, before any rank exists, with exit code 3; its store listens on loopback."""
    proc = subprocess.Popen(
        lone_node(tmp_path, "localhost"),
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not listening_addresses([proc.pid]) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert listening_addresses([proc.pid]) == ["127.0.0.1"]
        time.sleep(1)  # well inside the rendezvous's wait
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=5)
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3
    assert err.strip() == (
        "error: stopped on SIGTERM before any rank started (waiting in the "
        "rendezvous): nothing to save"
    )
    assert not process_tree(proc.pid)[1:]


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (/proc/PID/status's SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line for line in f if line.startswith("SigCgt:")).split()[1]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            launcher = b"trainer.launch" in f.read()
    except (FileNotFoundError, StopIteration):
        return False
    return launcher and bool(int(mask, 16) >> (signum - 1) & 1)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_the_launcher_imports_is_one_line(tmp_path, signum):
    """Ctrl-C (or SIGTERM) in a launch's first seconds, while the launcher imports torch: one
    line and code 3, as later before any rank starts (was a KeyboardInterrupt or RecursionError
    traceback from inside the import, or for SIGTERM a silent death)."""
    proc = subprocess.Popen(
        [str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path)],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not _catches(proc.pid, signal.SIGTERM) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.005)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (proc.returncode, err.strip()) == (
        3,
        f"error: stopped on {signum.name} before any rank started: nothing to save",
    ), out + err
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_a_node_that_never_comes_is_one_line(tmp_path):
    """--nnodes 2 and only this node: after the join timeout, one line naming the endpoint,
    id and timeout key, exit 1 (was torchrun's RendezvousTimeoutError traceback)."""
    cmd = lone_node(tmp_path, "127.0.0.1", "--rdzv-conf", "join_timeout=2")
    port = cmd[cmd.index("--rdzv_endpoint") + 1].rsplit(":", 1)[1]
    proc = subprocess.run(
        cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"error: the rendezvous timed out (--rdzv_endpoint 127.0.0.1:{port}, --rdzv_id t): "
        "too few nodes for --nnodes 2 joined within its join_timeout (--rdzv-conf "
        "join_timeout=SECONDS, default 600): start every node with the same endpoint and id, "
        "and check that each can reach the endpoint"
    ), proc.stderr
