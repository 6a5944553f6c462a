"""Start MPI once per process, so that processes started on their own can meet through connect/accept.

Where no process manager launched this process (no ``PMI_FD``, ``PMI_PORT`` or ``PMIX_*`` in the
environment), MPICH would initialize as a singleton whose world is named ``singinit`` in every process;
two such worlds collide and ``MPI_Comm_connect`` fails with "Local and remote groups in
MPI_Intercomm_create must not overlap". So this module starts :mod:`kvcore_mpi._pmi_server` (a
one-process PMI-1 process manager) first and hands MPICH one end of a socket pair as ``PMI_FD``: the
world then gets a namespace unique to this process. A process that an ``mpiexec`` launched keeps its own
process manager.

MPI is initialized with ``MPI_THREAD_MULTIPLE`` (the agent's accept, service and transfer threads call MPI
concurrently), errors return as exceptions, and ``MPI_Finalize`` is not called at exit: a thread of a
fenced peer may still sit inside MPI, and finalize would wait for it forever.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import uuid
from types import ModuleType

from kvcore.errors import TransferError

#: The MPI libraries this agent knows; another is refused (its singleton and fault behaviour are unchecked).
KNOWN_LIBRARY = re.compile(r"MPICH Version:\s+(4\.[1-9]|5\.0)\b")

_lock = threading.Lock()
_mpi: ModuleType | None = None
_pm: subprocess.Popen[bytes] | None = None


def _launched_by_a_process_manager() -> bool:
    return any(k in os.environ for k in ("PMI_FD", "PMI_PORT")) or any(k.startswith("PMIX_") for k in os.environ)


def _start_process_manager() -> None:
    """Start the one-process PMI server and point MPICH at it through ``PMI_FD`` (for this process only)."""
    global _pm
    ours, theirs = socket.socketpair()
    kvsname = f"kvcore_{os.getpid()}_{uuid.uuid4().hex[:16]}"
    _pm = subprocess.Popen(
        [sys.executable, "-m", "kvcore_mpi._pmi_server", str(theirs.fileno()), kvsname],
        pass_fds=(theirs.fileno(),),
        stdin=subprocess.DEVNULL,
    )
    theirs.close()
    fd = ours.detach()  # never closed: MPI_Finalize (if anyone calls it) still talks to the server
    os.environ.update({"PMI_FD": str(fd), "PMI_RANK": "0", "PMI_SIZE": "1"})


def mpi() -> ModuleType:
    """``mpi4py.MPI``, initialized for the agent (thread level multiple, errors as exceptions); once per process.

    Raises:
        TransferError: MPI is not MPICH 4.1-5.0, or does not provide ``MPI_THREAD_MULTIPLE``.
    """
    global _mpi
    with _lock:
        if _mpi is not None:
            return _mpi
        import mpi4py

        ours = "mpi4py.MPI" not in sys.modules
        if ours:
            mpi4py.rc.thread_level = "multiple"
            mpi4py.rc.errors = "exception"
            mpi4py.rc.finalize = False
            if not _launched_by_a_process_manager():
                _start_process_manager()
        try:
            from mpi4py import MPI
        finally:
            if ours and _pm is not None:  # children of this process must not inherit our PMI socket
                for key in ("PMI_FD", "PMI_RANK", "PMI_SIZE"):
                    os.environ.pop(key, None)
        version = MPI.Get_library_version()
        if not KNOWN_LIBRARY.search(version):
            raise TransferError(
                f"mpi agent: MPI library: expected MPICH 4.1-5.0, got {version.splitlines()[0] if version else '?'!r}"
            )
        if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
            raise TransferError(
                f"mpi agent: MPI thread level: expected MPI_THREAD_MULTIPLE ({MPI.THREAD_MULTIPLE}), "
                f"got {MPI.Query_thread()} (MPI was initialized before kvcore with a lower level)"
            )
        _mpi = MPI
        return MPI
