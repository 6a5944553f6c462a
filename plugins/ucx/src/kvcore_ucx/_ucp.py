"""cffi (ABI mode) binding to the UCP API of the ``libucx-cu12`` wheel: no compiler needed at install or run time.

Only what the agent uses is declared. The setup every user of the binding does (context, worker, endpoint and
its close: the agent, the bench baseline) is written once at the end (:func:`create_context` and the rest). The struct layouts are copied field by
field from ``libucx/include/ucp/api/ucp.h`` of UCX 1.22 (the wheel this plugin
pins); ``tests/test_ucx.py::test_binding_struct_layouts_match_the_c_compiler``
compiles a C program against the wheel's headers and checks every
``sizeof``/``offsetof`` below against the compiler's,
so a layout drift fails a test instead of corrupting memory. UCX keeps these
structs append-only across 1.x (every parameter struct carries a
``field_mask``), so a newer library reads only the fields we flag.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "UcpLibrary",
    "load",
    "ptr_status",
    "UcxUnavailableError",
    "CDEF",
    "STRUCTS",
    "Check",
    "create_context",
    "create_worker",
    "worker_address",
    "create_endpoint",
    "close_endpoint",
]

CDEF = r"""
typedef int8_t ucs_status_t;               /* enum declared UCS_S_PACKED: one byte */
typedef void *ucs_status_ptr_t;
typedef struct ucp_context *ucp_context_h;
typedef struct ucp_config ucp_config_t;
typedef struct ucp_worker *ucp_worker_h;
typedef struct ucp_ep *ucp_ep_h;
typedef struct ucp_address ucp_address_t;
typedef struct ucp_mem *ucp_mem_h;
typedef struct ucp_rkey *ucp_rkey_h;
typedef struct ucp_conn_request *ucp_conn_request_h;
typedef uint64_t ucp_datatype_t;
typedef int ucs_thread_mode_t;
typedef int ucs_memory_type_t;
typedef int ucp_err_handling_mode_t;
typedef unsigned int socklen_t;
struct sockaddr;

typedef struct { unsigned long ucs_bits[16]; } ucs_cpu_set_t;
typedef struct ucs_sock_addr { const struct sockaddr *addr; socklen_t addrlen; } ucs_sock_addr_t;

typedef void (*ucp_request_init_callback_t)(void *request);
typedef void (*ucp_request_cleanup_callback_t)(void *request);
typedef void (*ucp_send_nbx_callback_t)(void *request, ucs_status_t status, void *user_data);
typedef void (*ucp_err_handler_cb_t)(void *arg, ucp_ep_h ep, ucs_status_t status);

typedef struct ucp_am_recv_param { uint64_t recv_attr; ucp_ep_h reply_ep; } ucp_am_recv_param_t;
typedef ucs_status_t (*ucp_am_recv_callback_t)(void *arg, const void *header, size_t header_length,
                                               void *data, size_t length, const ucp_am_recv_param_t *param);

typedef struct ucp_params {
    uint64_t field_mask;
    uint64_t features;
    size_t request_size;
    ucp_request_init_callback_t request_init;
    ucp_request_cleanup_callback_t request_cleanup;
    uint64_t tag_sender_mask;
    int mt_workers_shared;
    size_t estimated_num_eps;
    size_t estimated_num_ppn;
    const char *name;
    size_t node_local_id;
} ucp_params_t;

typedef struct ucp_context_attr {
    uint64_t field_mask;
    size_t request_size;
    ucs_thread_mode_t thread_mode;
    uint64_t memory_types;
    char name[32];
    size_t device_counter_size;
} ucp_context_attr_t;

typedef struct ucp_worker_params {
    uint64_t field_mask;
    ucs_thread_mode_t thread_mode;
    ucs_cpu_set_t cpu_mask;
    unsigned events;
    void *user_data;
    int event_fd;
    uint64_t flags;
    const char *name;
    size_t am_alignment;
    uint64_t client_id;
} ucp_worker_params_t;

typedef struct ucp_worker_attr {
    uint64_t field_mask;
    ucs_thread_mode_t thread_mode;
    uint32_t address_flags;
    ucp_address_t *address;
    size_t address_length;
    size_t max_am_header;
    char name[32];
    size_t max_debug_string;
} ucp_worker_attr_t;

typedef struct ucp_err_handler { ucp_err_handler_cb_t cb; void *arg; } ucp_err_handler_t;

typedef struct ucp_ep_params {
    uint64_t field_mask;
    const ucp_address_t *address;
    ucp_err_handling_mode_t err_mode;
    ucp_err_handler_t err_handler;
    void *user_data;
    unsigned flags;
    ucs_sock_addr_t sockaddr;
    ucp_conn_request_h conn_request;
    const char *name;
    ucs_sock_addr_t local_sockaddr;
} ucp_ep_params_t;

