"""Distributed Checkpoint (DCP) save and resume.

A checkpoint is `{dump_folder}/{folder}/step-N`, holding the sharded model and optimizer state
(through `torch.distributed.checkpoint.state_dict`, so it reshards across world sizes and
FSDP/HSDP layouts on load), the lr scheduler's position (a resume applies its own config's lr
schedule from the next step on), the train state (step, tokens seen), the RNG states and the
dataloader position.

A save is atomic: every rank writes into `step-N.partial`; once DCP has written the metadata,
the ranks hash their share of the files and rank 0 writes `manifest.json` (see
integrity.py), then renames the folder to `step-N`. Only `step-N` folders are ever loaded,
so a crash mid-save leaves the previous checkpoint as the latest. On an object store
(`checkpoint.folder = s3://...`; steps.py, storage.py), which cannot rename a folder, the
ranks write under a fresh prefix (`step-N`, or `step-N.K` while `step-N` holds a step set
aside) and the manifest, written by rank 0 after every rank's objects are, is the commit: only
steps with a manifest are listed. The clean-up after a commit (superseded and pruned steps) is
separate work: its failure is a warning, never a failed save. A save the storage refuses
(disk full, permissions, I/O error, on any rank) is agreed on by all ranks before anything is
committed: the partial folder is removed and the run stops with one line, or warns and goes on
(`on_save_error = "continue"`).

Resume takes the newest checkpoint whose files match its manifest; a damaged one is named in
one line and skipped (an explicit `load_step` of a damaged one is a checkpoint error). After a
resume from an older step (`load_step`, or past a damaged one), the first save sets the later
steps aside (`step-M.abandoned-<time>`; on a store their manifest renamed
`manifest.abandoned-<time>.json`, no data moved), so no later resume or pruning mistakes them
for this run's checkpoints.

A rollback (`training.on_spike = "rollback"`, trainer/health/spikes.py) reloads `latest`, the newest
checkpoint of this run's branch (never a later step of an abandoned one), and saves that step
again at once with the rollback recorded in the TrainState: the new folder replaces the old one.

With `async_mode = "async"`, the state is staged to CPU memory and written by a background
thread while training goes on; the commit (the rename) happens at the next save or at the end
of the run, whichever comes first. The background writes use a gloo process group of their own:
on the default group their collectives would interleave with training's and hang.
"""

from __future__ import annotations

import datetime
import functools
import os
import threading
import time

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint import integrity, lease, retry, safe_load, storage, store_lease
from trainer.checkpoint.optim_state import (
    ModelAndOptimizer,
    changed_line,
    check_fits,
    optimizer_switched,
    saved_grouped,
)
from trainer.checkpoint.states import Adapter, RNGState, TrainState
from trainer.checkpoint.steps import StepFolder, abandoned_suffix
from trainer.errors import CheckpointError, ConfigError
from trainer.health import faults

# Marks a rank's check that met a store fault outlasting its retries (trainer/checkpoint/retry.py).
STORE_FAILED = "store failed: "
# On a store, the most requests rank 0 sends one after another while the other ranks wait for
# it in one of the checkpoint's collectives (listing, setting a step aside, the manifest, the
# clean-up it joins): their collectives wait this many requests' worst case (every retry).
STORE_SERIAL_REQUESTS = 16


def store_wait_seconds(cfg) -> float:
    """How long the checkpoint's collectives on a store wait for a rank: the training timeout
    plus STORE_SERIAL_REQUESTS requests through every retry (5 retries of 60 s: ~2 h; a hang
    inside is still named by the heartbeat's watch)."""
    c = cfg.checkpoint
    budget = retry.request_budget(c.store_retries, c.store_timeout_seconds)
    return cfg.comm.train_timeout_seconds + STORE_SERIAL_REQUESTS * budget


