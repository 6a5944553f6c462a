"""pid 1 of a namespaced host (:mod:`kvcore.runtime.hosts`): ``python -m kvcore.runtime.hostinit NAME SHM_SIZE HOSTS``.

It names the host ``NAME``, mounts a private tmpfs of ``SHM_SIZE`` on ``/dev/shm`` and binds ``HOSTS`` (a file
naming both hosts) over ``/etc/hosts``, writes ``ready`` on stdout, then reaps orphans (as a pid 1 must) until
its stdin closes: the creating process died or closed the host, and the kernel takes every process of the pid
namespace with it. It runs inside the host's fresh namespaces, before anything else, and imports only the
standard library.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Set the host up from ``argv`` (name, /dev/shm size, hosts file), report ready, reap until stdin closes."""
    name, shm_size, hosts_file = argv
    socket.sethostname(name)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777,size=" + shm_size, "kvcore-shm", "/dev/shm"], check=True)
    subprocess.run(["mount", "--bind", hosts_file, "/etc/hosts"], check=True)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    fd = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([fd], [], [], 0.5)
        if readable and not os.read(fd, 4096):
            return 0
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
