"""Accuracy and speed versus worker count (`python -m trainer.benchmark`).

Runs, one after another and with the same model, seed, global batch and
steps: a ps cluster for each worker count in --workers, the single-process
baseline (each of --single_threads intra-op thread counts) and TensorFlow's
MultiWorkerMirroredStrategy with the same worker counts, for each of
--seeds, each --repeats times (the median run by images/s is reported,
with the mean, min and max of accuracy and images/s over the runs).
Reports final test accuracy, training time, images/s, efficiency E(N) =
images/s / best
single-process images/s, mean step time, time to --target_accuracy and
peak memory as a Markdown table on stdout, a CSV, a JSON (with the
provenance: trainer/observe/provenance.py), TensorBoard HParams data
(`tensorboard --logdir OUT`) and, with matplotlib, a chart as PNG, SVG
and PDF. --replot=OUT writes them again from OUT/results.json.

--hosts=local (the default) runs everything on this machine's loopback
(thread counts follow the local launcher). --hosts=simulated puts every ps
task and every worker on a simulated host of its own (trainer/bench/simhosts/hosts.py:
--host_cpu / --ps_cpu cores, --link_rate) and adds the speedup S(N), the
scaling efficiency S(N)/N and the ps-link bound (trainer/bench/simhosts/bound.py).
--hosts=slurm, run inside a Slurm allocation (salloc or sbatch), starts
each run as an srun job step over the allocation's nodes
(trainer/bench/slurm_steps.py; the peers' processes as one step each).

Every trainer flag (model, batch, optimizer, steps, ...) applies to every
run. Traced runs (--trace_steps) add the step breakdown's columns.
"""

import dataclasses
import datetime
import functools
import json
import math
import os
import pathlib
import time

from absl import app
from absl import flags
from absl import logging

from trainer import flags as trainer_flags
from trainer.bench import checks
from trainer.bench import replot
from trainer.bench import report
from trainer.bench import peers
from trainer.bench import rows as rows_lib
from trainer.bench import runs as runs_lib
from trainer.bench import slurm_steps
from trainer.bench.simhosts import runs as simulated
from trainer.common import processes
from trainer.common.errors import RunFailed, UserError
from trainer.observe import provenance

trainer_flags.define_isolate_flag()

flags.DEFINE_list("workers", ["1", "2", "4"],
                  "Worker counts to run the ps cluster (and MWMS) with.")
flags.DEFINE_list("baselines", ["single", "mwms"],
                  "Peers to run beside the ps trainer: single (one process, "
                  "no servers), " + ", ".join(
                      p.help for p in peers.all_peers().values())
                  + "; empty for none.")
flags.DEFINE_list("single_threads", ["1", "2"],
                  "Intra-op thread counts for the single-process baseline; "
                  "the best is the reference for efficiency.")
flags.DEFINE_integer("repeats", 1, "Runs of each configuration and seed "
                     "(the same seed each time: timing noise only); the "
                     "row is the median run by images/s.", lower_bound=1)
flags.DEFINE_list("seeds", [], "Seeds to run every configuration with "
                  "(--repeats times each; default: --seed alone). Rows "
                  "add the mean, min and max of accuracy and images/s "
                  "over all of a configuration's runs.")
flags.DEFINE_float("target_accuracy", 0.99,
                   "Report the training time until the test accuracy, "
                   "evaluated every --eval_every steps, first reaches this.")
flags.DEFINE_string("out", None,
                    "Output folder (default bench/<model>-<time>).")
flags.DEFINE_string("replot", None, "A benchmark's --out folder: write "
                    "its table, CSV, JSON, chart (PNG, SVG, PDF) and "
                    "dashboard again from its results.json, into --out "
                    "(default <folder>/replot-<time>), without running.")
flags.DEFINE_float("run_timeout_secs", 3600, "Give up on a run after this.")
flags.DEFINE_enum("hosts", "local", ["local", "simulated", "slurm"],
                  "local: every process on this machine's loopback; "
                  "simulated: each task on a simulated host (root only); "
                  "slurm: each run an srun job step in the Slurm allocation "
                  "this command runs in (salloc or sbatch).")
flags.DEFINE_integer("slurm_tasks_per_node", 1, "With --hosts=slurm: tasks "
                     "of a ps run on each node (1: every ps task and "
                     "worker on a node of its own).")
flags.DEFINE_list("host_cpu", ["0.3"], "With --hosts=simulated: cores of "
                  "each worker host and of the single-process host; or a "
                  "list, one value per worker host in worker order "
                  "(0.3,0.3,0.15,0.15), the first also for the "
                  "single-process host.")
