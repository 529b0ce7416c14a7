"""Every trainer flag, and their conversion to the run's settings.

The entry points (main, launch, benchmark, soak) import this module; none
imports another entry point. Flags only describe the run: the library
(trainer.roles.run and below) takes a TrainConfig and a Task and never reads
FLAGS.

Every command parses its flags through `run_command`: a bad flag or a stray
argument is one line on stderr and exit status 2, as is every other input
error (absl's own parser prints its usage hint and exits 1).
"""

import dataclasses
import os
import sys
from typing import Callable

from absl import app
from absl import flags
from absl import logging

from trainer.cluster import spec as cluster_lib
from trainer.cluster import kubernetes
from trainer.cluster import slurm
from trainer.common.config import (LR_SCHEDULES, MODELS, OPTIMIZERS,
                                   WIRE_DTYPES, TrainConfig)

# Flags the launcher sets for each task itself.
_PER_TASK_FLAGS = ("job_name", "task_index", "ps_hosts", "worker_hosts",
                   "cluster", "slurm_base_port", "kubernetes_workers",
                   "kubernetes_port", "kubernetes_hold_after_end")
_LOCAL_CLUSTER_FLAGS = ("num_workers", "isolate")


def _default(name: str):
    """The default of the setting `name`, declared once on TrainConfig's
    field; the trainer flag of that name takes it."""
    return TrainConfig.__dataclass_fields__[name].default


# --- Cluster (or set TF_CONFIG; these flags win over it) ---
flags.DEFINE_enum("job_name", None, ["ps", "worker"],
                  "This task's job. Worker 0 is the chief.")
flags.DEFINE_integer("task_index", None, "This task's index in its job.")
flags.DEFINE_string("ps_hosts", None,
                    "Comma-separated host:port of the ps tasks.")
flags.DEFINE_string("worker_hosts", None,
                    "Comma-separated host:port of the workers, chief first.")
flags.DEFINE_enum("cluster", "flags", ["flags", "slurm", "kubernetes"],
                  "Where the cluster and this task's role come from. flags: "
                  "the cluster flags above, else TF_CONFIG; slurm: the srun "
                  "job step (SLURM_PROCID, the step's node list); "
                  "kubernetes: the pod's StatefulSet name and ordinal "
                  "(deploy/kubernetes.yaml).")
flags.DEFINE_integer("num_ps", 1, "Number of ps tasks: of a local cluster "
                     "the launcher starts, with --cluster=slurm the first "
                     "tasks of the job step, with --cluster=kubernetes the "
                     "ps StatefulSet's replicas.", lower_bound=1)
flags.DEFINE_integer("slurm_base_port", slurm.DEFAULT_BASE_PORT,
                     "With --cluster=slurm: the port of each node's first "
                     "task; further tasks on a node use the next ports.",
                     lower_bound=1, upper_bound=65535)
flags.DEFINE_integer("kubernetes_workers", None,
                     "With --cluster=kubernetes: the replicas of the worker "
                     "StatefulSet (--num_ps: those of the ps one).",
                     lower_bound=1)
flags.DEFINE_integer("kubernetes_port", kubernetes.DEFAULT_PORT,
                     "With --cluster=kubernetes: the port of every task.",
                     lower_bound=1, upper_bound=65535)
flags.DEFINE_boolean("kubernetes_hold_after_end", True,
                     "With --cluster=kubernetes: after a clean end, stay up "
                     "until the pod is deleted, so that the StatefulSet "
                     "does not start the task again.")

# --- Model and optimisation ---
flags.DEFINE_enum("model", _default("model"), list(MODELS), "Model to train.")
flags.DEFINE_integer("hidden_units", _default("hidden_units"),
                     "Width of the mlp's hidden layer.")
flags.DEFINE_integer("batch_size", _default("batch_size"),
                     "Global batch: images per step over all workers.")
flags.DEFINE_enum("optimizer", _default("optimizer"),
                  list(OPTIMIZERS), "Update rule.")
