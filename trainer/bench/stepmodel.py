"""A step-time model of the ps trainer, fitted on benchmark runs.

    python -m trainer.bench.stepmodel OUT [OUT ...]

reads the ps rows of one or more benchmark folders (simulated hosts) and
fits, by least squares with every coefficient at least 0,

    step ms = a_m x (B / N) / cpu        compute: the slice on one host
            + b x link_ms                the links: the printed bound
            + c x N / ps_cpu             per-worker work on ps 0
            + d                          a fixed cost: tokens, round trips

a_m is per model m (the mlp's example costs far less than the cnn's),
B is the global batch, N the workers, cpu a worker host's share of a core
and ps_cpu a ps host's; link_ms is the ps-link bound in ms
(trainer/bench/simhosts/bound.py) for its K ps tasks. The per-worker
term is ps 0's: every worker's token, push event and admission pass
through it each step, however many ps tasks share the parameters (8
workers ran no faster with 2 ps than 1). It prints the fitted formula,
its error on every point and what it predicts for 32, 64 and 128
workers with one and with four ps tasks per 8 workers. Runs of the
retired pipelined protocol (--chunk_kb) are left out: their step was
another protocol's.
"""

import dataclasses
import itertools
import json
import pathlib
import sys

import numpy as np

from trainer.common.config import TrainConfig
from trainer.common.errors import UserError
from trainer.bench.simhosts import bound as bound_lib
from trainer.bench.simhosts.limits import parse_rate

SHARED_TERMS = ("b: x link bound", "c: ms x core per worker on ps 0",
                "d: ms fixed")
PREDICT_WORKERS = (32, 64, 128)
PS_PER_8 = (1, 4)


@dataclasses.dataclass(frozen=True)
class Point:
    """One configuration's step: where it ran and how long it took."""

    label: str
    config: TrainConfig
    workers: int
    num_ps: int
    host_cpu: float
    ps_cpu: float
    rate_bps: int
    placement: str
    step_ms: float | None = None   # measured; None for a prediction

    def link_ms(self) -> float:
        """The ps-link bound in ms."""
        return bound_lib.ps_link_bound_ms(self.config, self.num_ps,
                                          self.workers, self.rate_bps,
                                          self.placement)

    def features(self, models: tuple[str, ...]) -> np.ndarray:
        """float64 [len(models) + 3]: the terms' factors (module
        docstring), with one compute column per model."""
        compute = [self.config.batch_size / self.workers / self.host_cpu
                   if m == self.config.model else 0.0 for m in models]
        return np.array(compute + [self.link_ms(),
                                   self.workers / self.ps_cpu, 1.0])


@dataclasses.dataclass(frozen=True)
class Model:
    """Fitted coefficients: a per model, then b, c, d (module docstring)."""

    models: tuple[str, ...]
    coef: np.ndarray

    def predict(self, point: Point) -> float:
        return float(point.features(self.models) @ self.coef)

    def formula(self) -> str:
        b, c, d = self.coef[len(self.models):]
        compute = " + ".join(f"{a:.3f} x (B/N)/cpu [{m}]"
                             for m, a in zip(self.models, self.coef))
        return (f"step ms = {compute} + {b:.2f} x link_ms + "
                f"{c:.3f} x N/ps_cpu + {d:.2f}")


def _cpu(value) -> float:
    """A row's host_cpu: one number, or per-host numbers (their mean)."""
    values = [float(v) for v in str(value).split(",")]
    return sum(values) / len(values)


def load_points(folders: list[str]) -> list[Point]:
    """The ps rows of the benchmark folders that ran on simulated hosts
    without a straggler. Raises UserError for a folder without
    results.json."""
    points = []
    for folder in map(pathlib.Path, folders):
        summary = folder / "results.json"
        if not summary.is_file():
            raise UserError(f"{folder}: no results.json; give folders "
                             f"that python -m trainer.benchmark wrote")
        bench = json.loads(summary.read_text())
        hosts = bench.get("provenance", {}).get("simulated_hosts")
        if not hosts or hosts.get("straggler"):
            continue  # the model is of even hosts
        for row in bench["rows"]:
            if row.get("kind") != "ps" or "mean_step_time_ms" not in row:
                continue
            run = json.loads((folder / row["run"] / "results.json")
                             .read_text())
            if run["flags"].get("chunk_kb"):
                continue  # the retired pipelined protocol
            points.append(Point(
                f"{folder.name}/{row['run']}",
                TrainConfig(**run["flags"]), row["workers"], run["num_ps"],
                _cpu(row["host_cpu"]), float(row["ps_cpu"]),
                parse_rate(row["link_rate"]), row["ps_placement"],
                row["mean_step_time_ms"]))
    return points


def fit(points: list[Point]) -> Model:
    """The coefficients, each >= 0, of the least relative error (rows
    weighted by 1 / step ms): the best of every subset of terms whose
    unconstrained fit is nonnegative."""
    models = tuple(dict.fromkeys(p.config.model for p in points))
    terms = len(models) + len(SHARED_TERMS)
    if len(points) < terms:
        raise UserError(f"{len(points)} ps runs on simulated hosts; the "
                         f"model needs at least {terms} (more --workers, "
                         f"or more folders)")
    x = np.stack([p.features(models) for p in points])
    y = np.array([p.step_ms for p in points])
    w = 1.0 / y
    best, best_err = np.zeros(terms), np.inf
    for n in range(1, terms + 1):
        for cols in map(list, itertools.combinations(range(terms), n)):
            coef, *_ = np.linalg.lstsq(x[:, cols] * w[:, None], y * w,
                                       rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(terms)
            full[cols] = coef
            err = float(np.sum(((x @ full - y) * w) ** 2))
            if err < best_err - 1e-12:
                best, best_err = full, err
    return Model(models, best)


def report(points: list[Point], model: Model) -> list[str]:
    """The formula, the error on every point and the predictions."""
    lines = [model.formula(), "", "| point | N | K | cpu | link ms | "
             "measured ms | model ms | error |", "|---|---|---|---|---|---|"
             "---|---|"]
    for p in points:
        ms = model.predict(p)
        lines.append(f"| {p.label} | {p.workers} | {p.num_ps} | "
                     f"{p.host_cpu:g} | {p.link_ms():.1f} | {p.step_ms:.1f}"
                     f" | {ms:.1f} | {ms / p.step_ms - 1:+.1%} |")
    lines += ["", _predictions_header()]
    ref = points[0]
    for workers, per_8 in itertools.product(PREDICT_WORKERS, PS_PER_8):
        lines.append(_prediction_row(model, ref, workers, per_8))
    return lines


def _predictions_header() -> str:
    return "| N | K | step ms | images/s |\n|---|---|---|---|"


def _prediction_row(model: Model, ref: Point, workers: int, per_8: int
                    ) -> str:
    """A prediction on the first point's model, batch, cpus and links."""
    p = dataclasses.replace(ref, label="", workers=workers,
                            num_ps=workers // 8 * per_8, step_ms=None)
    ms = model.predict(p)
    return (f"| {workers} | {p.num_ps} | {ms:.1f} | "
            f"{ref.config.batch_size / ms * 1e3:,.0f} |")


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write("usage: python -m trainer.bench.stepmodel OUT "
                         "[OUT ...] (benchmark folders)\n")
        return 2
    try:
        points = load_points(argv)
        model = fit(points)
    except UserError as e:
        sys.stderr.write(f"stepmodel: {e}\n")
        return 2
    sys.stdout.write("\n".join(report(points, model)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
