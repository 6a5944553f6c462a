/* kvcore_native._ucx: a native poster (kvn_poster.h) on UCX RMA: ucp_put_nbx per run of fragments that continue
 * each other (on both sides, inside one registration each), then ucp_ep_flush_nbx.
 *
 * One poster owns one UCP context (FEATURE_RMA) and one worker of its own, the host memory it mapped with
 * ucp_mem_map, and its peers: an endpoint (error handling PEER by default, with an error callback that marks the
 * peer failed) and the peer's regions with their unpacked rkeys. A WRITE is one put per run and one flush of
 * the endpoint; the handle is that flush: a completed flush means every byte is in the target's memory.
 *
 * libucp is opened at run time by path (load(path): the Python module finds the wheel's library) and every UCP
 * function is called through a pointer found by dlsym, typed from the wheel's headers, so this extension builds
 * with gcc and the headers only and imports where the library is missing.
 *
 * Threads: every vtable function and every Python method takes the poster's own mutex (the worker is created
 * UCS_THREAD_MODE_SERIALIZED: many threads, one at a time); Python methods release the GIL around anything that
 * may wait. Nothing here calls into Python from the vtable or from the progress thread, which sleeps on the
 * worker's event fd and progresses it (wire-up, and the puts a target must serve over TCP) when nobody polls.
 *
 * A peer's descriptor is untrusted: every count and length is bounded, every offset checked, and a checksum
 * guards the worker address and rkeys, which UCX parses with no length (copies with zero padding are what it
 * reads).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-compare" /* ucs/sys/compiler_def.h's UCS_MASK */
#include <ucp/api/ucp.h>
#pragma GCC diagnostic pop

#include "kvn_poster.h"

#define MAX_PEERS 4096
#define MAX_REGIONS 4096
#define MAX_FRAGMENTS 1048576u
#define POLL_BUDGET_S 0.0005 /* the longest one poll progresses while the worker keeps moving */
#define MAX_HANDLES 4096 /* posted and not released, plus abandoned and still pending */
#define MAX_DESCRIPTOR (1u << 20)
#define MAX_ADDRESS 65536u
#define MAX_RKEY 4096u
#define UCX_PAD 4096 /* zeros after a peer's worker address and rkeys: UCX parses them with no length */
#define DESC_MAGIC "KVNU"
#define DESC_VERSION 1
#define DESC_HEADER 24 /* magic[4] u16 version u8 err_mode u8 0 u32 total u32 address_len u32 regions u32 0 */
#define DESC_REGION 20 /* u64 base u64 length u32 rkey_len, then the rkey */
#define DESC_TRAILER 8 /* u64 FNV-1a of everything before it */

/* --- libucp, opened by path ----------------------------------------------------------------------------- */

#define UCP_FUNCS(X)                                                                                              \
    X(ucp_get_version) X(ucp_config_read) X(ucp_config_release) X(ucp_config_modify) X(ucp_init_version)           \
    X(ucp_cleanup) X(ucp_worker_create) X(ucp_worker_destroy) X(ucp_worker_query) X(ucp_worker_release_address)   \
    X(ucp_worker_progress) X(ucp_worker_get_efd) X(ucp_worker_arm) X(ucp_ep_create) X(ucp_ep_close_nbx)          \
    X(ucp_ep_flush_nbx) X(ucp_mem_map) X(ucp_mem_unmap) X(ucp_rkey_pack) X(ucp_rkey_buffer_release)              \
    X(ucp_ep_rkey_unpack) X(ucp_rkey_destroy) X(ucp_put_nbx) X(ucp_request_check_status) X(ucp_request_free)     \
    X(ucp_request_cancel) X(ucs_status_string)

static struct {
#define KVN_DECLARE(f) __typeof__(&f) f;
    UCP_FUNCS(KVN_DECLARE)
#undef KVN_DECLARE
} U;

static void *lib_handle;
static char lib_path[4096];
static unsigned lib_version[3];
static PyObject *TransportError; /* kvcore_native.errors.NativeTransportError */

