"""The HParams dashboard: what it writes, and what real TensorBoard serves."""

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import tensorflow as tf

from trainer.bench import dashboard
from trainer.bench import peers
from trainer.common.errors import UserError

DOMAINS = {"kind": ["ps", "single", "mwms"], "workers": [1, 2],
           "ps_tasks": [0, 1], "model": ["cnn"], "batch": [128],
           "host_cpu": [0.5], "link_rate": ["1gbit"]}
BASE = {"model": "cnn", "batch": 128}
# run -> (hparams, metrics); mwms_2w never reached the target accuracy.
RUNS = {
    "ps_1w": ({"kind": "ps", "workers": 1, "ps_tasks": 1, **BASE},
              {"final_test_accuracy": 0.9931, "images_per_sec": 2788.0,
               "efficiency": 0.81, "time_to_target_secs": 110.0}),
    "ps_2w": ({"kind": "ps", "workers": 2, "ps_tasks": 1, **BASE,
               "host_cpu": 0.5, "link_rate": "1gbit"},
              {"final_test_accuracy": 0.9926, "images_per_sec": 2778.0,
               "efficiency": 0.80, "time_to_target_secs": 86.0}),
    "single_2t": ({"kind": "single", "workers": 1, "ps_tasks": 0, **BASE},
                  {"final_test_accuracy": 0.9931, "images_per_sec": 3456.0,
                   "efficiency": 1.0, "time_to_target_secs": 90.0}),
    "mwms_2w": ({"kind": "mwms", "workers": 2, "ps_tasks": 0, **BASE},
                {"final_test_accuracy": 0.9612, "images_per_sec": 2737.0,
                 "efficiency": 0.79, "time_to_target_secs": None}),
}
STEP_TAGS = ("eval/accuracy", "perf/images_per_sec")
LAST_STEP = 200
TIMEOUT_SECS = 60


def write_benchmark(out: pathlib.Path) -> None:
    """A tiny benchmark output: the experiment and four runs."""
    dashboard.write_experiment(out, DOMAINS)
    for name, (hparams, metrics) in RUNS.items():
        final = metrics["final_test_accuracy"]
        dashboard.write_run(out, name, hparams, metrics, {
            "eval/accuracy": [(100, final - 0.01), (LAST_STEP, final)],
            "perf/images_per_sec": [(LAST_STEP, metrics["images_per_sec"])]})


