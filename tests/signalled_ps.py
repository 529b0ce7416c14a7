"""A ps task with --firewall, stopped by a signal once it serves.

    unshare --net python -m tests.signalled_ps SIGNAL_NAME RECORD_FOLDER

Run in a private network namespace (it brings loopback up). Puts an
`nft` first on PATH that writes each `delete` it is asked for to
RECORD_FOLDER/deletes, with whether port 2222 still accepted a
connection at that moment, then runs the real nft. Starts the ps, sends
the signal once it logs "serving", and prints one JSON line: {"status":
exit status, "tables": `nft list tables` once no trainer table is left
(or after TABLE_WAIT_SECS), "log": the task's output, "deletes": [{"args":
[...], "listening": bool}, ...]}. Every wait is bounded.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

TABLE_WAIT_SECS = 10
RECORDING_NFT = """#!{python}
import json, os, socket, sys
if sys.argv[1:2] == ["delete"]:
    listening = socket.socket().connect_ex(("127.0.0.1", 2222)) == 0
    with open({log!r}, "a") as log:
        log.write(json.dumps({{"args": sys.argv[1:],
                               "listening": listening}}) + "\\n")
os.execv({nft!r}, [{nft!r}, *sys.argv[1:]])
"""


def recording_nft(folder: pathlib.Path) -> dict:
    """Writes folder/bin/nft; an environment with it first on PATH."""
    (folder / "bin").mkdir(exist_ok=True)
    (folder / "deletes").write_text("")
    nft = folder / "bin" / "nft"
    nft.write_text(RECORDING_NFT.format(python=sys.executable,
                                        log=str(folder / "deletes"),
                                        nft=shutil.which("nft")))
    nft.chmod(0o755)
    return {**os.environ, "PATH": f"{nft.parent}:{os.environ['PATH']}"}


def run_and_signal(signum: int, env: dict) -> tuple[int, str]:
    """(exit status, output) of a ps sent `signum` once serving."""
    task = subprocess.Popen(
        [sys.executable, "-m", "trainer.main", "--firewall", "--job_name=ps",
         "--task_index=0", "--ps_hosts=localhost:2222",
         "--worker_hosts=localhost:2223"], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env)
    seen, deadline = [], time.monotonic() + 60
    for line in task.stdout:
        seen.append(line)
        if "serving" in line or time.monotonic() > deadline:
            break
    task.send_signal(signum)
    try:
        status = task.wait(timeout=30)
    except subprocess.TimeoutExpired:
        task.kill()
        status = task.wait()
    seen += task.stdout.readlines()   # until its guard is gone too
    return status, "".join(seen)


def main(argv: list[str]) -> int:
    folder = pathlib.Path(argv[2])
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    status, log = run_and_signal(getattr(signal, argv[1]),
                                 recording_nft(folder))
    deadline = time.monotonic() + TABLE_WAIT_SECS
    while True:
        tables = subprocess.run(["nft", "list", "tables"],
                                capture_output=True, text=True).stdout
        if "mnist_trainer_" not in tables or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    deletes = (folder / "deletes").read_text().splitlines()
    print(json.dumps({"status": status, "tables": tables, "log": log,
                      "deletes": [json.loads(d) for d in deletes]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
