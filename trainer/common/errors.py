"""Errors that reach the user as one line instead of a traceback."""


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
