"""The silence rule for every watched task: the chief's members
(membership.py) and the chief's beat (takeover.Judge)."""

from typing import Callable

from trainer.roles import timing


def lost(silent: float, limit: float, flag: str, what: str,
         refuses: Callable[[], bool]) -> str | None:
    """Why a task silent for `silent` seconds is lost, or None: after
    `limit` (set by `flag`), or after timing.REFUSED_AFTER_SECS if its port
    refuses connections (its process is gone; a host cut off or frozen
    does not refuse). refuses() costs a connection: asked only then."""
    if silent >= limit:
        return f"no {what} for {limit:.0f} s, {flag}"
    if silent >= timing.REFUSED_AFTER_SECS and refuses():
        return "its port refuses connections"
    return None
