"""IDX reading and validation, checked downloads, sharding and batching."""

import functools
import gzip
import hashlib
import http.server
import threading

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from trainer.learning import data
from trainer.learning import batches
from trainer.learning import replica
from trainer.common import config as config_lib
from trainer.common.errors import UserError


@pytest.fixture
def folder(tmp_path):
    return helpers.fake_mnist(tmp_path / "mnist", train=50, test=20)


def test_reads_a_valid_folder(folder):
    mnist = data.load(folder, allow_download=False)
    assert mnist.train_images.shape == (50, 28, 28)
    assert mnist.train_images.dtype == np.uint8
    assert mnist.train_labels.shape == (50,)
    assert mnist.test_images.shape == (20, 28, 28)
    assert mnist.test_labels.max() <= 9


def test_reads_only_the_half_asked_for(folder):
    (folder / data.TEST_IMAGES).unlink()
    mnist = data.load(folder, allow_download=False, need_test=False)
    assert len(mnist.train_labels) == 50 and len(mnist.test_labels) == 0


def corrupt(folder, name, payload: bytes, compress=True):
    path = folder / name
    if compress:
        helpers.write_gz(path, payload)
    else:
        path.write_bytes(payload)
    return path


def images_payload(n=3, rows=28, cols=28, magic=0x803, extra=b""):
    return helpers.idx_bytes(np.zeros((n, rows, cols), np.uint8),
                             magic) + extra


@pytest.mark.parametrize("name, make, message", [
    (data.TRAIN_IMAGES, lambda f: corrupt(f, data.TRAIN_IMAGES,
                                          b"plain bytes", compress=False),
     "not a gzip file"),
    (data.TRAIN_IMAGES, lambda f: corrupt(f, data.TRAIN_IMAGES,
                                          images_payload(magic=0x801)),
     "wrong magic number 0x00000801, expected 0x00000803"),
    (data.TRAIN_LABELS, lambda f: corrupt(f, data.TRAIN_LABELS,
                                          images_payload()),
     "wrong magic number 0x00000803, expected 0x00000801"),
    (data.TRAIN_IMAGES, lambda f: corrupt(f, data.TRAIN_IMAGES,
                                          images_payload(rows=32, cols=32)),
     "images are 32x32 pixels, expected 28x28"),
    (data.TRAIN_IMAGES, lambda f: corrupt(
        f, data.TRAIN_IMAGES, images_payload()[:-100]),
     "truncated: the header promises 2352 bytes"),
    (data.TRAIN_IMAGES, lambda f: corrupt(
        f, data.TRAIN_IMAGES, images_payload(extra=b"xyz")),
     "3 unexpected bytes after"),
    (data.TRAIN_IMAGES, lambda f: corrupt(f, data.TRAIN_IMAGES, b"\x00\x00"),
     "too short for an IDX header"),
    (data.TRAIN_LABELS, lambda f: corrupt(
        f, data.TRAIN_LABELS,
        helpers.idx_bytes(np.array([1, 2, 12] + [0] * 47, np.uint8), 0x801)),
     "label 12 at position 2 is outside 0..9"),
])
def test_corrupt_file_is_one_line_naming_it(folder, name, make, message):
    make(folder)
    with pytest.raises(UserError) as error:
        data.load(folder, allow_download=False)
    text = str(error.value)
    assert message in text
    assert str(folder / name) in text
    assert "\n" not in text


def test_truncated_gzip_is_reported(folder):
    path = folder / data.TRAIN_IMAGES
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(UserError, match="gzip data is truncated"):
        data.load(folder, allow_download=False)


def test_image_and_label_counts_must_match(folder):
    helpers.write_labels(folder / data.TRAIN_LABELS,
                         np.zeros(49, np.uint8))
    with pytest.raises(UserError, match="holds 50 images but .* holds 49 "
                       "labels"):
        data.load(folder, allow_download=False)


