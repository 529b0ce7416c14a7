"""Accuracy and speed versus worker count (`python -m trainer.benchmark`).

Runs, one after another on this machine and with the same model, seed,
global batch and steps: a local ps cluster (`trainer.launch`) for each
worker count in --workers, the single-process baseline (best of the
--single_threads intra-op thread counts), and TensorFlow's
MultiWorkerMirroredStrategy with the same worker counts. Reports final test
accuracy, training time, images/s, efficiency E(N) = images/s / best
single-process images/s, mean step time, time to --target_accuracy and
each process's peak memory, as a Markdown table on stdout, a CSV, a JSON
and (with matplotlib) a PNG in --out. Each run's TensorBoard logs are in
their own subfolder of --out.

Every trainer flag (model, batch, optimizer, steps, ...) applies to every
run; thread counts follow the local launcher (cores / workers per worker).
"""

import collections
import dataclasses
import datetime
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags
from absl import logging

from trainer import flags as trainer_flags
from trainer import launcher
from trainer.bench import report
from trainer.config import validate
from trainer.errors import RunFailed, UserError

flags.DEFINE_list("workers", ["1", "2", "4"],
                  "Worker counts to run the ps cluster (and MWMS) with.")
flags.DEFINE_list("baselines", ["single", "mwms"],
                  "Baselines to run: single (one process, no servers) and "
                  "mwms (MultiWorkerMirroredStrategy); empty for none.")
flags.DEFINE_list("single_threads", ["1", "2"],
                  "Intra-op thread counts for the single-process baseline; "
                  "the best is the reference for efficiency.")
flags.DEFINE_float("target_accuracy", 0.99,
                   "Report the training time until the test accuracy, "
                   "evaluated every --eval_every steps, first reaches this.")
flags.DEFINE_string("out", None,
                    "Output folder (default bench/<model>-<time>).")
flags.DEFINE_float("run_timeout_secs", 3600, "Give up on a run after this.")

FLAGS = flags.FLAGS
_PROGRESS = re.compile(r"step (\d+)/(\d+) .* ETA (\d+:\d\d:\d\d)")


@dataclasses.dataclass
class Run:
    """One configuration's figures."""

    name: str
    kind: str            # ps | single | mwms
    workers: int
    results: dict        # the chief's results JSON
    peak_rss_mb: dict    # process name -> MiB

    def row(self, target: float, reference_images_per_sec: float) -> dict:
        reached = [e["train_secs"] for e in self.results["eval_history"]
                   if e["accuracy"] >= target]
        images_per_sec = self.results["images_per_sec"]
        return {
            "run": self.name,
            "kind": self.kind,
            "workers": self.workers,
            "test_accuracy": self.results["final_test_accuracy"],
            "wall_time_secs": self.results["wall_time_secs"],
            "train_time_secs": self.results["train_time_secs"],
            "images_per_sec": images_per_sec,
            "efficiency": images_per_sec / reference_images_per_sec,
            "mean_step_time_ms": self.results["mean_step_time_ms"],
            "time_to_target_secs": reached[0] if reached else None,
            "peak_rss_mb_max": max(self.peak_rss_mb.values()),
            "peak_rss_mb": ";".join(f"{k}:{v:.0f}" for k, v in
                                    self.peak_rss_mb.items()),
        }


