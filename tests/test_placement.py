"""Placement on simulated hosts: the benchmark's peers and colocated ps.

Each run goes through `python -m trainer.benchmark --hosts=simulated`, so
the hosts, links and budgets are the benchmark's own; the rows are read
back from its results.json. Needs root, namespaces, tbf and the cgroup v1
cpu controller (skipped with check_available()'s one-line reason).
"""

import json
import subprocess

import pytest

from tests import helpers
from tests.test_cluster_runs import differing, final_parameters
from tests.test_hosts import available  # noqa: F401 (a fixture)
from trainer.bench.simhosts import bound
from trainer.common.config import TrainConfig

pytestmark = pytest.mark.hosts

FLAGS = ("--hosts=simulated", "--host_cpu=0.4", "--link_rate=1gbit",
         "--model=mlp", "--hidden_units=32", "--batch_size=64", "--seed=3",
         "--optimizer=sgd", "--learning_rate=0.1", "--train_steps=30",
         "--log_every=10", "--eval_every=30", "--nodownload")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return helpers.fake_mnist(tmp_path_factory.mktemp("fake_mnist"))


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True,
                             text=True, check=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line}


def benchmark(out, data, *flags) -> dict:
    """Runs the benchmark; its rows by run name. Checks it left no
    namespace behind."""
    before = namespaces()
    result = helpers.run(["-m", "trainer.benchmark", *FLAGS,
                          f"--data_dir={data}", f"--out={out}", *flags],
                         timeout=900)
    assert result.returncode == 0, result.stdout[-3000:]
    assert namespaces() <= before
    return {r["run"]: r for r in
            json.loads((out / "results.json").read_text())["rows"]}


# With --runslow only (CI's time): the peers run on loopback in
# tests/test_benchmark.py, and simulated hosts in tests/test_hosts.py.
@pytest.mark.slow
def test_mwms_and_colocated_ps_on_hosts(available, data, tmp_path):
    rows = benchmark(tmp_path / "bench", data, "--workers=2", "--num_ps=2",
                     "--ps_placement=colocated", "--baselines=mwms")
    ps, mwms = rows["ps_2w"], rows["mwms_2w"]
    config = TrainConfig(logdir="x", model="mlp", hidden_units=32)
    assert ps["ps_placement"] == "colocated"
    assert ps["ps_link_bound_ms"] == pytest.approx(bound.ps_link_bound_ms(
        config, 2, 2, 10**9, "colocated"))
    assert ps["link_share"] == pytest.approx(ps["ps_link_bound_ms"]
                                             / ps["mean_step_time_ms"])
    assert mwms["ring_bound_ms"] == pytest.approx(bound.ring_bound_ms(
        config, 2, 10**9))
    assert ps["x_mwms"] == pytest.approx(ps["images_per_sec"]
                                         / mwms["images_per_sec"])
    assert mwms["ended_by_itself"] == "yes"
    assert ps["test_accuracy"] == pytest.approx(mwms["test_accuracy"],
                                                abs=0.02)


# Slow (81 s): sharded parameters are exact in
# tests/test_cluster_runs.py::test_two_ps_tasks_and_a_resume_on_another_shape
# and colocated runs train in test_mwms_and_colocated_ps_on_hosts.
@pytest.mark.slow
def test_colocated_placement_is_exact(available, data, tmp_path):
    """One worker (and its ps) against 4 workers each beside a ps task:
    the same parameters after the same steps."""
    one = tmp_path / "one"
    benchmark(one, data, "--workers=1", "--num_ps=1",
              "--ps_placement=colocated", "--baselines=")
    four = tmp_path / "four"
    rows = benchmark(four, data, "--workers=4", "--num_ps=4",
                     "--ps_placement=colocated", "--baselines=")
    assert rows["ps_4w"]["ps_placement"] == "colocated"
    assert not differing(final_parameters(one / "ps_1w"),
                         final_parameters(four / "ps_4w"))
