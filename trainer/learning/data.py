"""MNIST: find, download, validate and read the IDX files.

The four gzip-compressed IDX files are read from a data folder: `--data_dir`,
else the `MNIST_DATA_DIR` environment variable, else the project's `data/`
folder. Missing files are downloaded from a source of the original files
and checked against the published SHA-256 sums. Every file is validated
(gzip stream, magic number, counts, image size, label range) and any fault
is reported as one line that names the file. Batching is in
trainer/learning/batches.py.
"""

import dataclasses
import gzip
import hashlib
import os
import pathlib
import struct
import urllib.error
import urllib.request
import zlib

import numpy as np

from trainer.common.errors import UserError, edge

ENV_DATA_DIR = "MNIST_DATA_DIR"
DEFAULT_DATA_DIR = pathlib.Path(__file__).resolve().parents[2] / "data"

TRAIN_IMAGES = "train-images-idx3-ubyte.gz"
TRAIN_LABELS = "train-labels-idx1-ubyte.gz"
TEST_IMAGES = "t10k-images-idx3-ubyte.gz"
TEST_LABELS = "t10k-labels-idx1-ubyte.gz"
FILES = (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS)

# Published SHA-256 of the original gzip files (as served by the sources).
SHA256 = {
    TRAIN_IMAGES:
        "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    TRAIN_LABELS:
        "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    TEST_IMAGES:
        "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    TEST_LABELS:
        "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}
# Sources of the original files, tried in order (yann.lecun.com no longer
# serves them without a login).
SOURCES = (
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
)
DOWNLOAD_TIMEOUT_SECS = 30


def source_list(data_url: str | None) -> tuple[str, ...]:
    """--data_url as a source list, or the public sources."""
    return (data_url.rstrip("/") + "/",) if data_url else SOURCES

IMAGE_SIZE = 28
NUM_CLASSES = 10
_IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions
_LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension


@dataclasses.dataclass(frozen=True)
class Mnist:
    """The dataset in memory.

    Images are uint8 [n, 28, 28] with 0 for background; labels are uint8 [n]
    in 0..9.
    """

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def resolve_data_dir(flag_value: str | None,
                     environ: dict[str, str] | None = None) -> pathlib.Path:
    """`--data_dir` if given, else $MNIST_DATA_DIR, else the project's data/."""
    environ = os.environ if environ is None else environ
    if flag_value:
        return pathlib.Path(flag_value).expanduser()
    if environ.get(ENV_DATA_DIR):
        return pathlib.Path(environ[ENV_DATA_DIR]).expanduser()
    return DEFAULT_DATA_DIR


def _read_gzip(path: pathlib.Path) -> bytes:
    with edge("data file", path, "make it readable, or point --data_dir or "
              f"${ENV_DATA_DIR} at a folder with the MNIST .gz files"):
        raw = open(path, "rb")
    try:
        with raw, gzip.GzipFile(fileobj=raw, mode="rb") as f:
            return f.read()
    except gzip.BadGzipFile:
        raise UserError(f"{path}: not a gzip file; replace it with the "
                        "original .gz file") from None
    except EOFError:
        raise UserError(f"{path}: gzip data is truncated (the file was cut "
                        "short); delete it and download it again") from None
    except (zlib.error, OSError) as e:
        raise UserError(f"{path}: gzip data is corrupt ({e}); delete it and "
                        "download it again") from None


def _parse_idx(path: pathlib.Path, magic: int, dims: int) -> tuple:
    """Returns (shape, payload) of an IDX file after checking its header."""
    raw = _read_gzip(path)
    header_size = 4 + 4 * dims
    if len(raw) < header_size:
        raise UserError(f"{path}: only {len(raw)} bytes, too short for an "
                        f"IDX header of {header_size} bytes")
    (found,) = struct.unpack(">I", raw[:4])
    if found != magic:
        kind = "images" if magic == _IMAGES_MAGIC else "labels"
        raise UserError(
            f"{path}: wrong magic number 0x{found:08x}, expected "
            f"0x{magic:08x} for MNIST {kind}; is this the right file?")
    shape = struct.unpack(f">{dims}I", raw[4:header_size])
    payload = raw[header_size:]
    expected = int(np.prod(shape))
    if len(payload) < expected:
        raise UserError(
            f"{path}: truncated: the header promises {expected} bytes of "
            f"data for shape {shape} but the file holds {len(payload)}")
    if len(payload) > expected:
        raise UserError(
            f"{path}: {len(payload) - expected} unexpected bytes after the "
            f"{expected} bytes of data the header promises")
    return shape, payload


def read_images(path: pathlib.Path) -> np.ndarray:
    """Reads an IDX image file: uint8 [n, 28, 28]."""
    shape, payload = _parse_idx(path, _IMAGES_MAGIC, 3)
    if shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
        raise UserError(
            f"{path}: images are {shape[1]}x{shape[2]} pixels, expected "
            f"{IMAGE_SIZE}x{IMAGE_SIZE}")
    return np.frombuffer(payload, np.uint8).reshape(shape)


def read_labels(path: pathlib.Path) -> np.ndarray:
    """Reads an IDX label file: uint8 [n], each in 0..9."""
    shape, payload = _parse_idx(path, _LABELS_MAGIC, 1)
    labels = np.frombuffer(payload, np.uint8).reshape(shape)
    if labels.size and labels.max() >= NUM_CLASSES:
        bad = int(np.argmax(labels >= NUM_CLASSES))
        raise UserError(
            f"{path}: label {labels[bad]} at position {bad} is outside "
            f"0..{NUM_CLASSES - 1}")
    return labels


def _read_pair(images_path: pathlib.Path, labels_path: pathlib.Path):
    images = read_images(images_path)
    labels = read_labels(labels_path)
    if len(images) != len(labels):
        raise UserError(
            f"{images_path} holds {len(images)} images but {labels_path} "
            f"holds {len(labels)} labels; the two files must match")
    if not len(images):
        raise UserError(f"{images_path}: holds no images")
    return images, labels


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(name: str, data_dir: pathlib.Path, sources=SOURCES,
             checksums=None, timeout=DOWNLOAD_TIMEOUT_SECS) -> pathlib.Path:
    """Fetches one file into data_dir atomically and verifies its SHA-256.

    The file is written under a temporary name and renamed only after its
    checksum matched, so a crash or a bad download never leaves a partial
    file under the real name. A mismatch deletes the download and fails.
    """
    checksums = SHA256 if checksums is None else checksums
    target = data_dir / name
    partial = data_dir / f".{name}.{os.getpid()}.partial"
    # The folder's own faults are the user's to fix, not a source's.
    with edge("--data_dir", data_dir, "give --data_dir a folder this user "
              "can create and write, or copy the MNIST .gz files there"):
        data_dir.mkdir(parents=True, exist_ok=True)
        partial.touch()
    failures = []
    for source in sources:
        url = source + name
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, \
                    open(partial, "wb") as out:
                for block in iter(lambda: response.read(1 << 20), b""):
                    out.write(block)
        except (urllib.error.URLError, OSError, ValueError) as e:
            partial.unlink(missing_ok=True)
            failures.append(f"{url}: {getattr(e, 'reason', e)}")
            continue
        found = _sha256(partial)
        if found != checksums[name]:
            partial.unlink(missing_ok=True)
            raise UserError(
                f"download of {url} has SHA-256 {found}, expected "
                f"{checksums[name]}; the bad file was removed. Try again "
                f"later or copy the original file to {target}")
        os.replace(partial, target)
        return target
    raise UserError(
        f"{target} is missing and could not be downloaded "
        f"({'; '.join(failures)}); copy the four MNIST .gz files there or "
        f"point --data_dir or ${ENV_DATA_DIR} at a folder that has them")


def fetch_missing(data_dir: pathlib.Path, allow_download: bool = True,
                  sources=SOURCES, checksums=None,
                  names=(TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES,
                         TEST_LABELS)) -> None:
    """Downloads (and checks) those of `names` missing from data_dir, or
    raises UserError; reads nothing. The local launcher calls it before it
    leaves the network (trainer/cluster/isolation.py)."""
    data_dir = pathlib.Path(data_dir)
    if not allow_download and not data_dir.is_dir():
        raise UserError(f"data folder {data_dir} does not exist; pass "
                        f"--data_dir or set ${ENV_DATA_DIR} to the folder "
                        "with the MNIST .gz files")
    for name in names:
        if not (data_dir / name).exists():
            if not allow_download:
                raise UserError(
                    f"{data_dir / name} is missing and downloading is off; "
                    f"copy the file there or point --data_dir or "
                    f"${ENV_DATA_DIR} at the folder that has it")
            download(name, data_dir, sources, checksums)


def load(data_dir: pathlib.Path, allow_download: bool = True,
         sources=SOURCES, checksums=None, need_train: bool = True,
         need_test: bool = True) -> Mnist:
    """Reads (and if needed downloads) MNIST from data_dir.

    Args:
      data_dir: folder with the four .gz files.
      allow_download: fetch missing files from `sources`.
      sources, checksums: where to download from and the expected SHA-256
        per file name (tests point these at a local server).
      need_train, need_test: which half to read; the other is left empty.
    """
    data_dir = pathlib.Path(data_dir)
    wanted = ((TRAIN_IMAGES, TRAIN_LABELS) if need_train else ()) + (
        (TEST_IMAGES, TEST_LABELS) if need_test else ())
    fetch_missing(data_dir, allow_download, sources, checksums, wanted)
    empty_images = np.zeros((0, IMAGE_SIZE, IMAGE_SIZE), np.uint8)
    empty_labels = np.zeros((0,), np.uint8)
    train = (_read_pair(data_dir / TRAIN_IMAGES, data_dir / TRAIN_LABELS)
             if need_train else (empty_images, empty_labels))
    test = (_read_pair(data_dir / TEST_IMAGES, data_dir / TEST_LABELS)
            if need_test else (empty_images, empty_labels))
    return Mnist(train[0], train[1], test[0], test[1])
