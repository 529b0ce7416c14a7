"""A long run that checks for leaks and lost steps: `python -m trainer.soak`.

Runs the local launcher (1 ps + 4 workers, mlp, 20,000 global steps
unless --num_ps, --num_workers, --model or --train_steps say otherwise), samples every task's resident memory once a second, and checks at
the end that:
  * every task exited 0;
  * no task's memory grew more than --max_growth over what it used once
    --warmup_steps steps were done;
  * the global step reached --train_steps, no gradient was dropped and
    every worker's local step count equals it (nothing lost or repeated).
Prints a table and writes soak.json in --out; the exit status is 0 only if
every check passed.
"""

import datetime
import json
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
from trainer.bench import report as bench_report
from trainer.common import processes
from trainer.observe import progress_line

trainer_flags.define_local_cluster_flags(num_workers=4)
trainer_flags.define_isolate_flag()

flags.DEFINE_integer("warmup_steps", 1000,
                     "Memory after this many steps is the reference.")
flags.DEFINE_float("max_growth", 0.10,
                   "Largest allowed memory growth after the warm-up, as a "
                   "fraction of the reference.")
flags.DEFINE_string("out", None, "Output folder (default soak/<time>).")
flags.DEFINE_float("sample_secs", 1.0, "Memory sampling interval.")

FLAGS = flags.FLAGS
_STARTED = re.compile(r"started (\w+) \(pid (\d+)\)")
# The launcher relays the chief's output with this prefix.
_CHIEF = "[worker0] "
# Seconds the launcher gets to stop its tasks (5 s of grace each, then
# SIGKILL) before it is killed itself.
_STOP_GRACE_SECS = 15.0


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


class Sampler:
    """Reads the launcher's output and every task's memory as it runs."""

    def __init__(self, launcher: processes.Child, log_path: pathlib.Path):
        self.launcher = launcher
        self.log = open(log_path, "w")
        self.pids: dict[str, int] = {}
        self.step = 0
        self.samples: dict[str, list] = {}  # task -> [(step, MiB)]
        self.lock = threading.Lock()

    def read_line(self, line: str) -> None:
        """Child.relay's on_line: logs the line, notes task pids and the
        chief's step (the live figure; results.json has the final ones)."""
        self.log.write(line)
        started = _STARTED.search(line)
        if started:
            with self.lock:
                self.pids[started.group(1)] = int(started.group(2))
        figures = (progress_line.parse_progress_line(line)
                   if line.startswith(_CHIEF) else None)
        if figures:
            self.step = figures["step"]
            if self.step % 2000 == 0:
                logging.info("soak: step %d/%d", self.step,
                             figures["train_steps"])

    def sample(self, every: float) -> None:
        while self.launcher.poll() is None:
            with self.lock:
                pids = dict(self.pids)
            for name, pid in pids.items():
                value = rss_mb(pid)
                if value is not None:
                    self.samples.setdefault(name, []).append(
                        (self.step, value))
            time.sleep(every)


def check(samples: dict, results: dict, status: int, train_steps: int,
          warmup: int, max_growth: float) -> tuple[list, list]:
    """Returns (rows per task, failed checks)."""
    rows, failures = [], []
    if status != 0:
        failures.append(f"the launcher exited with status {status}")
    for name, series in sorted(samples.items()):
        after = [mb for step, mb in series if step >= warmup]
        if len(after) < 2:
            failures.append(f"{name}: too few memory samples after step "
                            f"{warmup}")
            continue
        reference, peak = after[0], max(after)
        growth = peak / reference - 1.0
        rows.append({"task": name, "rss_at_warmup_mb": reference,
                     "peak_after_mb": peak, "growth": growth,
                     "samples": len(series)})
        if growth > max_growth:
            failures.append(f"{name}: memory grew {100 * growth:.1f}% after "
                            f"step {warmup} (limit {100 * max_growth:.0f}%)")
    if results.get("global_step") != train_steps:
        failures.append(f"global step {results.get('global_step')} != "
                        f"{train_steps}")
    if results.get("dropped_gradients", 1) != 0:
        failures.append(f"{results.get('dropped_gradients')} gradients "
                        "dropped")
    averaged = results.get("averaged_steps", {})
    wrong = {k: v for k, v in averaged.items() if v != train_steps}
    if wrong or len(averaged) != results.get("num_workers"):
        failures.append(f"averaged step counts differ from {train_steps}: "
                        f"{averaged}")
    return rows, failures


