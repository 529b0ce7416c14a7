"""`python -m trainer.benchmark --replot=DIR`: a benchmark's outputs again
from its results.json, without running anything.

Writes the table (stdout), results.csv, results.json, the chart (PNG, SVG,
PDF) and, where results.json holds the dashboard's sessions, the HParams
dashboard, into a new folder: the runs' own folders stay as they were.
"""

import json
import pathlib
import sys

from absl import logging

from trainer.bench import report
from trainer.bench import rows as rows_lib
from trainer.common.errors import UserError


def describe(origin: dict) -> str:
    """One line of provenance under the table."""
    dirty = {True: " (dirty)", False: "", None: " (dirty: unknown)"}
    return (f"provenance: Python {origin.get('python')}, TensorFlow "
            f"{origin.get('tensorflow')}, NumPy {origin.get('numpy')}; "
            f"{origin.get('cpu_model')}, {origin.get('cpu_count')} cores; "
            f"host {origin.get('host')}; commit "
            f"{origin.get('commit') or 'unknown'}"
            f"{dirty.get(origin.get('dirty'), '')}; simulated hosts: "
            f"{origin.get('simulated_hosts') or 'none'}")


def _load(src: pathlib.Path) -> dict:
    """The benchmark's results.json; UserError naming the fix if it is
    missing or not a benchmark's."""
    path = src / "results.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"--replot={src}: no results.json there; give the "
                        "--out folder of a finished benchmark") from None
    except (OSError, ValueError) as e:
        raise UserError(f"--replot={src}: cannot read {path} ({e}); give "
                        "the --out folder of a finished benchmark") from None
    if not (isinstance(data, dict) and isinstance(data.get("rows"), list)
            and data["rows"] and "target_accuracy" in data):
        raise UserError(f"--replot={src}: {path} is not a benchmark's "
                        "results (no rows or target_accuracy)")
    return data


def _destination(src: pathlib.Path, out: pathlib.Path | None,
                 stamp: str) -> pathlib.Path:
    out = out or src / f"replot-{stamp}"
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out={out} is not empty; give a new folder for "
                        "the replot (or leave --out out)")
    return out


def main(src: pathlib.Path, out: pathlib.Path | None, stamp: str) -> int:
    """Replots src into out; 0, or 2 with one line on bad input."""
    try:
        data = _load(src)
        out = _destination(src, out, stamp)
    except UserError as e:
        logging.error("%s", e)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    more = {k: v for k, v in data.items() if k not in ("rows",)}
    more["replotted_from"] = str(src)
    more["replot_command"] = " ".join(sys.argv)
    if "dashboard" in data:
        rows_lib.write_dashboard(out, data["dashboard"])
    else:
        logging.info("%s/results.json has no dashboard sessions (an older "
                     "benchmark): no dashboard", src)
    report.emit(report.write_outputs(out, data["rows"],
                                     data["target_accuracy"], more))
    if "provenance" in data:
        report.emit(describe(data["provenance"]))
    report.emit(f"outputs in {out}; tensorboard --logdir {out}")
    return 0
