"""Runs a whole cluster on this machine: `python -m trainer.launch`.

Starts --num_ps ps tasks and --num_workers workers as separate OS processes
of `python -m trainer.main` on free loopback ports (trainer/cluster/local.py),
prefixes their output with the task's name. A failed worker other than
the chief is left behind or started again (--worker_restarts); the chief
or a ps failing, or Ctrl-C, stops them all. The exit status is the run's:
0 when the chief and the ps tasks exited 0, else that of the first of them
that failed. Every trainer flag given here is passed on.
"""

import signal

from absl import app
from absl import flags
from absl import logging

from trainer import flags as trainer_flags
from trainer.cluster import local as launcher
from trainer.common import console as console_lib
from trainer.observe import status_line
from trainer.common.errors import UserError

trainer_flags.define_local_cluster_flags()
trainer_flags.define_isolate_flag()
flags.DEFINE_string("host", "localhost",
                    "Address the tasks use to reach each other.")
flags.DEFINE_string("report", None,
                    "Write each task's exit status and peak memory (RSS) "
                    "to this JSON file at the end.")
flags.DEFINE_float("exit_grace_secs", 30,
                   "After the workers finish, how long the ps tasks may "
                   "take to exit before they are killed.")

flags.DEFINE_integer("worker_restarts", 0,
                     "How often a worker other than the chief that fails is "
                     "started again, so that it joins the run again; with "
                     "0 the run goes on without it.", lower_bound=0)

FLAGS = flags.FLAGS


def worker_threads(num_workers: int) -> list[str]:
    """default_worker_threads as flags, except those given on our command
    line, which win."""
    return [f"--{name}={value}" for name, value in
            launcher.default_worker_threads(num_workers).items()
            if not FLAGS[name].present]



def _interrupt(signum, frame):
    del signum, frame
    raise KeyboardInterrupt


def main(argv) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    # Ctrl-C and SIGTERM stop every task, whatever this process inherited:
    # a launcher started from a script's background job (`cmd &`) inherits
    # SIGINT as ignored, and Python then never raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        isolated = launcher.isolate_network(FLAGS.isolate, FLAGS.host,
                                            trainer_flags.fetch_data)
    except UserError as e:
        logging.error("%s", e)
        return trainer_flags.INPUT_ERROR_STATUS
    except KeyboardInterrupt:  # while fetching MNIST: no task started yet
        logging.error("interrupted")
        return 130
    console = console_lib.Console()
    if console.live:  # our log lines above the status line, not on it
        logging.get_absl_handler().python_handler.stream = (
            console.text_stream())
    try:
        return launcher.launch(
            FLAGS.num_ps, FLAGS.num_workers, FLAGS.host,
            trainer_flags.forwarded_flags(),
            worker_threads(FLAGS.num_workers), FLAGS.exit_grace_secs,
            FLAGS.report, FLAGS.worker_restarts, isolated, console,
            status_line.RunStatus(console.status))
    finally:
        console.close()


def run_main():
    """Console-script entry point."""
    trainer_flags.run_command(main)


if __name__ == "__main__":
    run_main()