def _stream(processes: list, label: str, timeout: float) -> list[int]:
    """Waits for processes, logging a progress line per log interval of
    the first (the chief); kills them all on timeout. On failure, logs the
    end of the chief's output."""
    tail = collections.deque(maxlen=30)

    def relay():
        for line in processes[0].stdout:
            tail.append(line.rstrip())
            match = _PROGRESS.search(line)
            if match:
                logging.info("%s: step %s/%s, ETA %s", label, *match.groups())

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    statuses = []
    for process in processes:
        try:
            statuses.append(process.wait(
                timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            logging.error("%s: no end after %.0f s; killing it", label,
                          timeout)
            for p in processes:
                p.kill()
            statuses.append(process.wait())
    reader.join(timeout=10)
    if any(statuses):
        logging.error("%s failed (exit statuses %s); its last lines:\n%s",
                      label, statuses, "\n".join(tail))
    return statuses


def _popen(args: list[str], log_path: pathlib.Path | None = None,
           **env_changes):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_changes)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.pop("TF_CONFIG", None)
    return subprocess.Popen(
        [sys.executable] + args, env=env, text=True,
        stdout=subprocess.PIPE if log_path is None else open(log_path, "w"),
        stderr=subprocess.STDOUT)


def run_ps(out: pathlib.Path, workers: int, train_flags: list[str],
           label: str) -> Run:
    name = f"ps_{workers}w"
    logdir = out / name
    report = out / f"{name}.launch.json"
    process = _popen(["-m", "trainer.launch", f"--num_workers={workers}",
                      f"--num_ps={FLAGS.num_ps}", f"--logdir={logdir}",
                      f"--report={report}", *train_flags])
    (status,) = _stream([process], label, FLAGS.run_timeout_secs)
    if status != 0:
        raise RunFailed(f"{label} failed with status {status}")
    tasks = json.loads(report.read_text())["tasks"]
    return Run(name, "ps", workers,
               json.loads((logdir / "results.json").read_text()),
               {t["task"]: t["peak_rss_mb"] for t in tasks})


def _write_config(out: pathlib.Path, name: str, **changes) -> pathlib.Path:
    config = dataclasses.replace(trainer_flags.config_from_flags(),
                                 logdir=str(out / name), **changes)
    path = out / f"{name}.config.json"
    path.write_text(json.dumps(dataclasses.asdict(config)))
    return path


def run_single(out: pathlib.Path, threads: int, label: str) -> Run:
    name = f"single_{threads}t"
    config = _write_config(out, name, intra_op_threads=threads,
                           checkpoint_every=_NO_CHECKPOINTS)
    results = out / f"{name}.results.json"
    # A process without a server sizes its thread pool from this variable,
    # not from the session's ConfigProto.
    process = _popen(["-m", "trainer.bench.baselines", "single", str(config),
                      str(results)], TF_NUM_INTRAOP_THREADS=str(threads))
    (status,) = _stream([process], label, FLAGS.run_timeout_secs)
    if status != 0:
        raise RunFailed(f"{label} failed with status {status}")
    data = json.loads(results.read_text())
    return Run(name, "single", 1, data, {"process": data["peak_rss_mb"]})


def run_mwms(out: pathlib.Path, workers: int, label: str) -> Run:
    name = f"mwms_{workers}w"
    config = _write_config(
        out, name, checkpoint_every=_NO_CHECKPOINTS,
        intra_op_threads=max(1, (os.cpu_count() or 1) // workers))
    hosts = ",".join(f"localhost:{p}"
                     for p in launcher.free_ports("localhost", workers))
    outputs = [out / f"{name}.worker{i}.json" for i in range(workers)]
    processes = [_popen(["-m", "trainer.bench.baselines", "mwms", str(config),
                         str(outputs[i]), str(i), hosts],
                        None if i == 0 else out / f"{name}.worker{i}.log")
                 for i in range(workers)]
    statuses = _stream(processes, label, FLAGS.run_timeout_secs)
    if any(statuses):
        raise RunFailed(f"{label} failed with statuses {statuses}")
    per_worker = [json.loads(p.read_text()) for p in outputs]
    return Run(name, "mwms", workers, per_worker[0],
               {f"worker{i}": r["peak_rss_mb"]
                for i, r in enumerate(per_worker)})


# Checkpoints are not what the benchmark measures: only the final one.
_NO_CHECKPOINTS = 1 << 40


def check_settings(out: pathlib.Path) -> list[int]:
    """Refuses, before any run, what would fail or mislead halfway.

    Returns the worker counts. A used --out is refused: its runs' logdirs
    hold final checkpoints, so the ps runs would resume them and train
    nothing.
    """
    try:
        worker_counts = [int(w) for w in FLAGS.workers]
    except ValueError:
        raise UserError(f"--workers={','.join(FLAGS.workers)} must be a "
                        "comma-separated list of worker counts") from None
    if not worker_counts or min(worker_counts) < 1:
        raise UserError("--workers needs worker counts of 1 or more")
    unknown = set(FLAGS.baselines) - {"single", "mwms"}
    if unknown:
        raise UserError(f"--baselines: unknown {', '.join(sorted(unknown))};"
                        " use single, mwms or both")
    validate(trainer_flags.config_from_flags(), max(worker_counts))
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out={out} already holds a benchmark; give a "
                        "new folder (or leave --out out for a fresh one)")
    return worker_counts


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = pathlib.Path(FLAGS.out or f"bench/{FLAGS.model}-{stamp}")
    try:
        worker_counts = check_settings(out)
    except UserError as e:
        logging.error("%s", e)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    train_flags = trainer_flags.forwarded_flags(
        exclude=("logdir", "checkpoint_every", "intra_op_threads"))
    train_flags.append(f"--checkpoint_every={_NO_CHECKPOINTS}")
    plan = [("ps", n) for n in worker_counts]
    if "single" in FLAGS.baselines:
        plan += [("single", int(t)) for t in FLAGS.single_threads]
    if "mwms" in FLAGS.baselines:
        plan += [("mwms", n) for n in worker_counts]
    logging.info("benchmark of %d runs into %s: %s", len(plan), out,
                 ", ".join(f"{k} {n}" for k, n in plan))
    runs = []
    for i, (kind, count) in enumerate(plan, 1):
        label = (f"[{i}/{len(plan)}] " +
                 {"ps": f"ps cluster, {count} worker(s)",
                  "single": f"single process, {count} thread(s)",
                  "mwms": f"MWMS, {count} worker(s)"}[kind])
        logging.info("%s: starting", label)
        start = time.monotonic()
        try:
            if kind == "ps":
                runs.append(run_ps(out, count, train_flags, label))
            elif kind == "single":
                runs.append(run_single(out, count, label))
            else:
                runs.append(run_mwms(out, count, label))
        except RunFailed as e:
            logging.error("%s", e)
            return 1
        logging.info("%s: done in %s", label, datetime.timedelta(
            seconds=round(time.monotonic() - start)))
    singles = [r for r in runs if r.kind == "single"]
    reference = (max(r.results["images_per_sec"] for r in singles)
                 if singles else runs[0].results["images_per_sec"])
    rows = [r.row(FLAGS.target_accuracy, reference) for r in runs]
    table = report.write_outputs(out, rows, FLAGS.target_accuracy)
    print(table)
    print(f"\nE = images/s / {reference:,.0f} (best single process"
          f"{'' if singles else ' not run: first run'}); outputs in {out}; "
          f"tensorboard --logdir {out}")
    return 0 if all(math.isfinite(r["images_per_sec"]) for r in rows) else 1


def run_main():
    app.run(lambda argv: sys.exit(main(argv)))


if __name__ == "__main__":
    run_main()