flags.DEFINE_float("learning_rate", _default("learning_rate"),
                   "Initial learning rate.")
flags.DEFINE_enum("lr_schedule", _default("lr_schedule"), list(LR_SCHEDULES),
                  "cosine: decay to 0 over the run; constant: no decay.")
flags.DEFINE_float("momentum", _default("momentum"),
                   "Momentum of --optimizer=momentum.")
flags.DEFINE_integer("train_steps", _default("train_steps"),
                     "Global steps to train (default: --epochs).")
flags.DEFINE_float("epochs", _default("epochs"),
                   "Epochs to train if --train_steps is not given "
                   "(default 12).")
flags.DEFINE_enum("wire_dtype", _default("wire_dtype"), list(WIRE_DTYPES),
                  "Type of parameters and gradients on the links between "
                  "workers and ps tasks; the ps keeps, sums and applies in "
                  "float32. bfloat16 halves the bytes (float16 may overflow "
                  "on gradient sums); both need --nodeterministic.")
flags.DEFINE_integer("micro_batch", _default("micro_batch"),
                     "Compute the global batch in micro-batches of N rows, "
                     "each with the same ops and shapes whoever computes it; "
                     "slices are whole micro-batches. An example's gradient "
                     "then has the same bits whatever slice holds it "
                     "(docs/how-it-works.md#micro-batches). 0: each slice "
                     "in one piece, or with --deterministic the largest "
                     "divisor of --batch_size up to 8 and --batch_size/16.")
flags.DEFINE_bool("deterministic", _default("deterministic"),
                  "Sum gradients as int32 fixed-point integers over "
                  "micro-batches (--micro_batch): the parameters then "
                  "have the same bits for any number of workers, any "
                  "slicing and any fault (docs/how-it-works.md#"
                  "bit-identical-training). --nodeterministic sums "
                  "float32 (needed for a 16-bit --wire_dtype).")
flags.DEFINE_boolean("ps_mirrors", _default("ps_mirrors"),
                     "With 2 or more ps tasks, keep a copy of each ps's "
                     "shards and optimizer state on the next ps, updated by "
                     "every step: a ps started again is refilled from the "
                     "copies, and no step is trained again "
                     "(docs/how-it-works.md#a-lost-ps-and-its-mirrors).")
flags.DEFINE_boolean("ordered_pulls", _default("ordered_pulls"),
                     "Workers read the parameters one at a time, in worker "
                     "order, so the first computes and pushes while the "
                     "others still pull: for a step bound by a ps link's "
                     "bandwidth (docs/how-it-works.md#ordered-pulls). Not "
                     "with --backup_workers.")
flags.DEFINE_integer("chunk_kb", _default("chunk_kb"),
                     "Retired: it chose the pipelined protocol, and any "
                     "value but 0 is now refused; every step pulls whole "
                     "shards, then pushes them (docs/how-it-works.md"
                     "#pipelined-chunks).")
flags.DEFINE_integer("seed", _default("seed"),
                     "Seed of initialisation, shuffling, dropout.")
flags.DEFINE_integer("backup_workers", _default("backup_workers"),
                     "Workers beyond the ones averaged per step; each step "
                     "uses the first N - b gradients and drops late ones.")
flags.DEFINE_integer("min_workers", _default("min_workers"),
                     "The chief trains once this many workers (itself "
                     "included) are in, and stops the run, after a "
                     "checkpoint, when fewer are left. Others join and "
                     "leave at step boundaries.")
flags.DEFINE_string("slices", _default("slices"),
                    "How the chief cuts each global batch among the "
                    "workers that are in: balanced (by each worker's "
                    "measured examples per second) or equal.")

# --- Data ---
flags.DEFINE_string("data_dir", _default("data_dir"),
                    "Folder with the four MNIST .gz files (default: "
                    "$MNIST_DATA_DIR, else the project's data/ folder).")
