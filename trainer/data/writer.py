"""Writing a token store: N worker processes tokenize disjoint parts of a source into shards.

Worker w tokenizes part w of N of the source (disjoint parts, see sources.py) into shards of
~shard_tokens tokens that end on document boundaries. After each shard it records the shard and
the number of documents consumed in progress/worker_w.json, so an interrupted run resumes at its
last shard. The manifest is written last and atomically: a store with a manifest is finished
and reused as is; one without is resumed when its plan (source, tokenizer, workers, dtype)
matches and rebuilt otherwise. The command line is trainer/data/prepare.py.
"""

from __future__ import annotations

import itertools
import json
import os
import queue as queue_mod
import shutil
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np

from trainer.data.config import DataConfig
from trainer.data.lock import file_lock
from trainer.data.progress import Progress, rate
from trainer.data.sources import documents, source_record
from trainer.data.store import (
    FORMAT,
    MANIFEST,
    PLAN,
    TOKENIZER_FILE,
    VERSION,
    file_blake2b,
    read_manifest,
    token_dtype,
)
from trainer.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from trainer.errors import DataError

DEFAULT_SHARD_TOKENS = 1 << 25  # 64 MiB per uint16 shard: resume granularity vs. file count
_BATCH_CHARS, _BATCH_DOCS = 1 << 20, 1024


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _plan(cfg: DataConfig, tok: Tokenizer | HFTokenizer, workers: int, shard_tokens: int) -> dict:
    """Everything that decides the store's content; a store is resumed only if this matches."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "source": source_record(cfg),
        "tokenizer": {
            "sha256": tok.sha256,
            "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "pad_id": tok.pad_id,
            "original_path": os.path.abspath(tok.path),
        },
        "eos_handling": {
            "add_bos": cfg.add_bos,
            "add_eos": cfg.add_eos,
            "note": "each document is framed by BOS/EOS; documents are "
            "concatenated, windows may span documents",
        },
        "dtype": token_dtype(tok.vocab_size),
        "workers": workers,
        "shard_tokens": shard_tokens,
    }


def _same_content(a: dict, b: dict) -> bool:
    keys = ("format", "version", "source", "eos_handling", "dtype", "workers", "shard_tokens")
    return (
        all(a.get(k) == b.get(k) for k in keys)
        and a.get("tokenizer", {}).get("sha256") == b["tokenizer"]["sha256"]
    )


# -- one worker ------------------------------------------------------------------------------
def _load_journal(out: Path, w: int) -> dict:
    """The worker's finished shards, cut back to the last one that is intact on disk."""
    path = out / "progress" / f"worker_{w:03d}.json"
    journal = json.loads(path.read_text()) if path.is_file() else {"shards": [], "done": False}
    dtype_size = np.dtype(journal.get("dtype", "uint16")).itemsize
    kept = []
    for s in journal["shards"]:
        f = out / s["file"]
        if not f.is_file() or f.stat().st_size != s["tokens"] * dtype_size:
            journal["done"] = False
            break
        kept.append(s)
    # documents without text so far; after the last intact shard they are read again
    journal["skipped"] = (
        journal.get("skipped", 0)
        if journal["done"]
        else (kept[-1].get("skipped_end", 0) if kept else 0)
    )
    journal["shards"] = kept
    journal["docs_end"] = kept[-1]["docs_end"] if kept else 0
    return journal


