"""--cluster=kubernetes: each pod of the two StatefulSets derives the same
cluster and its own role from its name (trainer/cluster/kubernetes.py)."""

import signal

import pytest

from tests import helpers
from trainer.cluster import spec
from trainer.cluster import kubernetes
from trainer.common.errors import UserError

PODS = ["mnist-ps-0", "mnist-worker-0", "mnist-worker-1", "mnist-worker-2"]


def task(name: str, num_ps: int = 1, workers: int | None = 3,
         port: int = 2222, env_key: str = "POD_NAME"):
    return kubernetes.task_from_pod({env_key: name}, num_ps, workers, port)


def test_every_pod_derives_the_same_cluster_and_its_role():
    tasks = [task(name) for name in PODS]
    assert {t.cluster for t in tasks} == {tasks[0].cluster}
    cluster = tasks[0].cluster
    assert cluster.ps == ("mnist-ps-0.mnist-ps:2222",)
    assert cluster.workers == tuple(f"mnist-worker-{k}.mnist-worker:2222"
                                    for k in range(3))
    assert [(t.job_name, t.task_index) for t in tasks] == [
        ("ps", 0), ("worker", 0), ("worker", 1), ("worker", 2)]
    assert [t.is_chief for t in tasks] == [False, True, False, False]
    assert tasks[1].source == kubernetes.SOURCE
    assert tasks[1].describe() == (
        "worker 0 (mnist-worker-0.mnist-worker:2222)" + spec.CHIEF_UNLESS)


def test_names_with_hyphens_ports_and_hostname():
    t = task("my-run-2-ps-1", num_ps=2, workers=1, port=9000,
             env_key="HOSTNAME")
    assert (t.job_name, t.task_index) == ("ps", 1)
    assert t.cluster.ps == ("my-run-2-ps-0.my-run-2-ps:9000",
                            "my-run-2-ps-1.my-run-2-ps:9000")
    both = kubernetes.task_from_pod(
        {"POD_NAME": "a-worker-0", "HOSTNAME": "a-ps-0"}, 1, 1, 2222)
    assert both.job_name == "worker"     # POD_NAME wins over HOSTNAME


@pytest.mark.parametrize("environ, workers, phrase", [
    ({}, 2, "neither POD_NAME nor HOSTNAME"),
    ({"POD_NAME": "trainer-7d9f8"}, 2, "is not NAME-ps-<i> or NAME-worker-<i>"),
    ({"POD_NAME": "mnist-chief-0"}, 2, "is not NAME-ps-<i>"),
    ({"POD_NAME": "mnist-worker-0"}, None, "needs --kubernetes_workers=W"),
    ({"POD_NAME": "mnist-worker-2"}, 2,
     "ordinal 2 is beyond --kubernetes_workers=2"),
    ({"POD_NAME": "mnist-ps-1"}, 2, "ordinal 1 is beyond --num_ps=1"),
])
def test_what_cannot_be_derived_is_one_clear_error(environ, workers, phrase):
    with pytest.raises(UserError) as error:
        kubernetes.task_from_pod(environ, 1, workers, 2222)
    assert phrase in str(error.value)
    assert "\n" not in str(error.value)


def test_a_finished_pod_stays_up_until_sigterm():
    before = signal.getsignal(signal.SIGTERM)
    slept = []

    def sleep(secs):
        slept.append(secs)
        raise StopIteration          # the test's way out of the loop
    try:
        with pytest.raises(StopIteration):
            kubernetes.hold_after_end(sleep)
        assert slept == [3600]
        assert signal.getsignal(signal.SIGTERM) is not before
    finally:
        signal.signal(signal.SIGTERM, before)


def test_main_with_a_pod_name_it_cannot_read_exits_2():
    env = {**helpers.python_env(), "POD_NAME": "web-7d9f8"}
    result = helpers.run(["-m", "trainer.main", "--cluster=kubernetes",
                          "--kubernetes_workers=2"], timeout=120, env=env)
    assert result.returncode == 2, result.stdout[-3000:]
    assert "Traceback" not in result.stdout
    assert "pod name 'web-7d9f8' is not NAME-ps-<i>" in result.stdout
