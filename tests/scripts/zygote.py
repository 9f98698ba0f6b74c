"""A Python zygote for the tests' subprocesses: one process per pytest worker that imports torch
and the trainer once, then forks each `python -m MODULE ...` or `python SCRIPT.py ...` it is
handed: run_train.sh's `-m trainer.launch` launches, and the tests' own CLI runs and probe
launchers (tests/helpers.py's fork_python: `-m trainer.plan`, tests/scripts/forkrun.py, ...).

run_train.sh runs unchanged (bash, its exports, its command line); only its interpreter is
tests/scripts/zygote_shim.py (PYTHON=, set by tests/helpers.py), which hands its argv,
environment, working directory and stdin/stdout/stderr to this server and exits with the
process's status. The process is a fork of this one that runs the module as `__main__` (what
`python -m` does; the module's earlier import is dropped first) or the script as `__main__`
(what `python SCRIPT` does), with that argv, environment, folder, streams, `sys.path[0]` and
thread count: the ~3-6 CPU-s of interpreter start and imports of each are paid once (a
launcher then forks its CPU ranks as usual). If the shim goes away (a test's timeout killed
it), its process group is killed.

    python tests/scripts/zygote.py SOCKET_PATH        (started by tests/helpers.py)
"""

import array
import gc
import json
import os
import select
import signal
import socket
import sys

gc.disable()  # while torch and the trainer import, as trainer.launch does
os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # the launcher's own level (trainer/launch.py)

import torch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401

# Rank 0 imports TensorBoard's writer when it opens it (~0.2-0.3 s here: it pulls in boto3 and
# fsspec for its own s3 support), on the path every other rank waits on at its first collective.
import torch.utils.tensorboard  # noqa: E402,F401
from torch.distributed.run import config_from_args, elastic_launch, parse_args  # noqa: E402,F401

import trainer.launch  # noqa: E402,F401  (its imports; run afresh as __main__ per launch)
import trainer.train  # noqa: E402,F401

gc.enable()


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: a JSON line {argv (after the interpreter), env, cwd} with the shim's fds
    0, 1, 2."""
    fds = array.array("i")
    data = b""
    while not data.endswith(b"\n"):
        msg, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_LEN(3 * fds.itemsize))
        if not msg:
            raise ConnectionError("the shim went away")
        data += msg
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return json.loads(data), list(fds)


def launch(request: dict, fds: list[int]) -> None:
    """In the forked process: become `python ARGV` (run) and never return."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group, so a lost shim's launch dies whole
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if os.environ.get("OMP_NUM_THREADS"):  # what torch reads at its start in a fresh one
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        try:
            run(request["argv"])
            code = 0  # trainer.launch ends with os._exit; a CLI returns here or exits
        except SystemExit as stop:  # as the interpreter treats it: None 0, a message 1
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
            if not isinstance(stop.code, int) and stop.code is not None:
                print(stop.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
        import atexit
        import threading

        threading._shutdown()  # what a fresh interpreter does at its end: join its threads,
        atexit._run_exitfuncs()  # then run the exit handlers (the script's and its imports')
    except BaseException:
        import traceback

        traceback.print_exc()
        code = code or 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def run(argv: list[str]) -> None:
    """`python -m MODULE ARGS` or `python SCRIPT ARGS` in this (forked) process."""
    import runpy

    if argv[0] == "-m":
        module = argv[1]
        sys.path[0] = os.getcwd()  # as `python -m` puts the working folder first
        sys.argv = [module, *argv[2:]]  # [0]: runpy sets the file
        # the module that runs (a package's __main__) runs afresh, as in a fresh interpreter
        loaded = sys.modules.get(module)
        sys.modules.pop(module + ".__main__", None)
        if loaded is not None and not hasattr(loaded, "__path__"):
            sys.modules.pop(module)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` puts the script's folder
        sys.argv = [argv[0], *argv[1:]]
        runpy.run_path(script, run_name="__main__")


def book_cpu(usage) -> None:
    """Append a finished launch's CPU seconds (its launcher's and ranks': `usage`, wait4's
    rusage) to the ledger beside
    the socket (LEDGER): its CPU reaches the pytest worker's RUSAGE_CHILDREN only when the
    zygote exits, so tests/budget.py adds the ledger to charge each test its launches."""
    line = f"{usage.ru_utime + usage.ru_stime:.3f}\n".encode()
    fd = os.open(LEDGER[0], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one small O_APPEND write: whole, whatever runs beside it
    finally:
        os.close(fd)


def handle(conn: socket.socket) -> None:
    """In a forked handler: start the launch, tell the shim its pid, wait for it (killing its
    group if the shim goes away), book its CPU seconds and send its exit status."""
    request, fds = receive(conn)
    pid = os.fork()
    if pid == 0:
        conn.close()
        launch(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        readable, _, _ = select.select([conn], [], [], 0.05)
        if readable and not conn.recv(1):  # EOF: the shim was killed
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            book_cpu(os.wait4(pid, 0)[2])
            return
    book_cpu(usage)
    code = os.waitstatus_to_exitcode(status)
    conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")


def reap(block: bool) -> None:
    """Wait for the finished handlers (all of them if `block`)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


LEDGER = [""]  # the CPU ledger's path: SOCKET_PATH + ".cpu"


def serve(path: str) -> None:
    parent = os.getppid()
    LEDGER[0] = path + ".cpu"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    # SIGTERM (tests/helpers.py at exit): reap every handler, then exit, so that the launches'
    # CPU time reaches the pytest process's children's (time -v, RUSAGE_CHILDREN) through ours.
    signal.signal(signal.SIGTERM, lambda *_: (reap(block=True), os._exit(0)))
    gc.freeze()  # the imported heap: out of every later collection, in every fork
    print("ready", flush=True)
    while os.getppid() == parent:  # the pytest worker that started it is alive
        reap(block=False)
        readable, _, _ = select.select([server], [], [], 1.0)
        if not readable:
            continue
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                handle(conn)
            finally:
                os._exit(0)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