static double mono(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

/* A one-line message into a caller's buffer (which may be NULL or empty). */
__attribute__((format(printf, 3, 4))) static int fail(char *err, size_t errlen, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

/* Raise NativeTransportError with a printf-formatted message (PyErr_Format has no %#lx); returns NULL. */
__attribute__((format(printf, 1, 2))) static PyObject *terr(const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    PyErr_SetString(TransportError, msg);
    return NULL;
}

static const char *status_text(ucs_status_t st) { return U.ucs_status_string ? U.ucs_status_string(st) : "?"; }

/* load(path): open libucp at ``path`` and find every function this module calls. */
static PyObject *load(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    if (lib_handle) {
        if (strcmp(path, lib_path) == 0) Py_RETURN_NONE;
        return PyErr_Format(PyExc_OSError, "kvcore_native: libucp is already loaded from %s (not %s)", lib_path, path);
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) return PyErr_Format(PyExc_OSError, "kvcore_native: cannot open %s: %s", path, dlerror());
    const char *missing = NULL;
#define KVN_FIND(f) if (!missing && !(U.f = (__typeof__(&f))dlsym(h, #f))) missing = #f;
    UCP_FUNCS(KVN_FIND)
#undef KVN_FIND
    if (missing) {
        memset(&U, 0, sizeof U);
        dlclose(h);
        return PyErr_Format(PyExc_OSError, "kvcore_native: %s has no symbol %s", path, missing);
    }
    U.ucp_get_version(&lib_version[0], &lib_version[1], &lib_version[2]);
    if (lib_version[0] != UCP_API_MAJOR || lib_version[1] < 16) {
        unsigned a = lib_version[0], b = lib_version[1], c = lib_version[2];
        memset(&U, 0, sizeof U);
        dlclose(h);
        return PyErr_Format(PyExc_OSError, "kvcore_native: %s is UCX %u.%u.%u; this poster needs 1.16 or a newer 1.x",
                            path, a, b, c);
    }
    snprintf(lib_path, sizeof lib_path, "%s", path);
    lib_handle = h;
    Py_RETURN_NONE;
}

/* version() -> (major, minor, release) of the loaded libucp, or None before load(). */
static PyObject *version(PyObject *self, PyObject *noargs) {
    if (!lib_handle) Py_RETURN_NONE;
    return Py_BuildValue("(III)", lib_version[0], lib_version[1], lib_version[2]);
}

/* --- the poster ----------------------------------------------------------------------------------------- */

typedef struct {
    uint64_t base, end;
    ucp_mem_h memh;
    void *rkey;
    uint32_t rkey_len;
} LocalRegion;

typedef struct {
    uint64_t base, end;
    ucp_rkey_h rkey;
} RemoteRegion;

typedef struct Peer {
    int used;
    int failed; /* ucs_status_t the error callback reported, 0 while healthy (__atomic) */
    ucp_ep_h ep;
    RemoteRegion *regs; /* sorted by base, disjoint */
    uint32_t nregs, last;
    uint32_t live, abandoned; /* its handles posted and not released; released while pending */
} Peer;

enum { H_FREE = 0, H_LIVE = 1, H_ABANDONED = 2 };

typedef struct {
    void *req; /* the flush request while pending, else NULL */
    int state, final; /* final: status is the verdict (a poll progressed the worker after the flush ended) */
    ucs_status_t status; /* the flush's end once req is NULL */
    uint32_t peer;
} Handle;

typedef struct Poster {
    PyObject_HEAD
    pthread_mutex_t mu;
    int closed, err_peer;
    double close_timeout_s;
    ucp_context_h ctx;
    ucp_worker_h worker;
    void *address;
    size_t address_len;
    LocalRegion *regs; /* sorted by base, disjoint */
    uint32_t nregs, last;
    Peer *peers;
    uint32_t npeers, next_peer;
    Handle *pool;
    uint32_t *free_ix, nfree;
    uint32_t *abandoned_ix, nabandoned;
    uint32_t nlive;
    uint64_t puts; /* ucp_put_nbx calls, one per run of fragments that continue each other */
    int efd, stopfd, stop, thread_started;
    pthread_t thread;
    kvn_poster_ref ref;
} Poster;

static void lock_nogil(Poster *p) {
    if (pthread_mutex_trylock(&p->mu) == 0) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->mu);
    Py_END_ALLOW_THREADS
}

/* The region of ``regs`` (sorted, disjoint) holding [a, a + len), or -1; ``*last`` is a hint (fragments of one
 * write are mostly in one region). The caller checked that a + len does not overflow. */
#define FIND_REGION(name, T)                                                                                     \
    static int64_t name(const T *regs, uint32_t n, uint32_t *last, uint64_t a, uint64_t len) {                    \
        if (*last < n && regs[*last].base <= a && a + len <= regs[*last].end) return *last;                       \
        uint32_t lo = 0, hi = n; /* first region with base > a */                                                  \
        while (lo < hi) {                                                                                          \
            uint32_t mid = lo + (hi - lo) / 2;                                                                     \
            if (regs[mid].base <= a) lo = mid + 1; else hi = mid;                                                  \
        }                                                                                                          \
        if (lo == 0 || a + len > regs[lo - 1].end) return -1;                                                      \
        *last = lo - 1;                                                                                            \
        return lo - 1;                                                                                             \
    }
FIND_REGION(find_local, LocalRegion)
FIND_REGION(find_remote, RemoteRegion)

static Handle *handle_of(Poster *p, void *h) {
    if (!p->pool || (char *)h < (char *)p->pool || (char *)h >= (char *)(p->pool + MAX_HANDLES)) return NULL;
    if (((char *)h - (char *)p->pool) % sizeof(Handle)) return NULL;
    Handle *x = h;
    return x->state == H_FREE ? NULL : x;
}

static void handle_free(Poster *p, Handle *h) {
    h->state = H_FREE;
    h->req = NULL;
    p->free_ix[p->nfree++] = (uint32_t)(h - p->pool);
}

/* Finish what a pending flush says: its status is final. */
static void handle_settle(Poster *p, Handle *h, ucs_status_t st) {
    U.ucp_request_free(h->req);
    h->req = NULL;
    h->status = st;
}

/* Free the abandoned handles whose flush ended (the only record of them is this list). */
static void drive_abandoned(Poster *p) {
    for (uint32_t i = 0; i < p->nabandoned;) {
        Handle *h = &p->pool[p->abandoned_ix[i]];
        if (h->req) {
            ucs_status_t st = U.ucp_request_check_status(h->req);
            if (st == UCS_INPROGRESS) { i++; continue; }
            handle_settle(p, h, st);
        }
        p->peers[h->peer].abandoned--;
        handle_free(p, h);
        p->abandoned_ix[i] = p->abandoned_ix[--p->nabandoned];
    }
}

static void abandon(Poster *p, Handle *h) {
    h->state = H_ABANDONED;
    p->peers[h->peer].abandoned++;
    p->abandoned_ix[p->nabandoned++] = (uint32_t)(h - p->pool);
}

/* Progress until the abandoned handles (of ``peer``, or all when peer < 0) ended or ``timeout_s`` passed; true
 * when none is left. Mutex held. */
static int drain_locked(Poster *p, int64_t peer, double timeout_s) {
    double deadline = mono() + timeout_s;
    for (;;) {
        drive_abandoned(p);
        uint32_t left = peer < 0 ? p->nabandoned : p->peers[peer].abandoned;
        if (!left) return 1;
        if (mono() > deadline) return 0;
        if (!U.ucp_worker_progress(p->worker)) sched_yield();
    }
}

/* Drop a peer: its rkeys (UCX wants them gone before their endpoint), then its endpoint (forced in PEER mode, where
 * the peer may be gone, and for a failed peer), bounded; handles still pending on it end with the endpoint (UCX
 * cancels them) or are dropped. Mutex held. */
static void peer_drop_locked(Poster *p, uint32_t slot) {
    Peer *q = &p->peers[slot];
    for (uint32_t i = 0; i < q->nregs; i++) U.ucp_rkey_destroy(q->regs[i].rkey);
    free(q->regs);
    q->regs = NULL;
    q->nregs = 0;
    if (q->ep) {
        ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                    .flags = (p->err_peer || __atomic_load_n(&q->failed, __ATOMIC_ACQUIRE))
                                                 ? UCP_EP_CLOSE_FLAG_FORCE : 0};
        void *r = U.ucp_ep_close_nbx(q->ep, &prm);
        if (UCS_PTR_IS_PTR(r)) {
            double deadline = mono() + p->close_timeout_s;
            while (U.ucp_request_check_status(r) == UCS_INPROGRESS && mono() < deadline)
                if (!U.ucp_worker_progress(p->worker)) sched_yield();
            if (U.ucp_request_check_status(r) == UCS_INPROGRESS) U.ucp_request_cancel(p->worker, r);
            U.ucp_request_free(r);
        }
        q->ep = NULL;
    }
    if (q->abandoned) {
        drain_locked(p, slot, 0.1);
        for (uint32_t i = 0; i < p->nabandoned;) { /* UCX keeps them; nothing can land through a closed endpoint */
            Handle *h = &p->pool[p->abandoned_ix[i]];
            if (h->peer != slot) { i++; continue; }
            if (h->req) U.ucp_request_free(h->req);
            handle_free(p, h);
            p->abandoned_ix[i] = p->abandoned_ix[--p->nabandoned];
        }
        q->abandoned = 0;
    }
    q->used = 0;
    __atomic_store_n(&q->failed, 0, __ATOMIC_RELEASE);
    p->npeers--;
}

/* --- the vtable ------------------------------------------------------------------------------------------- */

