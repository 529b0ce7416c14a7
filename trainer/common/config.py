"""The run's settings, checked in one place before anything starts."""

import dataclasses
import math

from trainer.common.errors import UserError

MODELS = ("softmax", "mlp", "cnn")        # builders in trainer/learning/model.py
OPTIMIZERS = ("sgd", "momentum", "adam")  # rules in trainer/learning/optim.py
LR_SCHEDULES = ("cosine", "constant")     # schedules in trainer/learning/optim.py
WIRE_DTYPES = ("float32", "bfloat16", "float16")  # trainer/sync/wire.py
SLICES = ("balanced", "equal")            # trainer/sync/slices.py
DEFAULT_EPOCHS = 12
# Fixed-point sums (--deterministic, the default: trainer/learning/
# fixed_point.py) compute the batch in micro-batches. Unless --micro_batch
# gives one, it is the largest divisor of --batch_size up to
# DETERMINISTIC_MICRO_BATCH that still cuts the batch into at least
# MIN_MICRO_BATCHES (a function of the batch alone, never of the workers).
DETERMINISTIC_MICRO_BATCH = 8
MIN_MICRO_BATCHES = 16

# The settings that must match, declared once, on TrainConfig's fields:
# WORKERS: every worker must have the chief's (the handshake compares them,
#   trainer/roles/graph.py; the README lists them as flags);
# CHECKPOINT: a logdir's checkpoints were trained with them (a rerun that
#   differs is refused, trainer/saving/settings.py, which records them by
#   field name in settings.json).
# train_steps stands for its resolved count, what --epochs comes to.
WORKERS = "workers"
CHECKPOINT = "checkpoint"


