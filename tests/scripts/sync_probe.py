"""Under torchrun: the real trainer (`trainer.train.main`), with every way a tensor's value
reaches the host counted: `Tensor.item`, `tolist`, `__bool__`, `__int__`, `__float__` and
`__index__`. On a GPU each of these waits for the device; a CPU run counts the same calls.

Calls made inside trainer/data/ are the loader's own host tensors (it never creates a device
tensor) and are left out. Each call is counted against the step and the loop's phase
(trainer/health/heartbeat.py) it happened in; rank 0 writes them to OUT as JSON:
{"steps": {step: count}, "phases": {step: {phase: count}}, "where": {step: [file:line ...]}}.

    torchrun ... sync_probe.py OUT [--section.key value ...]
"""

import json
import sys
import traceback
from collections import defaultdict
from pathlib import Path

import torch

from trainer.health import heartbeat

DATA = str(Path(__file__).resolve().parents[2] / "trainer" / "data")
COUNTS: dict = defaultdict(lambda: defaultdict(int))
WHERE: dict = defaultdict(list)


def caller() -> str | None:
    """file:line of the trainer frame that asked for the value, or None if trainer/data did."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(DATA):
            return None
        if "/trainer/" in frame.filename:
            return f"{frame.filename.split('/trainer/')[-1]}:{frame.lineno}"
    return "?"


def counted(name: str):
    original = getattr(torch.Tensor, name)

    def wrapper(self, *args, **kwargs):
        where = caller()
        if where is not None:
            step, phase = heartbeat._state["step"], heartbeat._state["phase"]
            COUNTS[step][phase] += 1
            WHERE[step].append(f"{name} {phase} {where}")
        return original(self, *args, **kwargs)

    return wrapper


def main(argv: list[str]) -> None:
    out, args = argv[0], argv[1:]
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        setattr(torch.Tensor, name, counted(name))
    import torch.distributed as dist

    from trainer import train

    rank = int(__import__("os").environ.get("RANK", "0"))
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: None  # keep the rank for the report below
    code = train.main(args)
    dist.destroy_process_group = destroy
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "code": code,
                    "steps": {s: sum(p.values()) for s, p in COUNTS.items()},
                    "phases": {s: dict(p) for s, p in COUNTS.items()},
                    "where": dict(WHERE),
                }
            )
        )
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