static int post_locked(Poster *p, uint32_t peer, const uint64_t *src, const uint64_t *dst, const uint64_t *len,
                       uint32_t n, void **out, char *err, size_t errlen) {
    if (p->closed) return fail(err, errlen, "ucx poster: closed");
    if (n == 0) return fail(err, errlen, "ucx poster: a write of no fragments (n == 0)");
    if (n > MAX_FRAGMENTS) return fail(err, errlen, "ucx poster: %u fragments; at most %u per write", n, MAX_FRAGMENTS);
    if (!src || !dst || !len || !out) return fail(err, errlen, "ucx poster: a NULL src, dst, len or out");
    if (peer >= MAX_PEERS || !p->peers[peer].used)
        return fail(err, errlen, "ucx poster: unknown peer %u (never connected, or disconnected)", peer);
    Peer *q = &p->peers[peer];
    int failed = __atomic_load_n(&q->failed, __ATOMIC_ACQUIRE);
    if (failed)
        return fail(err, errlen, "ucx poster: peer %u failed: %s (UCS status %d); the peer died or is unreachable",
                    peer, status_text(failed), failed);
    if (!p->nfree) {
        drive_abandoned(p);
        if (!p->nfree)
            return fail(err, errlen, "ucx poster: %d handles in flight (posted, or abandoned and pending); release some",
                        MAX_HANDLES);
    }
    for (uint32_t i = 0; i < n; i++) { /* every fragment is checked before anything moves */
        uint64_t l = len[i];
        if (l == 0) return fail(err, errlen, "ucx poster: fragment %u: length 0", i);
        if (src[i] > UINT64_MAX - l || dst[i] > UINT64_MAX - l)
            return fail(err, errlen, "ucx poster: fragment %u: address + length overflows (src %#lx, dst %#lx, length %lu)",
                        i, (unsigned long)src[i], (unsigned long)dst[i], (unsigned long)l);
        if (find_local(p->regs, p->nregs, &p->last, src[i], l) < 0)
            return fail(err, errlen, "ucx poster: fragment %u: source [%#lx, +%lu) is not inside one registration of this poster",
                        i, (unsigned long)src[i], (unsigned long)l);
        if (find_remote(q->regs, q->nregs, &q->last, dst[i], l) < 0)
            return fail(err, errlen, "ucx poster: fragment %u: destination [%#lx, +%lu) is not inside one region of peer %u",
                        i, (unsigned long)dst[i], (unsigned long)l, peer);
    }
    ucs_status_t bad = UCS_OK;
    uint32_t i = 0;
    while (i < n) {
        /* One put per run of fragments that continue each other on both sides inside one registration each:
         * UCX's CMA moves a put in segments of up to 512 KiB, one system call each, so 8192 puts of 64 KiB cost
         * 8x the calls of the 1024 segments of the same bytes merged (the plan's fragments are per layer). */
        int64_t li = find_local(p->regs, p->nregs, &p->last, src[i], len[i]);
        int64_t ri = find_remote(q->regs, q->nregs, &q->last, dst[i], len[i]);
        uint64_t run = len[i];
        uint32_t k = i + 1;
        while (k < n && src[k] == src[i] + run && dst[k] == dst[i] + run && src[k] + len[k] <= p->regs[li].end &&
               dst[k] + len[k] <= q->regs[ri].end) {
            run += len[k];
            k++;
        }
        ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH, .memh = p->regs[li].memh};
        void *r = U.ucp_put_nbx(q->ep, (void *)(uintptr_t)src[i], run, dst[i], q->regs[ri].rkey, &prm);
        p->puts++;
        if (UCS_PTR_IS_ERR(r)) { bad = UCS_PTR_STATUS(r); break; }
        if (r) U.ucp_request_free(r); /* the flush reports its end */
        i = k;
    }
    ucp_request_param_t plain = {.op_attr_mask = 0};
    void *f = (bad == UCS_OK || i > 0) ? U.ucp_ep_flush_nbx(q->ep, &plain) : NULL;
    if (UCS_PTR_IS_ERR(f) && bad == UCS_OK) bad = UCS_PTR_STATUS(f);
    Handle *h = &p->pool[p->free_ix[--p->nfree]];
    h->state = H_LIVE;
    h->final = 0;
    h->peer = peer;
    h->req = UCS_PTR_IS_PTR(f) ? f : NULL;
    h->status = UCS_OK;
    if (bad != UCS_OK) {
        if (h->req) abandon(p, h); /* what was posted drains before its memory may go */
        else handle_free(p, h);
        return fail(err, errlen, "ucx poster: write to peer %u failed at fragment %u of %u: %s (UCS status %d)%s",
                    peer, i, n, status_text(bad), bad, i ? "; the fragments before it may have landed" : "");
    }
    q->live++;
    p->nlive++;
    *out = h;
    return 0;
}

static int vt_post_write(void *self, uint32_t peer, const uint64_t *src, const uint64_t *dst, const uint64_t *len,
                         uint32_t n, void **out, char *err, size_t errlen) {
    Poster *p = self;
    pthread_mutex_lock(&p->mu);
    int rc = post_locked(p, peer, src, dst, len, n, out, err, errlen);
    pthread_mutex_unlock(&p->mu);
    return rc;
}

