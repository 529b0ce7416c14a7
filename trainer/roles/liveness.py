"""The silence rule, written once for every task that another one
watches: the chief watching its members' pushes (membership.py), and
the workers watching the chief's beat (takeover.Judge)."""

from typing import Callable

from trainer.roles import timing


def lost(silent: float, limit: float, flag: str, what: str,
         refuses: Callable[[], bool]) -> str | None:
    """Why a task silent for `silent` seconds is lost, or None.

    Lost once silent for `limit` seconds (set by `flag`, named in the
    reason: "no gradient for 120 s, --worker_timeout_secs"), or for
    timing.REFUSED_AFTER_SECS while its port refuses connections: its
    process is gone. A host cut off, frozen or starved does not refuse,
    so only the limit tells those. refuses() is asked only in that
    window, since it costs a connection attempt."""
    if silent >= limit:
        return f"no {what} for {limit:.0f} s, {flag}"
    if silent >= timing.REFUSED_AFTER_SECS and refuses():
        return "its port refuses connections"
    return None