typedef struct ucp_mem_map_params {
    uint64_t field_mask;
    void *address;
    size_t length;
    unsigned flags;
    unsigned prot;
    ucs_memory_type_t memory_type;
    const void *exported_memh_buffer;
} ucp_mem_map_params_t;

typedef struct ucp_am_handler_param {
    uint64_t field_mask;
    unsigned id;
    uint32_t flags;
    ucp_am_recv_callback_t cb;
    void *arg;
} ucp_am_handler_param_t;

typedef struct {
    uint32_t op_attr_mask;
    uint32_t flags;
    void *request;
    union { ucp_send_nbx_callback_t send; void *other; } cb;
    ucp_datatype_t datatype;
    void *user_data;
    void *reply_buffer;
    ucs_memory_type_t memory_type;
    union { size_t *length; void *tag_info; } recv_info;
    ucp_mem_h memh;
    ucp_datatype_t remote_datatype;
    const void *remote;
    size_t remote_count;
} ucp_request_param_t;

void ucp_get_version(unsigned *major_version, unsigned *minor_version, unsigned *release_number);
const char *ucs_status_string(ucs_status_t status);
ucs_status_t ucp_config_read(const char *env_prefix, const char *filename, ucp_config_t **config_p);
void ucp_config_release(ucp_config_t *config);
ucs_status_t ucp_config_modify(ucp_config_t *config, const char *name, const char *value);
ucs_status_t ucp_init_version(unsigned api_major_version, unsigned api_minor_version,
                              const ucp_params_t *params, const ucp_config_t *config, ucp_context_h *context_p);
void ucp_cleanup(ucp_context_h context_p);
ucs_status_t ucp_context_query(ucp_context_h context_p, ucp_context_attr_t *attr);

ucs_status_t ucp_worker_create(ucp_context_h context, const ucp_worker_params_t *params, ucp_worker_h *worker_p);
void ucp_worker_destroy(ucp_worker_h worker);
ucs_status_t ucp_worker_query(ucp_worker_h worker, ucp_worker_attr_t *attr);
void ucp_worker_release_address(ucp_worker_h worker, ucp_address_t *address);
unsigned ucp_worker_progress(ucp_worker_h worker);
ucs_status_t ucp_worker_get_efd(ucp_worker_h worker, int *fd);
ucs_status_t ucp_worker_arm(ucp_worker_h worker);
ucs_status_t ucp_worker_signal(ucp_worker_h worker);
ucs_status_t ucp_worker_set_am_recv_handler(ucp_worker_h worker, const ucp_am_handler_param_t *param);

ucs_status_t ucp_ep_create(ucp_worker_h worker, const ucp_ep_params_t *params, ucp_ep_h *ep_p);
uintptr_t ucp_ep_close_nbx(ucp_ep_h ep, const ucp_request_param_t *param);
uintptr_t ucp_ep_flush_nbx(ucp_ep_h ep, const ucp_request_param_t *param);

ucs_status_t ucp_mem_map(ucp_context_h context, const ucp_mem_map_params_t *params, ucp_mem_h *memh_p);
ucs_status_t ucp_mem_unmap(ucp_context_h context, ucp_mem_h memh);
ucs_status_t ucp_rkey_pack(ucp_context_h context, ucp_mem_h memh, void **rkey_buffer_p, size_t *size_p);
void ucp_rkey_buffer_release(void *rkey_buffer);
ucs_status_t ucp_ep_rkey_unpack(ucp_ep_h ep, const void *rkey_buffer, ucp_rkey_h *rkey_p);
void ucp_rkey_destroy(ucp_rkey_h rkey);

/* Hot path: buffers and returned status pointers are declared uintptr_t (same register class as a
   pointer on every 64-bit ABI UCX supports) so Python passes and gets plain ints, with no ffi.cast. */
uintptr_t ucp_put_nbx(ucp_ep_h ep, uintptr_t buffer, size_t count, uint64_t remote_addr,
                      ucp_rkey_h rkey, const ucp_request_param_t *param);
uintptr_t ucp_get_nbx(ucp_ep_h ep, uintptr_t buffer, size_t count, uint64_t remote_addr,
                      ucp_rkey_h rkey, const ucp_request_param_t *param);
uintptr_t ucp_am_send_nbx(ucp_ep_h ep, unsigned id, const void *header, size_t header_length,
                                 const void *buffer, size_t count, const ucp_request_param_t *param);
