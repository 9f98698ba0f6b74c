"""The checkpoint folder's layout: which `step-N` are committed, where a save writes, how a
step is committed, set aside and deleted; on a local folder or an object store (storage.py).

Locally a save writes `step-N.partial` and is committed by renaming it to `step-N` (atomic).
An object store has no rename: a save writes under `step-N/` itself, and the step is
committed when rank 0 writes its `manifest.json`, after every rank's objects are written;
only steps with a manifest are listed, so a half-written step is never the latest. A step is
deleted manifest first, for the same reason.
"""

from __future__ import annotations

import os
import re
import time

from trainer.checkpoint import storage
from trainer.checkpoint.integrity import MANIFEST

STEP_DIR = re.compile(r"^step-(\d+)$")


class StepFolder:
    def __init__(self, folder: str, dump_folder: str):
        self.url = storage.is_url(folder)  # an object store: nothing on local disk
        self.root = folder.rstrip("/") if self.url else os.path.join(dump_folder, folder)

    def committed(self) -> list[int]:
        """The committed steps, oldest first."""
        if self.url:
            found = storage.filesystem(self.root).glob(self.path("*") + "/" + MANIFEST)
            names = (p.rstrip("/").rsplit("/", 2)[-2] for p in found)
        else:
            names = storage.listdir(self.root)
        return sorted(int(m.group(1)) for m in map(STEP_DIR.match, names) if m)

    def path(self, step: int | str) -> str:
        return storage.join(self.root, f"step-{step}")

    def partial(self, step: int) -> str:
        """Where a save writes: `step-N.partial`, renamed at the commit; on a store `step-N`."""
        return self.path(step) + ("" if self.url else ".partial")

    def clear_for_save(self, step: int, replace: bool) -> None:
        """Before a save (rank 0): remove what an interrupted save left; on a store, where the
        save writes in place, first set a committed `step-N` aside (`.superseded` when the
        save replaces it, else as an abandoned branch's)."""
        if self.url and step in self.committed():
            self.set_aside(step, ".superseded" if replace else abandoned_suffix())
        storage.remove_tree(self.partial(step))

    def restore_superseded(self, step: int) -> None:
        """After a failed save on a store: the step it was to replace comes back."""
        old = self.path(step) + ".superseded"
        if self.url and storage.exists(storage.join(old, MANIFEST)):
            storage.move_tree(old, self.path(step))

    def set_aside(self, step: int, suffix: str) -> None:
        """Rename `step-N` to `step-N{suffix}` (on a store: copy, then delete the original,
        its manifest first, so that no listing sees it half gone)."""
        if self.url:
            storage.remove_tree(self.path(step) + suffix)
            storage.move_tree(self.path(step), self.path(step) + suffix, MANIFEST)
        else:
            os.replace(self.path(step), self.path(step) + suffix)

    def install(self, step: int, replacing: bool) -> None:
        """Commit `partial` as `step-N` (the manifest is written). Locally a rename; a rollback's
        re-save (`replacing`) renames the old folder aside, then deletes it (a crash between
        the two renames leaves the same weights in `step-N.superseded`, which no resume reads:
        rename it back by hand). On a store the manifest was the commit: the old one goes."""
        final, old = self.path(step), self.path(step) + ".superseded"
        if self.url:
            storage.remove_tree(old)
            return
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
        storage.remove_tree(old)

    def prune(self, k: int, keep: int) -> None:
        """Keep the newest k steps (0: all), and always `keep` (just committed)."""
        if k > 0:
            for old in self.committed()[:-k]:
                if old != keep:  # the manifest first: never a listed step with files gone
                    storage.remove_file(storage.join(self.path(old), MANIFEST))
                    storage.remove_tree(self.path(old))


def abandoned_suffix() -> str:
    return f".abandoned-{time.strftime('%Y%m%d-%H%M%S')}"
