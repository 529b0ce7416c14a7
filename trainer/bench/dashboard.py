"""The benchmark's runs as a TensorBoard HParams dashboard.

`tensorboard --logdir <out_dir>` then shows, in its HPARAMS tab, one row
per run (table view) and one line per run across the axes kind, workers,
ps tasks, ... and the metrics (parallel-coordinates view), each run's
scalars beside it in the SCALARS tab.

Layout written:

    <out_dir>/events.out.tfevents.*           the experiment config (run ".")
    <out_dir>/hparams_experiment.json         the same config, for checks
    <out_dir>/<run_name>/events.out.tfevents.*  the run's hparams, its
                                              metric values and any per-step
                                              scalars

Usage (the caller passes plain dicts):

    write_experiment(out, {"kind": ["ps", "single", "mwms"],
                           "workers": [1, 2, 4], "ps_tasks": [0, 1],
                           "model": ["cnn"], "batch": [128]})
    write_run(out, "ps_2w",
              {"kind": "ps", "workers": 2, "ps_tasks": 1, "model": "cnn",
               "batch": 128},
              {"final_test_accuracy": 0.9926, "images_per_sec": 2778.0,
               "efficiency": 0.80, "time_to_target_secs": None},
              {"eval/accuracy": [(100, 0.95), (200, 0.97)]})

Summaries are written with tf.summary in eager mode; see `_eagerly` for
calls from inside a tf.compat.v1 graph.
"""

import json
import math
import numbers
import os
import pathlib
import threading
from typing import Callable, Iterable, Mapping

from absl import logging
import tensorflow as tf
from tensorboard.plugins.hparams import api as hp

from trainer.bench import peers
from trainer.common.errors import UserError


# name -> (type, display name, description). Values of int hparams are
# shown as floats by TensorBoard (it has no int type).
HPARAMS = {
    "kind": (str, "kind", "ps: this trainer; single: one process, no "
             "servers; mwms: MultiWorkerMirroredStrategy; sro: the "
             "SyncReplicasOptimizer recipe; async: ParameterServerStrategy"
             " (update: global batch); async_split: (update: batch / N)."),
    "workers": (int, "workers", "Worker processes (1 for single)."),
    "ps_tasks": (int, "ps tasks", "Parameter-server tasks (0 for single "
                 "and mwms)."),
    "model": (str, "model", "The trainer's --model."),
    "batch": (int, "global batch", "Images per synchronous step, all "
              "workers together."),
    "host_cpu": (float, "host CPU", "CPU of each simulated host, as a "
                 "fraction of one core."),
    "link_rate": (str, "link rate", "Rate of each simulated host's network "
                  "link, e.g. 1gbit."),
}

# name -> (display name, description); the scalar tag is METRIC_PREFIX+name.
METRICS = {
    "final_test_accuracy": ("final test accuracy", "Test accuracy after "
                            "the last step, 0 to 1."),
    "images_per_sec": ("images/s", "Training images per second of step "
                       "loop time, all workers together."),
    "efficiency": ("efficiency E(N)", "E(N): images/s divided by images/s "
                   "of the best single-process run of the same benchmark."),
    "time_to_target_secs": ("s to target accuracy", "Training seconds until "
                            "the test accuracy first reached the target; "
                            "empty if it never did."),
}
# With simulated hosts (the host_cpu hparam) "efficiency" holds S(N)/N.
SIMULATED_HOST_METRICS = {"efficiency": (
    "S(N)/N (ps), E (single)", "ps runs: scaling efficiency S(N)/N, "
    "images/s with N worker hosts / images/s with 1, over N (E without a "
    "1-worker run); single-process runs: E(N) as on local hosts.")}
METRIC_PREFIX = "hparams/"
SPEC_FILE = "hparams_experiment.json"


def metric_tag(name: str) -> str:
    """The scalar tag a metric is written under, e.g. hparams/efficiency."""
    return METRIC_PREFIX + name