ucs_status_t ucp_request_check_status(uintptr_t request);
void ucp_request_free(uintptr_t request);
void ucp_request_cancel(ucp_worker_h worker, uintptr_t request);
"""

#: Structs whose layout the binding test checks against the C compiler.
STRUCTS = (
    "ucp_params_t",
    "ucp_context_attr_t",
    "ucp_worker_params_t",
    "ucp_worker_attr_t",
    "ucp_ep_params_t",
    "ucp_mem_map_params_t",
    "ucp_am_handler_param_t",
    "ucp_request_param_t",
    "ucp_am_recv_param_t",
    "ucs_sock_addr_t",
    "ucs_cpu_set_t",
    "ucp_err_handler_t",
)

# --- constants from ucp.h / ucs/type/status.h (values are ABI, stable across 1.x) ---------------
UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_LAST = -100
#: A ``ucs_status_ptr_t`` at or above this value is an error code, not a request (``UCS_PTR_IS_ERR``).
PTR_ERR_MIN = (1 << 64) + UCS_ERR_LAST
STATUS_NAMES = {
    -1: "NO_MESSAGE",
    -2: "NO_RESOURCE",
    -3: "IO_ERROR",
    -4: "NO_MEMORY",
    -5: "INVALID_PARAM",
    -6: "UNREACHABLE",
    -7: "INVALID_ADDR",
    -8: "NOT_IMPLEMENTED",
    -15: "BUSY",
    -16: "CANCELED",
    -20: "TIMED_OUT",
    -22: "UNSUPPORTED",
    -23: "REJECTED",
    -24: "NOT_CONNECTED",
    -25: "CONNECTION_RESET",
    -80: "ENDPOINT_TIMEOUT",
}
UCS_ERR_BUSY = -15
UCS_ERR_TIMED_OUT = -20
#: Statuses that mean the peer is gone or unreachable (plus the link/endpoint failure ranges -40..-89).
PEER_LOST_STATUSES = frozenset({-3, -6, -16, -24, -25})

UCP_PARAM_FIELD_FEATURES = 1 << 0
UCP_PARAM_FIELD_MT_WORKERS_SHARED = 1 << 5
UCP_PARAM_FIELD_NAME = 1 << 8
UCP_FEATURE_TAG = 1 << 0
UCP_FEATURE_RMA = 1 << 1
UCP_FEATURE_WAKEUP = 1 << 4
UCP_FEATURE_AM = 1 << 6

UCP_ATTR_FIELD_MEMORY_TYPES = 1 << 2

UCS_THREAD_MODE_SINGLE = 0
UCS_THREAD_MODE_SERIALIZED = 1
UCS_THREAD_MODE_MULTI = 2
UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0
UCP_WORKER_PARAM_FIELD_NAME = 1 << 6

UCP_WORKER_ATTR_FIELD_ADDRESS = 1 << 1
UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER = 1 << 3

UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0
UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
UCP_EP_PARAM_FIELD_ERR_HANDLER = 1 << 2
UCP_EP_PARAM_FIELD_NAME = 1 << 7
UCP_ERR_HANDLING_MODE_NONE = 0
UCP_ERR_HANDLING_MODE_PEER = 1
UCP_EP_CLOSE_FLAG_FORCE = 1 << 0

UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0
UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1
UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 1 << 4
UCS_MEMORY_TYPE_HOST = 0
UCS_MEMORY_TYPE_CUDA = 1

UCP_AM_HANDLER_PARAM_FIELD_ID = 1 << 0
UCP_AM_HANDLER_PARAM_FIELD_FLAGS = 1 << 1
UCP_AM_HANDLER_PARAM_FIELD_CB = 1 << 2
UCP_AM_HANDLER_PARAM_FIELD_ARG = 1 << 3
UCP_AM_FLAG_WHOLE_MSG = 1 << 0
UCP_AM_SEND_FLAG_EAGER = 1 << 1
UCP_AM_SEND_FLAG_COPY_HEADER = 1 << 3
UCP_AM_RECV_ATTR_FLAG_DATA = 1 << 16
UCP_AM_RECV_ATTR_FLAG_RNDV = 1 << 17

UCP_OP_ATTR_FIELD_CALLBACK = 1 << 1
UCP_OP_ATTR_FIELD_FLAGS = 1 << 4
UCP_OP_ATTR_FIELD_MEMORY_TYPE = 1 << 6
UCP_OP_ATTR_FIELD_MEMH = 1 << 8
UCP_OP_ATTR_FLAG_MULTI_SEND = 1 << 19

#: UCP API version the cdef above was written against (``UCP_API_MAJOR/MINOR`` of libucx-cu12 1.22).
API_MAJOR, API_MINOR = 1, 22


class UcxUnavailableError(ImportError):
    """The UCX libraries (the ``libucx-cu12`` wheel or a system UCX) cannot be loaded."""


@dataclass
class UcpLibrary:
    """The loaded ``libucp`` (``lib``) and ``libucs`` (``ucs``) with their ffi and version."""

    ffi: Any
    lib: Any
    ucs: Any
    version: tuple[int, int, int]
    libdir: str

    def status_string(self, status: int) -> str:
        """``UCS_ERR_...: text`` for a status code."""
        text = self.ffi.string(self.ucs.ucs_status_string(status)).decode(errors="replace")
        return f"{STATUS_NAMES.get(status, status)} ({text})"


def ptr_status(value: int) -> int:
    """Decode a ``ucs_status_ptr_t`` returned as an int: ``UCS_OK``, ``UCS_INPROGRESS`` (a request) or an error."""
    if value == 0:
        return UCS_OK
    if value >= PTR_ERR_MIN:
        return value - (1 << 64)
    return UCS_INPROGRESS


_lock = threading.Lock()
_loaded: UcpLibrary | None = None


def _candidate_dirs() -> list[str]:
    dirs: list[str] = []
    env = os.environ.get("KVCORE_UCX_LIBDIR")
    if env:
        dirs.append(env)
    try:
        import libucx

        dirs.append(os.path.join(os.path.dirname(libucx.__file__), "lib"))
    except ImportError:
        pass
    return dirs


def load() -> UcpLibrary:
    """Load libucp/libucs once per process; raises ``UcxUnavailableError`` saying what was tried."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        try:
            import cffi
        except ImportError as exc:
            raise UcxUnavailableError("the 'cffi' package is required by kvcore-ucx: pip install cffi") from exc
        ffi = cffi.FFI()
        ffi.cdef(CDEF)
        errors: list[str] = []
        for d in [*_candidate_dirs(), ""]:
            ucp_path = os.path.join(d, "libucp.so.0") if d else "libucp.so.0"
            ucs_path = os.path.join(d, "libucs.so.0") if d else "libucs.so.0"
            if d and not os.path.exists(ucp_path):
                errors.append(f"{ucp_path}: not found")
                continue
            try:
                # libucs first, so libucp resolves it from the same directory whatever its RPATH says.
                ucs = ffi.dlopen(ucs_path)
                lib = ffi.dlopen(ucp_path)
            except OSError as exc:
                errors.append(f"{ucp_path}: {exc}")
                continue
            major, minor, release = ffi.new("unsigned*"), ffi.new("unsigned*"), ffi.new("unsigned*")
            lib.ucp_get_version(major, minor, release)
            version = (major[0], minor[0], release[0])
            if version[0] != API_MAJOR or version[1] < 16:
                errors.append(
                    f"{ucp_path}: UCX {'.'.join(map(str, version))} is not supported (need 1.16 or newer 1.x)"
                )
                continue
            _loaded = UcpLibrary(ffi, lib, ucs, version, d or "<system>")
            return _loaded
        raise UcxUnavailableError(
            "cannot load the UCX libraries (libucp.so.0): "
            + "; ".join(errors)
            + ". Install them with 'pip install libucx-cu12' or set KVCORE_UCX_LIBDIR to a directory holding libucp.so.0"
        )


