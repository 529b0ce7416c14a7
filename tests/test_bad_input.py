"""Bad input through the real command line: one line, non-zero, no trace.

Each case runs `python -m trainer.main` (a chief, or the task the input
concerns) and checks: the exit status, exactly one error line that names
the problem, no traceback, the process gone, and no checkpoint changed.
"""

import functools
import hashlib
import http.server
import json
import re
import socket
import threading

import numpy as np
import pytest

from tests import helpers

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return helpers.fake_mnist(tmp_path_factory.mktemp("data"), train=300)


def main(*args, env=None, timeout=120):
    return helpers.run(["-m", "trainer.main", *args], timeout=timeout,
                       env=env)


def chief(tmp_path, *args, data_dir=None, env=None):
    """worker 0 of a 1 ps + 2 workers cluster on free ports."""
    ps, w0, w1 = helpers.free_ports(3)
    return main("--job_name=worker", "--task_index=0",
                f"--ps_hosts=localhost:{ps}",
                f"--worker_hosts=localhost:{w0},localhost:{w1}",
                f"--logdir={tmp_path / 'logs'}", "--nodownload",
                *([f"--data_dir={data_dir}"] if data_dir else []), *args,
                env=env)


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines()
            if re.match(r"(E\d{4} |FATAL )", line)]


def assert_one_line_error(result, status: int, *phrases: str):
    assert result.returncode == status, result.stdout[-3000:]
    assert "Traceback" not in result.stdout, result.stdout[-3000:]
    lines = error_lines(result.stdout)
    assert len(lines) == 1, result.stdout[-3000:]
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


@pytest.mark.parametrize("args, status, phrases", [
    (["--job_name=chief", "--task_index=0"], 1,
     ["--job_name=chief", "value should be one of <ps|worker>"]),
    (["--job_name=worker", "--task_index=2"], 2,
     ["task index 2 is out of range for job 'worker', which has 2 task(s)"]),
    (["--job_name=ps", "--task_index=-1"], 2,
     ["task index -1 is out of range for job 'ps'"]),
    (["--job_name=ps", "--task_index=0", "--ps_hosts=localhost"], 2,
     ["--ps_hosts", "'localhost' is not host:port"]),
    (["--job_name=ps", "--task_index=0", "--ps_hosts=localhost:2222",
      "--worker_hosts=localhost:2222,localhost:2223"], 2,
     ["address localhost:2222 is used by both ps 0 and worker 0"]),
    (["--job_name=worker", "--task_index=0", "--batch_size=1"], 2,
     ["--batch_size=1 is smaller than the 2 workers"]),
    (["--job_name=worker", "--task_index=0", "--train_steps=0"], 2,
     ["--train_steps=0 must be a positive integer"]),
    (["--job_name=worker", "--task_index=0", "--learning_rate=-0.1"], 2,
     ["--learning_rate=-0.1 must be a positive number"]),
    (["--job_name=worker", "--task_index=0", "--model=resnet"], 1,
     ["--model=resnet", "value should be one of <softmax|mlp|cnn>"]),
    (["--job_name=worker", "--task_index=0", "--optimizer=lamb"], 1,
     ["--optimizer=lamb", "value should be one of <sgd|momentum|adam>"]),
])
def test_bad_flags(args, status, phrases):
    defaults = {"--ps_hosts": "localhost:4001",
                "--worker_hosts": "localhost:4002,localhost:4003"}
    given = {a.split("=")[0] for a in args}
    extra = [f"{k}={v}" for k, v in defaults.items() if k not in given]
    assert_one_line_error(main(*args, *extra), status, *phrases)


