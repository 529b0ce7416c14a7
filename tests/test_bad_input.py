"""Bad input through the real command line: one line, non-zero, no trace.

Each case runs `python -m trainer.main` (a chief, or the task the input
concerns) or another command and checks: the exit status (2 for every
input error, flags included), exactly one error line that names the
problem, no traceback, the process gone, and no checkpoint changed.
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


def chief(tmp_path, *args, data_dir=None, env=None, logdir=None):
    """worker 0 of a 1 ps + 2 workers cluster on free ports."""
    ps, w0, w1 = helpers.free_ports(3)
    return main("--job_name=worker", "--task_index=0",
                f"--ps_hosts=localhost:{ps}",
                f"--worker_hosts=localhost:{w0},localhost:{w1}",
                f"--logdir={logdir or tmp_path / 'logs'}", "--nodownload",
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
    (["--job_name=chief", "--task_index=0"], 2,
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
    (["--job_name=worker", "--task_index=0", "--wire_dtype=bfloat16"], 2,
     ["--wire_dtype=bfloat16 rounds the gradients", "add --nodeterministic"]),
    (["--job_name=worker", "--task_index=0", "--batch_size=16",
      "--micro_batch=16", "--backup_workers=1"], 2,
     ["holds 1 micro-batch(es) of 16, no more than --backup_workers=1"]),
    (["--job_name=worker", "--task_index=0", "--micro_batch=7"], 2,
     ["--micro_batch=7 does not divide --batch_size=128"]),
    (["--job_name=worker", "--task_index=0", "--train_steps=0"], 2,
     ["--train_steps=0 must be a positive integer"]),
    (["--job_name=worker", "--task_index=0", "--learning_rate=-0.1"], 2,
     ["--learning_rate=-0.1 must be a positive number"]),
    (["--job_name=worker", "--task_index=0", "--model=resnet"], 2,
     ["--model=resnet", "value should be one of <softmax|mlp|cnn>"]),
    (["--job_name=worker", "--task_index=0", "--optimizer=lamb"], 2,
     ["--optimizer=lamb", "value should be one of <sgd|momentum|adam>"]),
    (["--job_name=ps", "--task_index=0", "--ps_mirrors"], 2,
     ["--ps_mirrors keeps each ps's shards on the next ps and needs 2 ps "
      "tasks or more, not 1; add a ps task or drop --ps_mirrors"]),
])
def test_bad_flags(args, status, phrases):
    defaults = {"--ps_hosts": "localhost:4001",
                "--worker_hosts": "localhost:4002,localhost:4003"}
    given = {a.split("=")[0] for a in args}
    extra = [f"{k}={v}" for k, v in defaults.items() if k not in given]
    assert_one_line_error(main(*args, *extra), status, *phrases)


def test_the_retired_chunk_kb_is_refused_naming_the_fix():
    """An old script's --chunk_kb (the pipelined protocol, retired): one
    line saying why and what to use instead."""
    result = main("--job_name=worker", "--task_index=0", "--chunk_kb=64",
                  "--ps_hosts=localhost:4001",
                  "--worker_hosts=localhost:4002,localhost:4003")
    assert_one_line_error(result, 2)
    assert error_lines(result.stdout)[0].endswith(
        "--chunk_kb was retired: the pipelined protocol lost on the cnn and "
        "kept the mlp's gain only at 100 Mbit/s; drop the flag (whole "
        "shards are the one protocol), and use --wire_dtype=bfloat16 to "
        "halve the bytes on slow links")


@pytest.mark.parametrize("command, args, phrases", [
    ("trainer.launch", ["--num_ps=0"],
     ["--num_ps=0", "0 is not a positive integer", "--helpshort"]),
    ("trainer.launch", ["--wire_dtype=int8"],
     ["--wire_dtype=int8", "value should be one of <float32|bfloat16"]),
    ("trainer.launch", ["--ps_mirrors"],
     ["--ps_mirrors", "needs 2 ps tasks or more, not 1"]),
    ("trainer.launch", ["--num_workers=2", "stray"],
     ["unexpected arguments: stray", "--flag=value"]),
    ("trainer.benchmark", ["--model=resnet"],
     ["--model=resnet", "value should be one of <softmax|mlp|cnn>"]),
    ("trainer.benchmark", ["--repeats=0"],
     ["--repeats=0", "0 is not a positive integer"]),
    # Run outside a Slurm allocation (no SLURM_JOB_ID), as the suite is.
    ("trainer.benchmark", ["--hosts=slurm"],
     ["--hosts=slurm starts job steps in a Slurm allocation", "salloc"]),
    ("trainer.benchmark", ["--baselines=single,fast"],
     ["--baselines: unknown fast"]),
    ("trainer.soak", ["--num_workers=0"],
     ["--num_workers=0", "0 is not a positive integer"]),
])
def test_bad_flags_of_every_command(command, args, phrases):
    """absl's flag errors too end with one line and status 2, in each
    command (TensorFlow's C++ logs are off: they are not the command's)."""
    result = helpers.run(["-m", command, *args], timeout=120,
                         env=helpers.python_env(TF_CPP_MIN_LOG_LEVEL="3"))
    assert_one_line_error(result, 2, *phrases)


@pytest.mark.parametrize("where, phrase", [
    ("afile", "is a file, not a folder"),
    ("afile/sub", "a part of its path is a file"),
    ("/sys/kernel/x", "is refused"),          # EPERM as root, else EACCES
    ("/proc/1/nope", ""),                     # ENOENT as root, else EACCES
])
def test_logdir_that_cannot_be_made(tmp_path, data, where, phrase):
    """The chief refuses, before its server starts, a --logdir it cannot
    create or write, in one line that names it and the fix."""
    (tmp_path / "afile").write_text("a file, not a folder")
    logdir = where if where.startswith("/") else tmp_path / where
    result = chief(tmp_path, data_dir=data, logdir=logdir)
    assert_one_line_error(result, 2, f"--logdir={logdir}", phrase,
                          "give --logdir a folder this user can create")


def test_data_dir_that_cannot_be_made(tmp_path):
    (tmp_path / "afile").write_text("a file, not a folder")
    folder = tmp_path / "afile" / "mnist"
    result = chief(tmp_path, "--download", "--data_url=http://127.0.0.1:9/",
                   data_dir=folder)
    assert_one_line_error(result, 2, f"--data_dir={folder}",
                          "a part of its path is a file",
                          "give --data_dir a folder")


def test_data_file_that_is_a_folder(tmp_path, data):
    folder = corrupt_copy(data, tmp_path, "t10k-labels-idx1-ubyte.gz", b"")
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    (folder / "t10k-labels-idx1-ubyte.gz").mkdir()
    result = chief(tmp_path, data_dir=folder)
    assert_one_line_error(result, 2, str(folder / "t10k-labels-idx1-ubyte.gz"),
                          "is a folder, not a file", "--data_dir")


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


def test_logdir_of_other_settings_is_refused_untouched(tmp_path, data):
    """A rerun in the same logdir: other settings are refused in one line
    naming each; the same settings evaluate again and say so first."""
    logdir = tmp_path / "logs"
    made = helpers.launch(logdir, data, 1, "--model=softmax",
                          "--train_steps=5", "--log_every=5")
    assert made.returncode == 0, made.stdout[-3000:]
    before = checkpoint_digest(logdir)
    result = chief(tmp_path, "--model=mlp", "--train_steps=5", data_dir=data)
    assert_one_line_error(result, 2, "--model=mlp (the checkpoints': "
                          "softmax)", "give a new --logdir")
    result = chief(tmp_path, "--model=softmax", "--train_steps=5",
                   "--learning_rate=0.01", "--seed=4", data_dir=data)
    assert_one_line_error(result, 2, "--learning_rate=0.01 (the "
                          "checkpoints': 0.003)", "--seed=4", "new --logdir")
    assert checkpoint_digest(logdir) == before
    again = helpers.launch(logdir, data, 1, "--model=softmax",
                           "--train_steps=5", "--log_every=5")
    assert again.returncode == 0, again.stdout[-3000:]
    chief_lines = [line for line in again.stdout.splitlines()
                   if line.startswith("[worker0]") and "cluster from" not in
                   line and re.search(r"\] ", line)]
    assert "holds a finished run (global step 5 of 5)" in chief_lines[0]


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
