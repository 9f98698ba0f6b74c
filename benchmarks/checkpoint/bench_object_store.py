"""Object storage against the local disk, and the S3 client libraries against each other.

    python benchmarks/checkpoint/bench_object_store.py [--repeats 3] [--store-gib 1]
        [--object-mib 256]

One process, one run, every figure side by side (median and range of `--repeats`, the
stores and clients interleaved within each repeat), against an S3 API on loopback
(`moto.server` on a free 127.0.0.1 port, as tests/s3_server.py starts it, wrapped in a WSGI
layer that counts the S3 operations it serves: benchmarks/checkpoint/s3_loopback.py):
  (a) a DCP save and load of the debug model's fp32 parameters and AdamW moments: the
      trainer's own writer and safe reader (trainer/checkpoint/integrity.py, safe_load.py;
      DCP's fsspec writer over s3fs for a URL) to a local folder and to s3://, and
      s3torchconnector's DCP S3StorageWriter / S3StorageReader (obstore has no DCP writer);
  (b) a token store of `--store-gib` (uint16 shards of 128 MiB, written directly in the
      store's format): written locally, uploaded as `prepare --store_path s3://` does
      (remote.upload_store), then read through trainer.data.store.Store as training does:
      sequentially (the whole store through the block cache) and at random windows;
  (c) put and get of one `--object-mib` object through raw HTTP (one unsigned request: the
      server's own ceiling), s3fs (what the trainer uses), obstore and s3torchconnector.
Columns: MiB/s, the server's CPU seconds (moto is one Python process: when its CPU time is
close to the wall time it is the bottleneck), this process's CPU seconds, MiB per CPU second
of both (what a loaded machine's wall time hides), and the S3 operations the server saw
(multipart uploads show as CreateMultipartUpload + UploadPart).
Optional clients missing (pip install obstore "s3torchconnector[dcp]") are skipped, said so.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.checkpoint.s3_loopback import BUCKET, Server  # noqa: E402
from trainer.checkpoint import integrity, safe_load, storage  # noqa: E402
from trainer.data import remote  # noqa: E402
from trainer.data.store import FORMAT, MANIFEST, TOKENIZER_FILE, VERSION, Store  # noqa: E402
from trainer.models.build import build_model  # noqa: E402
from trainer.models.flavors import model_args  # noqa: E402

MIB = 1 << 20


class Table:
    """Rows of (MiB, seconds, server CPU, client CPU, operations) per label, over repeats."""

    def __init__(self, server: Server):
        self.server, self.rows = server, defaultdict(list)
        self.order: list[str] = []

    def time(self, label: str, mib: float, fn, *args):
        c0, s0, n0 = _self_cpu(), self.server.cpu(), self.server.counts()
        t0 = time.perf_counter()
        out = fn(*args)
        seconds = time.perf_counter() - t0
        ops = self.server.counts() - n0
        self.rows[label].append((mib, seconds, self.server.cpu() - s0, _self_cpu() - c0, ops))
        if label not in self.order:
            self.order.append(label)
        return out

    def print(self, title: str, labels: list[str]):
        if not labels:
            return
        print(f"\n{title}")
        print(
            f"{'':<52}{'MiB':>7}{'s':>8}{'MiB/s (range)':>20}{'srv CPU':>9}{'own CPU':>9}"
            f"{'MiB/CPU-s':>11}  S3 operations (last repeat)"
        )
        for label in [x for x in self.order if x in labels]:
            rows = self.rows[label]
            rates = [m / s for m, s, *_ in rows]
            med = lambda i: statistics.median(r[i] for r in rows)  # noqa: E731
            ops = ", ".join(f"{k} {v}" for k, v in sorted(rows[-1][4].items()) if v > 0) or "-"
            print(
                f"{label:<52}{med(0):>7.1f}{med(1):>8.2f}{statistics.median(rates):>8.0f} "
                f"({min(rates):>4.0f}-{max(rates):<5.0f}){med(2):>9.2f}{med(3):>9.2f}"
                f"{med(0) / max(med(2) + med(3), 1e-3):>11.0f}  {ops}"
            )


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _drop_cache(path: str | Path) -> None:
    """Evict a file from the page cache (written and fsynced), so a read goes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- (a) DCP
def model_state(flavor: str) -> dict:
    """{model: params, optim: {name: {exp_avg, exp_avg_sq}}}: the trainer's fp32 shapes."""
    with torch.device("meta"):
        model = build_model(model_args(flavor))
    torch.manual_seed(0)
    params = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    moments = {
        n: {"exp_avg": torch.randn(p.shape), "exp_avg_sq": torch.rand(p.shape)}
        for n, p in params.items()
    }
    return {"model": params, "optim": moments}


def _empty(sd):
    return {k: _empty(v) for k, v in sd.items()} if isinstance(sd, dict) else torch.empty_like(sd)


