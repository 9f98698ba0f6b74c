"""One run per dump folder: `{dump_folder}/lease.json` names the run that owns the folder.

Rank 0 takes the lease before the run writes anything there and refreshes its heartbeat from a
daemon thread every `job.lease_timeout_seconds / 6`; it removes the lease when the run ends. A
second run into a held folder stops with one line naming the holder (exit 2), having touched
nothing. A lease is taken over, with one line, when
- it belongs to this job: an in-job restart (MAX_RESTARTS) or a SLURM requeue (same job id);
- its holder's process is gone (same host, the pid no longer runs that process);
- or its heartbeat is older than `job.lease_timeout_seconds` (a node that died, a job killed
  on another host). Hosts compare wall clocks here: keep the timeout well above their skew.

Why not `flock`: on NFS and Lustre it is advisory, often disabled or local to one client, and
a lock dies with the process that holds it, so it cannot say who held the folder. Instead:
- the lease is created whole and atomically with `link(tmp, lease.json)`, which fails if the
  file exists, on local disks and NFSv3+ alike (`O_EXCL` where a file system has no hard links);
- a refresh writes a temporary file and renames it over the lease (atomic on POSIX and NFS);
- a takeover never removes the lease: the contender first creates a claim named for the stale
  lease's token (`lease.json.<token>.takeover`, `O_EXCL`: one contender per stale lease holds
  it), checks that the lease is still the one it judged stale, renames its own lease over
  it (atomic: there is always a lease, so no third run can create one meanwhile), and drops the
  claim. A claim left by a contender that died is dropped once older than the timeout.
A holder that finds another run's lease at its next refresh says so once and stops refreshing.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from trainer.errors import ConfigError

LEASE_FILE = "lease.json"
_held: dict = {"lease": None, "others": []}  # others: an s3:// folder's (store_lease.py)


@dataclass
class Holder:
    host: str
    job: str  # "slurm <id>", "torchrun <run id>", or "pid <pid>"
    pid: int  # rank 0's process
    start: str  # that process's start time (/proc/<pid>/stat), against pid reuse
    since: float  # when the lease was taken (unix time)
    heartbeat: float
    token: str  # unique per taking: tells leases apart
    machine: str = ""  # machine_id(): two machines (or containers) with one host name are
    # told apart before a pid is probed ("" in older leases)

    def describe(self, now: float | None = None) -> str:
        age = max(0.0, (now or time.time()) - self.heartbeat)
        return (
            f"{self.job} on {self.host} (pid {self.pid}), heartbeat {age:.0f}s ago, "
            f"holding it since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.since))}"
        )


def new_holder() -> Holder:
    """This process's record, as a lease it takes names it (a fresh token)."""
    pid, now = os.getpid(), time.time()
    return Holder(
        host=socket.gethostname(),
        job=job_id(),
        pid=pid,
        start=_start_time(pid),
        since=now,
        heartbeat=now,
        token=uuid.uuid4().hex,
        machine=machine_id(),
    )


def machine_id() -> str:
    """Where a pid means one process: this kernel's boot id and this pid namespace (two
    machines, or two containers, with the same host name differ in one of them); "" if
    neither can be read."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            parts.append(fh.read().strip())
    except OSError:
        pass
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    return " ".join(parts)


def on_this_machine(holder: Holder) -> bool:
    """The holder's process runs here (its pid can be probed): same host name and, where the
    lease records one, the same machine id."""
    return holder.host == socket.gethostname() and holder.machine in ("", machine_id())


class LeaseHeld(ConfigError):
    """Another live run owns the dump folder."""


def job_id(env=os.environ) -> str:
    """This launch, the same across its in-job restarts and SLURM requeues."""
    if env.get("SLURM_JOB_ID"):  # a requeue keeps the id (the batch script checks it too)
        return f"slurm {env['SLURM_JOB_ID']}"
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return f"torchrun {run_id}"
    if env.get("TORCHELASTIC_RUN_ID"):  # torchrun without --rdzv_id: its agent's pid
        return f"torchrun pid {os.getppid()}"
    return f"pid {os.getpid()}"


def _stat(pid: int, field: int) -> str:
    """Field `field` of /proc/<pid>/stat after the command name (0: the state, 19: the start
    time), or "" when the process or the field is not there."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[field]
    except (OSError, IndexError):
        return ""


