"""The benchmark's outputs: a Markdown table, CSV, JSON and a chart."""

import csv
import json
import pathlib
import sys

from absl import logging

from trainer.bench import peers

COLUMNS = ("run", "kind", "workers", "test_accuracy", "wall_time_secs",
           "train_time_secs", "images_per_sec", "efficiency",
           "mean_step_time_ms", "time_to_target_secs", "peak_rss_mb_max",
           "peak_rss_mb")
# Columns only some benchmarks have: repeats, simulated hosts, traces;
# pipelined_bound_ms only in results from before the pipelined protocol
# was retired (their replots still read it).
EXTRA_COLUMNS = ("runs", "seeds", "test_accuracy_mean", "test_accuracy_min",
                 "test_accuracy_max", "images_per_sec_mean",
                 "images_per_sec_min", "images_per_sec_max",
                 "images_per_sec_repeats", "x_mwms", "host_cpu", "ps_cpu",
                 "link_rate", "cpu_period_ms", "ps_placement", "nodes",
                 "speedup", "scaling_efficiency", "ps_link_bytes_per_step",
                 "ps_link_bound_ms", "pipelined_bound_ms",
                 "ring_bound_ms", "step_over_bound", "link_share",
                 "pushed_gradients", "distinct_slices", "ended_by_itself",
                 "cpu_throttled", "machine_idle",
                 "error",
                 "traced_step_ms",
                 "step_compute_ms", "step_pull_params_ms",
                 "step_push_grads_ms", "step_wait_others_ms",
                 "step_aggregate_apply_ms", "step_other_ms",
                 "step_overlap_ms")


def emit(text: str) -> None:
    """Writes a command's result, its final table, to stdout. (Progress
    goes to absl logging, on stderr; this is what the command prints for a
    person or a script to read.)"""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


CHART_FORMATS = ("png", "svg", "pdf")


def write_outputs(out: pathlib.Path, rows: list[dict],
                  target_accuracy: float, more: dict | None = None) -> str:
    """Writes results.csv, results.json (rows, command, target accuracy
    and `more`, e.g. provenance) and the chart as results.png, .svg and
    .pdf; returns the Markdown table. A replot passes the first run's
    command in `more`."""
    columns = list(COLUMNS) + [c for c in EXTRA_COLUMNS
                               if any(c in row for row in rows)]
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    (out / "results.json").write_text(json.dumps(
        {"rows": rows, "command": " ".join(sys.argv),
         "target_accuracy": target_accuracy, **(more or {})},
        indent=2) + "\n")
    _plot(out, rows)
    return markdown_table(rows, target_accuracy)


def _cell(value) -> str:
    if value is None:
        return "not reached"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4g}"
    return str(value)


def _percent(value) -> str:
    return f"{100 * value:.2f}%"


def _ratio(value) -> str:
    return "" if value is None else f"{value:.2f}"


def _table_columns(target_accuracy: float) -> list[tuple]:
    """(header, key, format) of every column the table may show."""
    return [
        ("run", "run", _cell), ("workers", "workers", _cell),
        ("nodes", "nodes", _cell),
        ("test acc", "test_accuracy", _percent),
        ("wall s", "wall_time_secs", _cell),
        ("train s", "train_time_secs", _cell),
        ("images/s", "images_per_sec", _cell),
        ("runs", "runs", _cell), ("seeds", "seeds", _cell),
        ("acc mean", "test_accuracy_mean", _percent),
        ("acc min", "test_accuracy_min", _percent),
        ("acc max", "test_accuracy_max", _percent),
        ("images/s mean", "images_per_sec_mean", _cell),
        ("images/s min", "images_per_sec_min", _cell),
        ("images/s max", "images_per_sec_max", _cell),
        ("repeats images/s", "images_per_sec_repeats", _cell),
        ("E", "efficiency", _ratio), ("x mwms", "x_mwms", _ratio),
        ("S(N)", "speedup", _ratio),
        ("S(N)/N", "scaling_efficiency", _ratio),
        ("step ms", "mean_step_time_ms", _cell),
        ("ps link MB/step", "ps_link_bytes_per_step",
         lambda v: "" if v is None else f"{v / 1e6:.3g}"),
        ("bound ms", "ps_link_bound_ms", _cell),
        ("pipelined bound ms", "pipelined_bound_ms", _cell),
        ("ring bound ms", "ring_bound_ms", _cell),
        ("step/bound", "step_over_bound", _ratio),
        ("links explain", "link_share", _ratio),
        (f"s to {100 * target_accuracy:g}%", "time_to_target_secs", _cell),
        ("peak RSS MB", "peak_rss_mb", _cell),
        ("gradients pushed", "pushed_gradients", _cell),
        ("distinct slices", "distinct_slices", _cell),
        ("ended by itself", "ended_by_itself", _cell),
        ("CPU throttled", "cpu_throttled", _cell),
        ("machine idle", "machine_idle", _cell),
        ("error", "error", _cell),
        ("traced step ms", "traced_step_ms", _cell),
        ("compute", "step_compute_ms", _cell),
        ("pull", "step_pull_params_ms", _cell),
        ("push", "step_push_grads_ms", _cell),
        ("wait", "step_wait_others_ms", _cell),
        ("apply", "step_aggregate_apply_ms", _cell),
        ("other", "step_other_ms", _cell),
        ("push/pull overlap", "step_overlap_ms", _cell),
    ]


