"""torchrun with a readable failure report and signals passed on to the workers.

    python -m trainer.launch [--check] [torchrun options] -m trainer.train [trainer overrides]

This is `torch.distributed.run` (the code behind `torchrun`) with these differences:

- Check first (`--check`, run_train.sh): the config and the launch checks run here before
  torchrun starts (check_first); a refused launch is one line and no process starts.

- Failures: torchrun prints a long report and its own traceback. A worker that stopped on a
  user error (`config error: ...`) or a signal has said so: we exit with its code silently;
  any other failure is one line naming the rank, host and exit code (the worker's own
  traceback is above it), and a failed rendezvous (a node that never came) is one line too.
- Signals: SLURM delivers SIGUSR1/SIGTERM to the launcher (srun's task), not to the workers.
  torchrun would die of SIGUSR1, or SIGTERM its workers and SIGKILL them 30 s later, possibly
  mid-save. We forward SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 to the workers and keep
  waiting: they save at the next step and exit with code 3. A second SIGINT or SIGTERM kills
  the workers at once.
- Restarts (`--max-restarts`, MAX_RESTARTS in run_train.sh): torchrun restarts every rank
  after any failure; here a failure that no restart cures (FINAL_CODES: user error, signalled
  stop, training error, OOM, a repeated failure) ends the job, and each restart is one line.
  A stopped rank (SIGSTOP) is SIGKILLed at once when the workers are stopped, instead of 30 s
  after a SIGTERM it cannot act on (see guard_restarts; trainer/health/heartbeat.py names it).
- Start: CPU ranks of the trainer are forked from this launcher once it has imported torch
  and the trainer (start method "fork"): ~4 s less per launch on 2 ranks, ~5 s on 4. They
  see no GPU (`hide_gpus`). CUDA ranks, any other target, and CPU ranks with
  TRAINER_FORK_RANKS=0 start as fresh processes, as under torchrun.
"""

from __future__ import annotations

import gc
import glob
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading


def _stop_before_ranks(signum, frame) -> None:
    """SIGINT/SIGTERM while the launcher imports and checks (~2 s, until install_forwarding): no
    rank exists, nothing to save: one line and code 3 (not a traceback from inside an import)."""
    print(
        f"error: stopped on {signal.Signals(signum).name} before any rank started: nothing to save",
        file=sys.stderr,
        flush=True,
    )
    os._exit(3)  # trainer.errors.PREEMPTED_EXIT_CODE, not imported yet


# As the launcher: no garbage collection during the imports (0.45 s of a 2.7 s import here;
# main() turns it back on), and a stop before any rank is one line. As a module: neither.
if __name__ == "__main__":
    gc.disable()
    for _signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_signum, _stop_before_ranks)

# The agents' own C++ warnings (e.g. a TCPStore peer gone at shutdown after a failed or stopped
# worker group) are noise in the launcher; c10 reads the level once, when torch loads, so set it
# for this process only and give the workers the user's setting back.
_user_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
import torch  # noqa: E402,F401

if _user_level is None:
    del os.environ["TORCH_CPP_LOG_LEVEL"]
else:
    os.environ["TORCH_CPP_LOG_LEVEL"] = _user_level

from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.elastic.rendezvous.api import RendezvousError  # noqa: E402
from torch.distributed.run import config_from_args, elastic_launch, parse_args  # noqa: E402

from trainer.errors import (
    GAVE_UP_EXIT_CODE,
    HANG_EXIT_CODE,
    OUT_OF_MEMORY_EXIT_CODE,  # noqa
    PREEMPTED_EXIT_CODE,
    TRAINING_ERROR_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
)
from trainer.health.elastic import (
    note_elastic_world,
    rendezvous_anew_each_round,  # noqa: E402
    rendezvous_failure,
)

# No restart cures these (MAX_RESTARTS): the job ends at once.
FINAL_CODES = (
    USER_ERROR_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    TRAINING_ERROR_EXIT_CODE,
    OUT_OF_MEMORY_EXIT_CODE,
    GAVE_UP_EXIT_CODE,
)
QUIET_CODES = (*FINAL_CODES, HANG_EXIT_CODE)


FORK_ENV = "TRAINER_FORK_RANKS"  # 0: start CPU ranks as fresh processes too
FAILED_RANK_GRACE_S = 2.0  # see forked_rank
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")


def _children() -> list[int]:
    pids: list[int] = []
    for path in glob.glob("/proc/self/task/*/children"):
        with open(path) as fh:
            pids += [int(p) for p in fh.read().split()]
    return pids