flags.DEFINE_boolean("download", _default("download"),
                     "Download missing MNIST files from a public source.")
flags.DEFINE_string("data_url", _default("data_url"),
                    "Base URL of a source with the four MNIST .gz files "
                    "(default: public copies of the original files).")

# --- Logs, evaluation, checkpoints ---
flags.DEFINE_string("logdir", None,
                    "Checkpoints, TensorBoard logs and results.json "
                    "(default: runs/<model>). The chief resumes from the "
                    "latest checkpoint here.")
flags.DEFINE_integer("log_every", _default("log_every"),
                     "Log and summarize every N steps.")
flags.DEFINE_integer("eval_every", _default("eval_every"),
                     "Evaluate on the test set every N steps.")
flags.DEFINE_integer("checkpoint_every", _default("checkpoint_every"),
                     "Checkpoint every N steps.")
flags.DEFINE_integer("keep_checkpoints", _default("keep_checkpoints"),
                     "Checkpoints (and exports) to keep.")
flags.DEFINE_boolean("continue_with_new_settings",
                     _default("continue_with_new_settings"),
                     "Go on from the checkpoints in --logdir although they "
                     "were trained for another number of steps (--train_steps"
                     " or --epochs). Other changed settings (model, "
                     "optimizer, learning rate, batch, seed, ...) need a new "
                     "--logdir.")

# --- Runtime ---
flags.DEFINE_integer("intra_op_threads", _default("intra_op_threads"),
                     "Threads per op in this process (0: one per core). "
                     "The local launcher gives each worker its share of "
                     "the cores.")
flags.DEFINE_integer("inter_op_threads", _default("inter_op_threads"),
                     "Ops run at once in this process (0: one per core).")
flags.DEFINE_float("startup_timeout_secs", _default("startup_timeout_secs"),
                   "How long to wait for the ps tasks and the chief, at "
                   "start and after losing a ps; a chief that has not "
                   "stepped since its claim may be silent this long "
                   "before a worker takes over its work.")
flags.DEFINE_float("worker_timeout_secs", _default("worker_timeout_secs"),
                   "The silence after which a task counts as lost. It "
                   "bounds: the chief's wait for a member's gradient "
                   "before it hands that worker's examples to the others; "
                   "the chief's beat, before the next worker in line takes "
                   "over its work (each further one waits this long "
                   "again); a claim's wait for the chief's lock (half of "
                   "it); how long "
                   "the chief waits for ps 0, and a worker's wait before "
                   "it joins again once ps 0 answers; and gRPC's give-up "
                   "on a peer that does not acknowledge (keepalive).")
flags.DEFINE_string("trace_steps", _default("trace_steps"),
                    "FIRST:END: record global steps [FIRST, END) with "
                    "TensorFlow's full trace on every worker; writes a "
                    "Chrome trace per worker and a per-step time breakdown "
                    "into --logdir (and results.json).")
flags.DEFINE_boolean("firewall", False,
                     "Before the server starts, install an nftables table "
                     "(root) so that this task's port accepts TCP only from "
                     "loopback and the cluster's hosts; a guard process "
                     "removes it once this task has exited, however it ends "
                     "(docs/deploying.md#security).")
flags.DEFINE_boolean("debug", False, "Show tracebacks of errors.")

FLAGS = flags.FLAGS
INPUT_ERROR_STATUS = 2


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with its errors as one line and status 2.

    Returns argv without the flags (the program name); anything else left
    on the command line is an error too, since every setting is a flag.
    """
    try:
        rest = FLAGS(argv)
    except flags.Error as e:
        _input_error(f"Flags parsing error: {' '.join(str(e).split())}; "
                     "see --helpshort for the flags and their values")
    if len(rest) > 1:
        _input_error(f"unexpected arguments: {' '.join(rest[1:])}; give "
                     "every setting as --flag=value (see --helpshort)")
    return rest


def _input_error(message: str) -> None:
    """Ends the process before main: one line on stderr, status 2. The
    line starts with FATAL, as absl's own flag errors do."""
    sys.stderr.write(f"FATAL {message}\n")
    sys.stderr.flush()
    sys.exit(INPUT_ERROR_STATUS)


