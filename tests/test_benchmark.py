"""The benchmark command, run end to end in a tiny configuration."""

import csv
import importlib.util
import json
import math
import subprocess
import sys
import time

import pytest

from tests import helpers
from tests.test_dashboard import (get_json, poll, session_groups,
                                  tensorboard)
from trainer.bench import dashboard, peers, report, runs
from trainer.bench.baselines import peer as peer_lib
from trainer.bench import rows as rows_lib
from trainer.bench.simhosts import bound
from trainer.bench.simhosts import runs as simulated
from trainer.common.config import TrainConfig
from trainer.observe import progress_line

pytestmark = pytest.mark.cluster
RUNS = ["ps_1w", "ps_2w", "single_1t", "single_2t", "mwms_1w", "mwms_2w"]
NUMBERS = ["test_accuracy", "wall_time_secs", "train_time_secs",
           "images_per_sec", "efficiency", "mean_step_time_ms",
           "time_to_target_secs", "peak_rss_mb_max"]


def test_benchmark_reports_every_run_and_column(tmp_path):
    data = helpers.fake_mnist(tmp_path / "data")
    out = tmp_path / "bench"
    result = helpers.run(
        ["-m", "trainer.benchmark", "--model=softmax", "--train_steps=40",
         "--batch_size=32", "--workers=1,2", "--eval_every=20",
         "--log_every=20", "--target_accuracy=0.05", f"--data_dir={data}",
         "--nodownload", f"--out={out}"], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    table = [line for line in result.stdout.splitlines()
             if line.startswith("| ")]
    assert table[0].startswith("| run | workers | test acc |")
    assert [line.split(" | ")[0][2:] for line in table[1:]] == RUNS
    assert all(line.count(" | ") == table[0].count(" | ") for line in table)

    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == RUNS
    for row in rows:
        for column in NUMBERS:
            value = float(row[column])
            assert math.isfinite(value) and value > 0, (row["run"], column)
        assert row["peak_rss_mb"].count(":") == (
            1 if row["kind"] == "single" else int(row["workers"]) +
            (row["kind"] == "ps"))

    report = json.loads((out / "results.json").read_text())
    assert [r["run"] for r in report["rows"]] == RUNS
    for row in report["rows"]:
        assert all(math.isfinite(row[c]) and row[c] > 0 for c in NUMBERS)
    # Same seed, same batches: every configuration learns the same model.
    accuracies = {round(r["test_accuracy"], 4) for r in report["rows"]}
    assert max(accuracies) - min(accuracies) <= 0.001

    for run in RUNS:  # each run's TensorBoard logs in its own folder
        assert list((out / run).glob("events.out.tfevents.*")), run
    if importlib.util.find_spec("matplotlib"):
        assert (out / "results.png").stat().st_size > 10_000
    else:
        assert "matplotlib is not installed" in result.stdout
    check_tensorboard_shows(out, tmp_path, report["rows"])


def check_tensorboard_shows(out, work, rows) -> None:
    """A real TensorBoard over the benchmark's output lists every run, its
    scalars and the HParams experiment with every run's metrics."""
    metric_tags = {dashboard.metric_tag(m) for m in dashboard.METRICS}
    with tensorboard(out, work) as (process, base):
        runs = poll(lambda: get_json(base + "/data/runs"),
                    lambda r: set(RUNS) <= set(r), "runs")
        groups = poll(lambda: session_groups(base),
                      lambda g: sum(len(x.get("metricValues", []))
                                    for x in g.get("sessionGroups", []))
                      == len(RUNS) * len(metric_tags),
                      "every run's metrics in the HParams view")
        tags = get_json(base + "/data/plugin/scalars/tags")
        experiment = get_json(base + "/data/plugin/hparams/experiment",
                              {"experimentName": ""})
    assert process.returncode == 0
    assert set(RUNS) <= set(runs)
    for run in RUNS:
        assert metric_tags <= set(tags[run]), (run, tags[run])
        assert "eval/accuracy" in tags[run], (run, tags[run])
    assert {i["name"] for i in experiment["hparamInfos"]} >= {
        "kind", "workers", "ps_tasks", "model", "batch"}
    assert {i["name"]["tag"] for i in experiment["metricInfos"]} == \
        metric_tags
    by_name = {g["name"]: g for g in groups["sessionGroups"]}
    assert set(by_name) == set(RUNS)
    for row in rows:
        group = by_name[row["run"]]
        assert group["hparams"]["kind"] == row["kind"]
        assert group["hparams"]["workers"] == row["workers"]
        values = {v["name"]["tag"]: v["value"] for v in group["metricValues"]}
        assert values[dashboard.metric_tag("images_per_sec")] == \
            pytest.approx(row["images_per_sec"], rel=1e-5)
        assert values[dashboard.metric_tag("final_test_accuracy")] == \
            pytest.approx(row["test_accuracy"], rel=1e-5)


@pytest.mark.parametrize("make_args, phrase", [
    (lambda out: ["--batch_size=3", "--workers=1,4"],
     "--batch_size=3 is smaller than the 4 workers"),
    (lambda out: ["--workers=1,two"], "--workers=1,two must be"),
    (lambda out: ["--baselines=single,horovod"], "unknown horovod"),
    (lambda out: ["--hosts=simulated", "--host_cpu_period_ms=0.5"],
     "bad CPU budget period 0.5 ms"),
    # A used --out holds final checkpoints the runs would resume from.
    (lambda out: (out.mkdir(), (out / "ps_1w").mkdir(), [])[-1],
     "already holds a benchmark"),
])
def test_benchmark_refuses_bad_settings_before_any_run(tmp_path, make_args,
                                                       phrase):
    out = tmp_path / "bench"
    result = helpers.run(["-m", "trainer.benchmark", f"--out={out}",
                          *make_args(out)], timeout=120)
    assert result.returncode == 2, result.stdout[-3000:]
    assert phrase in result.stdout
    assert "Traceback" not in result.stdout
    assert "starting" not in result.stdout  # no run was started


def test_a_failed_process_ends_its_run_at_once():
    """A ps would wait for a dead chief until the run's timeout: the
    benchmark stops the rest of a run as soon as one process fails."""
    def python(code, **kwargs):
        return subprocess.Popen([sys.executable, "-c", code], text=True,
                                **kwargs)

    chief = python("import time; print('step 1/9 x ETA 0:00:09'); "
                   "time.sleep(0.5); raise SystemExit(3)",
                   stdout=subprocess.PIPE)
    waiting_ps = python("import time; time.sleep(120)")
    started = time.monotonic()
    try:
        statuses = runs.stream([chief, waiting_ps], "test run", timeout=100)
    finally:
        for p in (chief, waiting_ps):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert statuses[0] == 3
    assert statuses[1] == -15  # SIGTERM from the benchmark, not its own end
    assert time.monotonic() - started < 15


def test_the_ps_link_bound():
    """(N x S + P) x W x 8 / R: N workers pull the largest shard S in turn,
    then the last pushes all P parameters' gradient over its own link."""
    mlp = TrainConfig(logdir="x", model="mlp")  # 101,770 parameters
    float32_ms = 1000 * (4 * 101_770 + 101_770) * 4 * 8 / 100e6
    assert bound.ps_link_bound_ms(mlp, 1, 4, int(100e6)) == \
        pytest.approx(float32_ms)
    bf16 = TrainConfig(logdir="x", model="mlp", wire_dtype="bfloat16")
    assert bound.ps_link_bound_ms(bf16, 1, 4, int(100e6)) == \
        pytest.approx(float32_ms / 2)
    # Two ps tasks, the parameters cut by bytes: half each (to an element).
    halves_ms = 1000 * (4 * 50_885 + 101_770) * 4 * 8 / 100e6
    assert bound.ps_link_bound_ms(mlp, 2, 4, int(100e6)) == \
        pytest.approx(halves_ms, rel=1e-4)


def test_every_peer_runs_and_says_how_it_ended(tmp_path):
    """mwms, sro and async beside the ps trainer, two workers each: every
    row, the x mwms ratio, the recipe's pushes and who the benchmark had to
    stop (servers that never return), read back from results.json."""
    data = helpers.fake_mnist(tmp_path / "data")
    out = tmp_path / "bench"
    result = helpers.run(
        ["-m", "trainer.benchmark", "--model=softmax", "--train_steps=20",
         "--batch_size=32", "--workers=2", "--baselines=mwms,sro,async",
         "--eval_every=10", "--log_every=10", f"--data_dir={data}",
         "--nodownload", f"--out={out}"], timeout=900)
    assert result.returncode == 0, result.stdout[-3000:]
    rows = {r["run"]: r for r in
            json.loads((out / "results.json").read_text())["rows"]}
    assert list(rows) == ["ps_2w", "mwms_2w", "sro_2w", "async_2w"]
    mwms = rows["mwms_2w"]["images_per_sec"]
    for name, row in rows.items():
        assert row["x_mwms"] == pytest.approx(row["images_per_sec"] / mwms)
        assert 0 < row["test_accuracy"] <= 1
    assert rows["mwms_2w"]["ended_by_itself"] == "yes"
    # The recipe's ps blocks in server.join(); async's servers never end.
    assert "ps0" in rows["sro_2w"]["ended_by_itself"]
    assert rows["async_2w"]["ended_by_itself"].startswith("no: stopped")
    pushed = dict(p.split(":") for p in
                  rows["sro_2w"]["pushed_gradients"].split(";"))
    # Who pushes what depends on timing (one shared token queue: either
    # worker may take most tokens). What holds for any timing: the 20
    # applied steps averaged 2 gradients each, and every one of those 40
    # was counted by its worker, except at most one in flight on worker 1
    # when the benchmark stopped it: a push that never returned. (Its count
    # is on disk twice a second, and it is stopped only seconds after the
    # chief, which applies no step after its last.)
    assert set(pushed) == {"0", "1"}
    assert sum(int(n) for n in pushed.values()) >= 2 * 20 - 1
    # async: one update per global batch of 32, each batch trained once,
    # whichever worker ran it.
    whole = json.loads((out / "async_2w.chief.json").read_text())
    assert (whole["functions"], whole["examples_per_update"],
            whole["distinct_slices"]) == (20, 32, 20)


def test_each_peer_is_one_module_that_declares_its_processes(tmp_path):
    """The peers are found from their modules, in their declared order,
    and the command line written for a process is the one it reads back."""
    found = peers.all_peers()
    assert list(found) == ["mwms", "sro", "async", "async_split"]
    for peer in found.values():
        spec = importlib.util.find_spec(peer.module)
        assert spec is not None and spec.origin.endswith(".py")
    assert peers.get("mwms").roles(2, 3) == [("worker", 0), ("worker", 1)]
    assert peers.task_counts("async", 2, 1) == {"chief": 1, "worker": 2,
                                                "ps": 1}
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"logdir": str(tmp_path), "model": "softmax",
                                  "batch_size": 8}))
    addresses = {"worker": ["a:1", "b:2"], "ps": ["p:3"], "chief": []}
    (task,) = [t for t in peers.tasks("sro", config, tmp_path, "r",
                                      addresses) if t.name == "ps0"]
    assert task.argv[:2] == ["-m", "trainer.bench.baselines.sro"]
    seen = []
    assert peer_lib.main(peers.get("sro"), lambda *a: seen.append(a),
                         ["prog", *task.argv[2:]]) == 0
    ((got_config, out, job, index, hosts),) = seen
    assert (got_config.model, got_config.batch_size) == ("softmax", 8)
    assert (out, job, index) == (str(task.out_json), "ps", 0)
    assert hosts == {"worker": ["a:1", "b:2"], "ps": ["p:3"]}


