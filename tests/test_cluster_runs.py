"""Real clusters of OS processes on loopback, started by the local launcher.

Every run picks free ports (the launcher does), is bounded by a timeout and
kills what it started; the launcher's children die with it.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from trainer.observe import summaries

pytestmark = pytest.mark.cluster
STEPS = 20


@pytest.fixture(scope="module")
def fake_data(tmp_path_factory):
    return helpers.fake_mnist(tmp_path_factory.mktemp("fake_mnist"))


def final_parameters(logdir) -> dict:
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(logdir)))
    return {name: reader.get_tensor(name)
            for name in reader.get_variable_to_shape_map()
            if name.startswith("model/")}


def max_relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(a[k])))
               for k in a)


def differing(a: dict, b: dict) -> list[str]:
    """The variables of two final_parameters whose bits differ (the
    default fixed-point sums make any two runs of one training equal)."""
    assert a.keys() == b.keys()
    return [k for k in a if a[k].tobytes() != b[k].tobytes()]


def train(tmp_path, data, workers, *flags, num_ps=1, logdir=None):
    logdir = logdir or tmp_path / f"{workers}_workers_{num_ps}_ps"
    result = helpers.launch(logdir, data, workers, *flags, num_ps=num_ps)
    assert result.returncode == 0, result.stdout[-3000:]
    results = json.loads((logdir / "results.json").read_text())
    return logdir, results


@pytest.mark.parametrize("model, flags, dataset", [
    ("mlp", ("--optimizer=sgd", "--learning_rate=0.1"), "fake"),
    ("cnn", ("--optimizer=sgd", "--learning_rate=0.05"), "mnist"),
])
def test_more_workers_give_the_same_parameters(tmp_path, fake_data, model,
                                               flags, dataset):
    data = fake_data if dataset == "fake" else helpers.real_mnist_dir()
    if data is None:
        pytest.skip("real MNIST not found in $MNIST_DATA_DIR or "
                    "../shared/mnist")
    common = (f"--model={model}", "--batch_size=64",
              f"--train_steps={STEPS}", "--seed=7", "--log_every=10",
              *flags)
    reference_dir, reference = train(tmp_path, data, 1, *common)
    expected = final_parameters(reference_dir)
    runs = ([(2,), (3,), (3, "--ordered_pulls")] if model == "mlp"
            else [(2,)])
    for workers, *extra in runs:
        logdir, results = train(
            tmp_path, data, workers, *common, *extra,
            # Every worker in every step, in equal slices (balanced ones may
            # leave a worker slowed by this busy machine out for a while).
            f"--min_workers={workers}", "--slices=equal",
            logdir=tmp_path / f"{workers}_workers{''.join(extra)}")
        differ = differing(expected, final_parameters(logdir))
        shape = " ".join([f"{workers} workers", *extra])
        print(f"{model}: 1 vs {shape}, global batch 64: variables that "
              f"differ: {differ}")
        assert not differ
        assert results["global_step"] == STEPS
        assert results["averaged_steps"] == {str(k): STEPS
                                          for k in range(workers)}
        assert results["dropped_gradients"] == 0
    assert reference["averaged_steps"] == {"0": STEPS}


def test_runs_have_the_same_bits_for_any_shape_with_no_flags(tmp_path,
                                                             fake_data):
    # Float sums differ in their last bits from the first step with
    # another slicing; the default fixed-point sums must not, in any
    # variable (Adam's slots included), on any number of workers or ps
    # tasks. No flag asks for it.
    common = ("--model=mlp", "--batch_size=64", f"--train_steps={STEPS}",
              "--seed=7", "--log_every=10")
    reference_dir, _ = train(tmp_path, fake_data, 1, *common)
    expected = final_parameters(reference_dir)
    assert any(name.endswith("/v") for name in expected)
    for workers, num_ps, extra in [(2, 1, ()), (4, 1, ()), (3, 1, ()),
                                   (2, 2, ("--slices=equal",))]:
        logdir, results = train(tmp_path, fake_data, workers, *common,
                                *extra, num_ps=num_ps)
        assert sum(results["averaged_examples"].values()) == 64 * STEPS
        values = final_parameters(logdir)
        differ = differing(expected, values)
        assert not differ, f"{workers} workers, {num_ps} ps: {differ}"


def test_a_batch_of_fewer_micro_batches_than_workers_trains_the_same_bits(
        tmp_path, fake_data):
    # 16 rows in micro-batches of 8 among 3 workers: the chief and
    # worker 1 compute one each, worker 2 sits every round out
    # (slices.at_most), and the sums are still the one-worker run's.
    common = ("--model=mlp", "--batch_size=16", "--micro_batch=8",
              f"--train_steps={STEPS}", "--seed=7", "--log_every=10")
    reference_dir, _ = train(tmp_path, fake_data, 1, *common)
    logdir, results = train(tmp_path, fake_data, 3, *common,
                            "--min_workers=3")
    examples = results["averaged_examples"]
    assert sum(examples.values()) == 16 * STEPS
    assert examples["2"] == 0, examples
    assert not differing(final_parameters(reference_dir),
                         final_parameters(logdir))


# With --runslow only (CI's time): two ps tasks are exact, bit for bit, in
# test_deterministic_runs_have_the_same_bits_for_any_shape, and a
# checkpoint read back on other shard counts in tests/test_params.py
# (test_checkpoint_uses_parameter_names_and_fits_other_shard_counts).
@pytest.mark.slow
def test_two_ps_tasks_and_a_resume_on_another_shape(tmp_path, fake_data):
    common = ("--model=mlp", "--optimizer=sgd", "--learning_rate=0.1",
              "--lr_schedule=constant", "--batch_size=64", "--seed=3",
              "--log_every=10", "--checkpoint_every=10")
    reference_dir, _ = train(tmp_path, fake_data, 1, *common,
                             f"--train_steps={STEPS}")
    expected = final_parameters(reference_dir)
    # The same 20 steps on 2 ps + 2 workers.
    sharded_dir, results = train(tmp_path, fake_data, 2, *common,
                                 f"--train_steps={STEPS}", num_ps=2)
    assert results["num_ps"] == 2
    assert not differing(expected, final_parameters(sharded_dir))
    # And with ordered pulls, each shard serving the workers in its order.
    ordered_dir, _ = train(tmp_path, fake_data, 3, *common, "--ordered_pulls",
                           f"--train_steps={STEPS}", num_ps=2,
                           logdir=tmp_path / "ordered")
    assert not differing(expected, final_parameters(ordered_dir))
    # Half the steps on 2 ps + 2 workers, the rest after a restart on
    # 1 ps + 3 workers from the same logdir.
    resumed = tmp_path / "resumed"
    train(tmp_path, fake_data, 2, *common, f"--train_steps={STEPS // 2}",
          num_ps=2, logdir=resumed)
    _, results = train(tmp_path, fake_data, 3, *common,
                       f"--train_steps={STEPS}",
                       "--continue_with_new_settings", logdir=resumed)
    assert results["global_step"] == STEPS
    assert results["steps_this_run"] == STEPS // 2
    assert not differing(expected, final_parameters(resumed))


def event_tags(logdir) -> set:
    tags = set()
    for path in logdir.glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            tags.update(value.tag for value in event.summary.value)
    return tags


def run_cards(logdir) -> list[str]:
    """The text of every run/start card in logdir's event files."""
    return [tf.make_ndarray(value.tensor).item().decode()
            for path in logdir.glob("events.out.tfevents.*")
            for event in tf.compat.v1.train.summary_iterator(str(path))
            for value in event.summary.value
            if value.tag == summaries.RUN_TEXT_TAG]