def _work(job: dict, report: Callable[[int, int], None]) -> None:
    """Tokenize part job['w'] of job['n'] into shards, resuming from the worker's journal."""
    out, w, dtype = Path(job["out"]), job["w"], np.dtype(job["dtype"])
    cfg = DataConfig(**job["cfg"])
    journal = _load_journal(out, w)
    journal["dtype"] = job["dtype"]
    if journal["done"]:
        return
    tok = load_tokenizer(out / TOKENIZER_FILE)
    docs_end = journal["docs_end"]
    pending: list[np.ndarray] = []
    pending_tokens = pending_docs = 0

    def flush() -> None:
        nonlocal pending, pending_tokens, pending_docs
        name = f"shard_w{w:03d}_{len(journal['shards']):05d}.bin"
        tmp = out / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(np.concatenate(pending).astype(dtype).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out / name)
        journal["shards"].append(
            {
                "file": name,
                "tokens": pending_tokens,
                "docs": pending_docs,
                "docs_end": docs_end,
                "skipped_end": journal["skipped"],
                "blake2b": file_blake2b(out / name),
            }
        )
        write_json_atomic(out / "progress" / f"worker_{w:03d}.json", journal)
        pending, pending_tokens, pending_docs = [], 0, 0

    stream = itertools.islice(documents(cfg, w, job["n"]), docs_end, None)
    while batch := list(_take_batch(stream)):
        nonempty = [t for t in batch if t]
        ids = iter(tok.encode_docs(nonempty, cfg.add_bos, cfg.add_eos) if nonempty else [])
        n_tokens = 0
        for text in batch:  # shards end on document boundaries, possibly mid-batch
            if text:
                pending.append(np.asarray(next(ids), dtype=np.int64))
                pending_tokens += len(pending[-1])
                n_tokens += len(pending[-1])
                pending_docs += 1
            else:  # no text: nothing stored, counted apart (the manifest's skipped_docs)
                journal["skipped"] += 1
            docs_end += 1
            if pending_tokens >= job["shard_tokens"]:
                flush()
        report(len(nonempty), n_tokens)
    if pending_tokens:
        flush()
    journal["done"] = True
    write_json_atomic(out / "progress" / f"worker_{w:03d}.json", journal)


def _take_batch(stream):
    """Up to ~1 MB of text or 1024 documents: large enough to amortise the encode call."""
    chars = 0
    for i, text in enumerate(stream):
        yield text
        chars += len(text)
        if chars >= _BATCH_CHARS or i + 1 >= _BATCH_DOCS:
            return


# -- the coordinator ----------------------------------------------------------------------------
def worker_process_main() -> None:
    """Entry point of a worker process: the job comes as JSON on stdin, progress and the
    outcome go back as JSON lines on stdout."""
    job = json.loads(sys.stdin.read())

    def send(*msg) -> None:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

    try:
        _work(job, lambda d, t: send("progress", d, t))
        send("done", 0, 0)
    except BaseException as e:  # the parent re-raises; a DataError stays a one-line error
        send("error", isinstance(e, DataError), str(e) or traceback.format_exc())
        if not isinstance(e, Exception):
            raise


def _run_workers(jobs: list[dict], on_progress: Callable[[int, int], None]) -> None:
    """Run the jobs in separate interpreters (not multiprocessing: its spawn re-imports the
    caller's __main__, and fork is unsafe in a threaded trainer process)."""
    if len(jobs) == 1:  # in-process: no start-up cost, and Ctrl-C / errors propagate directly
        _work(jobs[0], on_progress)
        return
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
    }
    cmd = [sys.executable, "-c", "from trainer.data.writer import worker_process_main as m; m()"]
    procs = [
        subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for _ in jobs
    ]
    lines: queue_mod.Queue = queue_mod.Queue()
    for w, (p, job) in enumerate(zip(procs, jobs, strict=True)):
        p.stdin.write(json.dumps(job))
        p.stdin.close()
        threading.Thread(target=_pump, args=(w, p.stdout, lines), daemon=True).start()
    try:
        _collect(procs, lines, on_progress)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _pump(w: int, stream, lines: queue_mod.Queue) -> None:
    for line in stream:
        lines.put((w, line))
    lines.put((w, None))


def _collect(procs: list, lines: queue_mod.Queue, on_progress: Callable[[int, int], None]):
    """Forward progress; raise the first error; insist every worker reported 'done'."""
    done: set[int] = set()
    closed = 0
    while closed < len(procs):
        w, line = lines.get()
        if line is None:
            closed += 1
            if w not in done:
                raise RuntimeError(f"prepare worker {w} died (exit code {procs[w].wait()})")
            continue
        kind, a, b = json.loads(line)
        if kind == "progress":
            on_progress(a, b)
        elif kind == "done":
            done.add(w)
        else:
            raise DataError(b) if a else RuntimeError(f"prepare worker {w} failed:\n{b}")