# --- setup: the one place a UCP context, worker and endpoint are made -----------------------------------------

#: A caller's status check: ``check(status, what)`` returns on ``UCS_OK`` and raises the caller's own error
#: (naming ``what``) otherwise, so each user keeps the error type and wording its callers know.
Check = Callable[[int, str], None]


def create_context(
    u: UcpLibrary,
    settings: Mapping[str, str],
    *,
    features: int,
    check: Check,
    name: bytes | None = None,
    refused: Callable[[str, str, int], BaseException] | None = None,
) -> Any:
    """A ``ucp_context_h`` with ``features``, read from the ``UCX_*`` environment with ``settings`` applied on top.

    ``settings`` are ``ucp_config_modify`` names (no ``UCX_`` prefix) and values; ``name`` (at most 31 bytes
    are used) labels the context in UCX's logs. A setting UCX refuses raises ``refused(key, value, status)``
    when given, else what ``check`` raises for ``"ucx_config <key>"``. The caller owns the context
    (``ucp_cleanup``).
    """
    ffi, lib = u.ffi, u.lib
    cfg = ffi.new("ucp_config_t **")
    check(lib.ucp_config_read(ffi.NULL, ffi.NULL, cfg), "ucp_config_read")
    try:
        for key, value in settings.items():
            status = lib.ucp_config_modify(cfg[0], key.encode(), value.encode())
            if status != UCS_OK and refused is not None:
                raise refused(key, value, status)
            check(status, f"ucx_config {key}")
        params = ffi.new("ucp_params_t *")
        params.field_mask = UCP_PARAM_FIELD_FEATURES
        params.features = features
        if name is not None:
            cname = ffi.new("char[]", name[:31])  # kept alive until ucp_init returned
            params.field_mask |= UCP_PARAM_FIELD_NAME
            params.name = cname
        ctx = ffi.new("ucp_context_h *")
        check(lib.ucp_init_version(API_MAJOR, API_MINOR, params, cfg[0], ctx), "ucp_init")
    finally:
        lib.ucp_config_release(cfg[0])
    return ctx[0]