def _shared(default, *kinds: str):
    """A field whose value must match in each of `kinds`."""
    return dataclasses.field(default=default, metadata={"shared": kinds})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything one task needs besides the cluster description."""

    logdir: str
    model: str = _shared("cnn", WORKERS, CHECKPOINT)
    hidden_units: int = _shared(128, WORKERS, CHECKPOINT)
    # global: summed over the workers
    batch_size: int = _shared(128, WORKERS, CHECKPOINT)
    optimizer: str = _shared("adam", CHECKPOINT)
    learning_rate: float = _shared(3e-3, CHECKPOINT)
    # cosine: decays to 0 at the last step
    lr_schedule: str = _shared("cosine", CHECKPOINT)
    momentum: float = _shared(0.9, CHECKPOINT)
    # global steps; or derived from epochs
    train_steps: int | None = _shared(None, WORKERS, CHECKPOINT)
    epochs: float | None = None
    seed: int = _shared(0, WORKERS, CHECKPOINT)
    data_dir: str | None = None        # None: $MNIST_DATA_DIR or data/
    download: bool = True
    data_url: str | None = None        # None: the public mirrors
    log_every: int = 100
    eval_every: int = 500
    checkpoint_every: int = 500
    keep_checkpoints: int = 5
    backup_workers: int = _shared(0, WORKERS)
    min_workers: int = 1               # fewer in the roster: the run stops
    slices: str = "balanced"           # how the chief cuts the global batch
    intra_op_threads: int = 0          # 0: TensorFlow's default, all cores
    inter_op_threads: int = 0
    startup_timeout_secs: float = 120.0
    worker_timeout_secs: float = 120.0
    trace_steps: str | None = None     # "A:B": trace global steps [A, B)
    # parameters and gradients on links
    wire_dtype: str = _shared("float32", WORKERS, CHECKPOINT)
    # workers read parameters in turn
    ordered_pulls: bool = _shared(False, WORKERS)
    # rows computed together, slices in whole ones (0: each slice at once)
    micro_batch: int = _shared(0, WORKERS, CHECKPOINT)
    # gradient sums in fixed point: the same bits for any worker count
    deterministic: bool = _shared(True, WORKERS, CHECKPOINT)
    # a copy of each ps's shards on the next ps (2 or more ps tasks)
    ps_mirrors: bool = _shared(False, WORKERS)
    chunk_kb: int = 0                  # retired: anything but 0 is refused
    continue_with_new_settings: bool = False  # more steps on a logdir

    def micro_batch_rows(self) -> int:
        """The micro-batch in use: --micro_batch; else, with
        --deterministic, the largest divisor of --batch_size at most
        DETERMINISTIC_MICRO_BATCH and --batch_size / MIN_MICRO_BATCHES
        (at least 1); else 0 (none)."""
        if self.micro_batch or not self.deterministic:
            return self.micro_batch
        most = max(1, min(DETERMINISTIC_MICRO_BATCH,
                          self.batch_size // MIN_MICRO_BATCHES))
        return max(d for d in range(1, most + 1) if self.batch_size % d == 0)

    def op_threads(self) -> tuple[int, int]:
        """(intra-op, inter-op) threads of a task's session; 0: all cores.

        With --deterministic every op runs on one thread: a multi-threaded
        kernel may split a long sum (the cnn's filter gradient over a
        micro-batch) by the thread count, and so give a micro-batch other
        bits on a machine with other cores. The threads go to running
        micro-batches side by side instead (inter-op)."""
        intra, inter = self.intra_op_threads, self.inter_op_threads
        if not self.deterministic:
            return intra, inter
        return 1, (0 if 0 in (intra, inter) else max(intra, inter))

    def replicas_to_aggregate(self, num_workers: int) -> int:
        return num_workers - self.backup_workers

    def trace_range(self) -> tuple[int, int] | None:
        """--trace_steps=A:B as (A, B), or None; see validate()."""
        if not self.trace_steps:
            return None
        first, end = (int(v) for v in self.trace_steps.split(":"))
        return first, end

    def resolved_train_steps(self, num_examples: int) -> int:
        """--train_steps, or --epochs (default 12) of full global batches.
        Raises UserError if --batch_size is more than the `num_examples`
        training examples (known once the data is read)."""
        if self.batch_size > num_examples:
            raise UserError(f"--batch_size={self.batch_size} is larger than "
                            f"the {num_examples} training examples")
        if self.train_steps is not None:
            return self.train_steps
        epochs = DEFAULT_EPOCHS if self.epochs is None else self.epochs
        return max(1, math.ceil(epochs * (num_examples // self.batch_size)))


def shared_names(kind: str) -> tuple[str, ...]:
    """The fields declared `kind` (WORKERS or CHECKPOINT), in field order."""
    return tuple(f.name for f in dataclasses.fields(TrainConfig)
                 if kind in f.metadata.get("shared", ()))


def shared_settings(config: TrainConfig, kind: str,
                    train_steps: int) -> dict:
    """name -> value of the settings declared `kind`, in field order, with
    train_steps the resolved count of global steps."""
    settings = {name: getattr(config, name) for name in shared_names(kind)}
    if "train_steps" in settings:
        settings["train_steps"] = train_steps
    return settings


# --chunk_kb chose the pipelined protocol, retired by measurement
# (docs/how-it-works.md#pipelined-chunks); the flag stays so that old
# scripts get this line instead of absl's unknown-flag error.
CHUNK_KB_RETIRED = (
    "--chunk_kb was retired: the pipelined protocol lost on the cnn and "
    "kept the mlp's gain only at 100 Mbit/s; drop the flag (whole shards "
    "are the one protocol), and use --wire_dtype=bfloat16 to halve the "
    "bytes on slow links")


def _positive(name: str, value, kind=int):
    if value is None:
        return
    if not isinstance(value, (int, float)) or value <= 0 or (
            kind is int and int(value) != value):
        noun = "a positive integer" if kind is int else "a positive number"
        raise UserError(f"--{name}={value} must be {noun}")


def _check_trace_steps(text: str | None) -> None:
    if not text:
        return
    parts = text.split(":")
    if (len(parts) != 2 or not all(p.strip().isdigit() for p in parts)
            or int(parts[0]) >= int(parts[1])):
        raise UserError(f"--trace_steps={text} must be FIRST:END, global "
                        "steps with FIRST < END, e.g. 200:205")


def _check_micro_batch(config: TrainConfig, num_workers: int) -> None:
    _positive("micro_batch", config.micro_batch or None)
    m = config.micro_batch_rows()
    if m == 0:
        return
    if config.batch_size % m:
        raise UserError(f"--micro_batch={m} does not divide --batch_size="
                        f"{config.batch_size}; pick a divisor of it, or drop "
                        "--micro_batch for the default")
    if config.deterministic and config.wire_dtype != "float32":
        raise UserError(
            f"--wire_dtype={config.wire_dtype} rounds the gradients on the "
            "wire, which the exact sums (--deterministic, the default) "
            "cannot: add --nodeterministic to sum floats, or drop "
            "--wire_dtype")
    # Fewer micro-batches than workers still train: the workers beyond
    # them sit each round out (slices.at_most); but the rounds must not
    # end on backup workers alone.
    if config.batch_size // m <= config.backup_workers:
        raise UserError(
            f"--batch_size={config.batch_size} holds "
            f"{config.batch_size // m} micro-batch(es) of {m}, no more than "
            f"--backup_workers={config.backup_workers}: a round could end "
            "with none averaged; lower --micro_batch or --backup_workers")


def check_ps_mirrors(ps_mirrors: bool, num_ps: int) -> None:
    """Raises UserError if --ps_mirrors is given with one ps task."""
    if ps_mirrors and num_ps < 2:
        raise UserError("--ps_mirrors keeps each ps's shards on the next ps"
                        f" and needs 2 ps tasks or more, not {num_ps}; add "
                        "a ps task or drop --ps_mirrors")


def validate(config: TrainConfig, num_workers: int,
             num_ps: int | None = None) -> None:
    """Raises UserError naming the first bad setting and how to fix it
    (num_ps: None where not known yet). A --batch_size above the training
    examples is refused once they are read (resolved_train_steps)."""
    if config.chunk_kb:
        raise UserError(CHUNK_KB_RETIRED)
    if num_ps is not None:
        check_ps_mirrors(config.ps_mirrors, num_ps)
    for name, choices in (("model", MODELS), ("optimizer", OPTIMIZERS),
                          ("lr_schedule", LR_SCHEDULES),
                          ("wire_dtype", WIRE_DTYPES), ("slices", SLICES)):
        if getattr(config, name) not in choices:
            raise UserError(f"--{name}={getattr(config, name)} is unknown; "
                            f"choose one of {', '.join(choices)}")
    if config.train_steps is not None and config.epochs is not None:
        raise UserError("give either --train_steps or --epochs, not both")
    for name in ("hidden_units", "batch_size", "train_steps", "log_every",
                 "eval_every", "checkpoint_every", "keep_checkpoints"):
        _positive(name, getattr(config, name))
    for name in ("intra_op_threads", "inter_op_threads"):
        if getattr(config, name) < 0:
            raise UserError(f"--{name}={getattr(config, name)} must be 0 "
                            "(one per core) or more")
    for name in ("learning_rate", "epochs", "startup_timeout_secs",
                 "worker_timeout_secs"):
        _positive(name, getattr(config, name), float)
    _check_trace_steps(config.trace_steps)
    if not 0 <= config.momentum < 1:
        raise UserError(f"--momentum={config.momentum} must be in [0, 1)")
    if not config.logdir:
        raise UserError("--logdir is empty; give a folder for checkpoints, "
                        "TensorBoard logs and results.json")
    if not 0 <= config.backup_workers < num_workers:
        raise UserError(
            f"--backup_workers={config.backup_workers} must be at least 0 "
            f"and less than the {num_workers} worker(s), so that at least "
            "one gradient is averaged per step")
    if not 1 <= config.min_workers <= num_workers:
        raise UserError(
            f"--min_workers={config.min_workers} must be at least 1 and at "
            f"most the {num_workers} declared worker(s)")
    if config.ordered_pulls and config.backup_workers:
        raise UserError(
            "--ordered_pulls and --backup_workers do not mix: a late worker "
            "would hold back the pulls of every worker after it; drop one")
    _check_micro_batch(config, num_workers)
    if config.batch_size < num_workers:
        raise UserError(
            f"--batch_size={config.batch_size} is smaller than the "
            f"{num_workers} workers; the global batch needs at least one "
            "example per worker")
