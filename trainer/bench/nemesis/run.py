"""Running one fault schedule on a cluster, and the 1-worker reference.

`run_schedule` starts the cluster, hits each fault once the chief has
logged its step, undoes it `secs` later, and returns what the checker
(trainer/bench/nemesis/checker.py) judges: the tasks' exit statuses, the
history of faults and when each step was seen, the folder of the logs.
"""

import dataclasses
import hashlib
import heapq
import pathlib
import shutil
import subprocess
import sys
import time

from trainer.bench.nemesis import cluster as cluster_lib
from trainer.bench.nemesis import schedule as schedule_lib
from trainer.common import processes

POLL_SECS = 0.1
# A worker back from a fault less than --worker_timeout_secs + this before
# the run ended (or still faulted then) may have missed the end; it gets
# this long to end by itself, then is stopped and not judged by status.
LATE_RETURN_SLACK_SECS = 10.0


@dataclasses.dataclass
class Setup:
    """What every schedule of a nemesis run shares."""

    workers: int
    train_flags: list[str]   # training flags, identical on every task
    run_secs: float          # bound on one schedule's run
    worker_timeout_secs: float
    cpu: float | None = None       # each simulated host's cores
    # Each host's cores once training runs (slower steps: more time per
    # step for faults in a run short enough for a tight yardstick).
    training_cpu: float | None = None
    link_rate: str | None = None   # each simulated host's link
    ps: int = 1                    # ps tasks


@dataclasses.dataclass
class Outcome:
    """One schedule's run, as the checker needs it."""

    folder: pathlib.Path
    logdir: pathlib.Path
    codes: dict            # task -> exit status of its latest start
    history: list          # (time, step, task, what) of starts and faults
    steps_seen: list       # (wall-clock time, chief's step) as it moved
    ended_at: float        # wall-clock time ps 0 exited (told by the chief)
    faults_in_effect: dict  # task -> fault kinds still on at the chief's end
    hung: bool             # the run outlived setup.run_secs
    # Workers (re)started too late to join, or back from a fault too late
    # to learn that the run ended, stopped by the nemesis: their ps had
    # gone, so they would wait for it (--startup_timeout_secs).
    stopped_late: list = dataclasses.field(default_factory=list)


def run_schedule(setup: Setup, faults: list, folder: pathlib.Path, sim=None,
                 ports=None) -> Outcome:
    """Trains under `faults` (a schedule); stops whatever is left."""
    cluster = cluster_lib.Cluster(folder, setup.train_flags, setup.workers,
                                  sim, setup.cpu, setup.link_rate, ports,
                                  setup.ps)
    try:
        for name in cluster.names:
            cluster.start(name)
        outcome = _drive(cluster, faults, setup)
    finally:
        if sim is not None:
            cluster.heal()
        cluster.stop()
    return outcome


def _drive(cluster, faults: list, setup: Setup) -> Outcome:
    """Hits and undoes faults until ps 0 exits, which the chief tells it
    at the end (or run_secs pass), then lets every task end within a
    bound. ps 0 killed by a fault is not the end: it is started again."""
    start, pending = time.monotonic(), list(faults)
    undo_at, on, steps_seen, count = [], {}, [], 0
    while cluster.running("ps0") or schedule_lib.KILL in on.get("ps0", ()):
        now = time.monotonic()
        if now - start > setup.run_secs:
            break
        step = cluster.read_step()
        if step and setup.training_cpu and cluster.cpu != setup.training_cpu:
            cluster.pace(setup.training_cpu)
        if not steps_seen or steps_seen[-1][1] != step:
            steps_seen.append((time.time(), step))
        while pending and pending[0].at_step <= step:
            fault = pending.pop(0)
            cluster.hit(fault)
            on.setdefault(fault.task, []).append(fault.kind)
            if fault.secs is not None:
                count += 1
                heapq.heappush(undo_at, (now + fault.secs, count, fault))
        while undo_at and undo_at[0][0] <= now:
            _, _, fault = heapq.heappop(undo_at)
            on[fault.task].remove(fault.kind)
            cluster.undo(fault, on)
        cluster.start_exited()
        time.sleep(POLL_SECS)
    ended = time.time()
    hung = cluster.running("ps0")
    cluster.read_step()
    in_effect = {task: kinds[:] for task, kinds in on.items() if kinds}
    # Undo what is left, so that every task can learn that the run ended.
    if cluster.sim is not None:
        cluster.heal()
    late = [] if hung else cluster.stop_unjoined() + cluster.stop_returned(
        after=ended - setup.worker_timeout_secs - LATE_RETURN_SLACK_SECS,
        in_effect=in_effect, grace=LATE_RETURN_SLACK_SECS)
    codes = cluster.wait_all(timeout=max(
        30.0, 3 * setup.worker_timeout_secs + 20.0))
    return Outcome(cluster.folder, cluster.logdir, codes, cluster.history,
                   steps_seen, ended, in_effect, hung or any(
                       c is None for c in codes.values()), late)


def reference_logdir(setup: Setup, cache: pathlib.Path,
                     data_flags: list[str], timeout: float) -> pathlib.Path:
    """The logdir of a 1-worker run with the same training flags and ps
    tasks, made once per flag set under `cache` (the local launcher, on
    loopback)."""
    key = hashlib.sha256(" ".join(setup.train_flags + [
        f"ps={setup.ps}"]).encode()).hexdigest()
    logdir = cache / f"reference-{key[:12]}"
    if (logdir / "results.json").exists():
        return logdir
    shutil.rmtree(logdir, ignore_errors=True)
    flags = [f for f in setup.train_flags if not f.startswith("--min_workers")]
    argv = [sys.executable, "-m", "trainer.launch", "--num_workers=1",
            f"--num_ps={setup.ps}", f"--logdir={logdir}", *flags,
            *data_flags]
    result = subprocess.run(argv, env=processes.child_env(), timeout=timeout,
                            capture_output=True, text=True,
                            cwd=cluster_lib.REPO)
    if result.returncode != 0:
        raise RuntimeError("the 1-worker reference run failed:\n"
                           + result.stdout[-2000:] + result.stderr[-2000:])
    return logdir