def _equal(a, b) -> bool:
    return all(_equal(a[k], b[k]) for k in a) if isinstance(a, dict) else torch.equal(a, b)


def _s3tc_config():
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True)  # reads AWS_ENDPOINT_URL itself


def dcp_repeat(t: Table, sd: dict, tmp: str, rep: int, s3tc: bool) -> None:
    """Saves, then loads (checked bit for bit), of each store; then deleted."""
    mib = sum(x.numel() * 4 for x in sd["model"].values()) * 3 / MIB
    local, url, url2 = (
        os.path.join(tmp, f"step-{rep}"),
        f"s3://{BUCKET}/ckpt/step-{rep}",
        f"s3://{BUCKET}/s3tc/step-{rep}",
    )

    def save(path):
        dcp.save(sd, storage_writer=integrity.storage_writer(path, 0, 0), no_dist=True)

    t.time("(a) save  local disk, trainer's writer", mib, save, local)
    t.time("(a) save  s3, trainer (DCP fsspec + s3fs)", mib, save, url)
    if s3tc:
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        t.time(
            "(a) save  s3, s3torchconnector S3StorageWriter",
            mib,
            lambda: dcp.save(
                sd, storage_writer=S3StorageWriter("us-east-1", url2, _s3tc_config()), no_dist=True
            ),
        )
    for name in os.listdir(local):
        _drop_cache(os.path.join(local, name))
    for label, path in (
        ("local disk (cold cache), trainer's reader", local),
        ("s3, trainer (DCP fsspec + s3fs)", url),
    ):
        target = _empty(sd)
        t.time(f"(a) load  {label}", mib, lambda: safe_load.load(target, path, no_dist=True))
        assert _equal(target, sd), label
    if s3tc:
        target = _empty(sd)
        t.time(
            "(a) load  s3, s3torchconnector S3StorageReader",
            mib,
            lambda: dcp.load(
                target,
                storage_reader=S3StorageReader("us-east-1", url2, _s3tc_config()),
                no_dist=True,
            ),
        )
        assert _equal(target, sd)
        storage.remove_tree(url2)
    shutil.rmtree(local)
    storage.remove_tree(url)


# ----------------------------------------------------------------------------- (b) store
SHARD_MIB, SEQ, WINDOW = 128, 8192, 2049


def make_shards(gib: float) -> list[np.ndarray]:
    """uint16 token shards of 128 MiB, each of other content (the cache keys blocks by it)."""
    base = np.random.default_rng(0).integers(0, 50000, SHARD_MIB * MIB // 2, dtype=np.uint16)
    return [base ^ np.uint16(7919 * i + 1) for i in range(max(1, round(gib * 1024 / SHARD_MIB)))]


def write_store(folder: Path, shards: list[np.ndarray]) -> None:
    """The shards written and fsynced: what `prepare` writes to its local (staging) folder."""
    folder.mkdir(parents=True)
    for i, arr in enumerate(shards):
        with open(folder / f"shard_{i:05d}.bin", "wb") as f:
            f.write(arr.data)
            f.flush()
            os.fsync(f.fileno())


def finish_store(folder: Path, shards: list[np.ndarray]) -> None:
    """tokenizer.model (a stand-in: only its sha256 is checked) and the manifest."""
    tok = b"bench tokenizer stand-in"
    (folder / TOKENIZER_FILE).write_bytes(tok)
    entries = [
        {
            "file": f"shard_{i:05d}.bin",
            "tokens": a.size,
            "docs": 1,
            "blake2b": hashlib.blake2b(a.data, digest_size=16).hexdigest(),
        }
        for i, a in enumerate(shards)
    ]
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "source": {"dataset": "bench"},
        "tokenizer": {"sha256": hashlib.sha256(tok).hexdigest(), "vocab_size": 50000},
        "dtype": "uint16",
        "shards": entries,
        "total_docs": len(entries),
        "total_tokens": sum(e["tokens"] for e in entries),
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))
    for e in entries:
        _drop_cache(folder / e["file"])


def read_sequential(store: Store) -> np.ndarray:
    """Every window of SEQ+1 tokens, in order, 64 per read (a loader's batches)."""
    starts = np.arange(0, store.total_tokens - SEQ - 1, SEQ)
    last = None
    for i in range(0, len(starts), 64):
        last = store.read(starts[i : i + 64], SEQ + 1)
    return last


def read_random(store: Store, starts: np.ndarray) -> np.ndarray:
    return np.concatenate([store.read(starts[i : i + 8], WINDOW) for i in range(0, len(starts), 8)])