def test_mlp_on_real_mnist_reaches_97_percent(tmp_path):
    data = helpers.real_mnist_dir()
    if data is None:
        pytest.skip("real MNIST not found in $MNIST_DATA_DIR or "
                    "../shared/mnist")
    logdir = tmp_path / "mlp"
    start = time.monotonic()
    result = helpers.launch(logdir, data, 2, "--model=mlp", "--epochs=8",
                            "--min_workers=2", "--slices=equal",
                            timeout=400)
    wall = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-3000:]
    assert "every task exited 0" in result.stdout
    results = json.loads((logdir / "results.json").read_text())
    print(f"mlp, 1 ps + 2 workers: test accuracy "
          f"{results['final_test_accuracy']:.4f} in {wall:.1f} s "
          f"(training {results['wall_time_secs']:.1f} s, "
          f"{results['images_per_sec']:.0f} images/s)")
    assert results["final_test_accuracy"] >= 0.97
    assert results["num_workers"] == 2 and results["num_ps"] == 1
    assert results["averaged_steps"]["1"] == results["global_step"]
    assert {"train/loss", "train/accuracy", "train/learning_rate",
            "perf/images_per_sec", "perf/step_time_ms",
            "sync/dropped_gradients", "eval/accuracy",
            "eval/loss", summaries.RUN_TEXT_TAG} <= event_tags(logdir)
    # The launcher's status line, plain lines in a pipe.
    statuses = [line for line in result.stdout.splitlines()
                if line.startswith("[status] ")]
    steps = results["global_step"]
    assert statuses[-1].startswith(f"[status] step {steps}/{steps} (100%)")
    # The slices come from the chief's membership watch, every
    # timing.MEMBERSHIP_CHECK_SECS: a fast run's first line may precede
    # its first check, and then names none.
    named = [line for line in statuses if " workers in" in line]
    assert statuses[-1] in named, statuses
    assert all(" of 2 workers in: slices " in line for line in named)
    (card,) = run_cards(logdir)
    assert "| model | `mlp` |" in card
    assert results["cluster"]["worker"][1] in card
    assert "| tensorflow | `" in card and "| commit | `" in card


