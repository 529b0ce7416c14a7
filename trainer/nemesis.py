"""The nemesis: training under random fault schedules, each judged over
its whole history against the 1-worker run: `python -m trainer.nemesis`.

Schedule i is drawn from seed --seed + i (trainer/bench/nemesis/
schedule.py), run on a fresh cluster of --workers workers and one ps, on
simulated hosts (root) or on loopback (signals only), and judged by
trainer/bench/nemesis/checker.py. Prints one row per schedule, writes
nemesis.json into --out, and for a failing schedule the one command that
replays it. Exit status 0 only if every schedule passed. docs/nemesis.md
says what it checks, the yardstick, and what it found.
"""

import datetime
import json
import pathlib
import shlex
import sys

from absl import app
from absl import flags
from absl import logging
import numpy as np

from trainer.bench.nemesis import checker
from trainer.bench.nemesis import run as run_lib
from trainer.bench.nemesis import runner
from trainer.bench import report
from trainer.bench.nemesis import schedule as schedule_lib
from trainer.common import processes
from trainer.common.config import check_ps_mirrors
from trainer.common.errors import UserError

flags.DEFINE_integer("schedules", 3, "How many schedules to run.",
                     lower_bound=1)
flags.DEFINE_integer("seed", 1, "Schedule i is drawn from seed + i.")
flags.DEFINE_integer("faults", 4, "Faults per schedule (with --covering: "
                     "one of each kind instead).", lower_bound=0)
flags.DEFINE_float("max_fault_secs", None, "Cap on each fault's "
                   "duration (default: each kind's own range).")
flags.DEFINE_string("schedule", None, "Run this schedule instead of "
                    "drawing one: kind:task:step:secs items, comma "
                    "separated, e.g. cut:worker1:100:30,kill:worker2:50:never.")
flags.DEFINE_boolean("covering", False, "One fault of every kind per "
                     "schedule.")
flags.DEFINE_integer("workers", 4, "Workers, the chief included.",
                     lower_bound=2)
flags.DEFINE_integer("ps", 1, "ps tasks.", lower_bound=1)
flags.DEFINE_boolean("chief_faults", False, "Draw faults on the chief "
                     "(worker 0) too: its work then moves to another "
                     "worker (all kinds but term, which stops the run).")
flags.DEFINE_boolean("ps_faults", False, "Draw one fault per schedule of "
                     "two or more on a ps task, never the chief's only "
                     "one (all kinds but term; a killed ps is "
                     "started again, and the chief restores the newest "
                     "checkpoint).")
flags.DEFINE_enum("model", "mlp", ["mlp", "cnn"], "Model to train.")
flags.DEFINE_integer("train_steps", 600, "Global steps of each run.",
                     lower_bound=20)
flags.DEFINE_enum("hosts", "simulated", ["simulated", "loopback"],
                  "simulated: a host per task (root; every fault kind); "
                  "loopback: signals only (kill, term, stop).")
flags.DEFINE_list("kinds", None, "Fault kinds to draw from (default: all "
                  "the hosts allow).")
flags.DEFINE_float("cpu", 0.3, "Each simulated host's CPU budget (cores; "
                   "0: no limit).")
flags.DEFINE_float("training_cpu", 0.1, "Each host's budget once the first "
                   "step is done (0: --cpu throughout): slower steps give "
                   "the faults time in a run short enough for the yardstick.")
flags.DEFINE_string("link_rate", "1gbit", "Each simulated host's link.")
flags.DEFINE_float("worker_timeout_secs", 10.0, "The runs' "
                   "--worker_timeout_secs.")
flags.DEFINE_float("yardstick", 1e-4, "With --nodeterministic: the largest "
                   "relative difference from the 1-worker run that passes.")
flags.DEFINE_boolean("deterministic", True, "Train with the trainer's "
                     "default fixed-point sums (the reference too) and judge "
                     "by equality: every variable bit for bit the 1-worker "
                     "run's. --nodeterministic sums floats and judges by "
                     "--yardstick.")
flags.DEFINE_list("train_flags", [], "More training flags for every task "
                  "and the reference (e.g. --optimizer=sgd).")
flags.DEFINE_string("data_dir", "../shared/mnist", "MNIST folder.")
flags.DEFINE_string("out", None, "Output folder (default nemesis/<time>).")
flags.DEFINE_float("run_secs", 900.0, "Bound on one schedule's run.")
FLAGS = flags.FLAGS


def train_flags() -> list[str]:
    return [f"--model={FLAGS.model}", f"--train_steps={FLAGS.train_steps}",
            "--seed=11", "--log_every=10", "--eval_every=100000",
            "--checkpoint_every=100000", "--intra_op_threads=1",
            "--inter_op_threads=1", "--startup_timeout_secs=120",
            f"--worker_timeout_secs={FLAGS.worker_timeout_secs:g}",
            f"--data_dir={FLAGS.data_dir}", "--nodownload",
            "--deterministic" if FLAGS.deterministic else "--nodeterministic",
            *FLAGS.train_flags]


def yardstick() -> float:
    """The largest relative difference that passes: 0 (equality), or
    --yardstick with --nodeterministic."""
    return 0.0 if FLAGS.deterministic else FLAGS.yardstick