def _forward(signum, frame) -> None:
    if signum in (signal.SIGINT, signal.SIGTERM) and not _children():
        return  # no worker yet (or between restarts): _stop_without_workers ends the launcher
    _received[signum] = _received.get(signum, 0) + 1
    if signum in (signal.SIGINT, signal.SIGTERM) and _received[signum] > 1:
        _signal_children(signal.SIGKILL)  # the ranks would only record it: stop them now
        raise SignalException(
            f"second {signal.Signals(signum).name}: stopping now", signal.Signals(signum)
        )
    _signal_children(signum)


def _signal_children(signum: int) -> None:
    for pid in _children():
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


_received: dict[int, int] = {}


def install_forwarding() -> None:
    """Our handlers for the forwarded signals; torchrun keeps its own for the rest. Every
    signal also reaches _stop_without_workers through the wakeup fd."""
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGQUIT"
    read_fd, write_fd = os.pipe()  # first: a stop after _forward is in reaches the thread
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(
        target=_stop_without_workers, args=(read_fd,), daemon=True, name="launcher-signals"
    ).start()
    for name in FORWARDED:
        signal.signal(getattr(signal, name), _forward)


def _stop_without_workers(read_fd: int) -> None:
    """SIGTERM or SIGINT while no worker exists (the rendezvous waits for other nodes, or the
    agent is between restarts): nothing is running that could save, so the launcher ends at
    once with code 3, as a signalled stop does. A thread, because the main thread may sit in
    C++ (a store connecting or waiting), where Python's handlers never run: the C handler
    still writes the signal number to the wakeup fd, which this thread reads."""
    while True:
        for signum in os.read(read_fd, 64):
            if signum in (signal.SIGINT, signal.SIGTERM) and not _children():
                print(
                    f"error: stopped on {signal.Signals(signum).name} before any rank "
                    "started (waiting in the rendezvous): nothing to save",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(PREEMPTED_EXIT_CODE)


def forkable_trainer_args(args) -> list[str] | None:
    """The trainer's arguments when the ranks may be forked from this launcher: torchrun's
    `args` run `-m trainer.train`, its config puts the ranks on CPU, and TRAINER_FORK_RANKS is
    not 0. (A CUDA rank starts as a fresh process, as torchrun starts any script.)"""
    if (
        not (
            args.module
            and not args.no_python
            and not args.run_path
            and args.training_script == "trainer.train"
            and getattr(args, "use_env", True)
        )
        or os.environ.get(FORK_ENV, "1") == "0"
    ):
        return None
    from trainer.config.job import load_config
    from trainer.device import visible_gpus
    from trainer.errors import UserError

    argv = list(args.training_script_args)
    try:
        device = load_config(argv).training.device
    except UserError:  # the ranks report it, as without forking
        return None
    if device == "cpu" or (device == "auto" and visible_gpus()[0] == 0):
        return argv
    return None


def hide_gpus() -> None:
    """CPU ranks forked from here see no GPU, and nothing here initialises CUDA before the fork.

    torchrun's LaunchConfig asks `torch.cuda.is_available()`, which initialises the CUDA driver
    in this process where a GPU is visible; a rank forked after that fails at its first CUDA
    query, which CPU training makes too: torch 2.11's optimizer step asks for the current
    accelerator ("CUDA error: initialization error"), dynamo saves the CUDA RNG state ("Cannot
    re-initialize CUDA in forked subprocess"). Seen on an H100 in 47 tests (2026-11-25)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def forked_rank(argv: list[str]) -> None:
    """A rank forked from the launcher, which has imported torch and the trainer already: the
    same as `python -m trainer.train argv` in a fresh process, without its ~4 s of imports."""
    from trainer import train

    _name_process(f"trainer-rank{os.environ.get('RANK', '?')}")

    def record(signum, frame) -> None:
        train.EARLY_SIGNALS.append(signum)

    signal.set_wakeup_fd(-1)  # the launcher's pipe (install_forwarding) is not the rank's
    for name in FORWARDED:  # ours were inherited: record signals until the trainer's own
        signal.signal(getattr(signal, name), record)
    if os.environ.get("OMP_NUM_THREADS"):  # the rank's share of the cores, read at start
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        code = train.main(argv)
    except Exception:  # a bug: its traceback on this rank's stderr, as a fresh process prints it
        import time
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        # The launcher names the first failed rank it finds in a poll, in local-rank order: a
        # rank killed by a signal (the OOM killer's) leaves no traceback and its peers fail a
        # moment later: give the launcher time to name the rank that ended first.
        time.sleep(FAILED_RANK_GRACE_S)
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    if code == HANG_EXIT_CODE:  # a collective of gloo's threads may still wait on the silent
        os._exit(code)  # peer, and multiprocessing would join them before exiting
    if code:
        raise SystemExit(code)


def guard_restarts() -> None:
    """Two changes to torchrun's agent. Restarts (`--max-restarts`, MAX_RESTARTS): a worker
    group that failed with a code of FINAL_CODES is not restarted, and each restart is one
    line. Stopping workers: a worker that is stopped (SIGSTOP, a debugger, a frozen container)
    cannot act on the agent's SIGTERM, and the agent would wait 30 s before its SIGKILL: it
    gets the SIGKILL at once."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext

    monitor, close = LocalElasticAgent._monitor_workers, PContext.close

    def _monitor(self, worker_group):
        result = monitor(self, worker_group)
        if (
            result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
            and self._remaining_restarts > 0
        ):
            failures = sorted(result.failures.items(), key=lambda kv: kv[1].timestamp)
            if any(f.exitcode in FINAL_CODES for _, f in failures):
                self._remaining_restarts = 0
            elif failures:
                spec = worker_group.spec
                print(
                    f"restart {spec.max_restarts - self._remaining_restarts + 1} of "
                    f"{spec.max_restarts}: {_describe(*failures[0])}; every rank restarts "
                    "from the latest checkpoint",
                    file=sys.stderr,
                    flush=True,
                )
        return result

    def _close(self, death_sig=None, timeout: int = 30) -> None:
        _kill_stopped_children()
        close(self, death_sig, timeout)

    LocalElasticAgent._monitor_workers, PContext.close = _monitor, _close
    # Forked ranks: after one fails, torch.multiprocessing SIGTERMs the others and joins them
    # for 30 s before its SIGKILL.
    from torch.multiprocessing.spawn import ProcessContext

    join = getattr(ProcessContext, "_join_procs_with_timeout", None)
    if join is not None:

        def _join(self, timeout: float) -> None:
            _kill_stopped_children()
            join(self, timeout)

        ProcessContext._join_procs_with_timeout = _join


_LISTENERS: list[socket.socket] = []  # the loopback sockets the stores listen on, kept open


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _store(make, host: str, port: int, is_master: bool, **kwargs):
    """A TCPStore; a server for a loopback host listens on loopback only (TCPStore itself
    binds every interface whatever host it is given): it listens on a socket bound here."""
    if not (is_master and _is_loopback(host)):
        return make(host, port, is_master=is_master, **kwargs)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", port))
        listener.listen(1024)
    except OSError as e:  # another node on this host serves it: torchrun then connects to it
        listener.close()
        raise RuntimeError(f"the server socket has failed to bind: {e}") from None
    try:
        store = make(
            host,
            listener.getsockname()[1],
            is_master=True,
            master_listen_fd=listener.fileno(),
            use_libuv=True,
            **kwargs,
        )
    except (TypeError, RuntimeError, ValueError) as e:  # a torch without master_listen_fd
        listener.close()
        print(
            f"note: torchrun's store listens on every interface ({type(e).__name__}: {e})",
            file=sys.stderr,
            flush=True,
        )
        return make(host, port, is_master=True, **kwargs)
    _LISTENERS.append(listener)
    return store


def listen_on_loopback() -> None:
    """Single-node runs (a rendezvous endpoint and --local-addr on loopback, as run_train.sh
    gives) keep torchrun's two stores, the rendezvous's and the one the ranks share, off the
    network: they listen on loopback only. Multi-node endpoints are left as torchrun makes
    them. (Gloo, between the ranks, already binds the address it connects over.)"""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    def rendezvous_store(host, port, is_master=False, **kwargs):
        return _store(dist.TCPStore, host, port, is_master, **kwargs)

    def shared_store(self, master_addr, master_port):
        return _store(dist.TCPStore, master_addr, master_port, True, multi_tenant=True)

    backend.TCPStore = rendezvous_store
    DynamicRendezvousHandler._create_tcp_store_server = shared_store


def _describe(rank: int, failure) -> str:
    how = (
        f"signal {failure.signal_name()}"
        if failure.exitcode < 0
        else f"exit code {failure.exitcode}"
    )
    return (
        f"rank {rank} (local rank {failure.local_rank} on {socket.gethostname()}) ended with {how}"
    )


def _kill_stopped_children() -> None:
    for pid in _children():
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
            if state in ("T", "t"):
                os.kill(pid, signal.SIGKILL)
        except (OSError, IndexError):
            pass


def _name_process(name: str) -> None:
    """Name this process (what `ps -o comm` and `top` show; /proc/<pid>/comm): forked ranks
    would otherwise all look like the launcher, and their environment shows the launcher's."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def check_first(argv: list[str]) -> list[str] | int:
    """run_train.sh's `--check`: the config and the launch checks (trainer/plan/preflight.py)
    in this process before torchrun starts, as `python -m trainer.config --check` runs them,
    without a second interpreter importing torch (~2.5 s of CPU per launch).

    `argv` is torchrun's as run_train.sh writes it: `--nnodes N --nproc_per_node K ...`, then
    `-m trainer.train` and the trainer's arguments; K '' asks for the default ranks (every
    visible GPU, else 2 on CPU). Returns it with the ranks filled in, or the exit code of a
    refused launch, whose one line is printed (or 0 after `--help`'s reference). Also shares
    the cores out between the ranks (OMP_NUM_THREADS, where unset; torchrun would force 1).
    Torch is imported by now, so only torch's own pools follow it (the forked ranks call
    torch.set_num_threads); the trainer runs no numpy BLAS that would read it at load."""
    from trainer.config.job import check_launch
    from trainer.config.reference import text as reference
    from trainer.errors import UserError
    from trainer.plan.preflight import LAUNCH_CHECKS

    try:
        module = argv.index("-m")  # torchrun's options, then `-m trainer.train` and its args
        opts, trainer_args = argv[:module], argv[module + 2 :]
        nproc = opts.index("--nproc_per_node") + 1
        if {"--help", "-h"} & set(trainer_args):  # ./run_train.sh --help: every config key
            print(reference())
            return 0
        nnodes = opts[opts.index("--nnodes") + 1] if "--nnodes" in opts else "1"
        ranks = check_launch(
            [*trainer_args, "--nnodes", nnodes, "--nproc-per-node", opts[nproc]], LAUNCH_CHECKS
        )
    except (ValueError, IndexError):
        print(
            "error: trainer.launch --check takes run_train.sh's arguments: --nproc_per_node "
            "K (K may be '') and -m trainer.train ARGS",
            file=sys.stderr,
            flush=True,
        )
        return USER_ERROR_EXIT_CODE
    except UserError as e:
        print(e.one_line(), file=sys.stderr, flush=True)
        return e.exit_code
    if not os.environ.get("OMP_NUM_THREADS"):
        cores = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )
        os.environ["OMP_NUM_THREADS"] = str(max(cores // ranks, 1))
    return [*opts[:nproc], str(ranks), *opts[nproc + 1 :], *argv[module:]]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"]:
        checked = check_first(argv[1:])
        if isinstance(checked, int):
            return checked
        argv = checked
    args = parse_args(argv)
    note_elastic_world(args)  # trainer/health/elastic.py
    trainer_args = forkable_trainer_args(args)
    if trainer_args is not None:
        hide_gpus()  # before config_from_args, which asks CUDA
    config, cmd, cmd_args = config_from_args(args)
    if trainer_args is not None:
        import torch._dynamo  # noqa: F401  (DTensor imports it at its first use, in each rank)

        import trainer.train  # noqa: F401  (imported once here, inherited by every rank)

        # Frozen, the objects imported here stay out of every later collection: the forked
        # ranks' collections neither walk them nor write to (so copy) the pages they sit on.
        gc.freeze()
        config.start_method = "fork"
        cmd, cmd_args = forked_rank, [trainer_args]
    gc.enable()
    # launch_agent exports config.signals_to_handle as TORCHELASTIC_SIGNALS_TO_HANDLE (default
    # SIGTERM,SIGINT,SIGHUP,SIGQUIT), which would replace our handlers when the workers start.
    config.signals_to_handle = "SIGQUIT"
    install_forwarding()
    guard_restarts()
    listen_on_loopback()
    rendezvous_anew_each_round()
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except SignalException as err:  # a second SIGINT/SIGTERM: torchrun tore the workers down
        print(
            f"error: training stopped at once on {signal.Signals(err.sigval).name}",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(err.sigval)
    except RendezvousError as err:  # e.g. a node that never came: one line, no traceback
        print(rendezvous_failure(err, args), file=sys.stderr, flush=True)
        return 1
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        if code not in QUIET_CODES:
            print(
                f"error: training failed: {_describe(rank, failure)}; its output is above",
                file=sys.stderr,
                flush=True,
            )
        return code
    return 0


if __name__ == "__main__":
    # The elastic agent logs every worker failure at ERROR level before raising; the summary
    # above says the same in one line.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.CRITICAL)  # forked ranks
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous").setLevel(40)
    code = main(sys.argv[1:])
    # Everything has ended and been reported: skip the interpreter's teardown (freeing torch's
    # modules took 0.8 s of every launch on a 2-core machine).
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError):  # closed (>&-) or gone: nothing left to lose
            pass
    os._exit(code)
