"""In-job restarts: `MAX_RESTARTS=N ./run_train.sh` (torchrun's `--max-restarts`).

When a rank dies or hangs, the torchrun agent stops every rank and starts them all again (the
launcher prints one line per restart); they resume from the latest committed checkpoint, as a
relaunch would. Failures that a restart cannot cure end the job at once (trainer/launch.py):
user errors (2), a stop on a signal (3, SLURM requeues it), training errors (4), out of memory
(5) and a repeated failure (7).

A repeated failure: the rank that reports a failure (a hang, a lost peer, a crash) appends one
JSON line to `{dump_folder}/failures.jsonl` (launch id, attempt, kind, step, the report line).
At the start of each restarted attempt every rank reads it: when the last
`health.max_same_failures` attempts of this launch failed the same way at the same step, the run
stops with one `training error:` line and exit code 7 instead of restarting again. Rank 0 logs
each restart in one line and as the TensorBoard scalar `fault/restarts`.
"""

from __future__ import annotations

import json
import os

from trainer.errors import GAVE_UP_EXIT_CODE, TrainingError

FAILURES_FILE = "failures.jsonl"
_config = {"folder": None, "last": None}


class RepeatedFailure(TrainingError):
    exit_code = GAVE_UP_EXIT_CODE


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def attempt_store(timeout):
    """Under torchrun, the store the process group meets through, with this attempt's prefix
    (else None: init_process_group's own). torchrun hands every attempt the same agent store
    without one, so the ranks of a restart would read the previous attempt's gloo addresses
    (measured: "connectFullMesh failed ... Connection refused", or a hang)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    # trainer.launch passes the rendezvous round, the same on every node of an elastic job;
    # torchrun alone (one node), the restart count
    rnd = os.environ.get("TRAINER_RDZV_ROUND")
    return dist.PrefixStore(
        f"trainer/round_{rnd}" if rnd else f"trainer/attempt_{attempt()}", store
    )


def launch_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "none")


def _path() -> str | None:
    folder = _config["folder"]
    return None if folder is None else os.path.join(folder, FAILURES_FILE)


def record_failure(kind: str, ranks: list[int], step: int, line: str) -> None:
    """Append this attempt's failure (called by the rank that reports it; never raises)."""
    path = _path()
    if path is None:
        return
    entry = {
        "launch": launch_id(),
        "attempt": attempt(),
        "kind": kind,
        "ranks": ranks,
        "step": step,
        "line": line,
    }
    try:
        with open(path, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
    except OSError:
        pass


def _this_launch() -> list[dict]:
    try:
        with open(_path()) as fh:
            entries = [json.loads(x) for x in fh if x.strip()]
    except (OSError, ValueError):
        return []
    return [e for e in entries if e.get("launch") == launch_id()]


def check_restart(dump_folder: str, max_same: int) -> None:
    """At the start of an attempt: remember where failures go, and stop (RepeatedFailure)
    when the last `max_same` attempts failed the same way at the same step."""
    _config["folder"] = dump_folder
    if attempt() == 0:
        return
    seen = {e["attempt"]: e for e in _this_launch()}
    _config["last"] = seen.get(attempt() - 1)
    chain = [seen.get(attempt() - 1 - i) for i in range(max_same)]
    if max_same and all(chain) and len({(e["kind"], e["step"]) for e in chain}) == 1:
        last = chain[0]
        line = last["line"].removeprefix("training error: ")
        raise RepeatedFailure(
            f"the same failure at step {last['step']} {max_same} times in "
            f"a row, not restarting (health.max_same_failures = "
            f"{max_same}): {line}"
        )


def note_restart(metrics, step: int, log) -> None:
    """Rank 0 of a restarted attempt: one line and the TensorBoard count of restarts."""
    if attempt() == 0:
        return
    limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    last = _config["last"]
    after = f" after: {last['line'].removeprefix('training error: ')}" if last else ""
    log(f"restart {attempt()} of at most {limit} (MAX_RESTARTS){after}; resuming at step {step}")
    metrics.log_scalars(step, {"fault/restarts": attempt()})