flags.DEFINE_float("host_cpu_period_ms", 100.0, "With --hosts=simulated: "
                   "the CFS period over which every host's CPU budget is "
                   "enforced. A host of c cores runs c x period of CPU time "
                   "per period, then waits for the next: the kernel's "
                   "default 100 ms lets a 0.3-core host stall 70 ms; a "
                   "shorter period is closer to a slower CPU.")
flags.DEFINE_float("ps_cpu", None, "With --hosts=simulated: cores of each "
                   "ps host (default: --host_cpu).")
flags.DEFINE_string("link_rate", "1gbit", "With --hosts=simulated: each "
                    "host's link rate, tc syntax (100mbit, 1gbit).")
flags.DEFINE_enum("ps_placement", "separate", ["separate", "colocated"],
                  "With --hosts=simulated: separate gives each ps task a "
                  "host of its own; colocated puts ps task k on worker k's "
                  "host (--num_ps up to the smallest worker count).")
flags.DEFINE_bool("straggler", False, "With --hosts=simulated: once "
                  "training runs, cut the last worker's host to a tenth of "
                  "its CPU budget (runs of 2 or more workers).")

FLAGS = flags.FLAGS
_LABELS = {"ps": "ps cluster, {} worker(s)",
           "single": "single process, {} thread(s)",
           **{p.name: p.label for p in peers.all_peers().values()}}


def plan_runs(worker_counts: list[int]) -> list[tuple[str, int]]:
    plan = [("ps", n) for n in worker_counts]
    if "single" in FLAGS.baselines:
        plan += [("single", int(t)) for t in FLAGS.single_threads]
    for kind in peers.all_peers():
        if kind in FLAGS.baselines:
            plan += [(kind, n) for n in worker_counts]
    return plan


def _seeded(s: runs_lib.Settings, seed: int) -> runs_lib.Settings:
    """The settings with `seed` in the config and the forwarded flags."""
    return dataclasses.replace(
        s, config=dataclasses.replace(s.config, seed=seed),
        train_flags=[f for f in s.train_flags if not f.startswith("--seed=")]
        + [f"--seed={seed}"])


def _run_names(kind: str, count: int, seed_list: list[int]) -> list:
    """(seed, name) of each run of one configuration: <kind>_<N>w (or
    single_<T>t), then _s<seed> with several seeds, _r<k> with repeats."""
    base = f"single_{count}t" if kind == "single" else f"{kind}_{count}w"
    return [(seed, base + (f"_s{seed}" if len(seed_list) > 1 else "")
             + (f"_r{k + 1}" if FLAGS.repeats > 1 else ""))
            for seed in seed_list for k in range(FLAGS.repeats)]


