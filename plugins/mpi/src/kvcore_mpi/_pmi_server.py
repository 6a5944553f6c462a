"""A one-process PMI-1 process manager: what MPICH's ``MPI_Init`` talks to when kvcore starts MPI on its own.

Run as ``python -m kvcore_mpi._pmi_server FD KVSNAME`` by :mod:`kvcore_mpi._bootstrap`, with ``FD`` one end of
a socket pair whose other end MPICH reads from ``PMI_FD``. It answers the PMI-1 wire protocol (text lines,
``cmd=... key=value``) for a job of size 1 under a namespace unique to the process, and exits when the
socket closes (the MPI process exited). Why it exists: a process that MPICH 5.0 initializes as a
*singleton* (no process manager) always names its world ``singinit``, so two such processes see each
other's ranks as their own and ``MPI_Comm_connect``/``MPI_Comm_accept`` refuse them (README: evidence).
"""

from __future__ import annotations

import socket
import sys

#: Longest request line accepted; MPICH's own limit (PMIU_MAXLINE) is 1024.
MAX_LINE = 4096


def answer(line: str, kvsname: str, store: dict[str, str]) -> str:
    """The PMI-1 response to one request line (without its newline)."""
    fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
    cmd = fields.get("cmd", "")
    if cmd == "init":
        return "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"
    if cmd == "get_maxes":
        return "cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024"
    if cmd == "get_appnum":
        return "cmd=appnum rc=0 appnum=0"
    if cmd == "get_my_kvsname":
        return f"cmd=my_kvsname rc=0 kvsname={kvsname}"
    if cmd == "get_universe_size":
        return "cmd=universe_size rc=0 size=1"
    if cmd == "barrier_in":
        return "cmd=barrier_out rc=0"
    if cmd == "put":
        store[fields.get("key", "")] = fields.get("value", "")
        return "cmd=put_result rc=0"
    if cmd == "get":
        value = store.get(fields.get("key", ""))
        return "cmd=get_result rc=0 found=FALSE" if value is None else f"cmd=get_result rc=0 value={value}"
    if cmd == "finalize":
        return "cmd=finalize_ack rc=0"
    return f"cmd={cmd or 'unknown'} rc=-1 msg=unsupported_by_kvcore_pmi"


def serve(fd: int, kvsname: str) -> None:
    """Answer requests on ``fd`` until the peer closes it."""
    store: dict[str, str] = {}
    with socket.socket(fileno=fd) as sock, sock.makefile("rwb", buffering=0) as stream:
        while True:
            raw = stream.readline(MAX_LINE)
            if not raw:
                return
            reply = answer(raw.decode("ascii", "replace").strip(), kvsname, store)
            stream.write(reply.encode("ascii") + b"\n")


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
