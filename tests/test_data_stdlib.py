"""The embedded default: the stdlib corpus, tokenizer and store built at first use, with
several ranks building at once into one cache (one builds, the others wait)."""

from __future__ import annotations

import subprocess

from tests.data_fixtures import *  # noqa: F401,F403
from tests.data_fixtures import DataConfig, build
from tests.helpers import fork_python
from trainer.data.sources import stdlib_files

VOCAB = 2048  # smaller than the default to keep the test quick; same code path

RANK = """
import hashlib, sys
from trainer.data import DataConfig, build_dataloader
rank = int(sys.argv[2])
cfg = DataConfig(cache_dir=sys.argv[1], vocab_size={vocab})
loader = build_dataloader(cfg, seq_len=128, local_batch_size=2, global_batch_size=4,
                          dp_rank=rank, dp_size=2, seed=0)
x, y = loader.next_microbatch()
print(loader.tokenizer_path, loader.state_dict()["fingerprint"],
      hashlib.sha256(x.numpy().tobytes()).hexdigest()[:12])
""".format(vocab=VOCAB)


def test_stdlib_corpus_is_the_local_standard_library():
    files = stdlib_files()
    assert len(files) > 500 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert stdlib_files() == files  # a fixed order


def test_concurrent_first_use_builds_once(tmp_path):
    """Three processes start on an empty cache while the test holds its lock: each says it
    waits; released, one builds and the other two wait for it (held so that a process whose
    imports lag on a loaded machine cannot arrive after the build and say nothing)."""
    import fcntl
    import time

    from trainer.data.cache import stdlib_cache_dir

    cache, script = tmp_path / "cache", tmp_path / "rank.py"
    script.write_text(RANK)
    # separate processes forked from the zygote (torch and the trainer imported, no cache read)
    python, env = fork_python({"OMP_NUM_THREADS": "1"})
    errs = [tmp_path / f"err{r}" for r in range(3)]
    with open(
        stdlib_cache_dir(DataConfig(cache_dir=str(cache), vocab_size=VOCAB)) / ".lock", "a+"
    ) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = []
        for r in range(3):
            with open(errs[r], "w") as err:
                procs.append(
                    subprocess.Popen(
                        [python, str(script), str(cache), str(r % 2)],
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                    )
                )
        deadline = time.monotonic() + 300
        while not all("waiting for another process" in e.read_text() for e in errs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
                e.read_text() for e in errs
            ]
            time.sleep(0.1)
        fcntl.flock(lock, fcntl.LOCK_UN)
    results = [
        (p.communicate(timeout=300)[0], errs[r].read_text(), p.returncode)
        for r, p in enumerate(procs)
    ]
    for _out, err, rc in results:
        assert rc == 0, err
    stderr = "".join(err for _, err, _ in results)
    assert stderr.count("training stdlib tokenizer") == 1, stderr
    assert stderr.count("waiting for another process") == 3, stderr
    outs = [out.split() for out, _, _ in results]
    assert outs[0][:2] == outs[1][:2] == outs[2][:2]  # one tokenizer, one store
    assert outs[0][2] == outs[2][2] != outs[1][2]  # ranks 0, 1, 0: the rank's own slice
    leftovers = [
        p
        for p in cache.rglob("*")  # lock files stay: unlinking them is racy
        if (".partial" in p.name or ".tmp" in p.name) and p.suffix != ".lock"
    ]
    assert not leftovers
    # later runs reuse the cache: the same tokenizer, store and samples, without taking the
    # lock (held here: every rank of a later run used to queue on it, and say it waited)
    import threading

    got = []
    with open(
        stdlib_cache_dir(DataConfig(cache_dir=str(cache), vocab_size=VOCAB)) / ".lock", "a+"
    ) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        reader = threading.Thread(
            target=lambda: got.append(
                build(
                    DataConfig(cache_dir=str(cache), vocab_size=VOCAB),
                    seq_len=128,
                    local_batch_size=2,
                    global_batch_size=4,
                    dp_size=2,
                )
            ),
            daemon=True,
        )
        reader.start()
        reader.join(60)
        assert got, "a built cache waited for its lock"
    loader = got[0]
    assert loader.tokenizer_path == outs[0][0] and loader.vocab_size == VOCAB
    assert "stdlib" in loader.describe() and loader.store.total_tokens > 1_000_000
    manifest = loader.store.manifest  # prepared by 2 worker processes, every file once
    assert manifest["total_docs"] + manifest["skipped_docs"] == len(stdlib_files())
    assert manifest["skipped_docs"] > 0 and manifest["workers"] == 2  # empty __init__.py files
    assert {s["file"][:10] for s in manifest["shards"]} == {"shard_w000", "shard_w001"}