def run_all(s: runs_lib.Settings, plan: list) -> list[list[runs_lib.Run]]:
    """Every configuration for every seed, --repeats times; returns runs
    by configuration."""
    seed_list = checks.seeds()
    total = len(plan) * len(seed_list) * FLAGS.repeats
    local = {"ps": runs_lib.run_ps, "single": runs_lib.run_single}
    on_hosts = {"ps": simulated.run_ps_on_hosts,
                "single": simulated.run_single_on_host}
    as_steps = {"ps": slurm_steps.run_ps_as_step,
                "single": slurm_steps.run_single_as_step}
    for kind in peers.all_peers():  # (s, count, name, label) -> Run
        local[kind] = functools.partial(runs_lib.run_peer, kind=kind)
        on_hosts[kind] = functools.partial(simulated.run_peer_on_hosts,
                                           kind=kind)
        as_steps[kind] = functools.partial(slurm_steps.run_peer_as_steps,
                                           kind=kind)
    grouped, done, start = [], 0, time.monotonic()
    for kind, count in plan:
        group = []
        for seed, name in _run_names(kind, count, seed_list):
            done += 1
            label = f"[{done}/{total}] " + _LABELS[kind].format(count)
            logging.info("%s: starting", label)
            try:
                runner = (as_steps if s.steps else
                          on_hosts if s.sim else local)[kind]
                run = runner(_seeded(s, seed), count, name, label)
            except RunFailed as e:
                if not peers.is_peer(kind):
                    raise
                # A peer that fails gets an error in its row; the rest of
                # the benchmark goes on.
                logging.error("%s", e)
                run = runs_lib.Run(name, kind, count, {}, {}, error=str(e))
            group.append(run)
            elapsed = time.monotonic() - start
            logging.info("%s: done; benchmark ETA %s", label,
                         datetime.timedelta(seconds=round(
                             elapsed / done * (total - done))))
        grouped.append(group)
    return grouped


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    processes.interrupt_on_signals()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    if FLAGS.replot:
        return replot.main(pathlib.Path(FLAGS.replot), FLAGS.out and
                           pathlib.Path(FLAGS.out), stamp)
    out = pathlib.Path(FLAGS.out or f"bench/{FLAGS.model}-{stamp}")
    try:
        worker_counts, hosts = checks.check_settings(out)
    except UserError as e:
        logging.error("%s", e)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    train_flags = trainer_flags.forwarded_flags(
        exclude=("logdir", "checkpoint_every", "intra_op_threads",
                 "min_workers"))
    train_flags.append(f"--checkpoint_every={runs_lib.NO_CHECKPOINTS}")
    sim = hosts if isinstance(hosts, simulated.HostSettings) else None
    if sim is not None:  # every run's provenance records them
        os.environ[provenance.SIMULATED_HOSTS_ENV] = json.dumps(
            dataclasses.asdict(sim))
    steps = hosts if isinstance(hosts, slurm_steps.StepSettings) else None
    if sim is None and steps is None:
        try:  # every local run, the peers' too, in one private network
            train_flags += _isolate_local_runs()
        except UserError as e:
            logging.error("%s", e)
            return 2
    if steps is not None:
        logging.info("%s", slurm_steps.describe(steps))
        if FLAGS["intra_op_threads"].present:  # else the trainer's default
            train_flags.append(f"--intra_op_threads={FLAGS.intra_op_threads}")
    s = runs_lib.Settings(out, trainer_flags.config_from_flags(),
                          train_flags, FLAGS.num_ps, FLAGS.run_timeout_secs,
                          sim, steps)
    plan = plan_runs(worker_counts)
    logging.info("benchmark of %d runs x %d seed(s) x %d into %s: %s",
                 len(plan), len(checks.seeds()), FLAGS.repeats, out,
                 ", ".join(f"{k} {n}" for k, n in plan))
    try:
        grouped = run_all(s, plan)
    except RunFailed as e:
        logging.error("%s", e)
        return 1
    rows, reference = rows_lib.make_rows(s, grouped, FLAGS.target_accuracy)
    spec = rows_lib.dashboard_spec(s, plan, grouped, rows)
    rows_lib.write_dashboard(out, spec)
    origin = provenance.benchmark(
        [r.results for g in grouped for r in g], steps and steps.nodes)
    report.emit(report.write_outputs(out, rows, FLAGS.target_accuracy,
                                     {"provenance": origin,
                                      "dashboard": spec}))
    report.emit(replot.describe(origin))
    report.emit(_footer(rows, reference, out))
    return 0 if all(math.isfinite(r.get("images_per_sec", math.nan))
                    for r in rows) else 1


def _isolate_local_runs() -> list[str]:
    """--hosts=local: moves this process into a private network namespace
    (trainer/cluster/local.py), so that every run's servers are out of
    reach; returns the flags for the launcher of each ps run. If this
    process cannot move (without root, a process with threads cannot
    enter a user namespace), each launcher still isolates its own run."""
    from trainer.cluster import local
    local.isolate_network(FLAGS.isolate, "localhost",
                          trainer_flags.fetch_data)
    return [] if FLAGS.isolate else ["--noisolate"]


def _footer(rows: list, reference: float, out: pathlib.Path) -> str:
    singles = {"_".join(r["run"].split("_")[:2]): r["images_per_sec"]
               for r in rows if r["kind"] == "single"}
    lines = [f"\nE = images/s / {reference:,.0f} (best single process"
             f"{'' if singles else ' not run: first run'})"]
    if "single_1t" in singles and len(singles) > 1:
        bound = 2 * singles["single_1t"] / max(singles.values())
        lines.append(f"bound on E(2) on this machine: 2 x single_1t / best "
                     f"single = {bound:.2f}")
    runs = len(checks.seeds()) * FLAGS.repeats
    if runs > 1:
        lines.append(f"each row: the median of {runs} runs by images/s "
                     f"({len(checks.seeds())} seed(s) x {FLAGS.repeats}); mean, min "
                     "and max over them in the _mean/_min/_max columns")
    if FLAGS.deterministic:
        lines.append(rows_lib.deterministic_note(rows))
    lines.append(f"outputs in {out}; tensorboard --logdir {out}")
    return "\n".join(lines)


def run_main():
    trainer_flags.run_command(main)


if __name__ == "__main__":
    run_main()