static int vt_poll(void *self, void *handle, char *err, size_t errlen) {
    Poster *p = self;
    pthread_mutex_lock(&p->mu);
    Handle *h = handle_of(p, handle);
    int rc;
    if (!h || h->state != H_LIVE) {
        rc = KVN_FAILED;
        fail(err, errlen, "ucx poster: poll of an unknown or released handle");
    } else {
        if (!h->final) {
            /* Progress even when the flush already ended: a transport error of a put (CMA to a process that died)
             * reaches the endpoint's error callback only through progress, and the flush may not carry it.
             * Progress again while it moves something, for up to POLL_BUDGET_S: UCX's shared-memory copies (CMA)
             * move one segment (512 KiB, or one smaller put) per progress call (UCX_CMA_TX_QUOTA=1), so a caller
             * that does other work between polls (the lane serves its sockets) would otherwise pay that work once
             * per fragment. */
            double until = mono() + POLL_BUDGET_S;
            for (;;) {
                unsigned moved = U.ucp_worker_progress(p->worker);
                if (h->req) {
                    ucs_status_t st = U.ucp_request_check_status(h->req);
                    if (st != UCS_INPROGRESS) handle_settle(p, h, st);
                }
                if (!h->req || !moved || mono() >= until) break;
            }
            if (p->nabandoned) drive_abandoned(p);
            if (!h->req) {
                int failed = __atomic_load_n(&p->peers[h->peer].failed, __ATOMIC_ACQUIRE);
                if (h->status == UCS_OK && failed) h->status = failed;
                h->final = 1;
            }
        }
        if (h->req) rc = KVN_PENDING;
        else if (h->status == UCS_OK) rc = KVN_DONE;
        else {
            rc = KVN_FAILED;
            int failed = __atomic_load_n(&p->peers[h->peer].failed, __ATOMIC_ACQUIRE);
            fail(err, errlen, "ucx poster: write to peer %u failed: %s (UCS status %d)%s", h->peer,
                 status_text(h->status), h->status, failed ? "; the peer died or is unreachable" : "");
        }
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

static void vt_release(void *self, void *handle) {
    Poster *p = self;
    pthread_mutex_lock(&p->mu);
    Handle *h = handle_of(p, handle);
    if (h && h->state == H_LIVE) {
        p->nlive--;
        p->peers[h->peer].live--;
        if (h->req) {
            ucs_status_t st = U.ucp_request_check_status(h->req);
            if (st != UCS_INPROGRESS) handle_settle(p, h, st);
        }
        if (h->req) abandon(p, h);
        else handle_free(p, h);
    }
    pthread_mutex_unlock(&p->mu);
}

static const kvn_poster_vtable VTABLE = {
    .abi = KVN_POSTER_ABI, .backend = "ucx", .post_write = vt_post_write, .poll = vt_poll, .release = vt_release,
};

/* --- the progress thread ---------------------------------------------------------------------------------- */

static void *progress_run(void *arg) {
    Poster *p = arg;
    struct pollfd fds[2] = {{p->efd, POLLIN, 0}, {p->stopfd, POLLIN, 0}};
    for (;;) {
        pthread_mutex_lock(&p->mu);
        if (p->stop) { pthread_mutex_unlock(&p->mu); return NULL; }
        for (int i = 0; i < 1000 && U.ucp_worker_progress(p->worker); i++) {}
        if (p->nabandoned) drive_abandoned(p);
        ucs_status_t armed = U.ucp_worker_arm(p->worker);
        pthread_mutex_unlock(&p->mu);
        if (armed == UCS_ERR_BUSY) continue;
        poll(fds, 2, armed == UCS_OK ? 50 : 5);
    }
}

static void stop_thread(Poster *p) {
    if (!p->thread_started) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_mutex_unlock(&p->mu);
    uint64_t one = 1;
    if (write(p->stopfd, &one, sizeof one) < 0) {} /* it polls every 50 ms anyway */
    pthread_join(p->thread, NULL);
    p->thread_started = 0;
}

/* --- Python: Poster(name, settings, error_peer, progress_thread, close_timeout_s) ---------------------------- */

/* Drain abandoned handles (bounded), drop every peer, then the registrations, the worker and the context. The
 * caller marked the poster closed first, so nothing new is posted meanwhile. */
static void teardown(Poster *p) {
    stop_thread(p);
    pthread_mutex_lock(&p->mu);
    p->closed = 1;
    if (p->worker) {
        drain_locked(p, -1, p->close_timeout_s);
        for (uint32_t s = 0; s < MAX_PEERS && p->npeers; s++)
            if (p->peers[s].used) peer_drop_locked(p, s);
        for (uint32_t i = 0; i < MAX_HANDLES; i++) /* none without peers; at dealloc, a caller's forgotten ones */
            if (p->pool[i].state != H_FREE) {
                if (p->pool[i].req) U.ucp_request_free(p->pool[i].req);
                handle_free(p, &p->pool[i]);
            }
        p->nabandoned = p->nlive = 0;
    }
    for (uint32_t i = 0; i < p->nregs; i++) {
        U.ucp_rkey_buffer_release(p->regs[i].rkey);
        U.ucp_mem_unmap(p->ctx, p->regs[i].memh);
    }
    p->nregs = 0;
    if (p->worker) U.ucp_worker_destroy(p->worker);
    p->worker = NULL;
    if (p->ctx) U.ucp_cleanup(p->ctx);
    p->ctx = NULL;
    pthread_mutex_unlock(&p->mu);
}

static void Poster_dealloc(Poster *p) {
    if (p->pool) { /* initialised */
        Py_BEGIN_ALLOW_THREADS
        teardown(p);
        Py_END_ALLOW_THREADS
    }
    if (p->stopfd >= 0) close(p->stopfd);
    free(p->address);
    free(p->regs);
    free(p->peers);
    free(p->pool);
    free(p->free_ix);
    free(p->abandoned_ix);
    pthread_mutex_destroy(&p->mu);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyObject *Poster_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Poster *p = (Poster *)type->tp_alloc(type, 0);
    if (!p) return NULL;
    pthread_mutex_init(&p->mu, NULL);
    p->closed = 1; /* until __init__ made the worker */
    p->efd = p->stopfd = -1;
    p->ref.vt = &VTABLE;
    p->ref.self = p;
    return (PyObject *)p;
}

static PyObject *raise_status(const char *what, ucs_status_t st) {
    terr("ucx poster: %s failed: %s (UCS status %d)", what, status_text(st), (int)st);
    return NULL;
}

static int Poster_init(Poster *p, PyObject *args, PyObject *kw) {
    const char *name;
    PyObject *settings;
    int err_peer, thread;
    double close_timeout_s;
    if (!PyArg_ParseTuple(args, "sO!ppd", &name, &PyList_Type, &settings, &err_peer, &thread, &close_timeout_s))
        return -1;
    if (p->pool) { PyErr_SetString(TransportError, "ucx poster: already initialised"); return -1; }
    if (!lib_handle) { PyErr_SetString(TransportError, "ucx poster: libucp is not loaded (call load(path) first)"); return -1; }
    if (!(close_timeout_s > 0 && close_timeout_s < 3600)) {
        terr("ucx poster: close_timeout_s must be in (0, 3600) seconds");
        return -1;
    }
    p->err_peer = err_peer;
    p->close_timeout_s = close_timeout_s;
    p->regs = calloc(MAX_REGIONS, sizeof *p->regs);
    p->peers = calloc(MAX_PEERS, sizeof *p->peers);
    p->pool = calloc(MAX_HANDLES, sizeof *p->pool);
    p->free_ix = calloc(MAX_HANDLES, sizeof *p->free_ix);
    p->abandoned_ix = calloc(MAX_HANDLES, sizeof *p->abandoned_ix);
    if (!p->regs || !p->peers || !p->pool || !p->free_ix || !p->abandoned_ix) { PyErr_NoMemory(); return -1; }
    for (uint32_t i = 0; i < MAX_HANDLES; i++) p->free_ix[i] = MAX_HANDLES - 1 - i;
    p->nfree = MAX_HANDLES;

    ucp_config_t *cfg;
    ucs_status_t st = U.ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) { raise_status("ucp_config_read", st); return -1; }
    Py_ssize_t ns = PyList_GET_SIZE(settings);
    for (Py_ssize_t i = 0; i < ns; i++) {
        const char *key, *value;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(settings, i), "ss", &key, &value)) { U.ucp_config_release(cfg); return -1; }
        st = U.ucp_config_modify(cfg, key, value);
        if (st != UCS_OK) {
            U.ucp_config_release(cfg);
            terr("ucx poster: UCX refused the setting %s=%s: %s (UCS status %d)", key, value,
                         status_text(st), (int)st);
            return -1;
        }
    }
    ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
                           .features = UCP_FEATURE_RMA | (thread ? UCP_FEATURE_WAKEUP : 0),
                           .name = name};
    st = U.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, cfg, &p->ctx);
    U.ucp_config_release(cfg);
    if (st != UCS_OK) { p->ctx = NULL; raise_status("ucp_init", st); return -1; }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    st = U.ucp_worker_create(p->ctx, &wp, &p->worker);
    if (st != UCS_OK) { p->worker = NULL; raise_status("ucp_worker_create", st); return -1; }
    ucp_worker_attr_t wa = {.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS};
    st = U.ucp_worker_query(p->worker, &wa);
    if (st != UCS_OK) { raise_status("ucp_worker_query", st); return -1; }
    if (wa.address_length == 0 || wa.address_length > MAX_ADDRESS) {
        U.ucp_worker_release_address(p->worker, wa.address);
        terr("ucx poster: this worker's address is %zu bytes; descriptors carry 1..%u",
                     wa.address_length, MAX_ADDRESS);
        return -1;
    }
    p->address = malloc(wa.address_length);
    if (p->address) memcpy(p->address, wa.address, wa.address_length);
    p->address_len = wa.address_length;
    U.ucp_worker_release_address(p->worker, wa.address);
    if (!p->address) { PyErr_NoMemory(); return -1; }
    if (thread) {
        st = U.ucp_worker_get_efd(p->worker, &p->efd);
        if (st != UCS_OK) { raise_status("ucp_worker_get_efd", st); return -1; }
        p->stopfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (p->stopfd < 0) { PyErr_SetFromErrno(PyExc_OSError); return -1; }
        int rc = pthread_create(&p->thread, NULL, progress_run, p);
        if (rc) { errno = rc; PyErr_SetFromErrno(PyExc_OSError); return -1; }
        p->thread_started = 1;
    }
    p->closed = 0;
    return 0;
}

