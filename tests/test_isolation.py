"""The local launcher's private network: nothing outside reaches its ports.

`python -m trainer.launch` moves itself, before it starts any task, into a
network namespace with only loopback (trainer/cluster/isolation.py). While
it trains, this test (in the machine's namespace: another namespace from
the cluster's) tries every task port on every address of this machine and
runs tests/outsider.py against the ps port; none of it may get in. As
root, the same ports are tried from inside the cluster's namespace at the
same time (`nsenter --net=/proc/<ps pid>/ns/net`), and must answer.
"""

import functools
import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from tests import helpers
from trainer.cluster import isolation, local
from trainer.common.errors import UserError

pytestmark = pytest.mark.cluster
RUN_SECS = 400
CONNECT_SECS = 1.0

# Tries to connect to each host:port given; prints those that answered.
PROBE = """
import json, socket, sys
got = []
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
        got.append(target)
    except OSError:
        pass
print(json.dumps(got))
"""


@pytest.fixture(scope="module")
def can_isolate():
    """Skips, with the reason, where this machine allows no namespace."""
    result = subprocess.run(
        [sys.executable, "-c", "from trainer.cluster import isolation; "
         "print(isolation.isolate())"], capture_output=True, text=True,
        timeout=60, cwd=helpers.REPO, env=helpers.python_env())
    if result.returncode:
        pytest.skip(f"no private network namespace here: "
                    f"{result.stderr.strip().splitlines()[-1:]}")


def machine_addresses() -> list[str]:
    """This namespace's IPv4 addresses, loopback first."""
    found = ["127.0.0.1"]
    if shutil.which("ip"):
        listing = subprocess.run(["ip", "-o", "-4", "addr", "show"],
                                 capture_output=True, text=True, timeout=10)
        found += re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", listing.stdout)
    return sorted(set(found), key=found.index)


def probe(targets: list[str], netns_of_pid: int | None = None) -> list[str]:
    """The targets that accept a TCP connection, tried from here or from
    the network namespace of a process (root: nsenter)."""
    argv = [sys.executable, "-c", PROBE, *targets]
    if netns_of_pid is not None:
        argv = ["nsenter", f"--net=/proc/{netns_of_pid}/ns/net", *argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return json.loads(out)


class Launch:
    """`python -m trainer.launch` in the background; its lines as they
    come. stop() kills its group if it is still running."""

    def __init__(self, *args):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "trainer.launch", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=helpers.python_env(), cwd=helpers.REPO,
            start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(
            target=lambda: self.lines.extend(self.process.stdout),
            daemon=True)
        self.reader.start()

    def wait_for(self, pattern: str, timeout: float = RUN_SECS):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, "".join(self.lines))
            if match:
                return match
            assert self.process.poll() is None, self.output()[-3000:]
            time.sleep(0.1)
        raise AssertionError(f"no /{pattern}/ in {timeout} s\n"
                             + self.output()[-3000:])

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 9)
        self.process.wait(timeout=30)
        self.reader.join(timeout=10)