def store_repeat(
    t: Table, shards: list[np.ndarray], tmp: str, rep: int, cache_gib: float, windows: int
) -> dict:
    folder, url = Path(tmp) / f"store-{rep}", f"s3://{BUCKET}/store-{rep}"
    mib = sum(a.nbytes for a in shards) / MIB
    t.time("(b) write local disk (shards + fsync)", mib, write_store, folder, shards)
    finish_store(folder, shards)
    t.time(
        "(b) write s3 (prepare's upload_store, s3fs)",
        mib,
        remote.upload_store,
        folder,
        url,
        MANIFEST,
    )
    here = Store(folder, verify="sizes")
    there = Store(
        url, verify="sizes", cache_dir=os.path.join(tmp, f"cache-{rep}"), cache_max_gib=cache_gib
    )
    seq_mib = len(np.arange(0, here.total_tokens - SEQ - 1, SEQ)) * (SEQ + 1) * 2 / MIB
    a = t.time("(b) read sequential  local disk (memmap)", seq_mib, read_sequential, here)
    b = t.time(
        f"(b) read sequential  s3 (ranged, {cache_gib:g} GiB cache)",
        seq_mib,
        read_sequential,
        there,
    )
    assert np.array_equal(a, b)
    stats = dict(there.cache.stats)
    starts = np.random.default_rng(rep).integers(0, here.total_tokens - WINDOW, windows)
    for e in here.manifest["shards"]:
        _drop_cache(folder / e["file"])
    cold = Store(
        url, verify="sizes", cache_dir=os.path.join(tmp, f"cache-r{rep}"), cache_max_gib=cache_gib
    )
    rmib = windows * WINDOW * 2 / MIB
    a = t.time(f"(b) read {windows} random windows  local disk", rmib, read_random, here, starts)
    b = t.time(
        f"(b) read {windows} random windows  s3, cold cache", rmib, read_random, cold, starts
    )
    c = t.time(
        f"(b) read {windows} random windows  s3, warm cache", rmib, read_random, cold, starts
    )
    assert np.array_equal(a, b) and np.array_equal(a, c)
    shutil.rmtree(folder)
    shutil.rmtree(os.path.join(tmp, f"cache-{rep}"))
    shutil.rmtree(os.path.join(tmp, f"cache-r{rep}"))
    storage.remove_tree(url)
    return {"sequential": stats, "random": dict(cold.cache.stats)}


# ----------------------------------------------------------------------------- (c) clients
def loopback_tcp(data: bytes) -> None:
    """`data` through one TCP connection on 127.0.0.1 (no HTTP, no S3): the wire's ceiling."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        got = [0]

        def sink():
            conn, _ = listener.accept()
            with conn:
                while got[0] < len(data):
                    got[0] += len(conn.recv(1 << 20))

        reader = threading.Thread(target=sink)
        reader.start()
        with socket.create_connection(listener.getsockname()) as out:
            out.sendall(data)
        reader.join()


def raw_http(server: Server, method: str, key: str, data: bytes | None = None) -> bytes:
    """One unsigned request (moto does not check signatures; the object is put public-read
    so that an anonymous GET may read it): no client library at all."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    conn.request(
        method,
        f"/{BUCKET}/{key}",
        body=data,
        headers={"x-amz-acl": "public-read"} if data is not None else {},
    )
    resp = conn.getresponse()
    body = resp.read()
    assert resp.status == 200, (resp.status, body[:300])
    conn.close()
    return body


def clients(server: Server, s3tc: bool, obstore: bool) -> dict:
    """{name: (put(key, data), get(key) -> bytes)} of each client library available."""
    fs = storage.filesystem(f"s3://{BUCKET}")
    out = {
        "raw HTTP (one unsigned PUT / GET)": (
            lambda k, d: raw_http(server, "PUT", k, d),
            lambda k: raw_http(server, "GET", k),
        ),
        "s3fs 2026.9 (pipe_file / cat_file)": (
            lambda k, d: fs.pipe_file(f"{BUCKET}/{k}", d),
            lambda k: fs.cat_file(f"{BUCKET}/{k}"),
        ),
    }
    if obstore:
        import obstore as obs
        from obstore.store import S3Store

        store = S3Store(BUCKET, client_options={"allow_http": True})  # AWS_* from the env
        out["obstore (put / get)"] = (
            lambda k, d: obs.put(store, k, d),
            lambda k: bytes(obs.get(store, k).bytes()),
        )
    if s3tc:
        from s3torchconnector._s3client import S3Client

        client = S3Client("us-east-1", s3client_config=_s3tc_config())

        def put(k, d):
            writer = client.put_object(BUCKET, k)
            writer.write(d)
            writer.close()

        out["s3torchconnector (put_object / get_object)"] = (
            put,
            lambda k: client.get_object(BUCKET, k).read(),
        )
    return out