#define OPEN_OR_RAISE(p)                                                                                         \
    if ((p)->closed) { PyErr_SetString(TransportError, "ucx poster: closed"); goto out; }

/* register(addr, length): map host memory this side may write from or be written into. */
static PyObject *Poster_register(Poster *p, PyObject *args) {
    unsigned long long addr, length;
    if (!PyArg_ParseTuple(args, "KK", &addr, &length)) return NULL;
    if (length == 0) return terr("ucx poster: register: length 0 at %#llx", addr);
    if (addr == 0 || addr > UINT64_MAX - length)
        return terr("ucx poster: register: [%#llx, +%llu) is not a valid range", addr, length);
    PyObject *res = NULL;
    lock_nogil(p);
    OPEN_OR_RAISE(p);
    if (p->nregs >= MAX_REGIONS) {
        terr("ucx poster: register: %d registrations already (the cap)", MAX_REGIONS);
        goto out;
    }
    uint32_t at = 0;
    while (at < p->nregs && p->regs[at].base < addr) at++;
    if ((at > 0 && p->regs[at - 1].end > addr) || (at < p->nregs && p->regs[at].base < addr + length)) {
        LocalRegion *o = (at > 0 && p->regs[at - 1].end > addr) ? &p->regs[at - 1] : &p->regs[at];
        terr("ucx poster: register: [%#llx, +%llu) overlaps the registration [%#lx, +%lu)", addr,
                     length, (unsigned long)o->base, (unsigned long)(o->end - o->base));
        goto out;
    }
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                             UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
                               .address = (void *)(uintptr_t)addr, .length = length,
                               .memory_type = UCS_MEMORY_TYPE_HOST};
    ucp_mem_h memh;
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = U.ucp_mem_map(p->ctx, &mp, &memh);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) { raise_status("register: ucp_mem_map", st); goto out; }
    void *rkey;
    size_t rkey_len;
    st = U.ucp_rkey_pack(p->ctx, memh, &rkey, &rkey_len);
    if (st != UCS_OK || rkey_len == 0 || rkey_len > MAX_RKEY) {
        if (st == UCS_OK) U.ucp_rkey_buffer_release(rkey);
        U.ucp_mem_unmap(p->ctx, memh);
        if (st != UCS_OK) raise_status("register: ucp_rkey_pack", st);
        else terr("ucx poster: register: packed rkey of %zu bytes; descriptors carry 1..%u",
                          rkey_len, MAX_RKEY);
        goto out;
    }
    memmove(&p->regs[at + 1], &p->regs[at], (p->nregs - at) * sizeof *p->regs);
    p->regs[at] = (LocalRegion){addr, addr + length, memh, rkey, (uint32_t)rkey_len};
    p->nregs++;
    res = Py_NewRef(Py_None);
out:
    pthread_mutex_unlock(&p->mu);
    return res;
}

static uint64_t fnv1a(const uint8_t *b, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 0x100000001b3ull; }
    return h;
}
static void put16(uint8_t *b, uint16_t v) { b[0] = v; b[1] = v >> 8; }
static void put32(uint8_t *b, uint32_t v) { for (int i = 0; i < 4; i++) b[i] = v >> (8 * i); }
static void put64(uint8_t *b, uint64_t v) { for (int i = 0; i < 8; i++) b[i] = v >> (8 * i); }
static uint16_t get16(const uint8_t *b) { return b[0] | b[1] << 8; }
static uint32_t get32(const uint8_t *b) { uint32_t v = 0; for (int i = 3; i >= 0; i--) v = v << 8 | b[i]; return v; }
static uint64_t get64(const uint8_t *b) { uint64_t v = 0; for (int i = 7; i >= 0; i--) v = v << 8 | b[i]; return v; }

/* descriptor() -> bytes: this worker's address and registrations, what a peer's connect() reads. */
static PyObject *Poster_descriptor(Poster *p, PyObject *noargs) {
    PyObject *res = NULL;
    lock_nogil(p);
    OPEN_OR_RAISE(p);
    size_t total = DESC_HEADER + p->address_len + DESC_TRAILER;
    for (uint32_t i = 0; i < p->nregs; i++) total += DESC_REGION + p->regs[i].rkey_len;
    if (total > MAX_DESCRIPTOR) {
        terr("ucx poster: the descriptor would be %zu bytes; peers refuse more than %u", total,
                     MAX_DESCRIPTOR);
        goto out;
    }
    res = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (!res) goto out;
    uint8_t *b = (uint8_t *)PyBytes_AS_STRING(res), *w = b;
    memcpy(w, DESC_MAGIC, 4);
    put16(w + 4, DESC_VERSION);
    w[6] = (uint8_t)p->err_peer;
    w[7] = 0;
    put32(w + 8, (uint32_t)total);
    put32(w + 12, (uint32_t)p->address_len);
    put32(w + 16, p->nregs);
    put32(w + 20, 0);
    w += DESC_HEADER;
    memcpy(w, p->address, p->address_len);
    w += p->address_len;
    for (uint32_t i = 0; i < p->nregs; i++) {
        put64(w, p->regs[i].base);
        put64(w + 8, p->regs[i].end - p->regs[i].base);
        put32(w + 16, p->regs[i].rkey_len);
        memcpy(w + DESC_REGION, p->regs[i].rkey, p->regs[i].rkey_len);
        w += DESC_REGION + p->regs[i].rkey_len;
    }
    put64(w, fnv1a(b, (size_t)(w - b)));
out:
    pthread_mutex_unlock(&p->mu);
    return res;
}

static int cmp_remote(const void *a, const void *b) {
    uint64_t x = ((const RemoteRegion *)a)->base, y = ((const RemoteRegion *)b)->base;
    return x < y ? -1 : x > y;
}

static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    Peer *q = arg;
    __atomic_store_n(&q->failed, status ? (int)status : (int)UCS_ERR_CONNECTION_RESET, __ATOMIC_RELEASE);
}

