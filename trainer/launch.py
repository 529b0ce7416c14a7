"""Runs a whole cluster from one command: `python -m trainer.launch`.

Starts --num_ps ps tasks and --num_workers workers as separate OS processes
of `python -m trainer.main`: on free loopback ports of this machine
(trainer/cluster/local.py), or with --ssh_hosts on other machines over ssh
(trainer/cluster/ssh_launcher.py, which checks every host first). It
prefixes their output with the task's name. A failed worker is left
behind or started again (--worker_restarts); so is the chief where there
are other workers, one of which takes over its work. A failed ps is
started again with --ps_restarts; with --ps_mirrors, the run goes on
without a failed ps other than ps 0. A ps failing otherwise, the chief
failing alone, or Ctrl-C stops them all. The exit status is the
run's: 0 when the ps tasks exited 0, else that of the first task that
stopped the run. Every trainer flag given here is passed on.
"""

import pathlib
import signal
import sys

from absl import app
from absl import flags
from absl import logging

from trainer import flags as trainer_flags
from trainer import remote as remote_lib
from trainer.cluster import local as launcher
from trainer.cluster import ssh as ssh_lib
from trainer.cluster import ssh_launcher
from trainer.common import console as console_lib
from trainer.observe import status_line
from trainer.common.config import check_ps_mirrors
from trainer.common.errors import UserError

trainer_flags.define_local_cluster_flags()
trainer_flags.define_isolate_flag()
flags.DEFINE_string("host", "localhost",
                    "Address the tasks use to reach each other.")
flags.DEFINE_string("report", None,
                    "Write each task's exit status and peak memory (RSS; "
                    "not over ssh) to this JSON file at the end.")
flags.DEFINE_float("exit_grace_secs", 30,
                   "After the workers finish, how long the ps tasks may "
                   "take to exit before they are killed.")

flags.DEFINE_integer("worker_restarts", 0,
                     "How often a worker that fails is started again, so "
                     "that it joins the run again (the chief too, where "
                     "another worker takes over its work); with 0 the run "
                     "goes on without it.", lower_bound=0)
flags.DEFINE_integer("ps_restarts", 0,
                     "How often a ps task that fails is started again at "
                     "its address: the workers reconnect, and the chief "
                     "restores the newest checkpoint (up to "
                     "--checkpoint_every steps redone) or, with "
                     "--ps_mirrors, refills the ps from its copies "
                     "(nothing redone); with 0 a failed ps stops the run, "
                     "but for a ps other than ps 0 with --ps_mirrors.",
                     lower_bound=0)

flags.DEFINE_string(
    "ssh_hosts", None, "Run the tasks on these machines over ssh instead of "
    "on this one: [user@]host[=address],... or @FILE (one per line). The ps "
    "tasks, then the workers, go on the hosts in turn; --num_workers "
    "defaults to the hosts left after the ps tasks. Every host needs the "
    "checkout at --remote_dir and the same Python, TensorFlow and trainer, "
    "which is checked before anything starts.")
flags.DEFINE_integer("base_port", 2222, "With --ssh_hosts: the first port "
                     "of each host's tasks (then +1, +2, ...).",
                     lower_bound=1, upper_bound=65535)
flags.DEFINE_integer("ssh_port", None, "With --ssh_hosts: ssh's port "
                     "(default: ssh's own, e.g. from ~/.ssh/config).")
flags.DEFINE_string("ssh_options", "", "With --ssh_hosts: more arguments "
                    "for ssh, e.g. \"-i ~/.ssh/cluster -o User=ml\".")
flags.DEFINE_string("remote_dir", str(pathlib.Path(__file__).resolve()
                                      .parents[1]),
                    "With --ssh_hosts: the checkout on every host; the "
                    "tasks run there, so relative paths (--logdir, "
                    "--data_dir) are relative to it. Default: this "
                    "checkout's path.")
flags.DEFINE_string("remote_python", sys.executable, "With --ssh_hosts: "
                    "the Python on every host (default: this one's path).")

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
    try:  # the tasks check again; one line here rather than one per task
        check_ps_mirrors(FLAGS.ps_mirrors, FLAGS.num_ps)
    except UserError as e:
        logging.error("%s", e)
        return trainer_flags.INPUT_ERROR_STATUS
    if FLAGS.ssh_hosts:
        return _with_console(_launch_over_ssh)
    try:
        isolated = launcher.isolate_network(FLAGS.isolate, FLAGS.host,
                                            trainer_flags.fetch_data)
    except UserError as e:
        logging.error("%s", e)
        return trainer_flags.INPUT_ERROR_STATUS
    except KeyboardInterrupt:  # while fetching MNIST: no task started yet
        logging.error("interrupted")
        return 130
    return _with_console(lambda console, on_chief_line: launcher.launch(
        FLAGS.num_ps, FLAGS.num_workers, FLAGS.host,
        trainer_flags.forwarded_flags(), worker_threads(FLAGS.num_workers),
        FLAGS.exit_grace_secs, FLAGS.report, FLAGS.worker_restarts,
        isolated, console, on_chief_line, FLAGS.ps_restarts, FLAGS.ps_mirrors))


def _with_console(run) -> int:
    """run(console, on_chief_line) with the tasks' lines and the status
    line on one console."""
    console = console_lib.Console()
    if console.live:  # our log lines above the status line, not on it
        logging.get_absl_handler().python_handler.stream = (
            console.text_stream())
    try:
        return run(console, status_line.RunStatus(console.status))
    finally:
        console.close()


def _launch_over_ssh(console, on_chief_line) -> int:
    text = FLAGS.ssh_hosts
    try:
        if text.startswith("@"):
            text = pathlib.Path(text[1:]).read_text()
        hosts = ssh_lib.parse_hosts(text)
    except OSError as e:
        logging.error("--ssh_hosts=%s: cannot read it (%s)", text,
                      e.strerror)
        return trainer_flags.INPUT_ERROR_STATUS
    except UserError as e:
        logging.error("%s", e)
        return trainer_flags.INPUT_ERROR_STATUS
    num_workers = (FLAGS.num_workers if FLAGS["num_workers"].present
                   else max(1, len(hosts) - FLAGS.num_ps))
    check = ([f"--data_dir={FLAGS.data_dir}"] if FLAGS.data_dir else []) + (
        [] if FLAGS.download else ["--nodownload"])
    if not FLAGS.firewall:
        logging.info(launcher.SECURITY_NOTICE + " (or add --firewall)")
    remote = ssh_launcher.Remote(FLAGS.remote_python, FLAGS.remote_dir,
                                 FLAGS.ssh_port, FLAGS.ssh_options)
    return ssh_launcher.launch(
        hosts, FLAGS.num_ps, num_workers, FLAGS.base_port, remote,
        remote_lib.facts([], None, True), trainer_flags.forwarded_flags(),
        check, FLAGS.exit_grace_secs, FLAGS.report, FLAGS.worker_restarts,
        console, on_chief_line, FLAGS.ps_restarts, FLAGS.ps_mirrors)


def run_main():
    """Console-script entry point."""
    trainer_flags.run_command(main)


if __name__ == "__main__":
    run_main()
