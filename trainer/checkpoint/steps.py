"""The checkpoint folder's layout: which `step-N` are committed, where a save writes, how a
step is committed, set aside and deleted; on a local folder or an object store (storage.py).

Locally a save writes `step-N.partial` and is committed by renaming it to `step-N` (atomic);
setting a step aside is a rename too.

An object store has no rename, and copying a step is copying terabytes: nothing here ever
copies or moves a step's data. A step lives under a prefix `step-N` or, when that prefix still
holds a step set aside, a fresh `step-N.K` (K = 2, 3, ...). It is committed when rank 0 writes
its `manifest.json`, after every rank's objects are written; only prefixes with a manifest are
listed, so a half-written step is never the latest. Setting a step aside (an abandoned branch's
after a rewind, the step a rollback re-saves) renames its one small manifest object to
`manifest.<reason>.json`: the step's data stay where they are and no listing sees them.
Deletes go manifest first (a listed step never has files missing); a manifest is always the
last object written.

Work after a commit (deleting superseded and pruned steps, and what interrupted saves and
clean-ups left) is `clean_up`: it may fail without touching a committed step, and it is done
again in full after the next commit.
"""

from __future__ import annotations

import itertools
import os
import re
import time

from trainer.checkpoint import storage
from trainer.checkpoint.integrity import MANIFEST

STEP_DIR = re.compile(r"^step-(\d+)$")
STORE_STEP = re.compile(r"^step-(\d+)(?:\.(\d+))?$")  # step-N, or a later write step-N.K
SUPERSEDED = ".superseded"
ASIDE_PREFIX = "manifest."  # manifest.<reason>.json: a step set aside on a store


def aside_name(suffix: str) -> str:
    """The manifest's name once its step is set aside with `suffix` (".superseded", ...)."""
    return f"{ASIDE_PREFIX}{suffix.lstrip('.')}.json"