def write_experiment(out_dir: str | os.PathLike,
                     hparams: Mapping[str, Iterable],
                     metrics: Iterable[str] = tuple(METRICS)) -> None:
    """Writes the experiment config (hp.hparams_config) at the top of out_dir.

    Args:
      out_dir: the folder TensorBoard is pointed at; created if missing.
      hparams: hparam name (a key of HPARAMS: kind, workers, ps_tasks,
        model, batch, host_cpu, link_rate) -> every value the runs will
        use. These become the hparam's discrete domain: one axis tick per
        value, and TensorBoard's default filter, so write_run refuses
        others.
      metrics: names from METRICS (final_test_accuracy, images_per_sec,
        efficiency, time_to_target_secs); default all.
    Raises:
      UserError: an unknown name, no values, or a value of the wrong type.
    """
    domains = {name: _domain_values(name, values)
               for name, values in hparams.items()}
    metrics = list(metrics)
    for name in metrics:
        _check_metric_name(name)
    config = (
        [hp.HParam(name, hp.Discrete(values), display_name=HPARAMS[name][1],
                   description=HPARAMS[name][2])
         for name, values in domains.items()],
        [hp.Metric(metric_tag(name), display_name=label[0],
                   description=label[1])
         for name, label in _metric_labels(metrics, domains)])
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _eagerly(_write_events, out, lambda: hp.hparams_config(*config))
    (out / SPEC_FILE).write_text(json.dumps(
        {"hparams": domains, "metrics": metrics}, indent=1))
    logging.info("Dashboard: experiment with hparams %s and metrics %s in %s",
                 ", ".join(domains), ", ".join(metrics), out)


def write_run(out_dir: str | os.PathLike, run_name: str,
              hparams: Mapping[str, object],
              metrics: Mapping[str, float | None],
              scalars: Mapping[str, Iterable[tuple[int, float]]] | None = None
              ) -> None:
    """Writes one run's hparams, metric values and scalars to out_dir/run_name.

    Args:
      out_dir: the folder write_experiment wrote to (called first).
      run_name: the run's folder and row name, e.g. "ps_2w"; a relative
        path without "..".
      hparams: hparam name -> this run's value, among those given to
        write_experiment (see HPARAMS for names and types). An hparam left
        out shows as empty, e.g. host_cpu for a run without simulated hosts.
      metrics: metric name (see METRICS) -> value. A value that is None,
        NaN or infinite is left out: TensorBoard shows an empty cell, and
        sorts and filters the run as missing that metric.
      scalars: optional tag -> [(step, value), ...], e.g. "eval/accuracy"
        or "perf/images_per_sec"; tags may not start with "hparams/". The
        metric values are written at the last of these steps (else 0).
    Raises:
      UserError: no experiment in out_dir, a bad run name, an unknown or
        unconfigured name, or a value outside the experiment's domain.
    """
    out = pathlib.Path(out_dir)
    spec = _read_spec(out)
    logdir = _run_dir(out, run_name)
    hparams = _check_run_hparams(hparams, spec["hparams"])
    values = _finite_metrics(run_name, metrics, spec["metrics"])
    series = _check_scalars(scalars or {})
    last_step = max((step for points in series.values()
                     for step, _ in points), default=0)

    def write():
        hp.hparams(hparams, trial_id=run_name)
        for name, value in values.items():
            tf.summary.scalar(metric_tag(name), value, step=last_step)
        for tag, points in series.items():
            for step, value in points:
                tf.summary.scalar(tag, value, step=step)

    _eagerly(_write_events, logdir, write)
    logging.info("Dashboard: run %s with metrics %s and %d scalar series "
                 "in %s", run_name, ", ".join(values) or "none", len(series),
                 logdir)


def _write_events(logdir: pathlib.Path, write: Callable[[], object]) -> None:
    """Runs write() with a new eager file writer for logdir as the default.

    Each writer makes its own events file (the names hold the pid and a
    per-process counter), so writing to a folder again adds to it.
    """
    writer = tf.summary.create_file_writer(str(logdir))
    try:
        with writer.as_default():
            write()
    finally:
        writer.close()


def _eagerly(function: Callable, *args) -> None:
    """Calls function(*args) where TensorFlow executes eagerly.

    tf.summary with a file writer writes at once only in eager mode. The
    trainer builds tf.compat.v1 graphs inside `with graph.as_default():`
    blocks; called from inside one (or from a tf.function), tf.summary
    would instead add ops to that graph, to run in a session that never
    comes. The default graph is per thread, so a new thread runs eagerly
    again: the writing is done there, and the caller's graph gains no ops.
    Only tf.compat.v1.disable_eager_execution() for the whole process
    defeats this; then we raise instead of writing nothing.
    """
    if tf.executing_eagerly():
        function(*args)
        return
    failures = []

    def target():
        try:
            if not tf.executing_eagerly():
                raise RuntimeError(
                    "trainer.bench.dashboard needs eager execution, but "
                    "this process disabled it "
                    "(tf.compat.v1.disable_eager_execution)")
            function(*args)
        except BaseException as error:  # re-raised in the caller's thread
            failures.append(error)

    thread = threading.Thread(target=target, name="dashboard-writer")
    thread.start()
    thread.join()  # local file writes only: no timeout needed
    if failures:
        raise failures[0]