class Checkpointer:
    def __init__(
        self, cfg, *, model, optimizer, scheduler, dataloader, train_state: TrainState, log=print
    ):
        self.cfg = cfg.checkpoint
        self.folder = StepFolder(self.cfg.folder, cfg.job.dump_folder)  # local, or s3:// gs://
        self.root = self.folder.root
        self.lease_timeout, self.store_lease = cfg.job.lease_timeout_seconds, None
        self._taken = self._recovered = False  # take_folder, _recover done
        self.train_state, self.log = train_state, log
        self.states = {
            "model_optim": ModelAndOptimizer(model, optimizer),
            "lr_scheduler": Adapter(scheduler),
            "dataloader": Adapter(dataloader),
            "train_state": train_state,
            "rng": RNGState(),
        }
        self.fingerprint = integrity.model_fingerprint(model)
        # On a store the checkpoint's collectives have a gloo group of their own, whose timeout
        # covers rank 0's store requests through every retry (store_wait_seconds): a slow
        # store is waited for, never taken for a hang. Locally: the default group.
        self.group, self.group_timeout = None, None
        if self.cfg.enable and self.folder.url:
            self.group_timeout = datetime.timedelta(seconds=store_wait_seconds(cfg))
            self.group = dist.new_group(backend="gloo", timeout=self.group_timeout)
        self.async_group = None
        if self.cfg.enable and self.cfg.async_mode == "async":  # collective: every rank, once
            self.async_group = self.group or dist.new_group(backend="gloo")
        self._cleaning: threading.Thread | None = None  # rank 0's clean-up after a commit
        self.pending = None  # (step, future, start time) of an async save not yet committed
        # Later steps than this one belong to an abandoned branch: moved aside at the first save.
        self.branch_point: int | None = 0
        # The newest checkpoint of this run's branch (loaded or committed; the same on every
        # rank): what a rollback reloads. None before the first.
        self.latest: int | None = None
        self.replacing: int | None = None  # a re-save of this step replaces it (save(replace=))

    # ----------------------------------------------------------------------------- listing
    def committed_steps(self) -> list[int]:
        return self.folder.committed()

    def _path(self, step: int) -> str:
        return self.folder.path(step)

    # ----------------------------------------------------------------------------- load
    def take_folder(self) -> None:
        """The folder's client library and bucket checked, and (s3://) its lease taken by rank
        0: no collective, so a refusal can be every rank's before step_to_load's collectives
        (train.py agrees on it: the other ranks no longer fail as if rank 0 had died)."""
        if not self.cfg.enable or self._taken:
            return
        storage.check_path(self.root, "checkpoint.folder")  # its client library is installed
        storage.probe(self.root, "checkpoint.folder")  # the bucket is there and ours to use
        if self.folder.url:  # one run per folder (store_lease.py)
            self.store_lease = store_lease.take(
                self.root,
                self.lease_timeout,
                dist.get_rank(),
                log=self.log,
                checked=self.cfg.store_lease == "required",
            )
        self._taken = True

    def step_to_load(self) -> int | None:
        """`load_step`, or the newest intact committed step; None when there is nothing to
        resume. Collective: the ranks verify the files together and agree."""
        if not self.cfg.enable:
            return None
        self.take_folder()
        self._recover()
        steps = self.committed_steps()
        step = self.cfg.load_step
        if step != -1 and step not in steps:
            raise ConfigError(
                f"checkpoint.load_step = {step}: no checkpoint {self._path(step)}; "
                f"available steps: {steps or 'none'}"
            )
        damaged = []
        for candidate in [step] if step != -1 else steps[::-1]:
            problem = self._verify(candidate)
            if problem is None:
                if damaged:
                    self.log(
                        f"damaged checkpoint {', '.join(damaged)} skipped: resuming "
                        f"from the newest intact one, step-{candidate}"
                    )
                return candidate
            if step != -1:
                raise CheckpointError(
                    f"{self._path(step)} is damaged ({problem}); resume from "
                    f"another step (available: {steps}) or with load_step = -1"
                )
            damaged.append(f"{self._path(candidate)} ({problem})")
        if damaged:
            raise CheckpointError(
                f"no intact checkpoint in {self.root}: "
                f"{'; '.join(damaged)}; move them aside to start afresh"
            )
        return None

    def _recover(self) -> None:
        """Rank 0 lists again a store's step whose rollback re-save never committed, and
        aborts the multipart uploads a killed run left unfinished; the others wait."""
        if not self.folder.url or self._recovered:
            return
        self._recovered = True
        if dist.get_rank() == 0:
            try:
                self.folder.recover()
                aborted = storage.abort_uploads(self.root)
                if aborted:
                    self.log(
                        f"aborted {aborted} unfinished multipart upload(s) under {self.root} "
                        "(left by a run that was stopped mid-save)"
                    )
            except storage.store_errors() as e:
                self.log(f"warning: could not tidy {self.root} before resuming ({e})")
        self._collective_timeout()
        dist.barrier(group=self.group)

    def _collective_timeout(self) -> None:
        """The checkpoint group's own timeout (set_collective_timeout sets every group's)."""
        if self.group is not None:
            dist.distributed_c10d._set_pg_timeout(self.group_timeout, self.group)

    def _verify(self, step: int) -> str | None:
        """What is wrong with checkpoint `step` on any rank (each checks its share), or None."""
        rank, world = dist.get_rank(), dist.get_world_size()
        gave_up = retry.counts()["gave_up"]
        try:
            local = integrity.check_share(
                self._path(step),
                step,
                self.cfg.verify,
                rank,
                world,
                allow_pickle=self.cfg.allow_pickle,
            )
        except storage.store_errors() as e:  # a listing or probe the store kept refusing
            if retry.counts()["gave_up"] == gave_up:
                raise
            local = str(e)
        if local not in (None, integrity.LEGACY) and retry.counts()["gave_up"] > gave_up:
            local = STORE_FAILED + local  # the store failed to answer: not damage
        seen = [None] * world
        self._collective_timeout()
        dist.all_gather_object(seen, (step, local), group=self.group)
        if any(s != step for s, _ in seen):
            raise ConfigError(
                f"ranks see different checkpoints in {self.root}: "
                f"{[s for s, _ in seen]}; the dump folder must be on storage that "
                "every node shares"
            )
        problems = [p for _, p in seen if p not in (None, integrity.LEGACY)]
        failed = [p[len(STORE_FAILED) :] for p in problems if p.startswith(STORE_FAILED)]
        if failed:  # falling back to an older step would silently lose the newer one
            raise CheckpointError(
                f"the object store did not answer while {self._path(step)} was checked, past "
                f"checkpoint.store_retries = {retry.settings()['retries']} retries "
                f"({failed[0]}); it was not treated as damaged: resume again once the store "
                "answers"
            )
        if problems:
            return problems[0]
        if any(p == integrity.LEGACY for _, p in seen):
            self.log(
                f"checkpoint {self._path(step)} has no {integrity.MANIFEST} (written "
                "before integrity checks): loading it with its sizes checked against "
                ".metadata only"
            )
        return None

    def load(self, step: int | None, *, quiet: bool = False) -> bool:
        """Resume from checkpoint `step` (from `step_to_load`; or a rollback's, `quiet`: it
        prints its own line); False if None."""
        if step is None:
            return False
        t0 = time.monotonic()
        path = self._path(step)
        saved = safe_load.read_metadata(path, self.cfg.allow_pickle).state_dict_metadata
        model_optim = self.states["model_optim"]
        check_fits(path, saved, model_optim, self.fingerprint, self.cfg.reset_optimizer)
        states = dict(self.states)
        data, rng = states.pop("dataloader"), states.pop("rng")
        sched, train_state = states.pop("lr_scheduler"), states.pop("train_state")
        # The data position first: a changed data setup is then reported by the loader itself
        # (one line). It loads leniently because a streamed source keeps per-rank state, whose
        # keys differ on another dp size; the loader explains that case too.
        # Nothing loaded runs code from the folder (trainer/checkpoint/safe_load.py).
        load = functools.partial(
            safe_load.load,
            path=path,
            allow_pickle=self.cfg.allow_pickle,
            threads=self.cfg.store_threads,
        )
        load({"dataloader": data}, partial=True)
        model_optim.flat = "model_optim.optimizer.param_groups.0.lr" not in saved  # older
        fresh = model_optim.model_only = optimizer_switched(
            saved, model_optim.optimizer
        )  # reset_optimizer
        prefix = "model_optim.optimizer."  # the optimizer's state loads, its settings are ours
        model_optim.saved_keys = {k[len(prefix) :] for k in saved if k.startswith(prefix)}
        model_optim.grouped = saved_grouped(model_optim.saved_keys)
        model_optim.changes = []
        try:
            load(states)
        finally:
            model_optim.flat, model_optim.model_only, model_optim.saved_keys = True, False, None
            model_optim.grouped = True
        settings = None if fresh else changed_line(model_optim.changes)  # collective
        if fresh:
            self.log(
                f"checkpoint.reset_optimizer: {self._path(step)} holds another optimizer's "
                "state; the model, data position and schedule resume, the optimizer "
                "starts afresh"
            )
        # Leniently: older checkpoints have no spike window nor rollbacks (TrainState).
        load({"train_state": train_state}, partial=True)
        # After the optimizer: the schedule keeps this run's formula and sets the lr of the
        # next step from it (trainer/optim/optimizer.py).
        load({"lr_scheduler": sched})
        # Leniently too: a CPU checkpoint has no CUDA RNG state to give a GPU run.
        load({"rng": rng}, partial=True)
        self.branch_point = self.latest = step
        if quiet:
            return True
        self.log(
            f"resumed from {self._path(step)} (step {self.train_state.step}) in "
            f"{time.monotonic() - t0:.2f}s"
        )
        if os.environ.get(integrity.DIGEST_ENV):
            model = self.states["model_optim"].model
            self.log(f"loaded weights digest {integrity.weights_digest(integrity.saved(model))}")
        for note in (settings, sched.obj.resume_note()):
            if note:
                self.log(note)
        return True

    # ----------------------------------------------------------------------------- save
    def maybe_save(self, step: int, *, last: bool) -> bool:
        """Save on interval steps and the last step; True if a save was started."""
        if self.cfg.enable and (step % self.cfg.interval == 0 or last):
            self.save(step)
            return True
        return False

    def write_finished(self) -> bool:
        """This rank's background write (if any) is done; the loop commits once all are."""
        return self.pending is None or self.pending[1].done()

    def save(self, step: int, *, replace: bool = False) -> None:
        """Write `step-N.partial` (in the background when async), then commit it as `step-N`.
        `replace`: a rollback saves the step it reloaded again, with its record added: the new
        folder replaces the old one (rather than moving it aside as an abandoned branch's)."""
        self.wait()  # at most one save in flight; commit the previous one (and its clean-up)
        self.replacing = step if replace else None
        t0 = time.monotonic()
        target = [None, None]  # where the save writes, or why it cannot start (rank 0's)
        if dist.get_rank() == 0:
            try:
                target[0] = self.folder.prepare_save(step, replace)  # what an interrupted
            except storage.store_errors() as e:  # save left is removed first
                target[1] = f"preparing its folder: {e}"
        self._collective_timeout()
        dist.broadcast_object_list(target, src=0, group=self.group)
        if target[1] is not None:
            self.replacing = None
            self._save_failed(step, self.folder.partial(step), target[1])
            return
        self.folder.writing(step, target[0])
        partial = target[0]
        states = {**self.states, **integrity.marker()}
        writer = integrity.storage_writer(partial, step, dist.get_rank(), self.cfg.store_threads)
        if self.async_group is None:
            error = None
            try:
                dcp.save(states, storage_writer=writer, process_group=self.group)
            except (CheckpointException, *storage.store_errors()) as e:
                error = integrity.describe_save_error(e, partial)
            self._commit(step, t0, error, writer)
        else:
            future = dcp.async_save(states, storage_writer=writer, process_group=self.async_group)
            self.log(
                f"checkpoint step-{step}: staged in {time.monotonic() - t0:.2f}s, "
                "writing in the background"
            )
            self.pending = (step, future, t0, writer)

    def wait(self) -> None:
        """Finish and commit an async save in flight, and the clean-up after the last commit
        (call before exiting)."""
        self._wait_for_save()
        if self._cleaning is not None:
            self._cleaning.join()
            self._cleaning = None

    def _wait_for_save(self) -> None:
        if self.pending is not None:
            step, future, t0, writer = self.pending
            self.pending = None
            waited, error = time.monotonic(), None
            try:
                future.result()
            except (CheckpointException, *storage.store_errors()) as e:
                error = integrity.describe_save_error(e, self.folder.partial(step))
            if time.monotonic() - waited > 0.01:
                self.log(
                    f"checkpoint step-{step}: training waited "
                    f"{time.monotonic() - waited:.2f}s for the background write"
                )
            self._commit(step, t0, error, writer)

    def _commit(self, step: int, t0: float, error: str | None, writer) -> None:
        """Agree that every rank's write succeeded, record the manifest, rename; or give up."""
        partial, rank, world = self.folder.partial(step), dist.get_rank(), dist.get_world_size()
        faults.armed().before_commit(step)  # a testing hook: nothing unless asked
        files = {}
        if error is None:
            try:
                files = integrity.written_files(writer)  # hashed as written: no re-read
            except OSError as e:
                error = str(e)
        seen = [None] * world
        self._collective_timeout()
        dist.all_gather_object(seen, (error, files), group=self.group)  # every rank's data
        outcome = [next((err for err, _ in seen if err), None)]  # is written
        if outcome[0] is None and rank == 0:
            try:
                self._install(step, partial, {k: v for _, f in seen for k, v in f.items()})
            except storage.store_errors() as e:
                outcome = [str(e)]
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        self.replacing = None
        if outcome[0] is not None:
            self._save_failed(step, partial, outcome[0])
            return
        self.branch_point = None  # the abandoned branch (if any) is aside now
        self.latest = step
        self.log(f"saved checkpoint {self._path(step)} in {time.monotonic() - t0:.2f}s")
        if rank == 0:
            self._clean_up(step)

    def _install(self, step: int, partial: str, files: dict) -> None:
        """Rank 0 commits the step: the abandoned branch set aside, the manifest written (a
        store's commit), the folder renamed (a local one's). Raises the storage's error."""
        if taken := lease.lost():  # since the step end: nothing committed there
            raise OSError(f"this run lost the lease on {taken}")
        self._move_aside_abandoned(step)
        integrity.write_manifest(
            partial, step, self.fingerprint, {**integrity.unrecorded(partial, files), **files}
        )
        self.folder.install(step, replacing=self.replacing == step)

    def _clean_up(self, step: int) -> None:
        """After the commit of `step` (rank 0): the superseded and pruned steps deleted, and a
        store's leftovers. A failure is a warning: the step is committed, and the next commit
        cleans up again. On a store it runs in the background (joined at the next save)."""

        def work() -> None:
            try:
                self.folder.clean_up(self.cfg.keep_latest_k, keep=step)
            except storage.store_errors() as e:
                self.log(
                    f"warning: cleaning up after checkpoint step-{step} failed ({e}); "
                    f"{self._path(step)} is committed; the next save cleans up again"
                )

        if not self.folder.url:
            work()
            return
        self._cleaning = threading.Thread(target=work, name="checkpoint-clean-up")
        self._cleaning.start()

    def _save_failed(self, step: int, partial: str, error: str) -> None:
        if dist.get_rank() == 0:
            try:  # frees the space a partial write took; a store's replaced step comes back
                self.folder.discard(step)
            except storage.store_errors() as e:
                self.log(f"warning: could not remove {partial} ({e}); it is not listed")
        self._collective_timeout()
        dist.barrier(group=self.group)
        steps = self.committed_steps()
        latest = self._path(steps[-1]) if steps else "none"
        if self.cfg.on_save_error == "stop":
            raise CheckpointError(
                f"saving {partial} failed: {error}; the latest checkpoint is "
                f"{latest} (checkpoint.on_save_error = 'continue' trains on)"
            )
        self.log(
            f"warning: checkpoint step-{step} not saved ({error}); training goes on "
            f"(checkpoint.on_save_error = 'continue'); the latest checkpoint is {latest}"
        )

    def _move_aside_abandoned(self, step: int) -> None:
        """At this run's first commit, rename `step-M` folders later than the step it resumed
        from (and any `step-{step}`): they belong to the branch a rewind abandoned."""
        if self.branch_point is None:
            return
        later = [
            s
            for s in self.committed_steps()
            if s > self.branch_point or (s == step and s != self.replacing)
        ]
        if later:
            suffix = abandoned_suffix()
            for s in later:
                self.folder.set_aside(s, suffix)
            self.log(
                f"this run resumed from step {self.branch_point}: moved the later "
                f"checkpoint(s) {', '.join(f'step-{s}' for s in later)} aside as "
                f"step-N{suffix} (never resumed from nor pruned)"
            )
