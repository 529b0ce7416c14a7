"""The benchmark's outputs: a Markdown table, CSV, JSON and a chart."""

import csv
import json
import pathlib
import sys

from absl import logging

COLUMNS = ("run", "kind", "workers", "test_accuracy", "wall_time_secs",
           "train_time_secs", "images_per_sec", "efficiency",
           "mean_step_time_ms", "time_to_target_secs", "peak_rss_mb_max",
           "peak_rss_mb")


def write_outputs(out: pathlib.Path, rows: list[dict],
                  target_accuracy: float) -> str:
    """Writes results.csv, results.json and results.png; returns Markdown."""
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (out / "results.json").write_text(json.dumps(
        {"rows": rows, "command": " ".join(sys.argv),
         "target_accuracy": target_accuracy}, indent=2) + "\n")
    _plot(out / "results.png", rows)
    return markdown_table(rows, target_accuracy)


def _cell(value) -> str:
    if value is None:
        return "not reached"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4g}"
    return str(value)


def markdown_table(rows: list[dict], target_accuracy: float) -> str:
    headers = ("run", "workers", "test acc", "wall s", "train s",
               "images/s", "E", "step ms",
               f"s to {100 * target_accuracy:g}%", "peak RSS MB")
    keys = ("run", "workers", "test_accuracy", "wall_time_secs",
            "train_time_secs", "images_per_sec", "efficiency",
            "mean_step_time_ms", "time_to_target_secs", "peak_rss_mb")
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "---|" * len(headers)]
    for row in rows:
        cells = []
        for key in keys:
            value = row[key]
            if key == "test_accuracy":
                cells.append(f"{100 * value:.2f}%")
            elif key == "efficiency":
                cells.append(f"{value:.2f}")
            else:
                cells.append(_cell(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot(path: pathlib.Path, rows: list[dict]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        logging.info("matplotlib is not installed; skipping %s (pip install "
                     "-e '.[plot]')", path.name)
        return
    figure, (accuracy_axes, speed_axes) = pyplot.subplots(1, 2,
                                                          figsize=(11, 4))
    for kind, label in (("ps", "parameter server"), ("mwms", "MWMS")):
        kind_rows = sorted((r for r in rows if r["kind"] == kind),
                           key=lambda r: r["workers"])
        if kind_rows:
            workers = [r["workers"] for r in kind_rows]
            accuracy_axes.plot(workers, [100 * r["test_accuracy"]
                                         for r in kind_rows], "o-",
                               label=label)
            speed_axes.plot(workers, [r["images_per_sec"] for r in kind_rows],
                            "o-", label=label)
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
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