def test_port_already_in_use(tmp_path, data):
    holder = socket.socket()
    holder.bind(("", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        result = main("--job_name=ps", "--task_index=0",
                      f"--ps_hosts=localhost:{port}",
                      "--worker_hosts=localhost:4002")
    finally:
        holder.close()
    assert_one_line_error(result, 2, f"port {port} of ps 0 (localhost:{port})"
                          " is already in use on this machine")


@pytest.mark.parametrize("tf_config, phrases", [
    ("{cluster: ", ["TF_CONFIG is not valid JSON"]),
    (json.dumps({"task": {"type": "ps", "index": 0}}),
     ["TF_CONFIG has no 'cluster'"]),
    (json.dumps({"cluster": {"ps": ["a:1"], "worker": ["b:1"]}}),
     ["TF_CONFIG has no 'task'"]),
    (json.dumps({"cluster": {"ps": ["a:1"], "worker": ["b:1"]},
                 "task": {"type": "chief", "index": 0}}),
     ["task type 'chief' is not a job in 'cluster'"]),
])
def test_bad_tf_config(tf_config, phrases):
    result = main(env=helpers.python_env(TF_CONFIG=tf_config))
    assert_one_line_error(result, 2, *phrases)


def corrupt_copy(data, tmp_path, name, payload: bytes, compress=True):
    folder = tmp_path / "corrupt"
    folder.mkdir()
    for source in data.iterdir():
        (folder / source.name).write_bytes(source.read_bytes())
    if compress:
        helpers.write_gz(folder / name, payload)
    else:
        (folder / name).write_bytes(payload)
    return folder


@pytest.mark.parametrize("name, make_payload, phrase", [
    ("train-images-idx3-ubyte.gz", "truncate", "gzip data is truncated"),
    ("t10k-images-idx3-ubyte.gz",
     lambda: helpers.idx_bytes(np.zeros((5, 28, 28)), 0x801),
     "wrong magic number 0x00000801, expected 0x00000803"),
    ("train-labels-idx1-ubyte.gz",
     lambda: helpers.idx_bytes(np.zeros(299), 0x801),
     "holds 300 images but"),
    ("t10k-labels-idx1-ubyte.gz",
     lambda: helpers.idx_bytes(np.full(100, 11), 0x801),
     "label 11 at position 0 is outside 0..9"),
])
def test_bad_data_files(tmp_path, data, name, make_payload, phrase):
    if make_payload == "truncate":
        folder = corrupt_copy(data, tmp_path, name,
                              (data / name).read_bytes()[:-300],
                              compress=False)
    else:
        folder = corrupt_copy(data, tmp_path, name, make_payload())
    assert_one_line_error(chief(tmp_path, data_dir=folder), 2, phrase,
                          str(folder / name))


def test_missing_data_and_no_network(tmp_path):
    result = chief(tmp_path, "--download", "--data_url=http://127.0.0.1:9/",
                   data_dir=tmp_path / "nothing_here")
    assert_one_line_error(result, 2, "is missing and could not be downloaded",
                          "--data_dir")


def test_download_with_a_wrong_checksum_is_removed(tmp_path, data):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                                directory=str(data))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    target = tmp_path / "downloads"
    try:
        result = chief(tmp_path, "--download",
                       f"--data_url=http://127.0.0.1:{server.server_address[1]}",
                       data_dir=target)
    finally:
        server.shutdown()
    assert_one_line_error(result, 2, "has SHA-256", "the bad file was removed")
    assert not list(target.glob("*.gz"))
    assert not list(target.glob(".*partial"))


def checkpoint_digest(logdir) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(logdir.iterdir()) if p.name.startswith(
                ("model.ckpt", "checkpoint"))}


def test_logdir_of_another_model_is_refused_untouched(tmp_path, data):
    logdir = tmp_path / "logs"
    made = helpers.launch(logdir, data, 1, "--model=softmax",
                          "--train_steps=5", "--log_every=5")
    assert made.returncode == 0, made.stdout[-3000:]
    before = checkpoint_digest(logdir)
    result = chief(tmp_path, "--model=mlp", data_dir=data)
    assert_one_line_error(result, 2, "does not fit --model=mlp",
                          "use a new --logdir")
    assert checkpoint_digest(logdir) == before


def test_worker_with_another_cluster_fails_instead_of_hanging(tmp_path,
                                                              data):
    c = helpers.ManualCluster(tmp_path, 1, 2, "--model=softmax",
                              "--train_steps=50", f"--data_dir={data}",
                              "--nodownload", f"--logdir={tmp_path / 'l'}")
    try:
        c.start("ps", 0)
        c.start("worker", 0)
        third = helpers.free_ports(1)[0]
        c.start("worker", 1,
                f"--worker_hosts={c.worker_hosts},localhost:{third}")
        assert c.wait("worker1", timeout=120) == 1
    finally:
        c.close()
    lines = error_lines(c.log("worker1"))
    assert len(lines) == 1 and "differ from the chief's" in lines[0], lines
    assert "workers=" in lines[0]