def test_missing_file_without_download(folder):
    (folder / data.TEST_LABELS).unlink()
    with pytest.raises(UserError, match="is missing and downloading is off"):
        data.load(folder, allow_download=False)


def test_missing_folder_without_download(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        data.load(tmp_path / "nowhere", allow_download=False)


def test_data_dir_precedence(tmp_path):
    env = {data.ENV_DATA_DIR: str(tmp_path / "env")}
    assert data.resolve_data_dir(str(tmp_path / "flag"), env) == \
        tmp_path / "flag"
    assert data.resolve_data_dir(None, env) == tmp_path / "env"
    assert data.resolve_data_dir(None, {}) == data.DEFAULT_DATA_DIR


@pytest.fixture
def source(tmp_path):
    """A local HTTP server standing in for the download source."""
    served = tmp_path / "served"
    helpers.fake_mnist(served, train=30, test=10)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                                directory=str(served))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    sums = {name: hashlib.sha256((served / name).read_bytes()).hexdigest()
            for name in data.FILES}
    yield f"http://127.0.0.1:{server.server_address[1]}/", sums
    server.shutdown()


def test_download_fetches_verifies_and_renames(tmp_path, source):
    url, sums = source
    target = tmp_path / "downloaded"
    mnist = data.load(target, sources=(url,), checksums=sums)
    assert len(mnist.train_labels) == 30
    assert sorted(p.name for p in target.iterdir()) == sorted(data.FILES)


def test_download_with_bad_checksum_is_removed(tmp_path, source):
    url, sums = source
    bad = dict(sums, **{data.TRAIN_LABELS: "0" * 64})
    target = tmp_path / "downloaded"
    with pytest.raises(UserError, match="has SHA-256 .* expected 0000.*the "
                       "bad file was removed"):
        data.load(target, sources=(url,), checksums=bad)
    assert not (target / data.TRAIN_LABELS).exists()
    assert not list(target.glob(".*partial"))


def test_download_tries_the_next_source(tmp_path, source):
    url, sums = source
    dead = "http://127.0.0.1:9/"  # discard port: connection refused
    mnist = data.load(tmp_path / "d", sources=(dead, url), checksums=sums)
    assert len(mnist.test_labels) == 10


def test_no_network_is_a_clear_error(tmp_path):
    with pytest.raises(UserError) as error:
        data.load(tmp_path / "d", sources=("http://127.0.0.1:9/",))
    text = str(error.value)
    assert "is missing and could not be downloaded" in text
    assert "--data_dir" in text and "\n" not in text


def test_gzip_of_downloaded_file_is_what_was_served(tmp_path, source):
    url, sums = source
    data.load(tmp_path / "d", sources=(url,), checksums=sums)
    with gzip.open(tmp_path / "d" / data.TRAIN_LABELS) as f:
        assert len(f.read()) == 8 + 30


# --- Sharding and batching ---

@pytest.mark.parametrize("batch, workers", [(64, 1), (64, 2), (64, 3),
                                            (10, 4), (7, 7)])
def test_shard_bounds_cover_the_batch_once(batch, workers):
    bounds = batches.shard_bounds(batch, workers)
    assert len(bounds) == workers
    assert bounds[0][0] == 0 and bounds[-1][1] == batch
    for (_, end), (start, _) in zip(bounds, bounds[1:]):
        assert end == start
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_shard_bounds_unequal_slices():
    assert batches.shard_bounds(64, 3) == [(0, 22), (22, 43), (43, 64)]


def test_batch_smaller_than_workers_is_rejected():
    """By the config, naming the flag; shard_bounds only guards itself."""
    with pytest.raises(UserError, match="--batch_size=2 is smaller than the "
                                        "3 workers"):
        config_lib.validate(config_lib.TrainConfig("x", batch_size=2), 3)
    with pytest.raises(ValueError):
        batches.shard_bounds(2, 3)