def markdown_table(rows: list[dict], target_accuracy: float) -> str:
    """Rows as a Markdown table; a column only some rows have is shown
    where any row has it, empty for the others."""
    shown = [(h, k, f) for h, k, f in _table_columns(target_accuracy)
             if k in COLUMNS or any(k in row for row in rows)]
    lines = ["| " + " | ".join(h for h, _, _ in shown) + " |",
             "|" + "---|" * len(shown)]
    for row in rows:
        lines.append("| " + " | ".join(
            f(row[k]) if k in row else "" for _, k, f in shown) + " |")
    return "\n".join(lines)


def _series(kind_rows: list[dict], column: str, scale: float = 1.0):
    """(y, yerr) of one line: the mean over a row's runs with min-max
    error bars where rows have them, else the row's value and no bars.
    yerr: [[below...], [above...]] as matplotlib's errorbar takes it."""
    if not all(f"{column}_mean" in r for r in kind_rows):
        return [scale * r[column] for r in kind_rows], None
    y = [scale * r[f"{column}_mean"] for r in kind_rows]
    return y, [[v - scale * r[f"{column}_min"] for v, r in zip(y, kind_rows)],
               [scale * r[f"{column}_max"] - v for v, r in zip(y, kind_rows)]]


def chart_series(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """(label, rows by worker count) of each line of the chart: the ps
    trainer's, then every peer's the benchmark finds (peers.all_peers), each
    that has rows without an error. The single process is a level line."""
    kinds = [("ps", "this trainer (ps)")] + [
        (name, peer.series_label())
        for name, peer in peers.all_peers().items()]
    series = []
    for kind, label in kinds:
        kind_rows = sorted((r for r in rows
                            if r["kind"] == kind and "error" not in r),
                           key=lambda r: r["workers"])
        if kind_rows:
            series.append((label, kind_rows))
    return series


def _plot(out: pathlib.Path, rows: list[dict]) -> None:
    """results.<png|svg|pdf>: accuracy and images/s against workers."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        logging.info("matplotlib is not installed; skipping the chart "
                     "(pip install -e '.[plot]')")
        return
    figure, (accuracy_axes, speed_axes) = pyplot.subplots(1, 2,
                                                          figsize=(11, 4))
    for label, kind_rows in chart_series(rows):
        workers = [r["workers"] for r in kind_rows]
        for axes, column, scale in ((accuracy_axes, "test_accuracy", 100),
                                    (speed_axes, "images_per_sec", 1)):
            y, yerr = _series(kind_rows, column, scale)
            axes.errorbar(workers, y, yerr=yerr, fmt="o-", capsize=4,
                          label=label)
    singles = [r for r in rows if r["kind"] == "single"]
    if singles:
        best = max(singles, key=lambda r: r["images_per_sec"])
        speed_axes.axhline(best["images_per_sec"], color="gray",
                           linestyle="--", label=f"single process "
                           f"({best['run']})")
        accuracy_axes.axhline(100 * best["test_accuracy"], color="gray",
                              linestyle="--", label="single process")
    accuracy_axes.set(xlabel="workers", ylabel="test accuracy (%)",
                      title="Test accuracy vs workers")
    # Equal accuracies are the point: show at least half a point of range.
    low, high = accuracy_axes.get_ylim()
    middle = (low + high) / 2
    accuracy_axes.set_ylim(min(low, middle - 0.25), max(high, middle + 0.25))
    accuracy_axes.ticklabel_format(axis="y", useOffset=False)
    speed_axes.set(xlabel="workers", ylabel="images/s (whole cluster)",
                   title="Training speed vs workers")
    speed_axes.set_ylim(bottom=0)
    worker_counts = sorted({r["workers"] for r in rows})
    for axes in (accuracy_axes, speed_axes):
        axes.set_xticks(worker_counts)
        axes.legend()
        axes.grid(alpha=0.3)
    if any("test_accuracy_mean" in r for r in rows):
        figure.suptitle("mean over seeds and repeats; bars: min to max",
                        fontsize=9)
    figure.tight_layout()
    for suffix in CHART_FORMATS:
        figure.savefig(out / f"results.{suffix}", dpi=100)
    pyplot.close(figure)