/* A copy of untrusted bytes UCX will parse with no length, followed by zeros. */
static void *padded(const uint8_t *b, size_t n) {
    uint8_t *c = calloc(1, n + UCX_PAD);
    if (c) memcpy(c, b, n);
    return c;
}

/* The envelope of a packed host-memory rkey as ucp_rkey_pack writes it (UCX parses it with no length): u64 md_map
 * (memory domains below UCP_MAX_MDS, 16), u8 memory type (host: 0), then per md a u8 size and that many bytes, then
 * nothing or the system device 0xff (unknown). Device memory would add a device and distances, which UCX uses as
 * array indices unchecked: refused. */
static int check_rkey(const uint8_t *r, uint32_t n, char *err, size_t errlen) {
    if (n < 9) return fail(err, errlen, "rkey of %u bytes is shorter than its 9-byte header", n);
    uint64_t md_map = get64(r);
    if (md_map >> 16) return fail(err, errlen, "rkey names memory domains past the 16 UCX has (map %#lx)", (unsigned long)md_map);
    if (r[8] != UCS_MEMORY_TYPE_HOST) return fail(err, errlen, "rkey of memory type %u; posters register host memory", r[8]);
    uint32_t off = 9;
    for (uint64_t m = md_map; m; m &= m - 1) {
        if (off >= n || r[off] > n - off - 1) return fail(err, errlen, "rkey's memory-domain keys run past its %u bytes", n);
        off += 1 + r[off];
    }
    if (off < n && r[off] == 0xff) off++; /* the system device: unknown, so no distances follow */
    if (off != n) return fail(err, errlen, "rkey has %u bytes after its memory-domain keys (host memory has none)", n - off);
    return 0;
}

/* Check a descriptor's shape (no UCX call): 0, or -1 with the reason in err. */
static int parse_descriptor(const uint8_t *b, size_t n, int err_peer, const uint8_t **addr, uint32_t *addr_len,
                            uint32_t *nregs, char *err, size_t errlen) {
    if (n > MAX_DESCRIPTOR) return fail(err, errlen, "descriptor is %zu bytes; at most %u are read", n, MAX_DESCRIPTOR);
    if (n < DESC_HEADER + DESC_TRAILER)
        return fail(err, errlen, "descriptor is %zu bytes, shorter than its %d-byte header and trailer (truncated)", n,
                    DESC_HEADER + DESC_TRAILER);
    if (memcmp(b, DESC_MAGIC, 4)) return fail(err, errlen, "not a UCX poster descriptor (magic %02x%02x%02x%02x)", b[0], b[1], b[2], b[3]);
    if (get16(b + 4) != DESC_VERSION)
        return fail(err, errlen, "descriptor version %u; this poster reads version %d", get16(b + 4), DESC_VERSION);
    uint32_t total = get32(b + 8);
    if (total != n) return fail(err, errlen, "descriptor says it is %u bytes, %zu were given (truncated or padded)", total, n);
    uint64_t sum = get64(b + n - DESC_TRAILER), want = fnv1a(b, n - DESC_TRAILER);
    if (sum != want) return fail(err, errlen, "descriptor checksum %#lx, its bytes sum to %#lx (corrupted)", (unsigned long)sum, (unsigned long)want);
    if (b[6] > 1 || b[7] || get32(b + 20)) return fail(err, errlen, "descriptor header has unknown flags");
    if (b[6] != err_peer)
        return fail(err, errlen, "peer uses UCX error handling '%s', this poster '%s'; UCX refuses mixed endpoints",
                    b[6] ? "peer" : "none", err_peer ? "peer" : "none");
    *addr_len = get32(b + 12);
    *nregs = get32(b + 16);
    size_t body = n - DESC_HEADER - DESC_TRAILER;
    if (*addr_len == 0 || *addr_len > MAX_ADDRESS || *addr_len > body)
        return fail(err, errlen, "descriptor worker address of %u bytes (1..%u, within the %zu-byte body)", *addr_len,
                    MAX_ADDRESS, body);
    if ((b[DESC_HEADER] & 0xf) > 1) /* ucp_address_unpack_header aborts on a version other than V1 (0) or V2 (1) */
        return fail(err, errlen, "descriptor worker address version %u; UCP addresses are version 0 or 1",
                    b[DESC_HEADER] & 0xf);
    if (*nregs > MAX_REGIONS) return fail(err, errlen, "descriptor has %u regions; at most %d", *nregs, MAX_REGIONS);
    *addr = b + DESC_HEADER;
    size_t off = DESC_HEADER + *addr_len, end = n - DESC_TRAILER;
    for (uint32_t i = 0; i < *nregs; i++) {
        if (end - off < DESC_REGION) return fail(err, errlen, "descriptor region %u: its header runs past the end", i);
        uint64_t base = get64(b + off), length = get64(b + off + 8);
        uint32_t rl = get32(b + off + 16);
        if (length == 0 || base > UINT64_MAX - length)
            return fail(err, errlen, "descriptor region %u: [%#lx, +%lu) is not a valid range", i, (unsigned long)base,
                        (unsigned long)length);
        if (rl == 0 || rl > MAX_RKEY || rl > end - off - DESC_REGION)
            return fail(err, errlen, "descriptor region %u: rkey of %u bytes (1..%u, within the descriptor)", i, rl, MAX_RKEY);
        char why[160];
        if (check_rkey(b + off + DESC_REGION, rl, why, sizeof why)) return fail(err, errlen, "descriptor region %u: %s", i, why);
        off += DESC_REGION + rl;
    }
    if (off != end) return fail(err, errlen, "descriptor has %zu bytes after its last region", end - off);
    return 0;
}

