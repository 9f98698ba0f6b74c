"""Several invocations of one `python -m MODULE` command line tool, each in a process forked
from this one once it has imported what they all import (torch, `datasets`, the trainer): each
invocation skips ~3.5 CPU-s of imports on the 2-core EPYC, as forkrun.py's ranks do.

    python tests/scripts/forkcli.py MODULE [--preload M1,M2] -- ARGS1 -- ARGS2 ...

Each invocation runs exactly as `python -m MODULE ARGS`: a fresh fork executes the module as
`__main__` (runpy, what `-m` does) with that sys.argv, its stdout and stderr captured and its
exit status kept; one after another, in order. Prints one JSON line: a list of {"returncode",
"stdout", "stderr"} per invocation.
"""

import importlib
import json
import os
import runpy
import sys
import tempfile


def run_one(module: str, args: list[str], folder: str, index: int) -> dict:
    out, err = (os.path.join(folder, f"{index}.{name}") for name in ("out", "err"))
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: `python -m module args` with its streams in files
        code = 1
        try:
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            sys.argv = [module, *args]
            sys.modules.pop(module, None)  # preloaded: run afresh as __main__ (no runpy warning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):
                print(stop.code, file=sys.stderr)
        except BaseException:  # an uncaught error: its traceback, as the interpreter prints it
            import traceback

            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    with open(out) as fo, open(err) as fe:
        return {"returncode": code, "stdout": fo.read(), "stderr": fe.read()}


def split_cases(argv: list[str]) -> tuple[str, list[str], list[list[str]]]:
    """MODULE [--preload a,b] -- ARGS -- ARGS ... -> (module, preload, [args, ...])."""
    module, rest = argv[0], argv[1:]
    preload: list[str] = []
    if rest[:1] == ["--preload"]:
        preload, rest = [m for m in rest[1].split(",") if m], rest[2:]
    cases: list[list[str]] = []
    for arg in rest:
        if arg == "--":
            cases.append([])
        else:
            cases[-1].append(arg)
    return module, preload, cases


def main(argv: list[str]) -> None:
    module, preload, cases = split_cases(argv)
    for name in preload:
        importlib.import_module(name)
    with tempfile.TemporaryDirectory() as folder:
        results = [run_one(module, args, folder, i) for i, args in enumerate(cases)]
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
