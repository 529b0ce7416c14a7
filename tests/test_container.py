"""The image of deploy/Dockerfile trains: a ps and two workers, each in
its own container of the image, on fake MNIST, to the end.

Needs root, podman and runc (apt: podman runc mmdebstrap). There is no
image registry here, so the base image is made from Debian packages:
mmdebstrap, then `podman import` (built once, then reused by name). pip
inside the build reaches PyPI; when this machine trusts its own CA bundle
for that ($PIP_CERT), the bundle is layered onto the base image. Podman
runs containers here only as RUN_FLAGS say (crun fails on this hybrid
cgroup setup). Slow: the first run downloads TensorFlow into the image.
"""

import os
import pathlib
import shutil
import subprocess
import threading
import time
import uuid

import pytest

from tests import helpers

pytestmark = [pytest.mark.cluster]

PODMAN = ["podman", "--cgroup-manager=cgroupfs"]
RUN_FLAGS = ["--runtime", "/usr/sbin/runc", "--ulimit", "nofile=1024:1024",
             "--ulimit", "nproc=4096:4096"]
DEBIAN = "localhost/mnist-test-debian-python:bookworm"
BASE = "localhost/mnist-test-debian-python:site"
IMAGE = "localhost/mnist-ps-trainer:test"
STEPS = 20


def podman(*args: str, timeout: float, check: bool = True):
    result = subprocess.run(PODMAN + list(args), capture_output=True,
                            text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, (args, result.stderr[-3000:])
    return result


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, timeout=60,
                  check=False).returncode == 0