def _run_launcher(command: list[str], log_path: pathlib.Path
                  ) -> tuple[int, Sampler]:
    """Runs the launcher to its end, sampling its tasks' memory; returns
    its exit status and the sampler. In our process group (a terminal's
    Ctrl-C reaches it, as it reaches us); stopped here on Ctrl-C or any
    error (processes.stop_all), the launcher then stopping its tasks."""
    launcher = processes.Child.start(
        "launcher", command, processes.child_env(), own_session=False,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(launcher, log_path)
    try:
        launcher.relay(sampler.read_line)
        sampler.sample(FLAGS.sample_secs)
        status = launcher.poll(block=True)
    finally:
        processes.stop_all([launcher], _STOP_GRACE_SECS)
        launcher.join_relay(timeout=30)
        sampler.log.close()
    return status, sampler


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    processes.interrupt_on_signals()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = pathlib.Path(FLAGS.out or f"soak/{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    train_steps = FLAGS.train_steps or 20000
    args = trainer_flags.forwarded_flags(
        exclude=("logdir", "train_steps", "model"))
    command = [sys.executable, "-m", "trainer.launch",
               f"--num_ps={FLAGS.num_ps}",
               f"--num_workers={FLAGS.num_workers}",
               f"--model={FLAGS.model if FLAGS['model'].present else 'mlp'}",
               f"--train_steps={train_steps}", f"--logdir={out / 'run'}",
               f"--min_workers={FLAGS.num_workers}",
               f"--isolate={str(FLAGS.isolate).lower()}", *args]
    logging.info("soak: %s", " ".join(command[1:]))
    start = time.monotonic()
    status, sampler = _run_launcher(command, out / "launch.log")
    results_path = out / "run" / "results.json"
    results = (json.loads(results_path.read_text())
               if results_path.exists() else {})
    rows, failures = check(sampler.samples, results, status, train_steps,
                           FLAGS.warmup_steps, FLAGS.max_growth)
    report = {"command": " ".join(command[1:]), "exit_status": status,
              "wall_secs": time.monotonic() - start, "tasks": rows,
              "averaged_steps": results.get("averaged_steps"),
              "dropped_gradients": results.get("dropped_gradients"),
              "global_step": results.get("global_step"),
              "failures": failures,
              "rss_mb_by_step": {name: series[::max(1, len(series) // 60)]
                                 for name, series in
                                 sampler.samples.items()}}
    (out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["| task | RSS at step %d (MB) | peak after (MB) | growth |"
             % FLAGS.warmup_steps, "|---|---|---|---|"]
    lines += [f"| {row['task']} | {row['rss_at_warmup_mb']:.0f} | "
              f"{row['peak_after_mb']:.0f} | {100 * row['growth']:+.1f}% |"
              for row in rows]
    lines.append(f"\nglobal step {results.get('global_step')}, averaged "
                 f"steps {results.get('averaged_steps')}, dropped gradients "
                 f"{results.get('dropped_gradients')}, exit status {status}, "
                 f"{report['wall_secs']:.0f} s")
    lines += [f"FAILED: {failure}" for failure in failures]
    lines.append("soak passed" if not failures else "soak failed")
    bench_report.emit("\n".join(lines))
    return 0 if not failures else 1


def run_main():
    trainer_flags.run_command(main)


if __name__ == "__main__":
    run_main()