def read_scalars(logdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from the event files directly in logdir."""
    found = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "scalars":
                    found.setdefault(value.tag, []).append(
                        (event.step, float(tf.make_ndarray(value.tensor))))
    return found


def test_writes_eagerly_from_inside_a_graph(tmp_path):
    # As trainer code does: a tf.compat.v1 graph is the default here.
    with tf.Graph().as_default() as graph:
        dashboard.write_experiment(tmp_path, DOMAINS)
        dashboard.write_run(
            tmp_path, "ps_1w", RUNS["ps_1w"][0],
            {"final_test_accuracy": 0.99, "efficiency": float("nan"),
             "time_to_target_secs": None},
            {"eval/accuracy": [(5, 0.5), (9, 0.75)]})
    assert graph.get_operations() == []
    assert read_scalars(tmp_path / "ps_1w") == {
        "hparams/final_test_accuracy": [(9, pytest.approx(0.99))],
        "eval/accuracy": [(5, 0.5), (9, 0.75)]}


@pytest.mark.parametrize("call, message", [
    (lambda out: dashboard.write_experiment(out, {"threads": [1]}),
     "unknown hparam 'threads'"),
    (lambda out: dashboard.write_experiment(out, {"workers": ["2"]}),
     "hparam 'workers' must be of type int"),
    (lambda out: dashboard.write_experiment(out, {"kind": ["horovod"]}),
     "hparam 'kind' is 'horovod'"),
    (lambda out: dashboard.write_experiment(out, {"model": []}),
     "hparam 'model' has no values"),
    (lambda out: dashboard.write_experiment(out, {}, ["speedup"]),
     "unknown metric 'speedup'"),
    (lambda out: dashboard.write_run(out / "new", "r", {}, {}),
     "no experiment in"),
    (lambda out: dashboard.write_run(out, "../r", {}, {}), "bad run name"),
    (lambda out: dashboard.write_run(out, "r", {"threads": 1}, {}),
     "unknown hparam 'threads'"),
    (lambda out: dashboard.write_run(out, "r", {"workers": 4}, {}),
     "hparam 'workers' = 4 is not among the experiment's values [1, 2]"),
    (lambda out: dashboard.write_run(out, "r", {"model": "mlp"}, {}),
     "not in the experiment"),
    (lambda out: dashboard.write_run(out, "r", {}, {"images_per_sec": 5.0}),
     "metric 'images_per_sec' is not in the experiment"),
    (lambda out: dashboard.write_run(out, "r", {}, {},
                                     {"hparams/efficiency": [(0, 1.0)]}),
     "bad scalar tag"),
    (lambda out: dashboard.write_run(out, "r", {}, {},
                                     {"loss": [(-1, 1.0)]}), "has step -1"),
])
def test_rejects_bad_input(tmp_path, call, message):
    dashboard.write_experiment(
        tmp_path, {"workers": [1, 2], "kind": list(peers.all_kinds())},
        ["final_test_accuracy"])
    with pytest.raises(UserError, match=re.escape(message)):
        call(tmp_path)
    assert not (tmp_path / "r").exists()


def get_json(url: str, body: dict | None = None):
    """GET url, or POST body as JSON; the answer parsed."""
    request = urllib.request.Request(
        url, data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def poll(fetch, done, what: str):
    """fetch() until done(answer) or TIMEOUT_SECS pass; the last answer."""
    deadline = time.monotonic() + TIMEOUT_SECS
    while True:
        try:
            answer = fetch()
        except OSError:  # not listening yet, or reset while starting
            answer = None
        if answer is not None and done(answer):
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {TIMEOUT_SECS} s; last "
                                 f"answer: {answer}")
        time.sleep(0.5)


@contextlib.contextmanager
def tensorboard(logdir: pathlib.Path, work: pathlib.Path):
    """Serves logdir on 127.0.0.1; yields (process, base URL).

    Port 0: TensorBoard binds a free port itself (no race) and prints it.
    --load_fast=false keeps it one process (no Rust data server child).
    TMPDIR keeps its .tensorboard-info file in `work`. It makes no
    outgoing connections, so the missing internet does not stall it.
    """
    log = work / "tensorboard.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", f"--logdir={logdir}",
             "--host=127.0.0.1", "--port=0", "--load_fast=false",
             "--reload_interval=1"],
            stdout=sink, stderr=subprocess.STDOUT,
            env=dict(os.environ, TMPDIR=str(work), TF_CPP_MIN_LOG_LEVEL="3"))
    try:
        match, status = poll(
            lambda: (re.search(r"http://127\.0\.0\.1:(\d+)/",
                               log.read_text()), process.poll()),
            lambda answer: answer[0] or answer[1] is not None, "URL")
        assert status is None, log.read_text()[-3000:]
        yield process, f"http://127.0.0.1:{match.group(1)}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


def session_groups(base: str) -> dict:
    return get_json(base + "/data/plugin/hparams/session_groups", {
        "experimentName": "", "startIndex": 0, "sliceSize": 100,
        "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS",
                            "STATUS_FAILURE", "STATUS_RUNNING"]})


def all_metrics_loaded(answer: dict) -> bool:
    want = sum(v is not None for _, m in RUNS.values() for v in m.values())
    return sum(len(g.get("metricValues", []))
               for g in answer.get("sessionGroups", [])) == want


def test_tensorboard_serves_the_experiment(tmp_path):
    out = tmp_path / "bench"
    write_benchmark(out)
    with tensorboard(out, tmp_path) as (process, base):
        runs = poll(lambda: get_json(base + "/data/runs"),
                    lambda r: set(RUNS) <= set(r), "runs")
        groups = poll(lambda: session_groups(base), all_metrics_loaded,
                      "session groups with every metric value")
        tags = get_json(base + "/data/plugin/scalars/tags")
        experiment = get_json(base + "/data/plugin/hparams/experiment",
                              {"experimentName": ""})
        accuracy = get_json(base + "/data/plugin/scalars/scalars?run=ps_2w"
                                   "&tag=eval/accuracy")
    assert process.returncode == 0  # SIGTERM: TensorBoard's clean exit

    assert sorted(runs) == sorted(["."] + list(RUNS))
    for name, (_, metrics) in RUNS.items():
        assert set(tags[name]) == {
            dashboard.metric_tag(m) for m, v in metrics.items()
            if v is not None} | set(STEP_TAGS), name
    assert [(step, value) for _, step, value in accuracy] == [
        (100, pytest.approx(0.9826)), (LAST_STEP, pytest.approx(0.9926))]

    infos = {i["name"]: i for i in experiment["hparamInfos"]}
    assert set(infos) == set(DOMAINS)
    assert infos["kind"]["domainDiscrete"] == sorted(DOMAINS["kind"])
    assert infos["host_cpu"]["displayName"] == "host CPU"
    assert sorted(i["name"]["tag"] for i in experiment["metricInfos"]) == \
        sorted(dashboard.metric_tag(m) for m in dashboard.METRICS)

    by_name = {g["name"]: g for g in groups["sessionGroups"]}
    assert set(by_name) == set(RUNS)
    for name, (hparams, metrics) in RUNS.items():
        group = by_name[name]
        assert group["hparams"] == hparams, name
        shown = {v["name"]["tag"]: (v["trainingStep"], v["value"])
                 for v in group["metricValues"]}
        assert shown == {
            dashboard.metric_tag(m): (LAST_STEP, pytest.approx(v))
            for m, v in metrics.items() if v is not None}, name
