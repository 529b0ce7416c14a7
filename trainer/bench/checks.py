"""The benchmark's flags checked before any run (`python -m
trainer.benchmark`, whose module defines them): what would fail or
mislead halfway is refused first, in one line (UserError)."""

import os
import pathlib

from absl import flags

from trainer import flags as trainer_flags
from trainer.bench import peers
from trainer.bench import slurm_steps
from trainer.bench.simhosts import hosts as hosts_lib
from trainer.bench.simhosts import limits
from trainer.bench.simhosts import runs as simulated
from trainer.common.config import validate
from trainer.common.errors import UserError

FLAGS = flags.FLAGS


def check_settings(out: pathlib.Path) -> tuple[list[int], object]:
    """Refuses, before any run, what would fail or mislead halfway.

    Returns the worker counts and the simulated-host settings (or None).
    A used --out is refused: its runs' logdirs hold final checkpoints, so
    the ps runs would resume them and train nothing.
    """
    try:
        worker_counts = [int(w) for w in FLAGS.workers]
    except ValueError:
        raise UserError(f"--workers={','.join(FLAGS.workers)} must be a "
                        "comma-separated list of worker counts") from None
    if not worker_counts or min(worker_counts) < 1:
        raise UserError("--workers needs worker counts of 1 or more")
    seeds()
    known = ["single", *peers.all_peers()]
    unknown = set(FLAGS.baselines) - set(known)
    if unknown:
        raise UserError(f"--baselines: unknown {', '.join(sorted(unknown))};"
                        f" use any of {', '.join(known)}")
    validate(trainer_flags.config_from_flags(), max(worker_counts),
             FLAGS.num_ps)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out={out} already holds a benchmark; give a "
                        "new folder (or leave --out out for a fresh one)")
    if FLAGS.hosts != "simulated":
        if FLAGS.ps_placement != "separate" or FLAGS.straggler:
            raise UserError("--ps_placement and --straggler need "
                            "--hosts=simulated")
    if FLAGS.hosts == "slurm":
        return worker_counts, _check_slurm(worker_counts)
    if FLAGS.hosts == "local":
        return worker_counts, None
    if (FLAGS.ps_placement == "colocated"
            and FLAGS.num_ps > min(worker_counts)):
        raise UserError(f"--ps_placement=colocated puts ps task k beside "
                        f"worker k: --num_ps={FLAGS.num_ps} needs at least "
                        f"that many workers in every run of --workers")
    hosts_lib.parse_rate(FLAGS.link_rate)
    limits.check_period_ms(FLAGS.host_cpu_period_ms)
    cpus = _host_cpus(max(worker_counts))
    hosts_lib.check_available()
    return worker_counts, simulated.HostSettings(
        cpus[0], FLAGS.ps_cpu or cpus[0], FLAGS.link_rate,
        FLAGS.ps_placement, FLAGS.straggler,
        tuple(cpus) if len(cpus) > 1 else (), FLAGS.host_cpu_period_ms)


def _host_cpus(most_workers: int) -> list[float]:
    """--host_cpu as numbers: one for every host, or one per worker host
    (at least as many as the largest run has workers)."""
    try:
        cpus = [float(v) for v in FLAGS.host_cpu]
    except ValueError:
        cpus = []
    if not cpus or min(cpus) <= 0:
        raise UserError(f"--host_cpu={','.join(FLAGS.host_cpu)} must be "
                        "cores (0.3), or one value per worker host "
                        "(0.3,0.3,0.15,0.15)")
    if 1 < len(cpus) < most_workers:
        raise UserError(f"--host_cpu has {len(cpus)} values for runs of up "
                        f"to {most_workers} workers; give one value, or one "
                        "per worker host")
    return cpus


def _check_slurm(worker_counts: list[int]) -> slurm_steps.StepSettings:
    """--hosts=slurm: the allocation, checked to hold the largest run
    (a peer's tasks included). Without --baselines, only the single
    baseline runs beside the ps cluster."""
    if not FLAGS["baselines"].present:
        FLAGS.baselines = ["single"]
    most = max(worker_counts)
    largest = FLAGS.num_ps + most
    for kind in set(FLAGS.baselines) & set(peers.all_peers()):
        largest = max(largest, len(peers.get(kind).roles(most,
                                                         FLAGS.num_ps)))
    return slurm_steps.allocation(os.environ, largest,
                                  FLAGS.slurm_tasks_per_node,
                                  FLAGS.slurm_base_port)


def seeds() -> list[int]:
    """--seeds as integers (--seed if none); UserError if not."""
    try:
        values = [int(v) for v in FLAGS.seeds] or [FLAGS.seed]
    except ValueError:
        raise UserError(f"--seeds={','.join(FLAGS.seeds)} must be a "
                        "comma-separated list of integers") from None
    if len(set(values)) < len(values):
        raise UserError(f"--seeds={','.join(FLAGS.seeds)} repeats a seed; "
                        "use --repeats to rerun one seed")
    return values
