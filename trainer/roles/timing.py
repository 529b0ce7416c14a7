"""Every timing constant of a task's roles, in seconds, each named for
what it bounds or paces; the modules read them here, as `timing.NAME`.

Two flags bound the rest, each with every use listed in its help:
--worker_timeout_secs (the silence after which a worker or the chief is
lost) and --startup_timeout_secs (how long a task waits for its
cluster, or for a chief in its start). The sync rule's own constants
(pace.PROBE_SECS, the late factor) are parameters of its decision table
and stay beside it, in trainer/sync/pace.py.
"""

# Waiting for something about to appear: a ps, the chief's handshake,
# a token, the chief's end message (on a ps).
POLL_SECS = 0.25
# Saying that a task still waits for a ps or the chief.
PROGRESS_LOG_SECS = 5.0
# Giving up: the longest that ending a blocked run may take before the
# process exits.
CLOSE_DEADLINE_SECS = 15.0
# Closing a session whose runs failed (clean-up only).
QUICK_CLOSE_SECS = 1.0
# The chief's beat, and each worker's reading of it.
BEAT_SECS = 0.5
# A task (a member, the chief) silent this long whose port refuses
# connections is gone (liveness.lost).
REFUSED_AFTER_SECS = 1.0
# The membership watch's check of the round, on the chief.
MEMBERSHIP_CHECK_SECS = 0.5
# A gap between two membership checks longer than this: the chief's
# process did not run (stopped, swapped out), and the workers' silence
# meanwhile is not held against them.
STALL_SECS = 3.0
# A worker's watchdog: its check of the global step, and its warning.
WATCHDOG_CHECK_SECS = 2.0
WARN_EVERY_SECS = 10.0
# A read of ps 0 by a watch thread; a longer one counts as no answer.
READ_DEADLINE_SECS = 5.0
# A worker not yet in the roster asks to join again this often.
JOIN_AGAIN_SECS = 5.0
# A claim waits this share of --worker_timeout_secs for the lock before it
# calls the last chief lost inside a write. Less than 1: the next worker
# in line claims --worker_timeout_secs after the first, and must by then
# see the first's claim, or two claim at once (nemesis seed 913).
CLAIM_WAIT_SHARE = 0.5
# A worker's message to the chief that it leaves (SIGTERM).
LEAVE_DEADLINE_SECS = 1.5
# In the run this long, a worker builds ahead what a takeover or a lost
# ps would otherwise build then: the spare chief (roles/run.py), the
# graphs without a ps (roles/standby.py).
BUILD_AHEAD_AFTER_SECS = 30.0
# The chief's check of a ps port (a ps done without, or one it uses).
PS_PORT_CHECK_SECS = 1.0
# At the end, the chief waits this long for the workers' reports and
# for declared workers that never joined.
FINISH_WAIT_SECS = 15.0
# Each message of a failed run's end (STOP, a ps told to exit).
END_SECS = 5.0