def make_base(tmp: pathlib.Path) -> None:
    """Debian bookworm with Python, pip and venv, plus this machine's CA
    bundle for pip when it has one."""
    if not image_exists(DEBIAN):
        tar = tmp / "debian.tar"
        subprocess.run(["mmdebstrap", "--variant=apt", "--include=python3,"
                        "python3-venv,python3-pip,ca-certificates",
                        "bookworm", str(tar)], check=True, timeout=1200,
                       capture_output=True)
        podman("import", str(tar), DEBIAN, timeout=600)
    context = tmp / "base"
    context.mkdir()
    lines = [f"FROM {DEBIAN}"]
    bundle = os.environ.get("PIP_CERT")
    if bundle and os.path.isfile(bundle):
        shutil.copy(bundle, context / "ca.crt")
        lines += ["COPY ca.crt /etc/ssl/certs/site-ca-bundle.crt",
                  "ENV PIP_CERT=/etc/ssl/certs/site-ca-bundle.crt"]
    (context / "Containerfile").write_text("\n".join(lines) + "\n")
    podman("build", *RUN_FLAGS, "-t", BASE, str(context), timeout=600)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    for tool in ("podman", "mmdebstrap", "/usr/sbin/runc"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not found (apt: podman runc mmdebstrap)")
    if os.geteuid() != 0:
        pytest.skip("needs root (rootful podman)")
    make_base(tmp_path_factory.mktemp("image"))
    podman("build", *RUN_FLAGS, "--network", "host", "--build-arg",
           f"BASE_IMAGE={BASE}", "-f", "deploy/Dockerfile", "-t", IMAGE,
           str(helpers.REPO), timeout=1800)
    return IMAGE


def test_ps_and_two_workers_train_from_the_image(image, tmp_path):
    data = helpers.fake_mnist(tmp_path / "data")
    runs = tmp_path / "runs"
    runs.mkdir()
    ps, w0, w1 = helpers.free_ports(3)
    cluster = [f"--ps_hosts=localhost:{ps}",
               f"--worker_hosts=localhost:{w0},localhost:{w1}"]
    training = ["--model=softmax", f"--train_steps={STEPS}",
                "--batch_size=32", "--log_every=10", "--eval_every=10",
                "--nodownload", "--startup_timeout_secs=120"]
    tag = uuid.uuid4().hex[:8]
    tasks = {  # name -> the task's flags (the image's entry point's args)
        f"mnist-ps0-{tag}": ["--job_name=ps", "--task_index=0", *cluster],
        f"mnist-worker0-{tag}": ["--job_name=worker", "--task_index=0",
                                 *cluster, *training, "--logdir=/runs/cnn"],
        f"mnist-worker1-{tag}": ["--job_name=worker", "--task_index=1",
                                 *cluster, *training],
    }
    started = {}
    try:
        for name, args in tasks.items():
            started[name] = subprocess.Popen(
                PODMAN + ["run", "--rm", "--name", name, *RUN_FLAGS,
                          "--network", "host", "-v", f"{data}:/data/mnist:ro",
                          "-v", f"{runs}:/runs", image, *args],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        outputs = {name: p.communicate(timeout=600)[0]
                   for name, p in started.items()}
        for name, process in started.items():
            assert process.returncode == 0, (name, outputs[name][-3000:])
    finally:
        for name, process in started.items():
            if process.poll() is None:
                podman("rm", "-f", name, timeout=60, check=False)
                process.kill()
                process.wait(timeout=60)
    assert (runs / "cnn" / "results.json").is_file()
    version = runs / "cnn" / "export" / str(STEPS)
    assert (version / "saved_model.pb").is_file()
    assert "the chief" in outputs[f"mnist-worker0-{tag}"]


def manifest_args() -> dict[str, list[str]]:
    """StatefulSet name -> its container's args in deploy/kubernetes.yaml."""
    yaml = pytest.importorskip("yaml", reason="PyYAML: the test extra")
    text = (helpers.REPO / "deploy" / "kubernetes.yaml").read_text()
    return {d["metadata"]["name"]:
            d["spec"]["template"]["spec"]["containers"][0]["args"]
            for d in yaml.safe_load_all(text) if d["kind"] == "StatefulSet"}


def collect(process: subprocess.Popen, seen: list[str]) -> None:
    """Appends `process`'s output lines to `seen`, on a thread of its own,
    so that the test's waits stay bounded."""
    threading.Thread(target=lambda: seen.extend(process.stdout),
                     daemon=True).start()


def wait_for(seen: list[str], phrase: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(phrase in line for line in list(seen)):
        assert time.monotonic() < deadline, (
            f"no '{phrase}' in {timeout:.0f} s:\n{''.join(seen[-40:])}")
        time.sleep(1)


def test_pods_named_as_the_statefulsets_train_with_the_manifests_args(
        image, tmp_path):
    """--cluster=kubernetes in three containers named and addressed as the
    StatefulSets' pods (mnist-ps-0.mnist-ps, ...), with the args of
    deploy/kubernetes.yaml plus a short run; each stays up after the end
    until stopped, then exits 0."""
    data = helpers.fake_mnist(tmp_path / "data")
    runs = tmp_path / "runs"
    runs.mkdir()
    args = manifest_args()
    tag = uuid.uuid4().hex[:8]
    third = 100 + int(tag, 16) % 150
    network = f"mnist-test-{tag}"
    pods = {f"mnist-ps-{i}": args["mnist-ps"] for i in range(1)}
    pods.update({f"mnist-worker-{k}": args["mnist-worker"] for k in range(2)})
    ip = {pod: f"10.89.{third}.{10 + i}" for i, pod in enumerate(pods)}
    hosts = [f"--add-host={pod}.{pod.rsplit('-', 1)[0]}:{ip[pod]}"
             for pod in pods]
    short = ["--model=softmax", "--train_steps=20", "--batch_size=32",
             "--log_every=10", "--eval_every=10", "--nodownload"]
    started, seen = {}, {pod: [] for pod in pods}
    podman("network", "create", "--subnet", f"10.89.{third}.0/24", network,
           timeout=60)
    try:
        for pod, pod_args in pods.items():
            started[pod] = subprocess.Popen(
                PODMAN + ["run", "--rm", "--name", f"{pod}-{tag}", *RUN_FLAGS,
                          "--network", network, "--ip", ip[pod], *hosts,
                          "--hostname", pod, "-e", f"POD_NAME={pod}",
                          "-v", f"{data}:/data/mnist:ro", "-v",
                          f"{runs}:/runs", image, *pod_args, *short],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            collect(started[pod], seen[pod])
        for pod, process in started.items():
            wait_for(seen[pod], "training ended; this pod stays up", 600)
            assert process.poll() is None          # held, not exited
        for pod in pods:
            podman("stop", "-t", "30", f"{pod}-{tag}", timeout=90)
        for pod, process in started.items():
            assert process.wait(timeout=60) == 0, "".join(seen[pod][-40:])
    finally:
        for pod, process in started.items():
            if process.poll() is None:
                podman("rm", "-f", f"{pod}-{tag}", timeout=60, check=False)
                process.kill()
                process.wait(timeout=60)
        podman("network", "rm", "-f", network, timeout=60, check=False)
    chief = "".join(seen["mnist-worker-0"])
    assert ("this task is worker 0 (mnist-worker-0.mnist-worker:2222), "
            "the chief") in chief
    assert (runs / "cnn" / "results.json").is_file()
