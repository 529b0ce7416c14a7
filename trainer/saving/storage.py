"""Whether a worker's --logdir is the chief's storage.

A worker that takes over the chief's work (trainer/roles/takeover.py)
writes checkpoints, summaries and results into its own --logdir. They
stay in one place only if every worker's --logdir is the same storage (a
shared path, a Kubernetes volume, a Slurm cluster filesystem). Each chief
writes a random word into MARK_FILE in its logdir and onto ps 0; a worker
that does not find the same word in its own logdir says so at start.
"""

import pathlib
import secrets

from absl import logging
import tensorflow as tf

MARK_FILE = ".chief_storage"


def mark(logdir: pathlib.Path) -> str:
    """Writes a new word into logdir's MARK_FILE; returns it."""
    word = secrets.token_hex(8)
    (pathlib.Path(logdir) / MARK_FILE).write_text(word + "\n")
    return word


def warn_if_elsewhere(logdir: str, chiefs_word) -> bool:
    """Logs one line, and returns True, if logdir does not hold the word
    chiefs_word() reads from ps 0 (a chief of an older version wrote
    none: then nothing is said)."""
    try:
        word = chiefs_word().decode()
    except tf.errors.OpError:
        return False
    path = pathlib.Path(logdir) / MARK_FILE
    try:
        ours = path.read_text().strip()
    except OSError:
        ours = None
    if not word or ours == word:
        return False
    logging.warning(
        "this worker's --logdir, %s, is not the chief's storage (no mark "
        "of this chief in it): if this worker takes over the chief's "
        "work, checkpoints and summaries go there; give every worker one "
        "shared --logdir to keep them in one place",
        pathlib.Path(logdir).resolve())
    return True