/* connect(descriptor) -> peer slot: an endpoint to the peer's worker and its regions. Untrusted input. */
static PyObject *Poster_connect(Poster *p, PyObject *args) {
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*", &view)) return NULL;
    PyObject *res = NULL;
    char err[512];
    const uint8_t *b = view.buf, *addr = NULL;
    uint32_t addr_len = 0, nregs = 0;
    RemoteRegion *regs = NULL;
    void *addr_copy = NULL;
    lock_nogil(p);
    OPEN_OR_RAISE(p);
    if (parse_descriptor(b, (size_t)view.len, p->err_peer, &addr, &addr_len, &nregs, err, sizeof err)) {
        terr("ucx poster: connect: %s", err);
        goto out;
    }
    if (addr_len == p->address_len && !memcmp(addr, p->address, addr_len)) {
        PyErr_SetString(TransportError, "ucx poster: connect: the descriptor is this poster's own");
        goto out;
    }
    if (p->npeers >= MAX_PEERS) {
        terr("ucx poster: connect: %d peers already (the cap); disconnect one", MAX_PEERS);
        goto out;
    }
    regs = calloc(nregs ? nregs : 1, sizeof *regs);
    addr_copy = padded(addr, addr_len);
    if (!regs || !addr_copy) { PyErr_NoMemory(); goto out; }
    size_t off = DESC_HEADER + addr_len;
    for (uint32_t i = 0; i < nregs; i++) {
        regs[i].base = get64(b + off);
        regs[i].end = regs[i].base + get64(b + off + 8);
        regs[i].rkey = (ucp_rkey_h)(uintptr_t)off; /* where its rkey is, until unpacked */
        off += DESC_REGION + get32(b + off + 16);
    }
    qsort(regs, nregs, sizeof *regs, cmp_remote);
    for (uint32_t i = 1; i < nregs; i++)
        if (regs[i].base < regs[i - 1].end) {
            terr("ucx poster: connect: descriptor regions [%#lx, %#lx) and [%#lx, %#lx) overlap",
                         (unsigned long)regs[i - 1].base, (unsigned long)regs[i - 1].end, (unsigned long)regs[i].base,
                         (unsigned long)regs[i].end);
            goto out;
        }
    uint32_t slot = p->next_peer;
    while (p->peers[slot].used) slot = (slot + 1) % MAX_PEERS;
    Peer *q = &p->peers[slot];
    memset(q, 0, sizeof *q);
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = addr_copy,
                          .err_mode = p->err_peer ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE,
                          .err_handler = {.cb = on_ep_error, .arg = q}};
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = U.ucp_ep_create(p->worker, &ep, &q->ep);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) { q->ep = NULL; raise_status("connect: ucp_ep_create", st); goto out; }
    q->used = 1;
    p->npeers++;
    for (uint32_t i = 0; i < nregs; i++) {
        size_t at = (size_t)(uintptr_t)regs[i].rkey;
        regs[i].rkey = NULL;
        void *rk = padded(b + at + DESC_REGION, get32(b + at + 16));
        st = rk ? U.ucp_ep_rkey_unpack(q->ep, rk, &regs[i].rkey) : UCS_ERR_NO_MEMORY;
        free(rk);
        if (st != UCS_OK) {
            regs[i].rkey = NULL;
            for (uint32_t j = 0; j < i; j++) U.ucp_rkey_destroy(regs[j].rkey);
            for (uint32_t j = i; j < nregs; j++) regs[j].rkey = NULL;
            peer_drop_locked(p, slot);
            terr("ucx poster: connect: region %#lx: ucp_ep_rkey_unpack failed: %s (UCS status %d)",
                         (unsigned long)regs[i].base, status_text(st), (int)st);
            goto out;
        }
    }
    q->regs = regs;
    q->nregs = nregs;
    regs = NULL;
    p->next_peer = (slot + 1) % MAX_PEERS;
    res = PyLong_FromUnsignedLong(slot);
out:
    pthread_mutex_unlock(&p->mu);
    free(regs);
    free(addr_copy);
    PyBuffer_Release(&view);
    return res;
}

/* disconnect(peer): refuse while its handles are posted; drain its abandoned ones; drop rkeys and endpoint. */
static PyObject *Poster_disconnect(Poster *p, PyObject *args) {
    long long peer;
    if (!PyArg_ParseTuple(args, "L", &peer)) return NULL;
    PyObject *res = NULL;
    lock_nogil(p);
    OPEN_OR_RAISE(p);
    if (peer < 0 || peer >= MAX_PEERS || !p->peers[peer].used) {
        terr("ucx poster: disconnect: unknown peer %lld (never connected, or disconnected)", peer);
        goto out;
    }
    if (p->peers[peer].live) {
        terr("ucx poster: disconnect: peer %lld has %u handles posted and not released", peer,
                     p->peers[peer].live);
        goto out;
    }
    Py_BEGIN_ALLOW_THREADS
    drain_locked(p, peer, p->close_timeout_s);
    peer_drop_locked(p, (uint32_t)peer);
    Py_END_ALLOW_THREADS
    res = Py_NewRef(Py_None);
out:
    pthread_mutex_unlock(&p->mu);
    return res;
}

/* A uint64 argument: a C-contiguous 1-D buffer of 8-byte unsigned integers, or a sequence of ints. */
typedef struct {
    Py_buffer view;
    int has_view;
    uint64_t *tmp;
    const uint64_t *data;
    Py_ssize_t n;
} U64s;

static int u64s_get(PyObject *obj, const char *what, U64s *a) {
    memset(a, 0, sizeof *a);
    if (PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, &a->view, PyBUF_ND | PyBUF_FORMAT) == 0) {
            a->has_view = 1;
            const char *f = a->view.format ? a->view.format : "B";
            if (*f == '<' || *f == '=' || *f == '@') f++;
            if (a->view.ndim != 1 || a->view.itemsize != 8 || (strcmp(f, "Q") && strcmp(f, "L"))) {
                terr("ucx poster: write: %s must be uint64 (1-D), got a %d-D buffer of format '%s'",
                             what, a->view.ndim, a->view.format ? a->view.format : "B");
                return -1;
            }
            a->data = a->view.buf;
            a->n = a->view.shape ? a->view.shape[0] : a->view.len / 8;
            return 0;
        }
        PyErr_Clear(); /* not contiguous: read it as a sequence */
    }
    PyObject *seq = PySequence_Fast(obj, "");
    if (!seq) {
        terr("ucx poster: write: %s must be a sequence of ints or a uint64 array, got %.80s", what,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    a->n = PySequence_Fast_GET_SIZE(seq);
    if (a->n > (Py_ssize_t)MAX_FRAGMENTS) {
        Py_DECREF(seq);
        terr("ucx poster: write: %s has %zd entries; at most %u fragments per write", what, a->n,
                     MAX_FRAGMENTS);
        return -1;
    }
    a->tmp = PyMem_Malloc((a->n ? a->n : 1) * sizeof(uint64_t));
    if (!a->tmp) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < a->n; i++) {
        PyObject *ix = PyNumber_Index(items[i]);
        unsigned long long v = ix ? PyLong_AsUnsignedLongLong(ix) : (unsigned long long)-1;
        Py_XDECREF(ix);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyObject *r = PyObject_Repr(items[i]);
            const char *text = r ? PyUnicode_AsUTF8(r) : NULL;
            if (!text) PyErr_Clear();
            terr("ucx poster: write: %s[%zd] = %.80s is not an unsigned 64-bit integer", what, i, text ? text : "?");
            Py_XDECREF(r);
            Py_DECREF(seq);
            return -1;
        }
        a->tmp[i] = v;
    }
    Py_DECREF(seq);
    a->data = a->tmp;
    return 0;
}

static void u64s_release(U64s *a) {
    if (a->has_view) PyBuffer_Release(&a->view);
    PyMem_Free(a->tmp);
    a->has_view = 0;
    a->tmp = NULL;
}

