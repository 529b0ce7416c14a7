"""The roles' timing constants, in seconds (the sync rule's are in pace.py)."""

POLL_SECS = 0.25  # polling for a ps, the chief's handshake, a token, the end
PROGRESS_LOG_SECS = 5.0  # logging that a task still waits for ps or chief
CLOSE_DEADLINE_SECS = 15.0  # ending a blocked run, before the process exits
QUICK_CLOSE_SECS = 1.0  # closing a session whose runs failed
BEAT_SECS = 0.5  # the chief's beat, and each worker's reading of it
REFUSED_AFTER_SECS = 1.0  # silence after which a refusing port is gone
MEMBERSHIP_CHECK_SECS = 0.5  # the chief's membership watch's check
# A longer gap between membership checks: the chief's process did not
# run, and the workers' silence meanwhile is not held against them.
STALL_SECS = 3.0
WATCHDOG_CHECK_SECS = 2.0  # a worker's watchdog's check of the step
WARN_EVERY_SECS = 10.0  # the watchdog's warning that the step stands still
READ_DEADLINE_SECS = 5.0  # a watch thread's read of ps 0 (then: no answer)
JOIN_AGAIN_SECS = 5.0  # a worker not in the roster asks to join again
# Share of --worker_timeout_secs a claim waits for the lock before calling
# the last chief lost inside a write. Under 1, so that the next in line
# (--worker_timeout_secs later) sees the first's claim (nemesis seed 913).
CLAIM_WAIT_SHARE = 0.5
LEAVE_DEADLINE_SECS = 1.5  # a worker's message that it leaves (SIGTERM)
BUILD_AHEAD_AFTER_SECS = 30.0  # run time before a worker builds ahead
PS_PORT_CHECK_SECS = 1.0  # the chief's check of a ps port
FINISH_WAIT_SECS = 15.0  # the chief's wait for end reports and late joiners
END_SECS = 5.0  # each message of a failed run's end (STOP, a ps to exit)