def test_batch_larger_than_the_training_set_is_rejected():
    config = config_lib.TrainConfig("x", batch_size=51)
    with pytest.raises(UserError, match="--batch_size=51 is larger than the "
                                        "50 training examples"):
        config.resolved_train_steps(50)
    with pytest.raises(ValueError):
        batches.steps_per_epoch(50, 51)


def batches_of(num_workers, steps, n=100, batch=12, seed=3):
    """Each worker's (indices, labels) per step, from the in-graph batcher."""
    images = np.arange(n, dtype=np.uint8)[:, None, None] * np.ones(
        (1, 28, 28), np.uint8)
    labels = (np.arange(n) % 10).astype(np.uint8)
    out = []
    for bounds in batches.shard_bounds(batch, num_workers):
        with tf.Graph().as_default() as g:
            trainset = batches.InGraphTrainSet(n, seed, batch, bounds)
            step = tf.compat.v1.placeholder(tf.int64, [])
            x, y = trainset.batch(step)
            with tf.compat.v1.Session(graph=g) as session:
                trainset.initialize(session, images, labels)
                out.append([
                    session.run((tf.round(x[:, 0, 0, 0] * 255.0), y),
                                {step: s})
                    for s in range(steps)])
    return out


def test_worker_slices_partition_each_global_batch():
    n, batch, steps = 100, 12, 20  # 8 steps per epoch: crosses 2 epochs
    whole = batches_of(1, steps, n, batch)[0]
    for workers in (2, 3, 5):
        per_worker = batches_of(workers, steps, n, batch)
        for s in range(steps):
            joined = np.concatenate([w[s][0] for w in per_worker])
            np.testing.assert_array_equal(joined, whole[s][0])
            joined_labels = np.concatenate([w[s][1] for w in per_worker])
            np.testing.assert_array_equal(joined_labels, whole[s][1])
    epoch0 = np.concatenate([whole[s][0] for s in range(8)])
    assert len(set(epoch0.astype(int))) == 96  # no repeats
    epoch1 = np.concatenate([whole[s][0] for s in range(8, 16)])
    assert not np.array_equal(epoch0, epoch1)  # reshuffled


def test_a_new_session_on_the_same_server_keeps_the_training_set():
    """A worker that reconnects opens a new session on its own server,
    where the training set already is: it is not copied again."""
    server = tf.distribute.Server.create_local_server()
    images = np.arange(100, dtype=np.uint8)[:, None, None] * np.ones(
        (1, 28, 28), np.uint8)
    labels = (np.arange(100) % 10).astype(np.uint8)
    with tf.Graph().as_default() as g:
        with tf.device("/job:localhost/replica:0/task:0/cpu:0"):
            trainset = batches.InGraphTrainSet(100, 3, 10, (0, 10))
            x, y = trainset.batch(tf.constant(4, tf.int64))
    seen = []
    for fed in (images, images * 0):  # the second feed must be ignored
        with tf.compat.v1.Session(server.target, graph=g) as session:
            trainset.initialize(session, fed, labels)
            seen.append(session.run(x))
    np.testing.assert_array_equal(seen[0], seen[1])
    assert seen[0].max() > 0


def test_dropout_noise_is_the_same_however_the_batch_is_split():
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        step = tf.constant(5, tf.int64)
        whole = session.run(replica.example_uniform(7, step, (0, 13), 6))
        parts = session.run([replica.example_uniform(7, step, b, 6)
                             for b in batches.shard_bounds(13, 3)])
        other_step = session.run(replica.example_uniform(
            7, tf.constant(6, tf.int64), (0, 13), 6))
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert whole.shape == (13, 6)
    assert not np.array_equal(whole, other_step)


def test_the_default_data_folder_is_the_projects_data_folder():
    """data/ beside trainer/, wherever the module lives in the package."""
    assert data.DEFAULT_DATA_DIR == helpers.REPO / "data"
    assert (data.DEFAULT_DATA_DIR / "README.md").exists()