def _start_time(pid: int) -> str:
    return _stat(pid, 19)


def _alive(holder: Holder) -> bool:
    """Whether the holder's process still runs (callable only on its host). A zombie (killed,
    not yet reaped by its parent: a SIGKILLed run's ranks for a moment after their launcher)
    runs no more."""
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if _stat(holder.pid, 0) in ("Z", "X"):
        return False
    return not holder.start or _start_time(holder.pid) in ("", holder.start)


def read(path: str) -> Holder | None | str:
    """The lease at `path`; None if there is none; "partial" while a creator (O_EXCL) writes
    it, or if it cannot be parsed."""
    try:
        with open(path) as fh:
            return Holder(**json.load(fh))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):
        return "partial"


def why_free(holder: Holder, timeout: float, job: str | None, now: float) -> str | None:
    """Why a lease may be taken over, or None while its holder owns the folder."""
    if job is not None and holder.job == job:
        return "this job's own lease (a restart or requeue)"
    if on_this_machine(holder) and not _alive(holder):
        return f"its process {holder.pid} on this host is gone"
    if now - holder.heartbeat > timeout:
        return (
            f"no heartbeat for {now - holder.heartbeat:.0f}s > "
            f"job.lease_timeout_seconds = {timeout:g}"
        )
    return None


def refusal(folder: str, holder: Holder, timeout: float) -> LeaseHeld:
    return LeaseHeld(
        f"job.dump_folder {folder} is in use by another run: {holder.describe()}; give this run "
        f"another job.dump_folder, or stop that one (a lease whose heartbeat stops for "
        f"job.lease_timeout_seconds = {timeout:g} is taken over; "
        f"{os.path.join(folder, LEASE_FILE)})"
    )


def check_free(folder: str, timeout: float, env=os.environ) -> None:
    """Before a launch (trainer/plan/preflight.py): refuse at once if a live run holds the
    folder.
    Read-only; the run itself takes the lease (Lease.acquire)."""
    holder = read(os.path.join(folder, LEASE_FILE))
    job = job_id(env) if env.get("SLURM_JOB_ID") else None
    if isinstance(holder, Holder) and why_free(holder, timeout, job, time.time()) is None:
        raise refusal(folder, holder, timeout)


