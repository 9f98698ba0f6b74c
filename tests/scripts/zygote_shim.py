"""The interpreter of the tests' subprocesses that need no fresh one (PYTHON=this file's
wrapper, set by tests/helpers.py: run_train.sh's launches and fork_python's commands): hands
`-m MODULE ARGS` or `SCRIPT.py ARGS` to the zygote (tests/scripts/zygote.py; its socket in
TRAINER_TEST_ZYGOTE_SOCKET) with this process's environment, folder and stdin/stdout/stderr,
and exits with that process's status. Anything else (`-c`, interpreter options), or no zygote,
runs the real interpreter (TRAINER_TEST_ZYGOTE_PYTHON) on the same arguments. Imports nothing
heavy: it starts in ~20 ms."""

import json
import os
import socket
import sys


def real_python() -> None:
    python = os.environ["TRAINER_TEST_ZYGOTE_PYTHON"]
    os.execv(python, [python, *sys.argv[1:]])


def main() -> None:
    path = os.environ.get("TRAINER_TEST_ZYGOTE_SOCKET")
    argv = sys.argv[1:]
    forkable = (len(argv) >= 2 and argv[0] == "-m") or (argv and argv[0].endswith(".py"))
    if not forkable or not path:
        real_python()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        real_python()
    env = dict(os.environ)  # the launch sees the environment run_train.sh gave it, with the
    env["PYTHON"] = env.pop("TRAINER_TEST_ZYGOTE_PYTHON")  # real interpreter as its PYTHON
    env.pop("TRAINER_TEST_ZYGOTE_SOCKET")
    request = {"argv": argv, "env": env, "cwd": os.getcwd()}
    conn.sendmsg(
        [json.dumps(request).encode() + b"\n"],
        [
            (
                socket.SOL_SOCKET,
                socket.SCM_RIGHTS,
                bytes(memoryview(__import__("array").array("i", [0, 1, 2]))),
            )
        ],
    )
    reader = conn.makefile("rb")
    for line in reader:
        reply = json.loads(line)
        if "returncode" in reply:
            code = reply["returncode"]
            if code < 0:  # killed by a signal: so is this process, as the launcher was
                import signal

                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code if code >= 0 else 128 - code)
    os._exit(1)  # the zygote went away mid-launch


if __name__ == "__main__":
    main()