def run_command(main: Callable[[list[str]], int]) -> None:
    """Runs a command's main(argv) -> exit status under absl, its flags
    parsed by parse_flags. A Ctrl-C that main lets through (having
    stopped what it started on the way out) is one line and status 130."""

    def run(argv):
        try:
            status = main(argv)
        except KeyboardInterrupt:
            logging.error("interrupted; everything this command started "
                          "was stopped")
            status = 130
        sys.exit(status)

    app.run(run, flags_parser=parse_flags)


def trainer_flag_names() -> list[str]:
    """The trainer's flags (the local launcher passes them on to each
    task)."""
    return [f.name for f in FLAGS.get_flags_for_module(__name__)
            if f.name not in _LOCAL_CLUSTER_FLAGS]


def forwarded_flags(exclude: tuple[str, ...] = ()) -> list[str]:
    """The trainer flags given on this command line, as --name=value, to
    pass on to the tasks a launcher starts; not the per-task ones, the
    cluster shape, nor `exclude`."""
    skip = set(_PER_TASK_FLAGS) | {"num_ps"} | set(exclude)
    return [FLAGS[name].serialize() for name in trainer_flag_names()
            if name not in skip and FLAGS[name].present]


def define_local_cluster_flags(num_workers: int = 2) -> None:
    """Flags of the commands that start a cluster on this machine
    (launch, soak): --num_workers."""
    flags.DEFINE_integer("num_workers", num_workers, "Number of workers "
                         "(the first is the chief).", lower_bound=1)


def define_isolate_flag() -> None:
    """--isolate, of the commands that run clusters on this machine
    (launch, soak, benchmark with --hosts=local)."""
    flags.DEFINE_boolean(
        "isolate", True, "Run the cluster in a private network namespace "
        "with only loopback (unshare --net; --user --net without root), so "
        "that nothing else can reach its ports; the MNIST download happens "
        "before. Where the machine allows neither, one line says so and "
        "the run goes on without.")


def fetch_data() -> None:
    """Downloads the MNIST files missing from --data_dir, before a command
    leaves the network; raises UserError. With --nodownload it does
    nothing: the tasks check the files themselves, as they always do."""
    if not FLAGS.download:
        return
    from trainer.learning import data as data_lib
    data_lib.fetch_missing(data_lib.resolve_data_dir(FLAGS.data_dir),
                           FLAGS.download,
                           data_lib.source_list(FLAGS.data_url))


def config_from_flags() -> TrainConfig:
    """The run's settings: each TrainConfig field from the trainer flag of
    its name (tests/test_flags_doc.py checks that every field has one)."""
    values = {field.name: FLAGS[field.name].value
              for field in dataclasses.fields(TrainConfig)}
    values["logdir"] = FLAGS.logdir or os.path.join("runs", FLAGS.model)
    return TrainConfig(**values)


def task_from_flags() -> cluster_lib.Task:
    """This task and its cluster, from Slurm, the flags or TF_CONFIG."""
    if FLAGS.cluster == "slurm":
        task = slurm.task_from_slurm(os.environ, FLAGS.num_ps,
                                     FLAGS.slurm_base_port)
    elif FLAGS.cluster == "kubernetes":
        task = kubernetes.task_from_pod(os.environ, FLAGS.num_ps,
                                        FLAGS.kubernetes_workers,
                                        FLAGS.kubernetes_port)
    else:
        task = cluster_lib.resolve(
            FLAGS.job_name, FLAGS.task_index, FLAGS.ps_hosts,
            FLAGS.worker_hosts, os.environ.get("TF_CONFIG"))
    logging.info(
        "cluster from %s: %d ps, %d worker(s); this task is %s", task.source,
        task.cluster.num_ps, task.cluster.num_workers, task.describe())
    return task