def replay_command(seed: int) -> str:
    """The command that runs schedule `seed` alone."""
    names = ("schedule", "faults", "max_fault_secs", "covering",
             "workers", "ps", "chief_faults", "ps_faults", "model",
             "train_steps", "hosts", "kinds", "cpu",
             "training_cpu", "link_rate", "worker_timeout_secs",
             "yardstick", "deterministic", "train_flags", "data_dir")
    args = [f"--{n}={','.join(v) if isinstance(v, list) else v}"
            for n in names if (v := FLAGS[n].value) is not None]
    return shlex.join([sys.executable, "-m", "trainer.nemesis",
                       f"--seed={seed}", "--schedules=1", *args])


def judge(outcome: run_lib.Outcome, faults: list, reference: dict) -> dict:
    """The checker's verdict on one run: problems and figures."""
    # Progress lines are the chief's, in whichever worker's log.
    logs = [p.read_text(errors="replace")
            for p in sorted(outcome.folder.glob("worker*.log"))]
    param_problems, worst, where = checker.parameters(
        reference, outcome.logdir, yardstick())
    record_path = outcome.logdir / checker.RECORD_FILE
    record = np.load(record_path) if record_path.exists() else None
    mirrored = schedule_lib.ps_mirrored(FLAGS.train_flags)
    problems = (param_problems
                + checker.steps(outcome.logdir, logs, FLAGS.train_steps,
                                checker.ps_killed(outcome, mirrored))
                + checker.statuses(outcome.codes, faults,
                                   outcome.faults_in_effect,
                                   outcome.stopped_late,
                                   checker.deposed(outcome))
                + checker.rejoined(outcome, record,
                                   FLAGS.worker_timeout_secs))
    if outcome.hung:
        problems.insert(0, "hung: a task outlived its bound")
    return {"difference": worst, "variable": where, "problems": problems,
            "passed": not problems}


def out_when(outcome: run_lib.Outcome) -> str:
    """Who was out when: 'worker2 kill@120 start@190' per task."""
    by_task = {}
    for _, step, task, what in outcome.history:
        if what == "start" and task not in by_task:
            by_task[task] = []
            continue
        by_task.setdefault(task, []).append(f"{what.replace(' ', '-')}@{step}")
    return "; ".join(f"{t} {' '.join(e)}" for t, e in sorted(by_task.items())
                     if e)


def check_flags(kinds) -> None:
    """Raises UserError naming a bad --kinds, --schedule or --ps."""
    chosen = list(kinds)
    check_ps_mirrors(schedule_lib.ps_mirrored(FLAGS.train_flags), FLAGS.ps)
    if FLAGS.schedule:
        try:
            faults = schedule_lib.parse(
                FLAGS.schedule,
                schedule_lib.ps_mirrored(FLAGS.train_flags))
        except ValueError as e:
            raise UserError(f"--schedule: {e}") from None
        chosen = [f.kind for f in faults]
        for f in faults:
            job, flag = (("ps", "ps") if f.task.startswith("ps")
                         else ("worker", "workers"))
            if int(f.task[len(job):]) >= FLAGS[flag].value:
                raise UserError(f"--schedule names {f.task}, but "
                                f"--{flag}={FLAGS[flag].value}")
    unknown = [k for k in chosen if k not in schedule_lib.KINDS]
    if unknown:
        raise UserError(f"--kinds: {unknown[0]} is unknown; choose from "
                        f"{', '.join(schedule_lib.KINDS)}")
    needs_hosts = [k for k in chosen if k in schedule_lib.HOST_KINDS]
    if needs_hosts and FLAGS.hosts != "simulated":
        raise UserError(f"fault {needs_hosts[0]} needs --hosts=simulated "
                        "(root)")


def main(argv) -> int:
    del argv
    # SIGTERM, or Ctrl-C in a background job, still removes the hosts.
    processes.interrupt_on_signals()
    kinds = FLAGS.kinds or (schedule_lib.KINDS if FLAGS.hosts == "simulated"
                            else [k for k in schedule_lib.KINDS
                                  if k not in schedule_lib.HOST_KINDS])
    check_flags(kinds)
    out = pathlib.Path(FLAGS.out or "nemesis/" + datetime.datetime.now()
                       .strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    simulated = FLAGS.hosts == "simulated"
    setup = run_lib.Setup(
        FLAGS.workers, train_flags(), FLAGS.run_secs,
        FLAGS.worker_timeout_secs,
        cpu=FLAGS.cpu if simulated and FLAGS.cpu > 0 else None,
        link_rate=FLAGS.link_rate if simulated else None,
        training_cpu=(FLAGS.training_cpu if simulated
                      and FLAGS.training_cpu > 0 else None), ps=FLAGS.ps)
    rows_file = out / runner.ROWS_FILE
    try:
        rows = runner.run_all(setup, kinds, out, FLAGS, judge, out_when,
                              replay_command)
    except KeyboardInterrupt:
        # The hosts and tasks are gone already (context managers).
        rows = json.loads(rows_file.read_text()) if rows_file.exists() else []
        report.emit(runner.table(rows) + f"\ninterrupted after {len(rows)} "
                    f"of {FLAGS.schedules} schedules; wrote {rows_file}")
        return 130
    report.emit(runner.table(rows) + f"\nwrote {rows_file}")
    return 0 if all(r["passed"] for r in rows) else 1


def run_main():
    try:
        app.run(main)
    except UserError as e:
        logging.error("%s", e)
        sys.exit(2)


if __name__ == "__main__":
    run_main()
