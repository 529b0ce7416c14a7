"""The researcher's benchmark: seeds and spread, the chart as PNG, SVG and
PDF (its lines from the peers' registry), --replot, provenance, the two
async variants and the Slurm placement of the peers' tasks."""

import csv
import importlib.util
import json

import pytest

from tests import helpers
from trainer.bench import peers, replot, report, runs, slurm_steps
from trainer.bench import rows as rows_lib
from trainer.bench.baselines import peer as peer_lib
from trainer.common.config import TrainConfig
from trainer.observe import provenance, results

PROVENANCE_KEYS = {"python", "tensorflow", "numpy", "cpu_model", "cpu_count",
                   "cpu_usable", "host", "commit", "dirty",
                   "simulated_hosts"}


def fake_run(name: str, seed: int, accuracy: float, speed: float):
    results = {"images_per_sec": speed, "final_test_accuracy": accuracy,
               "wall_time_secs": 2.0, "train_time_secs": 1.0,
               "mean_step_time_ms": 5.0, "eval_history": [],
               "flags": {"seed": seed}}
    return runs.Run(name, "ps", 2, results, {"chief": 500.0}, 1)


def test_rows_give_mean_min_max_over_seeds_and_the_median_run(tmp_path):
    s = runs.Settings(tmp_path, TrainConfig(logdir=str(tmp_path)), [], 1, 60)
    group = [fake_run("ps_2w_s1", 1, 0.90, 300.0),
             fake_run("ps_2w_s2", 2, 0.96, 100.0),
             fake_run("ps_2w_s3", 3, 0.93, 200.0)]
    rows, _ = rows_lib.make_rows(s, [group], 0.99)
    row = rows[0]
    assert row["run"] == "ps_2w_s3"  # the median by images/s
    assert (row["runs"], row["seeds"]) == (3, "1;2;3")
    assert row["test_accuracy_mean"] == pytest.approx(0.93)
    assert (row["test_accuracy_min"], row["test_accuracy_max"]) == (0.90,
                                                                    0.96)
    assert row["images_per_sec_mean"] == pytest.approx(200.0)
    assert (row["images_per_sec_min"], row["images_per_sec_max"]) == (100.0,
                                                                      300.0)
    table = report.write_outputs(tmp_path, rows, 0.99)
    assert "| acc mean | acc min | acc max |" in table
    assert "| 93.00% | 90.00% | 96.00% |" in table
    with open(tmp_path / "results.csv") as f:
        (csv_row,) = csv.DictReader(f)
    assert float(csv_row["images_per_sec_max"]) == 300.0
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "results.svg").read_text().startswith("<?xml")
        assert (tmp_path / "results.pdf").read_bytes()[:5] == b"%PDF-"
        assert (tmp_path / "results.png").stat().st_size > 10_000


def test_the_deterministic_note_says_whether_accuracies_are_equal():
    rows = [{"run": "ps_1w", "kind": "ps", "test_accuracy": 0.9843},
            {"run": "ps_2w", "kind": "ps", "test_accuracy": 0.9843},
            {"run": "mwms_2w", "kind": "mwms", "test_accuracy": 0.9851},
            {"run": "single_2t", "kind": "single", "test_accuracy": 0.9842}]
    note = rows_lib.deterministic_note(rows)
    assert "equal to the last digit: 98.4300% in every one (ps_1w, ps_2w)" \
        in note
    rows[1]["test_accuracy"] = 0.9844
    note = rows_lib.deterministic_note(rows)
    assert "differ: ps_1w 98.4300%, ps_2w 98.4400%" in note
    assert "mwms" not in note and "single" not in note  # not promised


def test_a_new_peer_in_the_registry_gets_a_line_in_the_chart(monkeypatch):
    """The chart's lines are the ps trainer's and those of every peer the
    benchmark finds: a new peer module needs no change to the report."""
    new = peer_lib.Peer(name="ring2", order=9, label="Ring v2, {} worker(s)",
                        help="ring2 (a new peer)")
    registry = {**peers.all_peers(), "ring2": new}
    monkeypatch.setattr(peers, "all_peers", lambda: registry)
    rows = [{"run": f"{kind}_{w}w", "kind": kind, "workers": w,
             "test_accuracy": 0.9, "images_per_sec": 100.0 * w}
            for kind in ("ring2", "ps", "mwms", "single") for w in (2, 1)]
    rows.append({"run": "sro_1w", "kind": "sro", "workers": 1,
                 "error": "sro_1w failed with statuses [1]"})
    series = dict(report.chart_series(rows))
    assert list(series) == ["this trainer (ps)", "MWMS", "Ring v2"]
    assert [r["run"] for r in series["Ring v2"]] == ["ring2_1w", "ring2_2w"]


