"""Errors that reach the user as one line instead of a traceback.

`edge` is the one way an operating-system error at the edge of the program
(the logdir, the data folder, a port, a checkpoint, results or another
output file) becomes such a line: it names what the user gave, what the
system said and the fix.
"""

import contextlib
import errno
import os


class UserError(Exception):
    """Bad input: a flag, a host list, TF_CONFIG, a data file or a logdir.

    The message names the problem and the fix in one line. Entry points log
    it and exit with status 2, before any server starts where that is
    possible.
    """


class RunFailed(Exception):
    """The run cannot go on (a task went missing, the cluster disagrees).

    Entry points log the one-line message and exit with status 1.
    Checkpoints written before the failure stay valid, so running the same
    command again resumes from the latest one.
    """


# errno -> what the system's refusal means, said of the thing refused.
_PROBLEMS = {
    errno.EEXIST: "is a file, not a folder",
    errno.ENOTDIR: "cannot be a folder: a part of its path is a file",
    errno.EISDIR: "is a folder, not a file",
    errno.ENOENT: "cannot be found or made there (no such file or folder)",
    errno.EACCES: "is refused: permission denied",
    errno.EPERM: "is refused: operation not permitted",
    errno.EROFS: "is on a read-only file system",
    errno.ENOSPC: "cannot be written: no space left on the device",
    errno.EDQUOT: "cannot be written: disk quota exceeded",
    errno.ENAMETOOLONG: "has a name that is too long",
    errno.EADDRINUSE: "is already in use on this machine",
    errno.EADDRNOTAVAIL: "is not an address of this machine",
}


def edge_message(what: str, path, error: OSError,
                 fix: str | None = None) -> str:
    """One line: `what` (and `path`), what `error` means, and the fix."""
    subject = what if path is None else (
        f"{what}={path}" if what.startswith("--") else f"{what} {path}")
    problem = _PROBLEMS.get(error.errno) or (
        f"cannot be used ({error.strerror or error})")
    # Name the file the system refused when it is not the one given, e.g.
    # a checkpoint inside --logdir.
    refused = error.filename
    if refused is not None and path is not None and os.fspath(
            refused) != os.fspath(path):
        problem += f" ({refused})"
    fix = fix or (f"give {what} a path this user can create and write, or "
                  "fix its permissions")
    return f"{subject} {problem}; {fix}"


@contextlib.contextmanager
def edge(what: str, path=None, fix: str | None = None):
    """Turns an OSError raised inside into a one-line UserError.

        with edge("--logdir", logdir):
            pathlib.Path(logdir).mkdir(parents=True, exist_ok=True)

    Args:
      what: what the user gave: a flag ("--logdir") or a description
        ("port 2222 of ps 0 (localhost:2222)").
      path: the value given, or None when `what` says it all.
      fix: how to fix it; by default, to give a path this user can write.
    Raises:
      UserError: instead of any OSError from the block (no traceback: the
        message says what the system said).
    """
    try:
        yield
    except OSError as e:
        raise UserError(edge_message(what, path, e, fix)) from None