def test_nothing_outside_reaches_the_launchers_ports(can_isolate, tmp_path):
    data = helpers.real_mnist_dir()
    if data is None:
        pytest.skip("real MNIST not found; set MNIST_DATA_DIR")
    logdir = tmp_path / "mlp"
    run = Launch("--model=mlp", "--epochs=8", f"--logdir={logdir}",
                 f"--data_dir={data}", "--nodownload")
    try:
        cluster = run.wait_for(r"cluster: ps (\S+); workers (\S+)")
        ports = [a.rsplit(":", 1)[1] for a in
                 (cluster.group(1) + "," + cluster.group(2)).split(",")]
        ps_pid = int(run.wait_for(r"started ps0 \(pid (\d+)\)").group(1))
        run.wait_for(r"\[worker0\] .* step \d+/")
        targets = [f"{a}:{p}" for a in machine_addresses() for p in ports]
        outside = probe(targets)
        inside = (probe([f"127.0.0.1:{p}" for p in ports], ps_pid)
                  if os.geteuid() == 0 and shutil.which("nsenter") else None)
        outsider = subprocess.run(
            [sys.executable, "-m", "tests.outsider",
             f"localhost:{ports[0]}", "5"], capture_output=True, text=True,
            timeout=120, cwd=helpers.REPO, env=helpers.python_env())
        still_training = "final test accuracy" not in run.output()
        status = run.process.wait(timeout=RUN_SECS)
    finally:
        run.stop()
    output = run.output()
    print(f"from outside, {len(targets)} address:port pairs tried "
          f"({', '.join(machine_addresses())}): {outside or 'none'} answered;"
          f" from the cluster's namespace: {inside}; outsider: "
          f"{outsider.stdout.strip()}")
    assert status == 0, output[-3000:]
    assert "isolation: the cluster runs in a private" in output
    assert "security: TensorFlow servers listen" not in output
    assert outside == []
    assert json.loads(outsider.stdout.strip().splitlines()[-1])["read"] is \
        False
    if still_training and inside is not None:
        assert inside == [f"127.0.0.1:{p}" for p in ports]
    results = json.loads((logdir / "results.json").read_text())
    print(f"test accuracy {results['final_test_accuracy']:.4f}")
    assert results["final_test_accuracy"] >= 0.97


def test_mnist_is_downloaded_before_the_network_goes(can_isolate, tmp_path):
    # The mirror listens on this namespace's loopback, which the tasks in
    # theirs cannot reach: only the launcher's fetch, made before it
    # leaves, can get the files.
    data = helpers.real_mnist_dir()
    if data is None:
        pytest.skip("real MNIST not found; set MNIST_DATA_DIR")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                                directory=str(data))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    # The shared copy is re-compressed: its checksums stand in for the
    # published ones, as in tests/test_data.py.
    sums = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in data.glob("*.gz")}
    launch = ("import json, sys\n"
              "from trainer.learning import data\n"
              "data.SHA256.update(json.loads(sys.argv.pop(1)))\n"
              "sys.argv[0] = 'trainer.launch'\n"
              "from trainer import launch\n"
              "launch.run_main()\n")
    try:
        result = helpers.run(
            ["-c", launch, json.dumps(sums), "--model=softmax",
             "--train_steps=20",
             f"--logdir={tmp_path / 'run'}", f"--data_dir={tmp_path / 'd'}",
             f"--data_url=http://127.0.0.1:{server.server_address[1]}/"],
            timeout=RUN_SECS)
    finally:
        server.shutdown()
        thread.join(timeout=10)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "isolation: the cluster runs in a private" in result.stdout
    assert len(list((tmp_path / "d").glob("*.gz"))) == 4
    assert (tmp_path / "run" / "results.json").exists()


def test_without_namespaces_one_line_and_the_run_goes_on(monkeypatch,
                                                         tmp_path):
    def refuse():
        raise isolation.Unavailable("unshare --net failed: not permitted")

    monkeypatch.setattr(isolation, "isolate", refuse)
    monkeypatch.setattr(isolation, "only_loopback", lambda: False)
    warnings = []
    monkeypatch.setattr(local.logging, "warning",
                        lambda fmt, *a: warnings.append(fmt % a))
    fetched = tmp_path / "fetched"  # fetch_data runs in a forked child
    assert local.isolate_network(True, "localhost", fetched.touch) is False
    assert fetched.exists()
    assert len(warnings) == 1 and "not permitted" in warnings[0]
    assert "open on every interface" in warnings[0]


def test_a_failed_fetch_is_the_childs_one_line():
    def missing():
        raise UserError("data folder /nowhere does not exist; pass --data_dir")

    with pytest.raises(UserError, match="^data folder /nowhere"):
        isolation.in_child(missing)


def test_a_host_outside_loopback_is_one_line(tmp_path):
    result = helpers.run(["-m", "trainer.launch", "--host=10.1.2.3",
                          f"--logdir={tmp_path}"], timeout=60)
    lines = [line for line in result.stdout.splitlines() if "--host" in line]
    assert result.returncode == 2, result.stdout
    assert len(lines) == 1 and "--noisolate" in lines[0], result.stdout
    assert "Traceback" not in result.stdout