def test_provenance_is_in_every_results_file():
    origin = provenance.collect()
    assert set(origin) == PROVENANCE_KEYS
    assert origin["tensorflow"] and origin["numpy"] and origin["cpu_count"]
    assert origin["commit"] is None or len(origin["commit"]) == 40
    outcome = results.Outcome(history=[], train_secs=1.0, timed_steps=10,
                               dropped=0)
    fields = results.results_fields(outcome, TrainConfig(logdir="x"), 10)
    assert fields["provenance"] == origin
    line = replot.describe(origin)
    assert f"TensorFlow {origin['tensorflow']}" in line


def test_slurm_peer_tasks_are_placed_like_the_ps_runs():
    steps = slurm_steps.StepSettings("7", ("n1", "n2", "n3", "n4"), 1, 5000)
    placed, nodes = slurm_steps.peer_addresses(steps, "async", 2, 1)
    assert placed == {"chief": ["n1:5000"], "worker": ["n2:5001", "n3:5002"],
                      "ps": ["n4:5003"]}
    assert nodes == ["n1", "n2", "n3", "n4"]
    two = slurm_steps.StepSettings("7", ("n1", "n2"), 2, 5000)
    placed, nodes = slurm_steps.peer_addresses(two, "mwms", 3, 0)
    assert placed["worker"] == ["n1:5000", "n1:5001", "n2:5002"]


@pytest.mark.parametrize("args, phrase", [
    (["--seeds=1,x"], "--seeds=1,x must be a comma-separated list"),
    (["--seeds=3,3"], "repeats a seed"),
    (["--replot=/nonexistent/bench"], "no results.json there"),
])
def test_bad_seeds_or_replot_folder_is_one_line(tmp_path, args, phrase):
    result = helpers.run(["-m", "trainer.benchmark", *args,
                          f"--out={tmp_path / 'out'}"], timeout=120)
    assert result.returncode == 2, result.stdout[-2000:]
    assert phrase in result.stdout
    assert "Traceback" not in result.stdout


# With --runslow only (CI's time); the spread, the columns, provenance
# and the bad --seeds and --replot values are unit-tested above.
@pytest.mark.slow
@pytest.mark.cluster
def test_seeds_async_variants_provenance_and_replot(tmp_path):
    """Two seeds of ps and async_split with two workers; then --replot of
    the folder gives the same rows. (async on the whole global batch is
    checked the same way in tests/test_benchmark.py's every-peer run.)"""
    data = helpers.fake_mnist(tmp_path / "data")
    out = tmp_path / "bench"
    result = helpers.run(
        ["-m", "trainer.benchmark", "--model=softmax", "--train_steps=40",
         "--batch_size=32", "--workers=2", "--eval_every=40",
         "--log_every=20", "--baselines=async_split", "--seeds=0,1",
         f"--data_dir={data}", "--nodownload", f"--out={out}"], timeout=900)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "provenance: Python" in result.stdout
    saved = json.loads((out / "results.json").read_text())
    rows = {r["kind"]: r for r in saved["rows"]}
    assert sorted(rows) == ["async_split", "ps"]
    for row in rows.values():
        assert (row["runs"], row["seeds"]) == (2, "0;1")
        for figure in ("test_accuracy", "images_per_sec"):
            assert (row[f"{figure}_min"] <= row[f"{figure}_mean"]
                    <= row[f"{figure}_max"])
    assert PROVENANCE_KEYS <= set(saved["provenance"])
    assert saved["provenance"]["run_hosts"]
    for seed in (0, 1):
        per_run = json.loads((out / f"ps_2w_s{seed}" /
                              "results.json").read_text())
        assert per_run["flags"]["seed"] == seed
        assert set(per_run["provenance"]) == PROVENANCE_KEYS
        split = json.loads(
            (out / f"async_split_2w_s{seed}.chief.json").read_text())
        assert (split["functions"], split["examples_per_update"]) == (80, 16)
        # Every slice trained once, whichever worker ran it.
        assert split["distinct_slices"] == 80

    again = helpers.run(["-m", "trainer.benchmark", f"--replot={out}",
                         f"--out={tmp_path / 'replot'}"], timeout=300)
    assert again.returncode == 0, again.stdout[-3000:]
    replotted = json.loads((tmp_path / "replot" / "results.json").read_text())
    assert replotted["rows"] == saved["rows"]
    assert replotted["command"] == saved["command"]
    assert replotted["replotted_from"] == str(out)
    assert (tmp_path / "replot" / "results.csv").read_text() == (
        out / "results.csv").read_text()
    assert list((tmp_path / "replot").glob("events.out.tfevents.*"))
    if importlib.util.find_spec("matplotlib"):
        for suffix in ("png", "svg", "pdf"):
            assert (tmp_path / "replot" / f"results.{suffix}").exists()