class Lease:
    """Rank 0's lease on the dump folder (see the module docstring)."""

    def __init__(self, folder: str, timeout: float, log=print):
        self.folder, self.timeout, self.log = folder, float(timeout), log
        self.path = os.path.join(folder, LEASE_FILE)
        self.me = new_holder()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost, self.lost_to = False, None

    # -------------------------------------------------------------------------- taking it

    def acquire(self) -> None:
        """Take the lease, or raise LeaseHeld naming the live holder."""
        os.makedirs(self.folder, exist_ok=True)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self._create():
                return
            holder = read(self.path)
            if holder is None:
                continue  # released meanwhile
            if holder == "partial":
                if not self._partial_is_stale():
                    raise LeaseHeld(
                        f"job.dump_folder {self.folder} is being taken by another "
                        f"run ({self.path} is being written)"
                    )
                holder_desc, reason = "an unreadable lease", "written long ago"
            else:
                reason = why_free(holder, self.timeout, self.me.job, time.time())
                if reason is None:
                    raise refusal(self.folder, holder, self.timeout)
                holder_desc = holder.describe()
            taken = self._take_over(holder)
            if taken and holder != "partial" and holder.job != self.me.job:
                self.log(
                    f"dump folder {self.folder}: taking over the lease of {holder_desc} ({reason})"
                )
            if taken:
                return
            if taken is None:
                time.sleep(0.02)  # another contender holds the claim: see what it leaves
        raise LeaseHeld(
            f"job.dump_folder {self.folder}: could not take {self.path} (other runs keep taking it)"
        )

    def _payload(self) -> str:
        return json.dumps(asdict(self.me), indent=1) + "\n"

    def _create(self) -> bool:
        """Create the lease whole if there is none; False if one exists."""
        tmp = f"{self.path}.{self.me.token}.tmp"
        with open(tmp, "w") as fh:
            fh.write(self._payload())
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError as e:  # a file system without hard links
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            return self._create_exclusive()
        finally:
            os.unlink(tmp)

    def _create_exclusive(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            fh.write(self._payload())
        return True

    def _partial_is_stale(self) -> bool:
        try:
            return time.time() - os.stat(self.path).st_mtime > self.timeout
        except FileNotFoundError:
            return True

    def _take_over(self, judged: Holder | str) -> bool | None:
        """Replace the lease judged stale by ours: True if done; False if the lease changed
        meanwhile; None if another contender holds the claim on it."""
        name = judged.token if isinstance(judged, Holder) else "unreadable"
        claim = f"{self.path}.{name}.takeover"
        mine = f"{self.path}.{self.me.token}.tmp"
        with open(mine, "w") as fh:
            fh.write(self._payload())
        try:
            try:
                os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            except FileExistsError:
                self._drop_if_stale(claim)
                return None
            try:
                current = read(self.path)
                same = current == judged if isinstance(judged, Holder) else current == "partial"
                if not same:
                    return False
                os.replace(mine, self.path)
                return True
            finally:
                os.unlink(claim)
        finally:
            if os.path.exists(mine):
                os.unlink(mine)

    def _drop_if_stale(self, claim: str) -> None:
        """Remove a claim whose contender died before dropping it."""
        try:
            if time.time() - os.stat(claim).st_mtime > self.timeout:
                os.unlink(claim)
        except FileNotFoundError:
            pass

    # -------------------------------------------------------------------------- holding it

    def start(self) -> None:
        """Refresh the heartbeat every timeout/6 seconds from a daemon thread."""
        self._thread = threading.Thread(target=self._beat, name="dump-folder-lease", daemon=True)
        self._thread.start()
        _held["lease"] = self

    def _beat(self) -> None:
        while not self._stop.wait(max(0.5, self.timeout / 6)):
            try:
                self.refresh()
            except OSError as e:
                self.log(f"warning: could not refresh {self.path}: {e}")
            if self.lost:
                return

    def refresh(self) -> None:
        current = read(self.path)
        if current is None and self._create():  # removed by hand: ours again
            return
        if current != "partial" and (current is None or current.token != self.me.token):
            who = current.describe() if isinstance(current, Holder) else "nobody"
            self.lost_to = f"{self.folder} (now held by {who})"
            self.lost = True  # after lost_to: the loop reads both (lost())
            self.log(
                f"warning: this run lost the lease on {self.folder} (now held by {who}); "
                "another run may be writing there"
            )
            return
        self.me.heartbeat = time.time()
        tmp = f"{self.path}.{self.me.token}.tmp"
        with open(tmp, "w") as fh:
            fh.write(self._payload())
        os.replace(tmp, self.path)

    def release(self) -> None:
        """Stop refreshing and remove the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        current = read(self.path)
        if isinstance(current, Holder) and current.token == self.me.token:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        _held["lease"] = None


def take(folder: str, timeout: float, rank: int, log=print) -> Lease | None:
    """Rank 0 takes and holds the lease (others get None): call on every rank through
    agree_on_user_errors, so that a held folder stops every rank alike."""
    if rank != 0:
        return None
    lease = Lease(folder, timeout, log=log)
    lease.acquire()
    lease.start()
    return lease


def lost() -> str | None:
    """Which of this process's leases another run took (the folder and the new holder), or
    None: the training loop stops without saving into a folder that is no longer its own."""
    for held in (_held["lease"], *_held["others"]):
        if held is not None and getattr(held, "lost", False):
            return held.lost_to
    return None


def hold(other) -> None:
    """Release `other` (a lease with `release()`) with this process's own, at its exit."""
    _held["others"].append(other)


def release_held() -> None:
    """Release this process's leases, if it holds any (train.main's exit path)."""
    while _held["others"]:
        _held["others"].pop().release()
    lease = _held["lease"]
    if lease is not None:
        lease.release()