/* write(peer, src, dst, lengths, timeout_s): one WRITE through the vtable, polled to its end without the GIL. */
static PyObject *Poster_write(Poster *p, PyObject *args) {
    long long peer;
    PyObject *so, *dob, *lo;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "LOOOd", &peer, &so, &dob, &lo, &timeout_s)) return NULL;
    if (!(timeout_s > 0)) return terr("ucx poster: write: timeout_s must be > 0");
    U64s s, d, l;
    memset(&d, 0, sizeof d);
    memset(&l, 0, sizeof l);
    PyObject *res = NULL;
    if (u64s_get(so, "src", &s) || u64s_get(dob, "dst", &d) || u64s_get(lo, "lengths", &l)) goto out;
    if (s.n != d.n || s.n != l.n) {
        terr("ucx poster: write: src has %zd entries, dst %zd, lengths %zd: they must be equal", s.n,
                     d.n, l.n);
        goto out;
    }
    if (s.n > (Py_ssize_t)MAX_FRAGMENTS) {
        terr("ucx poster: write: %zd fragments; at most %u per write", s.n, MAX_FRAGMENTS);
        goto out;
    }
    if (peer < 0 || peer >= MAX_PEERS) {
        terr("ucx poster: unknown peer %lld (never connected, or disconnected)", peer);
        goto out;
    }
    uint32_t slot = (uint32_t)peer;
    char err[512];
    err[0] = 0;
    void *h = NULL;
    int rc, timed_out = 0;
    double t0;
    Py_BEGIN_ALLOW_THREADS
    t0 = mono();
    rc = vt_post_write(p, slot, s.data, d.data, l.data, (uint32_t)s.n, &h, err, sizeof err);
    if (rc == 0) {
        double deadline = t0 + timeout_s;
        for (unsigned spins = 0;; spins++) {
            rc = vt_poll(p, h, err, sizeof err);
            if (rc != KVN_PENDING) break;
            if (spins > 64) {
                double now = mono();
                if (now > deadline) { timed_out = 1; break; }
                if (now - t0 > 1e-4) sched_yield(); /* a target on this host may need the core to progress */
            }
        }
        vt_release(p, h); /* a handle still pending is abandoned: drained later, before its memory goes */
    }
    Py_END_ALLOW_THREADS
    if (timed_out) {
        char msg[640];
        snprintf(msg, sizeof msg,
                 "ucx poster: write of %zd fragments to peer %lld did not end within %.3gs; the handle is abandoned "
                 "(drained by later polls or close)", s.n, peer, timeout_s);
        PyErr_SetString(TransportError, msg);
    } else if (rc == KVN_FAILED || rc < 0) {
        PyErr_SetString(TransportError, err);
    } else {
        res = Py_NewRef(Py_None);
    }
out:
    u64s_release(&s);
    u64s_release(&d);
    u64s_release(&l);
    return res;
}

static void capsule_free(PyObject *cap) {
    PyObject *owner = PyCapsule_GetContext(cap);
    Py_XDECREF(owner);
}

/* capsule() -> PyCapsule KVN_POSTER_CAPSULE holding this poster's kvn_poster_ref; it keeps the poster alive. */
static PyObject *Poster_capsule(Poster *p, PyObject *noargs) {
    PyObject *cap = PyCapsule_New(&p->ref, KVN_POSTER_CAPSULE, capsule_free);
    if (!cap) return NULL;
    if (PyCapsule_SetContext(cap, p)) { Py_DECREF(cap); return NULL; }
    Py_INCREF(p);
    return cap;
}

/* close(): refuse while handles are posted and not released; drain abandoned ones (bounded); drop everything. */
static PyObject *Poster_close(Poster *p, PyObject *noargs) {
    lock_nogil(p);
    if (p->closed) { pthread_mutex_unlock(&p->mu); Py_RETURN_NONE; }
    if (p->nlive) {
        uint32_t n = p->nlive;
        pthread_mutex_unlock(&p->mu);
        return terr("ucx poster: close refused: %u handles posted and not released", n);
    }
    p->closed = 1; /* every call from now on is refused */
    pthread_mutex_unlock(&p->mu);
    Py_BEGIN_ALLOW_THREADS
    teardown(p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Poster_in_flight(Poster *p, void *closure) {
    lock_nogil(p);
    if (p->nabandoned && p->worker) drive_abandoned(p);
    uint32_t n = p->nlive + p->nabandoned;
    pthread_mutex_unlock(&p->mu);
    return PyLong_FromUnsignedLong(n);
}

static PyObject *Poster_puts(Poster *p, void *closure) {
    lock_nogil(p);
    unsigned long long n = p->puts;
    pthread_mutex_unlock(&p->mu);
    return PyLong_FromUnsignedLongLong(n);
}

static PyObject *Poster_closed(Poster *p, void *closure) { return PyBool_FromLong(p->closed); }

static PyMethodDef poster_methods[] = {
    {"register", (PyCFunction)Poster_register, METH_VARARGS, "register(addr, length): map host memory."},
    {"descriptor", (PyCFunction)Poster_descriptor, METH_NOARGS, "descriptor() -> bytes a peer's connect() reads."},
    {"connect", (PyCFunction)Poster_connect, METH_VARARGS, "connect(descriptor) -> peer slot."},
    {"disconnect", (PyCFunction)Poster_disconnect, METH_VARARGS, "disconnect(peer): drop a peer."},
    {"write", (PyCFunction)Poster_write, METH_VARARGS, "write(peer, src, dst, lengths, timeout_s): one WRITE, to its end."},
    {"capsule", (PyCFunction)Poster_capsule, METH_NOARGS, "capsule() -> PyCapsule of a kvn_poster_ref."},
    {"close", (PyCFunction)Poster_close, METH_NOARGS, "close(): drain and drop everything (again: nothing)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef poster_getset[] = {
    {"in_flight", (getter)Poster_in_flight, NULL, "handles posted and not released, plus abandoned ones pending", NULL},
    {"closed", (getter)Poster_closed, NULL, "whether close() ran", NULL},
    {"puts", (getter)Poster_puts, NULL, "UCX puts posted so far: one per run of fragments that continue each other", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PosterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcore_native._ucx.Poster",
    .tp_basicsize = sizeof(Poster),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Poster(name, settings, error_peer, progress_thread, close_timeout_s): a UCX poster (kvn_poster.h).",
    .tp_new = Poster_new,
    .tp_init = (initproc)Poster_init,
    .tp_dealloc = (destructor)Poster_dealloc,
    .tp_methods = poster_methods,
    .tp_getset = poster_getset,
};

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "load(path): open libucp at path for this module."},
    {"version", version, METH_NOARGS, "version() -> (major, minor, release) of the loaded libucp, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "kvcore_native._ucx", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__ucx(void) {
    if (!TransportError) {
        PyObject *errors = PyImport_ImportModule("kvcore_native.errors");
        if (!errors) return NULL;
        TransportError = PyObject_GetAttrString(errors, "NativeTransportError");
        Py_DECREF(errors);
        if (!TransportError) return NULL;
    }
    if (PyType_Ready(&PosterType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Poster", (PyObject *)&PosterType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_PEERS", MAX_PEERS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_REGIONS", MAX_REGIONS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_FRAGMENTS", MAX_FRAGMENTS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_HANDLES", MAX_HANDLES) < 0 ||
        PyModule_AddIntConstant(m, "MAX_DESCRIPTOR", MAX_DESCRIPTOR) < 0 ||
        PyModule_AddStringConstant(m, "CAPSULE_NAME", KVN_POSTER_CAPSULE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