def _start_or_resume(out: Path, plan: dict, overwrite: bool) -> str:
    """'reuse' a finished store, 'resume' an unfinished one, or 'new' after clearing it."""
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out)
        if _same_content(manifest, plan):
            return "reuse"
        if not overwrite:
            raise DataError(
                f"{out} already holds a finished store of another source or "
                "tokenizer; choose another --store_path or pass --overwrite"
            )
    elif (out / PLAN).is_file():
        if _same_content(json.loads((out / PLAN).read_text()), plan):
            return "resume"
    elif out.exists() and any(out.iterdir()):
        raise DataError(f"{out} exists and is not a token store; refusing to write into it")
    if out.exists():
        shutil.rmtree(out)  # an unfinished store of another plan: rebuild from scratch
    return "new"


def prepare_store(
    cfg: DataConfig,
    tokenizer_path: str,
    store_path: str,
    workers: int = 2,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    show_progress: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Prepare (or reuse, or resume) the store at store_path; returns its manifest.
    A lock next to the store makes concurrent prepares of one path wait for each other."""
    out = Path(os.path.expanduser(store_path))
    tok = load_tokenizer(tokenizer_path)
    plan = _plan(cfg, tok, workers, shard_tokens)
    progress = Progress(f"prepare {out}", show_progress)
    counts = {"docs": 0, "tokens": 0}

    def report(docs: int, tokens: int) -> None:
        counts["docs"] += docs
        counts["tokens"] += tokens
        progress.update(
            f"{counts['docs']:,} docs, {counts['tokens'] / 1e6:.1f}M tokens, "
            f"{rate(counts['tokens'], progress.elapsed())} tok/s ({workers} workers)"
        )
        if on_progress:
            on_progress(docs, tokens)

    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out.parent / f".{out.name}.lock", f"waiting for another prepare of {out}"):
        state = _start_or_resume(out, plan, overwrite)
        if state == "reuse":
            progress.done("finished store found, reused")
            return read_manifest(out)
        (out / "progress").mkdir(parents=True, exist_ok=True)
        if state == "new":
            shutil.copyfile(tok.path, out / f".{TOKENIZER_FILE}.tmp")
            os.replace(out / f".{TOKENIZER_FILE}.tmp", out / TOKENIZER_FILE)
            write_json_atomic(out / PLAN, plan)
        jobs = [
            {
                "cfg": asdict(cfg),
                "out": str(out),
                "w": w,
                "n": workers,
                "dtype": plan["dtype"],
                "shard_tokens": shard_tokens,
            }
            for w in range(workers)
        ]
        _run_workers(jobs, report)
        manifest = _finish(out, plan, workers)
    skipped = manifest.get("skipped_docs", 0)
    progress.done(
        f"{manifest['total_docs']:,} docs"
        + (f" ({skipped:,} more without text, skipped)" if skipped else "")
        + f", {manifest['total_tokens']:,} tokens "
        f"({rate(counts['tokens'], progress.elapsed())} tok/s this run)"
        + (" (resumed)" if state == "resume" else "")
    )
    return manifest


def _finish(out: Path, plan: dict, workers: int) -> dict:
    """Collect the workers' journals into the manifest, written last and atomically."""
    shards, skipped = [], 0
    for w in range(workers):
        journal = _load_journal(out, w)
        assert journal["done"], f"worker {w} did not finish"
        shards += [
            {k: s[k] for k in ("file", "tokens", "docs", "blake2b")} for s in journal["shards"]
        ]
        skipped += journal["skipped"]
    total = sum(s["tokens"] for s in shards)
    if total == 0:
        raise DataError(
            f"empty corpus: {_source_name(plan['source'])} produced no tokens (store {out})"
        )
    manifest = {
        **plan,
        "shards": shards,
        "total_tokens": total,
        "total_docs": sum(s["docs"] for s in shards),
        "skipped_docs": skipped,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json_atomic(out / MANIFEST, manifest)
    shutil.rmtree(out / "progress", ignore_errors=True)
    (out / PLAN).unlink(missing_ok=True)
    return manifest


def _source_name(source: dict) -> str:
    files = source.get("data_files")
    return ", ".join(files) if files else source.get("root", source.get("dataset", "?"))
