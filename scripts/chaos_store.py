"""The object-store layout of scripts/chaos.py (`--layout s3`): the chaos job's checkpoint folder
is an s3:// prefix on a real S3 API (moto's server on 127.0.0.1, tests/s3_server.py), and every
launch reaches it through scripts/s3_fault_proxy.py, which answers a seeded share (`--store-rate`)
of its requests with 503 SlowDown, 500 InternalError, no answer past the client's timeout, or
a reset connection: during saves (the PUTs of DCP's files, the manifest, multipart parts), loads
and the integrity checks (GETs, HEADs), listings and the lease's conditional writes.

    python scripts/chaos.py --layout s3 --faults 6 --min-during-save 2 --steps 16 --store-rate 0.1

The schedule's own faults (killed ranks, stop signals; `--kinds`, but not ckpt-damage, which
truncates local files) go on as in the fsdp layout; the reference run saves to a local folder.
Checked on top of chaos.py's checks (every resume from the newest committed step, the final
checkpoint's tensors, read back from the bucket, and every loss bitwise those of the reference):
the proxy injected faults, and none surfaced in any launch's output (each was retried by the
trainer's policy, trainer/checkpoint/retry.py, within checkpoint.store_retries).
"""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.chaos_common import STORE_BUCKET, STORE_TIMEOUT  # noqa: E402
from scripts.s3_fault_proxy import KINDS, FaultProxy, Rule  # noqa: E402

# What a store fault that outlasted the retries looks like in a run's output.
# A save refused past the retries may name only torch's zip writer ("unexpected pos"): any
# failed save to the store counts, but the injected full disk of save-ENOSPC (errno 28).
SURFACED = re.compile(
    r"reduce your request rate|encountered an internal error|Read timeout on "
    r"endpoint|Connection was closed before|could not refresh .*lease\.json|"
    r"saving s3://\S+ failed: (?!\[Errno 28\])|step-\d+ not saved \((?!\[Errno 28\])"
)


@dataclass
class Store:
    env: dict  # AWS_* variables that point a launch at the proxy
    proxy: FaultProxy

    def figures(self, texts: list[str]) -> dict:
        """What the proxy injected, when, and how many surfaced in the launches' `texts`."""
        st = self.proxy.stats()
        lines = list(self.proxy.log)
        return {
            "injected": st["injected"],
            "total": st["total"],
            "requests": st["requests"],
            "during_saves": sum(x.split()[1] in ("PUT", "POST") for x in lines),
            "during_loads": sum(x.split()[1] in ("GET", "HEAD") and "/step-" in x for x in lines),
            "surfaced": sum(len(SURFACED.findall(t)) for t in texts),
        }


def fault_rule(rate: float, seed: int) -> Rule:
    """Every kind of fault, on any request to the chaos bucket, with probability `rate`; one
    in seven a timeout (each costs the client's whole timeout)."""
    kinds = (*("503", "500", "reset") * 2, "timeout")
    assert set(kinds) == set(KINDS)
    return Rule(
        match=rf"^(GET|PUT|POST|HEAD|DELETE) /{STORE_BUCKET}[/?]", kinds=kinds, rate=rate, seed=seed
    )


@contextlib.contextmanager
def serve(rate: float, seed: int = 0):
    """A Store: moto's server with the chaos bucket, the proxy in front with `fault_rule`.
    This process itself (the checks) talks to the server directly."""
    from tests.s3_server import s3_server

    with s3_server(STORE_BUCKET) as (env, _client):
        with proxied(env, rate, seed) as store:
            yield store


@contextlib.contextmanager
def proxied(env: dict, rate: float, seed: int = 0):
    """A Store for a server already running (`env` points at it; a test's fixture)."""
    proxy = FaultProxy(env["AWS_ENDPOINT_URL"], delay=STORE_TIMEOUT + 0.5).start()
    proxy.set_rules(fault_rule(rate, seed))
    try:
        yield Store({**env, "AWS_ENDPOINT_URL": proxy.url}, proxy)
    finally:
        proxy.stop()