def create_worker(u: UcpLibrary, context: Any, *, thread_mode: int, check: Check) -> Any:
    """A ``ucp_worker_h`` of ``context`` in ``thread_mode`` (``UCS_THREAD_MODE_*``); the caller destroys it."""
    ffi = u.ffi
    wparams = ffi.new("ucp_worker_params_t *")
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE
    wparams.thread_mode = thread_mode
    worker = ffi.new("ucp_worker_h *")
    check(u.lib.ucp_worker_create(context, wparams, worker), "ucp_worker_create")
    return worker[0]


def mem_map_params(u: UcpLibrary, address: int, length: int, memory_type: int) -> Any:
    """The ``ucp_mem_map_params_t`` that maps ``length`` bytes at ``address`` of ``memory_type`` (``UCS_MEMORY_TYPE_*``)."""
    params = u.ffi.new("ucp_mem_map_params_t *")
    params.field_mask = (
        UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE
    )
    params.address = u.ffi.cast("void *", address)
    params.length = length
    params.memory_type = memory_type
    return params


def worker_address(u: UcpLibrary, worker: Any, *, check: Check) -> bytes:
    """The worker's address as bytes (what a peer's :func:`create_endpoint` connects to)."""
    ffi, lib = u.ffi, u.lib
    wattr = ffi.new("ucp_worker_attr_t *")
    wattr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS
    check(lib.ucp_worker_query(worker, wattr), "ucp_worker_query")
    address = bytes(ffi.buffer(wattr.address, wattr.address_length))
    lib.ucp_worker_release_address(worker, wattr.address)
    return address


def create_endpoint(
    u: UcpLibrary,
    worker: Any,
    address: bytes,
    *,
    peer_mode: bool,
    check: Check,
    err_handler: Any = None,
    err_arg: Any = None,
) -> Any:
    """A ``ucp_ep_h`` from ``worker`` to the worker at ``address``.

    ``peer_mode``: UCX's ``PEER`` error handling (a lost peer is reported; needed across hosts), else ``NONE``
    (zero-copy CMA on one host). ``err_handler`` (a ``ucp_err_handler_cb_t`` callback, with ``err_arg``) is
    called when the endpoint fails. The caller closes it with :func:`close_endpoint`.
    """
    ffi = u.ffi
    params = ffi.new("ucp_ep_params_t *")
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
    addr = ffi.from_buffer(address)  # alive until ucp_ep_create returned (UCX copies what it needs)
    params.address = ffi.cast("ucp_address_t *", addr)
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER if peer_mode else UCP_ERR_HANDLING_MODE_NONE
    if err_handler is not None:
        params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER
        params.err_handler.cb = err_handler
        params.err_handler.arg = err_arg
    ep = ffi.new("ucp_ep_h *")
    check(u.lib.ucp_ep_create(worker, params, ep), "ucp_ep_create")
    return ep[0]


def close_endpoint(u: UcpLibrary, worker: Any, ep: Any, param: Any, *, timeout_s: float) -> bool:
    """Close ``ep`` with the request parameters ``param`` (``UCP_EP_CLOSE_FLAG_FORCE`` for a peer-mode endpoint,
    whose peer may be gone), progressing ``worker`` for at most ``timeout_s``.

    False when the close did not finish in time (it is then cancelled); the request is freed either way.
    """
    lib = u.lib
    req = lib.ucp_ep_close_nbx(ep, param)
    if ptr_status(req) != UCS_INPROGRESS:
        return True
    deadline = time.monotonic() + timeout_s
    while lib.ucp_request_check_status(req) == UCS_INPROGRESS and time.monotonic() < deadline:
        lib.ucp_worker_progress(worker)
    finished = bool(lib.ucp_request_check_status(req) != UCS_INPROGRESS)
    if not finished:
        lib.ucp_request_cancel(worker, req)
    lib.ucp_request_free(req)
    return finished