def client_repeat(
    t: Table, server: Server, data: bytes, tmp: str, s3tc: bool, obstore: bool
) -> None:
    mib = len(data) / MIB
    t.time("(c) loopback TCP, one socket (no HTTP)", mib, loopback_tcp, data)
    path = os.path.join(tmp, "object.bin")

    def write():
        with open(path, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())

    def read():
        _drop_cache(path)
        with open(path, "rb") as f:
            return f.read()

    t.time("(c) put local disk (write + fsync)", mib, write)
    assert t.time("(c) get local disk (cold cache)", mib, read) == data
    os.remove(path)
    for name, (put, get) in clients(server, s3tc, obstore).items():
        key = f"objects/{hashlib.sha1(name.encode()).hexdigest()[:8]}"
        t.time(f"(c) put {name}", mib, put, key, data)
        assert t.time(f"(c) get {name}", mib, get, key) == data, name
        storage.remove_file(f"s3://{BUCKET}/{key}")


def probe_s3tc(server: Server) -> str:
    """s3torchconnector against moto as it is: its one failure, in words ('' if none)."""
    from s3torchconnector._s3client import S3Client

    writer = S3Client("us-east-1", s3client_config=_s3tc_config()).put_object(BUCKET, "probe")
    writer.write(b"x" * MIB)
    try:
        writer.close()
    except Exception as e:  # noqa: BLE001 - reported, then the compat layer is switched on
        return f"{type(e).__name__}: {e}"
    storage.remove_file(f"s3://{BUCKET}/probe")
    return ""


def _have(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("torch", "moto", "s3fs", "fsspec", "obstore", "s3torchconnector"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return ", ".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--store-gib", type=float, default=1.0)
    p.add_argument("--cache-gib", type=float, default=0.5, help="the block cache's bound")
    p.add_argument("--windows", type=int, default=100, help="random windows of 2049 tokens")
    p.add_argument("--object-mib", type=int, default=256)
    p.add_argument("--only", default="abc", help="which parts: any of a, b, c")
    a = p.parse_args()
    warnings.filterwarnings("ignore")  # DCP's "torch.distributed is disabled", s3tc's notes
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        ),
        "?",
    )
    print(
        f"{os.cpu_count()} cores ({cpu}), load average {os.getloadavg()[0]:.1f} at start; "
        f"{_versions()}"
    )
    s3tc, obstore = _have("s3torchconnector.dcp"), _have("obstore")
    server = Server()
    try:
        note = probe_s3tc(server) if s3tc else "not installed: skipped"
        if s3tc and note:
            print(
                f"s3torchconnector against moto as it is: {note}\n  -> moto answers "
                "CompleteMultipartUpload with <CompleteMultipartUploadResponse>, real S3 "
                "with <CompleteMultipartUploadResult>; every s3torchconnector put is a "
                "multipart upload, so this script's layer renames the root for it"
            )
            server.counts(compat=True)
            s3tc = not probe_s3tc(server)
        t = Table(server)
        sd = model_state(a.flavor) if "a" in a.only else None
        shards = make_shards(a.store_gib) if "b" in a.only else None
        data = (
            np.random.default_rng(1).integers(0, 256, a.object_mib * MIB, dtype=np.uint8).tobytes()
        )
        stats = {}
        with tempfile.TemporaryDirectory(prefix="bench_store_") as tmp:
            for rep in range(a.repeats):
                if sd is not None:
                    dcp_repeat(t, sd, tmp, rep, s3tc)
                if shards is not None:
                    stats = store_repeat(t, shards, tmp, rep, a.cache_gib, a.windows)
                if "c" in a.only:
                    client_repeat(t, server, data, tmp, s3tc, obstore)
                print(
                    f"repeat {rep + 1}/{a.repeats} done, load average {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
        labels = list(t.rows)
        t.print(
            f"(a) DCP save/load of {a.flavor} (fp32 params + AdamW moments), one process",
            [x for x in labels if x.startswith("(a)")],
        )
        t.print(
            f"(b) token store of {a.store_gib:g} GiB, {SHARD_MIB} MiB uint16 shards "
            f"(sequential: windows of {SEQ + 1}; random: windows of {WINDOW}, 8 a read)",
            [x for x in labels if x.startswith("(b)")],
        )
        for kind, s in stats.items():
            print(
                f"  s3 {kind} read (last repeat): {s['fetched_bytes'] / MIB:.0f} MiB fetched "
                f"in {s['requests']} ranged GETs, {s['evictions']} blocks evicted"
            )
        t.print(f"(c) one object of {a.object_mib} MiB", [x for x in labels if x.startswith("(c)")])
        print(
            f"\nmedian (range) of {a.repeats} repeats; load average {os.getloadavg()[0]:.1f} "
            "at the end; srv CPU: the moto server process's CPU seconds"
        )
    finally:
        server.close()


if __name__ == "__main__":
    main()