class StepFolder:
    def __init__(self, folder: str, dump_folder: str):
        self.url = storage.is_url(folder)  # an object store: nothing on local disk
        self.root = folder.rstrip("/") if self.url else os.path.join(dump_folder, folder)
        self._where: dict[int, str] = {}  # store: step -> the prefix that holds it committed
        self._writing: dict[int, str] = {}  # store: step -> the prefix its save writes

    # ----------------------------------------------------------------------------- listing
    def committed(self) -> list[int]:
        """The committed steps, oldest first."""
        if not self.url:
            names = storage.listdir(self.root)
            return sorted(int(m.group(1)) for m in map(STEP_DIR.match, names) if m)
        where: dict[int, tuple[int, str]] = {}
        for name, objects in self._prefixes().items():
            m = STORE_STEP.match(name)
            if m and MANIFEST in objects:
                step, k = int(m.group(1)), int(m.group(2) or 1)
                if step not in where or k > where[step][0]:
                    where[step] = (k, name)
        self._where = {step: storage.join(self.root, name) for step, (_, name) in where.items()}
        return sorted(self._where)

    def _prefixes(self) -> dict[str, set[str]]:
        """Store: {step prefix: the names of the objects directly under it} (one listing)."""
        fs = storage.filesystem(self.root)
        try:
            found = fs.find(self.root, prefix="step-")
        except FileNotFoundError:
            return {}
        base = self.root.split("://", 1)[1] + "/"
        out: dict[str, set[str]] = {}
        for key in found:
            rel = key.split("://", 1)[-1]
            if not rel.startswith(base):
                continue
            prefix, _, name = rel[len(base) :].partition("/")
            if STORE_STEP.match(prefix) and name and "/" not in name:
                out.setdefault(prefix, set()).add(name)
        return out

    def recover(self) -> None:
        """At start (rank 0, store): a step set aside for a rollback's re-save that never
        committed (the run died meanwhile) is listed again."""
        if not self.url:
            return
        marker = aside_name(SUPERSEDED)
        committed = set(self.committed())
        for name, objects in self._prefixes().items():
            step = int(STORE_STEP.match(name).group(1))
            if marker in objects and MANIFEST not in objects and step not in committed:
                self._restore(storage.join(self.root, name), marker)
                committed.add(step)

    def _restore(self, prefix: str, marker: str) -> None:
        """List a set-aside step again: its manifest written back (last), then the marker goes."""
        fs = storage.filesystem(prefix)
        fs.copy(storage.join(prefix, marker), storage.join(prefix, MANIFEST))
        storage.remove_file(storage.join(prefix, marker))

    def path(self, step: int | str) -> str:
        """Where committed step `step` is (on a store, as last listed: `step-N` or `step-N.K`)."""
        if self.url and isinstance(step, int) and step in self._where:
            return self._where[step]
        return storage.join(self.root, f"step-{step}")

    def partial(self, step: int) -> str:
        """Where a save writes: `step-N.partial`, renamed at the commit; on a store the fresh
        prefix `prepare_save` chose."""
        if self.url:
            return self._writing.get(step) or storage.join(self.root, f"step-{step}")
        return self.path(step) + ".partial"

    # ----------------------------------------------------------------------------- saving
    def prepare_save(self, step: int, replace: bool) -> str:
        """Before a save (rank 0): remove what an interrupted save left and say where the save
        writes. On a store a committed `step-N` is set aside first (`.superseded` when the save
        replaces it, else as an abandoned branch's), and the save writes a fresh prefix."""
        if not self.url:
            storage.remove_tree(self.partial(step))
            return self.partial(step)
        if step in self.committed():
            self.set_aside(step, SUPERSEDED if replace else abandoned_suffix())
        prefixes = self._prefixes()
        for k in itertools.count(1):
            name = f"step-{step}" if k == 1 else f"step-{step}.{k}"
            objects = prefixes.get(name, set())
            if any(o == MANIFEST or o.startswith(ASIDE_PREFIX) for o in objects):
                continue  # a committed or set-aside step: never written over
            target = storage.join(self.root, name)
            if objects:  # an interrupted save's or clean-up's leftovers: nothing listed
                storage.remove_tree(target)
            return target
        raise AssertionError("unreachable")

    def writing(self, step: int, target: str) -> None:
        """Every rank: the save of `step` writes `target` (rank 0's `prepare_save`)."""
        if self.url:
            self._writing[step] = target

    def set_aside(self, step: int, suffix: str) -> None:
        """Rename `step-N` to `step-N{suffix}` locally; on a store rename its manifest to
        `manifest.<suffix>.json` (written before the manifest is deleted: one small object
        copied, no data moved)."""
        if not self.url:
            os.replace(self.path(step), self.path(step) + suffix)
            return
        prefix = self.path(step)
        fs = storage.filesystem(prefix)
        fs.copy(storage.join(prefix, MANIFEST), storage.join(prefix, aside_name(suffix)))
        storage.remove_file(storage.join(prefix, MANIFEST))
        self._where.pop(step, None)

    def install(self, step: int, replacing: bool) -> None:
        """Commit `partial` as `step-N` (the manifest is written). Locally a rename; a rollback's
        re-save (`replacing`) renames the old folder aside first (a crash between the two
        renames leaves the same weights in `step-N.superseded`, which no resume reads: rename
        it back by hand); the old folder goes at the clean-up. On a store the manifest was the
        commit."""
        if self.url:
            self._where[step] = self.partial(step)
            self._writing.pop(step, None)
            return
        final, old = self.path(step), self.path(step) + SUPERSEDED
        if not replacing or not os.path.isdir(final):
            os.replace(self.partial(step), final)
            return
        storage.remove_tree(old)
        os.replace(final, old)
        try:
            os.replace(self.partial(step), final)
        except OSError:
            os.replace(old, final)  # the save failed: the reloaded step stays as it was
            raise

    def discard(self, step: int) -> None:
        """After a failed save: remove what it wrote (its manifest first, if its PUT landed
        though its answer was lost) and, on a store, bring back the step it was to replace."""
        if not self.url:
            storage.remove_tree(self.partial(step))
            return
        partial = self._writing.pop(step, None)  # None: the save failed before it had one
        if partial is not None:
            storage.remove_file(storage.join(partial, MANIFEST))
            storage.remove_tree(partial)
        self._restore_superseded(step)

    def _restore_superseded(self, step: int) -> None:
        marker = aside_name(SUPERSEDED)
        for name, objects in self._prefixes().items():
            m = STORE_STEP.match(name)
            if m and int(m.group(1)) == step and marker in objects and MANIFEST not in objects:
                self._restore(storage.join(self.root, name), marker)
                self._where[step] = storage.join(self.root, name)
                return

    # ----------------------------------------------------------------------------- clean-up
    def clean_up(self, k: int, keep: int) -> None:
        """After the commit of `keep` (rank 0): delete the step it superseded, keep the newest
        k steps (0: all) and always `keep`, and (on a store) delete what interrupted saves and
        clean-ups left. Idempotent; raises the store's or disk's error."""
        if not self.url:
            storage.remove_tree(self.path(keep) + SUPERSEDED)
        else:
            self._clean_store(keep)
        if k > 0:
            for old in self.committed()[:-k]:
                if old != keep:  # the manifest first: never a listed step with files gone
                    self.delete(old)

    def delete(self, step: int) -> None:
        path = self.path(step)
        storage.remove_file(storage.join(path, MANIFEST))
        storage.remove_tree(path)
        self._where.pop(step, None)

    def _clean_store(self, keep: int) -> None:
        """Superseded steps (their marker first) and prefixes holding neither a manifest nor a
        marker: an interrupted save's, or a clean-up's cut short. Steps set aside as an
        abandoned branch's stay."""
        superseded = aside_name(SUPERSEDED)
        committed = set(self.committed())
        for name, objects in self._prefixes().items():
            prefix = storage.join(self.root, name)
            if prefix in (self.path(keep), *self._writing.values()) or MANIFEST in objects:
                continue
            if superseded in objects:
                if int(STORE_STEP.match(name).group(1)) not in committed:
                    continue  # its re-save never committed: recover() lists it again
                storage.remove_file(storage.join(prefix, superseded))
            elif any(o.startswith(ASIDE_PREFIX) for o in objects):
                continue
            storage.remove_tree(prefix)


def abandoned_suffix() -> str:
    return f".abandoned-{time.strftime('%Y%m%d-%H%M%S')}"