def pids_started(output: str) -> list[int]:
    return [int(p) for p in re.findall(r"started \w+ \(pid (\d+)\)", output)]


def assert_all_gone(pids, within=10.0):
    deadline = time.monotonic() + within
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"still running: {alive}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is as good as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_failed_task_stops_the_whole_cluster(tmp_path):
    empty = tmp_path / "no_data"
    empty.mkdir()
    start = time.monotonic()
    result = helpers.launch(tmp_path / "logs", empty, 2, timeout=120)
    assert result.returncode == 2, result.stdout[-3000:]
    assert time.monotonic() - start < 60
    assert "is missing and downloading is off" in result.stdout
    assert "exited with status 2; stopping the others" in result.stdout
    assert "Traceback" not in result.stdout
    pids = pids_started(result.stdout)
    assert len(pids) == 3
    assert_all_gone(pids)


def test_ctrl_c_stops_every_task(tmp_path, fake_data):
    status, output = helpers.interrupt_launch(
        ["--num_workers=2", f"--logdir={tmp_path / 'logs'}",
         f"--data_dir={fake_data}", "--model=mlp",
         "--train_steps=100000000"], when="worker 1 joined")
    assert status == 130, output[-3000:]
    assert "interrupted: stopping every task" in output
    assert_all_gone(pids_started(output))


def test_backup_workers_use_the_first_replicas(tmp_path, fake_data):
    steps = 40
    logdir, results = train(tmp_path, fake_data, 3, "--model=mlp",
                            "--backup_workers=1", "--min_workers=3",
                            "--slices=equal",
                            f"--train_steps={steps}",
                            "--batch_size=60", "--log_every=20")
    assert results["global_step"] == steps
    assert results["replicas_to_aggregate"] == 2
    # Every gradient pushed was admitted (2 per step), dropped as late, or
    # still queued when training ended (at most one per backup worker...
    # or per worker that was mid-step).
    pushed = sum(results["pushed_gradients"].values())
    # averaged_steps counts admissions on the ps: exactly R = 2 per step.
    assert sum(results["averaged_steps"].values()) == 2 * steps
    leftover = pushed - 2 * steps - results["dropped_gradients"]
    print(f"backup run: pushed {pushed}, dropped "
          f"{results['dropped_gradients']}, left over {leftover}")
    assert 0 <= leftover <= 2


def start(args, env, log_path):
    log = open(log_path, "w")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=helpers.REPO, start_new_session=True)


def test_tasks_start_in_any_order_from_scripts_and_tf_config(tmp_path,
                                                             fake_data):
    ps, chief, worker = (f"localhost:{p}" for p in helpers.free_ports(3))
    hosts = dict(PS_HOSTS=ps, WORKER_HOSTS=f"{chief},{worker}",
                 PYTHON=sys.executable)
    flags = ["--model=mlp", "--train_steps=30", f"--data_dir={fake_data}",
             "--nodownload", "--log_every=10"]
    tf_config = json.dumps({"cluster": {"chief": [chief], "worker": [worker],
                                        "ps": [ps]},
                            "task": {"type": "chief", "index": 0}})
    processes = []
    try:
        processes.append(start(
            [str(helpers.REPO / "run_worker.sh"), "1", *flags],
            helpers.python_env(**hosts), tmp_path / "worker1.log"))
        processes.append(start(
            [sys.executable, "-m", "trainer.main", *flags,
             f"--logdir={tmp_path / 'logs'}"],
            helpers.python_env(TF_CONFIG=tf_config), tmp_path / "chief.log"))
        # Start the ps only once both workers say they are waiting for it.
        deadline = time.monotonic() + 120
        while not all("waiting for ps 0" in (tmp_path / f"{name}.log")
                      .read_text() for name in ("worker1", "chief")):
            assert time.monotonic() < deadline, "workers never waited"
            assert all(p.poll() is None for p in processes)
            time.sleep(0.2)
        processes.append(start([str(helpers.REPO / "run_ps.sh"), "0"],
                               helpers.python_env(**hosts),
                               tmp_path / "ps.log"))
        statuses = [p.wait(timeout=120) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    logs = {name: (tmp_path / f"{name}.log").read_text()
            for name in ("worker1", "chief", "ps")}
    assert statuses == [0, 0, 0], logs
    assert "cluster from TF_CONFIG" in logs["chief"]
    assert "cluster from flags" in logs["worker1"]
    assert re.search(r"worker 1 finished: \d+ gradients pushed",
                     logs["worker1"])
    results = json.loads((tmp_path / "logs" / "results.json").read_text())
    assert results["global_step"] == 30