def test_simulated_runs_start_the_projects_scripts():
    """The per-machine scripts the simulated-host runs start exist where
    the runs look for them."""
    assert simulated.REPO == helpers.REPO
    assert (simulated.REPO / "run_worker.sh").exists()
    assert (simulated.REPO / "run_ps.sh").exists()


def test_the_straggler_is_cut_once_when_training_runs():
    """--straggler: the last worker's host drops to a tenth of its budget
    at the leader's first-step line, once."""
    class Host:
        name, cuts = "w3", []

        def set_cpu(self, cores):
            self.cuts.append(cores)

    host = Host()
    watch = simulated.Straggler(host, 0.3)
    watch("I1123 step 0 ...: starting")
    assert host.cuts == []
    watch(f"I1123 progress.py:132] {progress_line.FIRST_STEP_DONE} in 3.1 s")
    watch(f"I1123 progress.py:132] {progress_line.FIRST_STEP_DONE} in 3.1 s")
    assert host.cuts == [pytest.approx(0.03)]


def test_a_failed_peer_gets_an_error_row_and_the_rest_goes_on(tmp_path):
    config = TrainConfig(logdir=str(tmp_path), model="softmax")
    s = runs.Settings(tmp_path, config, [], 1, 60)
    results = {"images_per_sec": 100.0, "final_test_accuracy": 0.9,
               "wall_time_secs": 2.0, "train_time_secs": 1.0,
               "mean_step_time_ms": 5.0, "eval_history": []}
    grouped = [[runs.Run("ps_2w", "ps", 2, results, {"chief": 500.0})],
               [runs.Run("sro_2w", "sro", 2, {}, {}, error="sro_2w failed "
                         "with statuses [1, 0, 0]")]]
    rows, _ = rows_lib.make_rows(s, grouped, 0.99)
    assert rows[1] == {"run": "sro_2w", "kind": "sro", "workers": 2,
                       "error": "sro_2w failed with statuses [1, 0, 0]"}
    table = report.write_outputs(tmp_path, rows, 0.99)
    assert "sro_2w failed with statuses [1, 0, 0]" in table
    assert json.loads((tmp_path / "results.json").read_text())["rows"][1][
        "error"].startswith("sro_2w failed")
