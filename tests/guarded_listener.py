"""A stand-in for a task with --firewall: a listening socket and a guard.

    python -m tests.guarded_listener PORT TABLE HANDLE LINGER_SECS

Listens on 127.0.0.1:PORT, starts the guard of table TABLE (handle
HANDLE, trainer/cluster/table_guard.py), prints one JSON line {"guard":
PID} and reads stdin. A line `exit N` ends it with status N, as a task
ends: atexit handlers first, among them one that sleeps LINGER_SECS
while the socket still listens (as TensorFlow's server does while the
interpreter shuts down); the socket is closed only by the kernel, with
the process. Signals end it the usual way (SIGTERM, SIGKILL: at once).
"""

import atexit
import json
import os
import socket
import sys
import time

from trainer.cluster import table_guard


def main(argv: list[str]) -> int:
    port, table, handle, linger = (int(argv[1]), argv[2], int(argv[3]),
                                   float(argv[4]))
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    os.dup(listener.fileno())   # left open: the kernel closes it at exit
    guard = table_guard.start(table, handle)
    print(json.dumps({"guard": guard.pid}), flush=True)
    atexit.register(time.sleep, linger)
    for line in sys.stdin:
        if line.startswith("exit "):
            return int(line.split()[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