def _metric_labels(metrics: list[str], hparams: Mapping) -> list:
    """(name, (display name, description)) of each metric, as it holds."""
    on_hosts = SIMULATED_HOST_METRICS if "host_cpu" in hparams else {}
    return [(name, {**METRICS, **on_hosts}[name]) for name in metrics]


def _domain_values(name: str, values: Iterable) -> list:
    """The sorted distinct values of hparam `name`, checked."""
    kind = _hparam_type(name)
    checked = sorted({_typed(name, kind, value) for value in values})
    if not checked:
        raise UserError(f"hparam {name!r} has no values; give every value "
                        f"the runs will use")
    return checked


def _hparam_type(name: str) -> type:
    if name not in HPARAMS:
        raise UserError(f"unknown hparam {name!r}; use one of "
                        f"{', '.join(HPARAMS)}")
    return HPARAMS[name][0]


def _typed(name: str, kind: type, value):
    """value as a plain `kind` (int, float or str) if it is one."""
    if kind is str:
        ok = isinstance(value, str)
    elif kind is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value,
                                                                    bool)
    else:
        ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
              and math.isfinite(value))
    if not ok:
        raise UserError(f"hparam {name!r} must be of type "
                        f"{kind.__name__}, got {value!r}")
    if name == "kind" and value not in peers.all_kinds():
        raise UserError(f"hparam 'kind' is {value!r}; use one of "
                        f"{', '.join(peers.all_kinds())}")
    return kind(value)


def _check_metric_name(name: str) -> None:
    if name not in METRICS:
        raise UserError(f"unknown metric {name!r}; use one of "
                        f"{', '.join(METRICS)}")


def _read_spec(out: pathlib.Path) -> dict:
    try:
        return json.loads((out / SPEC_FILE).read_text())
    except FileNotFoundError:
        raise UserError(f"no experiment in {out}; call write_experiment("
                        f"{str(out)!r}, ...) before write_run") from None


def _run_dir(out: pathlib.Path, run_name: str) -> pathlib.Path:
    path = pathlib.PurePosixPath(run_name)
    if not run_name or path.is_absolute() or ".." in path.parts or (
            "\\" in run_name or path == pathlib.PurePosixPath(".")):
        raise UserError(f"bad run name {run_name!r}; use a relative folder "
                        f"name such as 'ps_2w'")
    return out / path


def _check_run_hparams(hparams: Mapping[str, object],
                       domains: Mapping[str, list]) -> dict:
    """hparams with plain Python values, checked against the domains."""
    checked = {}
    for name, value in hparams.items():
        typed = _typed(name, _hparam_type(name), value)
        if name not in domains:
            raise UserError(f"hparam {name!r} is not in the experiment; add "
                            f"it to write_experiment's hparams")
        if typed not in domains[name]:
            raise UserError(f"hparam {name!r} = {value!r} is not among the "
                            f"experiment's values {domains[name]}; add it "
                            f"to write_experiment's hparams")
        checked[name] = typed
    return checked


def _finite_metrics(run_name: str, metrics: Mapping[str, float | None],
                    configured: list) -> dict[str, float]:
    """The metrics with a finite value, as floats; the others are logged."""
    values = {}
    for name, value in metrics.items():
        _check_metric_name(name)
        if name not in configured:
            raise UserError(f"metric {name!r} is not in the experiment; add "
                            f"it to write_experiment's metrics")
        if value is not None and not isinstance(value, numbers.Real):
            raise UserError(f"metric {name!r} must be a number or None, got "
                            f"{value!r}")
        if value is None or not math.isfinite(value):
            # TensorBoard cannot send NaN in its JSON answers; a missing
            # value is an empty cell there, e.g. a run that never reached
            # the target accuracy.
            logging.info("Dashboard: run %s has no %s (%r); left empty",
                         run_name, name, value)
            continue
        values[name] = float(value)
    return values


def _check_scalars(scalars: Mapping[str, Iterable[tuple[int, float]]]
                   ) -> dict[str, list[tuple[int, float]]]:
    checked = {}
    for tag, points in scalars.items():
        if not isinstance(tag, str) or not tag or tag.startswith(
                METRIC_PREFIX):
            raise UserError(f"bad scalar tag {tag!r}; use a name such as "
                            f"'eval/accuracy', not under {METRIC_PREFIX!r}")
        checked[tag] = []
        for step, value in points:
            if not isinstance(step, numbers.Integral) or step < 0:
                raise UserError(f"scalar {tag!r} has step {step!r}; steps "
                                f"are integers from 0")
            if not isinstance(value, numbers.Real):
                raise UserError(f"scalar {tag!r} has value {value!r} at step "
                                f"{step}; values are numbers")
            checked[tag].append((int(step), float(value)))
    return checked
