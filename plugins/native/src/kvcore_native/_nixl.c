/* kvcore_native._nixl: a poster (kvn_poster.h) over NIXL's C API, one NIXL agent per poster.
 *
 * NIXL's C API is libnixl_capi.so from the nixl-cu12 / nixl-cu13 wheel (the C wrapper its Rust bindings use). The
 * wheel ships no header, so the few prototypes and the one struct used are declared below from
 * src/bindings/rust/wrapper.h (NIXL 1.5.1), and the library is opened at run time by path (load()): this module
 * builds with gcc and the Python headers only, and imports where NIXL is missing.
 *
 * A poster owns: an agent created with no progress thread and no listener (a progress thread spins a core at
 * NIXL's default delay), one UCX backend (params from Python: ucx_error_handling_mode=none by default, where
 * same-host writes are one-sided CMA puts), its DRAM registrations, its peers (remote metadata loaded from
 * descriptors) and its handles. A write is one NIXL xfer request: local and remote DRAM xfer dlists (fragments
 * that continue each other on both sides merged), one createXferReq (WRITE), one postXferReq; poll is
 * getXferStatus; release destroys the request, or keeps it when it is still in flight (abandoned: driven to its
 * end by later polls and by close, never released under a copy that may still land).
 *
 * Peer descriptors are untrusted. NIXL parses its metadata blob with few checks and hands the peer's UCX worker
 * address and rkeys to UCX, which reads them without a length; so before NIXL sees a descriptor it is parsed here
 * against the exact layout NIXL 1.5.1 writes (nixlSerDes: tag, u64 length, bytes, '|'), every count and length
 * bounded, nothing left over. The DRAM regions a peer registered come out of that parse: post_write checks every
 * fragment against them as well as against this side's registrations, so NIXL never gets a range it would
 * refuse. What the parse cannot vouch for is UCX's packing inside the blobs: a forged rkey of sound framing still
 * crashes ucp_ep_rkey_unpack (found by fuzzing), so descriptors must come from authenticated peers.
 *
 * Threads: every vtable function and Python method takes the poster's mutex; the vtable never touches Python;
 * Python methods release the GIL around everything that may wait (agent and backend creation, registration,
 * connect, write's polling, the drains of disconnect and close, the agent's destruction).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvn_poster.h"

#define MAX_PEERS 4096
#define MAX_REGS 4096
#define MAX_FRAGS 1048576u
#define MAX_HANDLES 16384u
#define MAX_DESCRIPTOR (1u << 20)
#define MAX_NAME 255
#define MAX_PARAMS 64
#define MAX_PARAM_BYTES 4096
/* Descriptor bounds: what a NIXL 1.5 agent with a few backends and <= MAX_REGS registrations writes. */
#define MD_MAX_CONNS 16
#define MD_MAX_SECTIONS 16
#define MD_MAX_DESCS MAX_REGS
#define MD_MAX_BACKEND_NAME 64
#define MD_MAX_CONN_INFO 65536
#define MD_MAX_RKEY 65536
#define MD_BASIC_DESC 24 /* nixlBasicDesc: addr, len, devId (u64 each) */
#define MD_MEM_TYPES 5   /* nixl_mem_t: DRAM, VRAM, BLK, OBJ, FILE */
#define DRAIN_S 5.0      /* the bounded wait of close and disconnect for abandoned writes */
#define ERRLEN 512

static double mono(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void nap_us(long us) { struct timespec t = {0, us * 1000L}; nanosleep(&t, NULL); }

/* --- NIXL's C API (libnixl_capi.so), declared from NIXL 1.5.1's src/bindings/rust/wrapper.h --------------- */

enum { NX_SUCCESS = 0, NX_IN_PROG = 1 };    /* nixl_capi_status_t; errors are negative */
enum { NX_MEM_DRAM = 0 };                   /* nixl_capi_mem_type_t */
enum { NX_OP_WRITE = 1 };                   /* nixl_capi_xfer_op_t */
enum { NX_THREAD_SYNC_NONE = 0 };           /* nixl_capi_thread_sync_t */

/* nixl_capi_agent_config_t. Its 1.5.1 reader (nixl_capi_create_configured_agent) loads the two bools as one
 * 16-bit word at 0, listen_port at 4, thread_sync at 8, both delays as 16 bytes at 16 and capture_telemetry at
 * 32 (num_workers at 12 is not read): the asserts below keep this declaration on that layout. */
typedef struct {
    bool enable_prog_thread;
    bool enable_listen_thread;
    int listen_port;
    int thread_sync; /* an enum: int-sized */
    unsigned int num_workers;
    uint64_t pthr_delay_us;
    uint64_t lthr_delay_us;
    bool capture_telemetry;
} nx_agent_config;
_Static_assert(offsetof(nx_agent_config, listen_port) == 4, "nixl_capi_agent_config_t.listen_port");
_Static_assert(offsetof(nx_agent_config, thread_sync) == 8, "nixl_capi_agent_config_t.thread_sync");
_Static_assert(offsetof(nx_agent_config, num_workers) == 12, "nixl_capi_agent_config_t.num_workers");
_Static_assert(offsetof(nx_agent_config, pthr_delay_us) == 16, "nixl_capi_agent_config_t.pthr_delay_us");
_Static_assert(offsetof(nx_agent_config, capture_telemetry) == 32, "nixl_capi_agent_config_t.capture_telemetry");
_Static_assert(sizeof(nx_agent_config) == 40, "nixl_capi_agent_config_t size");

typedef void *nx_h; /* every nixl_capi_*_t handle is an opaque pointer */

static struct {
    int (*create_configured_agent)(const char *, const nx_agent_config *, nx_h *);
    int (*destroy_agent)(nx_h);
    int (*get_available_plugins)(nx_h, nx_h *);
    int (*string_list_size)(nx_h, size_t *);
    int (*string_list_get)(nx_h, size_t, const char **);
    int (*destroy_string_list)(nx_h);
    int (*create_params)(nx_h *);
    int (*params_add)(nx_h, const char *, const char *);
    int (*destroy_params)(nx_h);
    int (*create_backend)(nx_h, const char *, nx_h, nx_h *);
    int (*destroy_backend)(nx_h);
    int (*create_opt_args)(nx_h *);
    int (*opt_args_add_backend)(nx_h, nx_h);
    int (*destroy_opt_args)(nx_h);
    int (*get_local_md)(nx_h, void **, size_t *);
    int (*load_remote_md)(nx_h, const void *, size_t, char **);
    int (*invalidate_remote_md)(nx_h, const char *);
    int (*create_reg_dlist)(int, nx_h *);
    int (*reg_dlist_add_desc)(nx_h, uintptr_t, size_t, uint64_t, const void *, size_t);
    int (*destroy_reg_dlist)(nx_h);
    int (*register_mem)(nx_h, nx_h, nx_h);
    int (*deregister_mem)(nx_h, nx_h, nx_h);
    int (*create_xfer_dlist)(int, nx_h *);
    int (*xfer_dlist_add_desc)(nx_h, uintptr_t, size_t, uint64_t);
    int (*xfer_dlist_clear)(nx_h);
    int (*destroy_xfer_dlist)(nx_h);
    int (*create_xfer_req)(nx_h, int, nx_h, nx_h, const char *, nx_h *, nx_h);
    int (*post_xfer_req)(nx_h, nx_h, nx_h);
    int (*get_xfer_status)(nx_h, nx_h);
    int (*release_xfer_req)(nx_h, nx_h);
    int (*destroy_xfer_req)(nx_h);
    bool (*is_stub)(void);
} X;
static int loaded;
static char lib_path[1024];
static PyObject *TransportError; /* kvcore_native.errors.NativeTransportError, set by set_error_type */

static const char *status_name(int s) {
    switch (s) {
    case 0: return "SUCCESS";
    case 1: return "IN_PROG";
    case -1: return "INVALID_PARAM";
    case -2: return "BACKEND";
    case -3: return "INVALID_STATE";
    case -4: return "EXCEPTION";
    case -5: return "NO_TELEMETRY";
    case -6: return "NOT_FOUND";
    default: return "unknown status";
    }
}

static PyObject *raise_msg(const char *msg) {
    PyErr_SetString(TransportError ? TransportError : PyExc_RuntimeError, msg);
    return NULL;
}

static PyObject *raise_fmt(const char *fmt, ...) {
    char msg[ERRLEN + 256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return raise_msg(msg);
}

static void set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* load(path): open libnixl_capi.so at path for this module (again: nothing). */
static PyObject *load(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    if (loaded) Py_RETURN_NONE;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) return raise_fmt("cannot open NIXL's C API at %s: %s", path, dlerror());
#define NX_SYM(field) if (!(*(void **)&X.field = dlsym(lib, "nixl_capi_" #field))) { \
        dlclose(lib); memset(&X, 0, sizeof X); \
        return raise_fmt("%s has no nixl_capi_" #field " (not NIXL 1.5's C API?)", path); }
    NX_SYM(create_configured_agent) NX_SYM(destroy_agent) NX_SYM(get_available_plugins) NX_SYM(string_list_size)
    NX_SYM(string_list_get) NX_SYM(destroy_string_list) NX_SYM(create_params) NX_SYM(params_add)
    NX_SYM(destroy_params) NX_SYM(create_backend) NX_SYM(destroy_backend) NX_SYM(create_opt_args)
    NX_SYM(opt_args_add_backend) NX_SYM(destroy_opt_args) NX_SYM(get_local_md) NX_SYM(load_remote_md)
    NX_SYM(invalidate_remote_md) NX_SYM(create_reg_dlist) NX_SYM(reg_dlist_add_desc) NX_SYM(destroy_reg_dlist)
    NX_SYM(register_mem) NX_SYM(deregister_mem) NX_SYM(create_xfer_dlist) NX_SYM(xfer_dlist_add_desc)
    NX_SYM(xfer_dlist_clear) NX_SYM(destroy_xfer_dlist) NX_SYM(create_xfer_req) NX_SYM(post_xfer_req)
    NX_SYM(get_xfer_status) NX_SYM(release_xfer_req) NX_SYM(destroy_xfer_req) NX_SYM(is_stub)
#undef NX_SYM
    if (X.is_stub()) {
        dlclose(lib);
        memset(&X, 0, sizeof X);
        return raise_fmt("%s is NIXL's stub build (no NIXL behind its C API)", path);
    }
    snprintf(lib_path, sizeof lib_path, "%s", path);
    loaded = 1;
    Py_RETURN_NONE;
}

/* set_error_type(cls): the exception every refusal and failure raises. */
static PyObject *set_error_type(PyObject *self, PyObject *cls) {
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)PyExc_Exception))
        return PyErr_Format(PyExc_TypeError, "set_error_type: an Exception subclass expected");
    Py_INCREF(cls);
    Py_XSETREF(TransportError, cls);
    Py_RETURN_NONE;
}

/* --- memory ranges --------------------------------------------------------------------------------------- */

/* Registered ranges sorted by start, with the running maximum of their ends: [a, a + len) lies inside one
 * range iff the ranges starting at or before a reach a + len (overlapping ranges, as a peer may have, included). */
typedef struct {
    uint64_t *start, *end, *maxend;
    uint32_t n;
} Ranges;

static void ranges_free(Ranges *r) {
    free(r->start);
    free(r->end);
    free(r->maxend);
    memset(r, 0, sizeof *r);
}

static void ranges_index(Ranges *r) {
    for (uint32_t i = 0; i < r->n; i++) r->maxend[i] = i && r->maxend[i - 1] > r->end[i] ? r->maxend[i - 1] : r->end[i];
}

static int ranges_contain(const Ranges *r, uint64_t a, uint64_t end) {
    uint32_t lo = 0, hi = r->n; /* the first range starting after a */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (r->start[mid] <= a) lo = mid + 1;
        else hi = mid;
    }
    return lo > 0 && r->maxend[lo - 1] >= end;
}

/* --- the peer descriptor (NIXL 1.5.1's metadata blob) ---------------------------------------------------- */

typedef struct {
    const uint8_t *p;
    size_t n, off;
    char *err;
    size_t errlen;
} Rd;

/* One nixlSerDes field: tag, u64 length, bytes, '|'. */
static int rd_field(Rd *r, const char *tag, const char *what, const uint8_t **data, uint64_t *len) {
    size_t tl = strlen(tag), left = r->n - r->off;
    if (left < tl + 8) {
        set_err(r->err, r->errlen, "descriptor truncated at byte %zu: %s needs a %zu-byte header, %zu bytes left",
                r->off, what, tl + 8, left);
        return -1;
    }
    if (tl && memcmp(r->p + r->off, tag, tl) != 0) {
        set_err(r->err, r->errlen, "descriptor byte %zu: expected the tag '%s' of %s", r->off, tag, what);
        return -1;
    }
    uint64_t l;
    memcpy(&l, r->p + r->off + tl, 8);
    size_t at = r->off + tl + 8;
    left = r->n - at;
    if (l >= left) { /* the bytes and the '|' after them */
        set_err(r->err, r->errlen, "descriptor byte %zu: %s claims %llu bytes, %zu left", r->off, what,
                (unsigned long long)l, left ? left - 1 : 0);
        return -1;
    }
    if (r->p[at + l] != '|') {
        set_err(r->err, r->errlen, "descriptor byte %zu: %s is not followed by '|'", (size_t)(at + l), what);
        return -1;
    }
    *data = r->p + at;
    *len = l;
    r->off = at + l + 1;
    return 0;
}

static int rd_str(Rd *r, const char *tag, const char *what, uint64_t min, uint64_t max, const uint8_t **data,
                  uint64_t *len) {
    if (rd_field(r, tag, what, data, len)) return -1;
    if (*len < min || *len > max) {
        set_err(r->err, r->errlen, "descriptor: %s has %llu bytes, expected %llu to %llu", what,
                (unsigned long long)*len, (unsigned long long)min, (unsigned long long)max);
        return -1;
    }
    return 0;
}

static int rd_count(Rd *r, const char *tag, const char *what, uint64_t size, uint64_t max, uint64_t *out) {
    const uint8_t *d;
    uint64_t len;
    if (rd_field(r, tag, what, &d, &len)) return -1;
    if (len != size) {
        set_err(r->err, r->errlen, "descriptor: %s has %llu bytes, expected %llu", what, (unsigned long long)len,
                (unsigned long long)size);
        return -1;
    }
    uint64_t v = 0;
    memcpy(&v, d, size); /* little-endian, as NIXL writes it on this machine */
    if (v > max) {
        set_err(r->err, r->errlen, "descriptor: %s is %llu, at most %llu accepted", what, (unsigned long long)v,
                (unsigned long long)max);
        return -1;
    }
    *out = v;
    return 0;
}

static int eq(const uint8_t *d, uint64_t len, const char *s) { return len == strlen(s) && memcmp(d, s, len) == 0; }

typedef struct {
    char name[MAX_NAME + 1];
    Ranges dram; /* the peer's UCX DRAM registrations on device 0 */
} Parsed;

static int cmp_pair(const void *a, const void *b) {
    const uint64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* Parse and check a peer's descriptor; 0, or -1 with why in err. */
static int parse_descriptor(const uint8_t *p, size_t n, Parsed *out, char *err, size_t errlen) {
    static const char magic[] = "nixlSerDes|";
    memset(out, 0, sizeof *out);
    if (n > MAX_DESCRIPTOR) {
        set_err(err, errlen, "descriptor of %zu bytes refused: at most %u accepted", n, MAX_DESCRIPTOR);
        return -1;
    }
    if (n < sizeof magic - 1 || memcmp(p, magic, sizeof magic - 1) != 0) {
        set_err(err, errlen, "not a NIXL descriptor: %zu bytes without the 'nixlSerDes|' header", n);
        return -1;
    }
    Rd r = {p, n, sizeof magic - 1, err, errlen};
    const uint8_t *d;
    uint64_t len, count;
    if (rd_str(&r, "Agent", "the agent name", 1, MAX_NAME, &d, &len)) return -1;
    if (memchr(d, 0, len)) {
        set_err(err, errlen, "descriptor: the agent name holds a NUL byte");
        return -1;
    }
    memcpy(out->name, d, len);
    out->name[len] = 0;

    const uint8_t *backends[MD_MAX_CONNS];
    uint64_t backend_len[MD_MAX_CONNS];
    int ucx = 0;
    if (rd_count(&r, "Conns", "the connection count", 8, MD_MAX_CONNS, &count)) return -1;
    for (uint64_t i = 0; i < count; i++) {
        if (rd_str(&r, "t", "a connection's backend name", 1, MD_MAX_BACKEND_NAME, &d, &len)) return -1;
        for (uint64_t j = 0; j < i; j++)
            if (backend_len[j] == len && memcmp(backends[j], d, len) == 0) {
                set_err(err, errlen, "descriptor: backend '%.*s' has two connections", (int)len, (const char *)d);
                return -1;
            }
        backends[i] = d;
        backend_len[i] = len;
        ucx |= eq(d, len, "UCX");
        if (rd_str(&r, "c", "a connection's info", 1, MD_MAX_CONN_INFO, &d, &len)) return -1;
    }
    if (!ucx) {
        set_err(err, errlen, "descriptor: agent '%s' offers no UCX connection (%llu others)", out->name,
                (unsigned long long)count);
        return -1;
    }
    if (rd_str(&r, "", "the memory section marker", 1, 64, &d, &len)) return -1;
    if (!eq(d, len, "MemSection")) {
        set_err(err, errlen, "descriptor: expected the 'MemSection' marker at byte %zu", r.off);
        return -1;
    }
    uint64_t sections;
    if (rd_count(&r, "nixlSecElms", "the memory section count", 8, MD_MAX_SECTIONS, &sections)) return -1;
    uint64_t *pairs = NULL; /* (start, end) of the UCX DRAM regions */
    uint32_t npairs = 0, cap = 0;
    for (uint64_t s = 0; s < sections; s++) {
        const uint8_t *bk;
        uint64_t bklen, type = 0, ndesc;
        if (rd_str(&r, "bknd", "a section's backend name", 1, MD_MAX_BACKEND_NAME, &bk, &bklen) ||
            rd_str(&r, "nixlDList", "a section's list kind", 1, 64, &d, &len))
            goto fail;
        if (!eq(d, len, "nixlSDList")) {
            set_err(err, errlen, "descriptor: section %llu is not a registration list", (unsigned long long)s);
            goto fail;
        }
        if (rd_count(&r, "t", "a section's memory type", 4, MD_MEM_TYPES - 1, &type) ||
            rd_count(&r, "n", "a section's registration count", 8, MD_MAX_DESCS, &ndesc))
            goto fail;
        if (ndesc == 0) {
            set_err(err, errlen, "descriptor: section %llu lists no registration", (unsigned long long)s);
            goto fail;
        }
        int dram = eq(bk, bklen, "UCX") && type == NX_MEM_DRAM;
        for (uint64_t i = 0; i < ndesc; i++) {
            if (rd_str(&r, "", "a registration", MD_BASIC_DESC, MD_BASIC_DESC + MD_MAX_RKEY, &d, &len)) goto fail;
            uint64_t addr, rlen, dev;
            memcpy(&addr, d, 8);
            memcpy(&rlen, d + 8, 8);
            memcpy(&dev, d + 16, 8);
            if (rlen == 0 || addr + rlen < addr) {
                set_err(err, errlen, "descriptor: registration %llu of section %llu ([0x%llx, +%llu)) is empty or "
                        "overflows", (unsigned long long)i, (unsigned long long)s, (unsigned long long)addr,
                        (unsigned long long)rlen);
                goto fail;
            }
            if (!dram || dev != 0) continue;
            if (npairs == cap) {
                uint32_t ncap = cap ? cap * 2 : 16;
                uint64_t *np = realloc(pairs, (size_t)ncap * 2 * sizeof *pairs);
                if (!np) { set_err(err, errlen, "out of memory"); goto fail; }
                pairs = np;
                cap = ncap;
            }
            pairs[2 * npairs] = addr;
            pairs[2 * npairs + 1] = addr + rlen;
            npairs++;
        }
    }
    if (r.off != n) {
        set_err(err, errlen, "descriptor: %zu trailing bytes after its memory sections", n - r.off);
        goto fail;
    }
    if (npairs) {
        qsort(pairs, npairs, 2 * sizeof *pairs, cmp_pair);
        Ranges *g = &out->dram;
        g->start = malloc(npairs * sizeof(uint64_t));
        g->end = malloc(npairs * sizeof(uint64_t));
        g->maxend = malloc(npairs * sizeof(uint64_t));
        if (!g->start || !g->end || !g->maxend) { ranges_free(g); set_err(err, errlen, "out of memory"); goto fail; }
        for (uint32_t i = 0; i < npairs; i++) { g->start[i] = pairs[2 * i]; g->end[i] = pairs[2 * i + 1]; }
        g->n = npairs;
        ranges_index(g);
    }
    free(pairs);
    return 0;
fail:
    free(pairs);
    return -1;
}

/* --- the poster ------------------------------------------------------------------------------------------ */

enum { SLOT_FREE = 0, SLOT_CONNECTED = 1, SLOT_DISCONNECTED = 2 };
enum { H_PENDING = 0, H_DONE = 1, H_FAILED = 2 };
#define HANDLE_MAGIC 0x4B564E48u /* "KVNH" */

typedef struct {
    int state;
    char *name;
    Ranges dram;
    uint32_t live, abandoned; /* handles to this peer: posted and not released; released while pending */
} Peer;

typedef struct Handle {
    uint32_t magic;
    int state, abandoned, status; /* status: NIXL's, when FAILED */
    uint32_t peer, n;
    void *poster;
    nx_h req;
    struct Handle *prev, *next;
} Handle;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    int mu_ready, closed, leaked;
    char name[MAX_NAME + 1];
    nx_h agent, backend, opt, ldl, rdl;
    Ranges local;
    Peer *peers;
    Handle *handles; /* every handle not yet freed: live and abandoned */
    uint32_t live, abandoned;
    kvn_poster_ref ref;
} Poster;

static const kvn_poster_vtable vtable;

/* Free a handle whose request ended (or never got one); under mu. */
static void handle_free(Poster *p, Handle *h) {
    if (h->req) {
        /* Not in flight: NIXL deletes the request. Should it refuse, the wrapper is leaked, never freed under it. */
        if (X.release_xfer_req(p->agent, h->req) == NX_SUCCESS) X.destroy_xfer_req(h->req);
        else p->leaked++;
        h->req = NULL;
    }
    if (h->prev) h->prev->next = h->next;
    else p->handles = h->next;
    if (h->next) h->next->prev = h->prev;
    h->magic = 0;
    free(h);
}

/* Ask NIXL about a pending handle once (this drives UCX); under mu. */
static void handle_check(Poster *p, Handle *h) {
    if (h->state != H_PENDING) return;
    int s = X.get_xfer_status(p->agent, h->req);
    if (s == NX_SUCCESS) h->state = H_DONE;
    else if (s != NX_IN_PROG) { h->state = H_FAILED; h->status = s; }
}

/* Drive abandoned handles; free those that ended. Returns how many remain; under mu. */
static uint32_t drive_abandoned(Poster *p, int only_peer) {
    if (!p->abandoned) return 0;
    Handle *h = p->handles, *next;
    uint32_t left = 0;
    for (; h; h = next) {
        next = h->next;
        if (!h->abandoned || (only_peer >= 0 && h->peer != (uint32_t)only_peer)) continue;
        handle_check(p, h);
        if (h->state == H_PENDING) { left++; continue; }
        p->abandoned--;
        p->peers[h->peer].abandoned--;
        handle_free(p, h);
    }
    return left;
}

static int check_fragments(Poster *p, uint32_t peer, const uint64_t *src, const uint64_t *dst, const uint64_t *len,
                           uint32_t n, char *err, size_t errlen) {
    const Peer *pe = &p->peers[peer];
    for (uint32_t i = 0; i < n; i++) {
        uint64_t l = len[i];
        if (l == 0) {
            set_err(err, errlen, "fragment %u has length 0", i);
            return -1;
        }
        if (src[i] + l < src[i] || dst[i] + l < dst[i]) {
            set_err(err, errlen, "fragment %u overflows: %s 0x%llx + length %llu passes 2**64", i,
                    src[i] + l < src[i] ? "src" : "dst", (unsigned long long)(src[i] + l < src[i] ? src[i] : dst[i]),
                    (unsigned long long)l);
            return -1;
        }
        if (!ranges_contain(&p->local, src[i], src[i] + l)) {
            set_err(err, errlen, "fragment %u: src [0x%llx, 0x%llx) is outside this poster's registered memory", i,
                    (unsigned long long)src[i], (unsigned long long)(src[i] + l));
            return -1;
        }
        if (!ranges_contain(&pe->dram, dst[i], dst[i] + l)) {
            set_err(err, errlen, "fragment %u: dst [0x%llx, 0x%llx) is outside the memory peer %u ('%s') registered",
                    i, (unsigned long long)dst[i], (unsigned long long)(dst[i] + l), peer, pe->name);
            return -1;
        }
    }
    return 0;
}

static int vt_post_write(void *self, uint32_t peer, const uint64_t *src, const uint64_t *dst, const uint64_t *len,
                         uint32_t n, void **out, char *err, size_t errlen) {
    Poster *p = self;
    int rc = -1;
    if (err && errlen) err[0] = 0;
    if (out) *out = NULL;
    pthread_mutex_lock(&p->mu);
    if (p->closed || !p->agent) set_err(err, errlen, "the nixl poster '%s' is closed", p->name);
    else if (!out || !src || !dst || !len) set_err(err, errlen, "post_write: a NULL argument");
    else if (n == 0) set_err(err, errlen, "a write needs at least one fragment, got n == 0");
    else if (n > MAX_FRAGS) set_err(err, errlen, "a write of %u fragments: at most %u accepted", n, MAX_FRAGS);
    else if (peer >= MAX_PEERS || p->peers[peer].state == SLOT_FREE)
        set_err(err, errlen, "unknown peer %u (not a slot connect returned)", peer);
    else if (p->peers[peer].state == SLOT_DISCONNECTED) set_err(err, errlen, "peer %u was disconnected", peer);
    else if (p->live + p->abandoned >= MAX_HANDLES)
        set_err(err, errlen, "%u writes in flight: at most %u (poll and release some)", p->live + p->abandoned,
                MAX_HANDLES);
    else if (check_fragments(p, peer, src, dst, len, n, err, errlen) == 0) {
        Handle *h = calloc(1, sizeof *h);
        int s = h ? X.xfer_dlist_clear(p->ldl) : -1;
        if (s == NX_SUCCESS) s = X.xfer_dlist_clear(p->rdl);
        /* Fragments that continue each other on both sides, inside one registration on each, go as one
         * descriptor: UCX puts each descriptor separately (one process_vm_writev over CMA). */
        const Ranges *peer_dram = &p->peers[peer].dram;
        uint64_t rs = src[0], rd = dst[0], rl = len[0];
        for (uint32_t i = 1; i <= n && s == NX_SUCCESS; i++) {
            if (i < n && src[i] == rs + rl && dst[i] == rd + rl && rl + len[i] > rl &&
                ranges_contain(&p->local, rs, rs + rl + len[i]) && ranges_contain(peer_dram, rd, rd + rl + len[i])) {
                rl += len[i];
                continue;
            }
            s = X.xfer_dlist_add_desc(p->ldl, (uintptr_t)rs, (size_t)rl, 0);
            if (s == NX_SUCCESS) s = X.xfer_dlist_add_desc(p->rdl, (uintptr_t)rd, (size_t)rl, 0);
            if (i < n) { rs = src[i]; rd = dst[i]; rl = len[i]; }
        }
        if (!h) set_err(err, errlen, "out of memory for a write handle");
        else if (s != NX_SUCCESS)
            set_err(err, errlen, "NIXL could not build the descriptor lists of a %u-fragment write (status %d %s)",
                    n, s, status_name(s));
        else if ((s = X.create_xfer_req(p->agent, NX_OP_WRITE, p->ldl, p->rdl, p->peers[peer].name, &h->req,
                                        NULL)) != NX_SUCCESS) {
            h->req = NULL;
            set_err(err, errlen, "NIXL refused the write of %u fragments to peer %u ('%s'): createXferReq status %d "
                    "%s (NIXL dropped the peer after a failure, or lacks its ranges)", n, peer, p->peers[peer].name, s,
                    status_name(s));
        } else if ((s = X.post_xfer_req(p->agent, h->req, NULL)) != NX_SUCCESS && s != NX_IN_PROG) {
            set_err(err, errlen, "NIXL could not post the write of %u fragments to peer %u ('%s'): status %d %s (the "
                    "peer is gone or the transport failed)", n, peer, p->peers[peer].name, s, status_name(s));
        } else {
            h->magic = HANDLE_MAGIC;
            h->poster = p;
            h->peer = peer;
            h->n = n;
            h->state = s == NX_SUCCESS ? H_DONE : H_PENDING;
            h->next = p->handles;
            if (p->handles) p->handles->prev = h;
            p->handles = h;
            p->live++;
            p->peers[peer].live++;
            *out = h;
            rc = 0;
        }
        if (rc && h) {
            if (h->req) { /* created, not in flight (its post failed): NIXL deletes it */
                if (X.release_xfer_req(p->agent, h->req) == NX_SUCCESS) X.destroy_xfer_req(h->req);
                else p->leaked++;
            }
            free(h);
        }
    }
    if (rc && err && errlen && !err[0]) set_err(err, errlen, "the nixl poster refused the write");
    pthread_mutex_unlock(&p->mu);
    return rc;
}

/* Best effort against a caller's mix-up (another poster's handle); a released handle is freed memory. */
static int handle_ok(Poster *p, Handle *h) { return h && h->magic == HANDLE_MAGIC && h->poster == p && !h->abandoned; }

static int vt_poll(void *self, void *handle, char *err, size_t errlen) {
    Poster *p = self;
    Handle *h = handle;
    int st;
    pthread_mutex_lock(&p->mu);
    if (!handle_ok(p, h)) {
        set_err(err, errlen, "poll: not a live handle of the nixl poster '%s'", p->name);
        st = KVN_FAILED;
    } else {
        handle_check(p, h);
        if (h->state == H_DONE) st = KVN_DONE;
        else if (h->state == H_PENDING) st = KVN_PENDING;
        else {
            st = KVN_FAILED;
            set_err(err, errlen, "the write of %u fragments to peer %u ('%s') failed: NIXL status %d %s (the peer is "
                    "gone or the transport failed)", h->n, h->peer, p->peers[h->peer].name, h->status,
                    status_name(h->status));
        }
        drive_abandoned(p, -1);
    }
    pthread_mutex_unlock(&p->mu);
    return st;
}

static void vt_release(void *self, void *handle) {
    Poster *p = self;
    Handle *h = handle;
    pthread_mutex_lock(&p->mu);
    if (handle_ok(p, h)) {
        p->live--;
        p->peers[h->peer].live--;
        if (h->state == H_PENDING) handle_check(p, h);
        if (h->state == H_PENDING) { /* in flight: kept, driven to its end later */
            h->abandoned = 1;
            p->abandoned++;
            p->peers[h->peer].abandoned++;
        } else {
            handle_free(p, h);
        }
    }
    pthread_mutex_unlock(&p->mu);
}

static const kvn_poster_vtable vtable = {KVN_POSTER_ABI, "nixl", vt_post_write, vt_poll, vt_release};

/* Take mu from Python: the GIL is released while another thread holds it (it never waits for the GIL). */
static void lock_py(Poster *p) {
    if (pthread_mutex_trylock(&p->mu) == 0) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->mu);
    Py_END_ALLOW_THREADS
}

static int check_open(Poster *p, const char *what) {
    if (p->closed) { raise_fmt("%s: the nixl poster '%s' is closed", what, p->name); return -1; }
    if (!p->mu_ready || !p->agent) { raise_fmt("%s: the nixl poster was not initialized", what); return -1; }
    return 0;
}

static PyObject *Poster_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Poster *p = (Poster *)type->tp_alloc(type, 0);
    if (!p) return NULL;
    if (pthread_mutex_init(&p->mu, NULL) != 0) { Py_DECREF(p); return PyErr_NoMemory(); }
    p->mu_ready = 1;
    p->ref.vt = &vtable;
    p->ref.self = p;
    return (PyObject *)p;
}

/* Tear the NIXL side down; under mu, with nothing in flight (or on a failed __init__). */
static void teardown(Poster *p) {
    if (p->agent) {
        for (uint32_t i = 0; i < p->local.n; i++) {
            nx_h dl = NULL;
            if (X.create_reg_dlist(NX_MEM_DRAM, &dl) == NX_SUCCESS) {
                if (X.reg_dlist_add_desc(dl, (uintptr_t)p->local.start[i], (size_t)(p->local.end[i] -
                                         p->local.start[i]), 0, NULL, 0) == NX_SUCCESS)
                    X.deregister_mem(p->agent, dl, p->opt);
                X.destroy_reg_dlist(dl);
            }
        }
    }
    if (p->peers) {
        for (uint32_t i = 0; i < MAX_PEERS; i++) {
            free(p->peers[i].name);
            ranges_free(&p->peers[i].dram);
        }
        free(p->peers);
        p->peers = NULL;
    }
    ranges_free(&p->local);
    if (p->ldl) X.destroy_xfer_dlist(p->ldl);
    if (p->rdl) X.destroy_xfer_dlist(p->rdl);
    if (p->opt) X.destroy_opt_args(p->opt);
    if (p->backend) X.destroy_backend(p->backend); /* the wrapper only: the agent owns the backend */
    if (p->agent) X.destroy_agent(p->agent);
    p->ldl = p->rdl = p->opt = p->backend = p->agent = NULL;
}

/* Poster(name, params): params is a list of (key, value) str pairs for NIXL's UCX backend. */
static int Poster_init(PyObject *self, PyObject *args, PyObject *kw) {
    Poster *p = (Poster *)self;
    const char *name;
    Py_ssize_t name_len;
    PyObject *params;
    static char *kwlist[] = {"name", "params", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s#O:Poster", kwlist, &name, &name_len, &params)) return -1;
    if (p->agent) { raise_msg("Poster.__init__: already initialized"); return -1; }
    if (!loaded) { raise_msg("NIXL's C API is not loaded: call load(path) first"); return -1; }
    if (name_len < 1 || name_len > MAX_NAME || (Py_ssize_t)strlen(name) != name_len) {
        raise_fmt("name: expected 1 to %d bytes without NUL, got %zd bytes", MAX_NAME, name_len);
        return -1;
    }
    PyObject *seq = PySequence_Fast(params, "params: expected a sequence of (key, value) pairs");
    if (!seq) return -1;
    Py_ssize_t np = PySequence_Fast_GET_SIZE(seq);
    if (np > MAX_PARAMS) { Py_DECREF(seq); raise_fmt("params: %zd given, at most %d", np, MAX_PARAMS); return -1; }
    char *keys[MAX_PARAMS], *vals[MAX_PARAMS];
    Py_ssize_t got = 0;
    int bad = 0;
    for (; got < np; got++) {
        const char *k, *v;
        Py_ssize_t kl, vl;
        PyObject *item = PySequence_Fast_GET_ITEM(seq, got);
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "s#s#", &k, &kl, &v, &vl)) {
            PyErr_Clear();
            raise_fmt("params[%zd]: expected a (str, str) pair", got);
            bad = 1;
            break;
        }
        if (kl < 1 || kl > MAX_PARAM_BYTES || vl > MAX_PARAM_BYTES) {
            raise_fmt("params[%zd]: key of %zd bytes, value of %zd bytes: 1 to %d and 0 to %d accepted", got, kl, vl,
                      MAX_PARAM_BYTES, MAX_PARAM_BYTES);
            bad = 1;
            break;
        }
        keys[got] = strdup(k);
        vals[got] = strdup(v);
        if (!keys[got] || !vals[got]) { free(keys[got]); free(vals[got]); PyErr_NoMemory(); bad = 1; break; }
    }
    Py_DECREF(seq);
    char err[ERRLEN] = "";
    if (!bad) {
        memcpy(p->name, name, name_len);
        p->name[name_len] = 0;
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&p->mu);
        nx_agent_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.enable_prog_thread = false; /* NIXL 1.5's progress thread spins a core; write() polls instead */
        cfg.enable_listen_thread = false;
        cfg.thread_sync = NX_THREAD_SYNC_NONE; /* every call is under mu */
        cfg.num_workers = 1;
        cfg.pthr_delay_us = 0;
        cfg.lthr_delay_us = 100000;
        cfg.capture_telemetry = false;
        nx_h plist = NULL, nparams = NULL;
        int s;
        p->peers = calloc(MAX_PEERS, sizeof *p->peers);
        if (!p->peers) set_err(err, sizeof err, "out of memory for the peer table");
        else if ((s = X.create_configured_agent(p->name, &cfg, &p->agent)) != NX_SUCCESS) {
            p->agent = NULL;
            set_err(err, sizeof err, "NIXL could not create agent '%s' (status %d %s)", p->name, s, status_name(s));
        } else if ((s = X.get_available_plugins(p->agent, &plist)) != NX_SUCCESS) {
            set_err(err, sizeof err, "NIXL could not list its plugins (status %d %s)", s, status_name(s));
        } else {
            size_t count = 0, i;
            const char *pl;
            int has_ucx = 0;
            char names[256] = "";
            X.string_list_size(plist, &count);
            for (i = 0; i < count; i++)
                if (X.string_list_get(plist, i, &pl) == NX_SUCCESS && pl) {
                    has_ucx |= strcmp(pl, "UCX") == 0;
                    size_t used = strlen(names);
                    snprintf(names + used, sizeof names - used, "%s%s", used ? ", " : "", pl);
                }
            if (!has_ucx)
                set_err(err, sizeof err, "NIXL at %s has no UCX plugin (plugins: %s)", lib_path,
                        count ? names : "none");
        }
        if (plist) X.destroy_string_list(plist);
        if (!err[0] && (s = X.create_params(&nparams)) != NX_SUCCESS)
            set_err(err, sizeof err, "NIXL could not create a parameter map (status %d %s)", s, status_name(s));
        for (Py_ssize_t i = 0; !err[0] && i < got; i++)
            if ((s = X.params_add(nparams, keys[i], vals[i])) != NX_SUCCESS)
                set_err(err, sizeof err, "NIXL refused backend param %s=%s (status %d %s)", keys[i], vals[i], s,
                        status_name(s));
        if (!err[0] && (s = X.create_backend(p->agent, "UCX", nparams, &p->backend)) != NX_SUCCESS) {
            p->backend = NULL;
            char shown[300] = "";
            for (Py_ssize_t i = 0; i < got; i++) {
                size_t used = strlen(shown);
                snprintf(shown + used, sizeof shown - used, "%s%s=%s", i ? ", " : "", keys[i], vals[i]);
            }
            set_err(err, sizeof err, "NIXL could not create the UCX backend of agent '%s' with params {%s} (status %d "
                    "%s; see NIXL's and UCX's log lines above)", p->name, shown, s, status_name(s));
        }
        if (nparams) X.destroy_params(nparams);
        if (!err[0] && (s = X.create_opt_args(&p->opt)) != NX_SUCCESS) {
            p->opt = NULL;
            set_err(err, sizeof err, "NIXL could not create optional args (status %d %s)", s, status_name(s));
        }
        if (!err[0] && (s = X.opt_args_add_backend(p->opt, p->backend)) != NX_SUCCESS)
            set_err(err, sizeof err, "NIXL could not select its UCX backend (status %d %s)", s, status_name(s));
        if (!err[0] && ((s = X.create_xfer_dlist(NX_MEM_DRAM, &p->ldl)) != NX_SUCCESS ||
                        (s = X.create_xfer_dlist(NX_MEM_DRAM, &p->rdl)) != NX_SUCCESS))
            set_err(err, sizeof err, "NIXL could not create descriptor lists (status %d %s)", s, status_name(s));
        if (err[0]) {
            teardown(p);
            p->closed = 1;
        }
        pthread_mutex_unlock(&p->mu);
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t i = 0; i < got; i++) { free(keys[i]); free(vals[i]); }
    if (bad) return -1;
    if (err[0]) { raise_msg(err); return -1; }
    return 0;
}

static int parse_u64(PyObject *o, const char *field, uint64_t *out) {
    PyObject *idx = PyNumber_Index(o);
    if (!idx) {
        PyErr_Clear();
        raise_fmt("%s: expected an int, got %.100s", field, Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(idx);
    Py_DECREF(idx);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        raise_fmt("%s: expected an int in [0, 2**64)", field);
        return -1;
    }
    *out = v;
    return 0;
}

/* register(addr, length): host memory this poster may write from or be written into. */
static PyObject *Poster_register(PyObject *self, PyObject *args) {
    Poster *p = (Poster *)self;
    PyObject *oa, *ol;
    uint64_t addr, len;
    if (!PyArg_ParseTuple(args, "OO:register", &oa, &ol)) return NULL;
    if (parse_u64(oa, "addr", &addr) || parse_u64(ol, "length", &len)) return NULL;
    if (len == 0) return raise_msg("register: length must be positive, got 0");
    if (addr == 0) return raise_msg("register: addr must not be NULL");
    if (addr + len < addr) return raise_fmt("register: 0x%llx + %llu passes 2**64", (unsigned long long)addr,
                                            (unsigned long long)len);
    char err[ERRLEN] = "";
    lock_py(p);
    if (check_open(p, "register")) { pthread_mutex_unlock(&p->mu); return NULL; }
    Ranges *g = &p->local;
    uint32_t at = 0;
    while (at < g->n && g->start[at] < addr) at++;
    if (g->n >= MAX_REGS) set_err(err, sizeof err, "register: %u registrations already, at most %u", g->n, MAX_REGS);
    else if ((at > 0 && g->end[at - 1] > addr) || (at < g->n && g->start[at] < addr + len)) {
        uint32_t o = at > 0 && g->end[at - 1] > addr ? at - 1 : at;
        set_err(err, sizeof err, "register: [0x%llx, 0x%llx) overlaps registration [0x%llx, 0x%llx)",
                (unsigned long long)addr, (unsigned long long)(addr + len), (unsigned long long)g->start[o],
                (unsigned long long)g->end[o]);
    } else {
        nx_h dl = NULL;
        int s;
        Py_BEGIN_ALLOW_THREADS
        s = X.create_reg_dlist(NX_MEM_DRAM, &dl);
        if (s == NX_SUCCESS) s = X.reg_dlist_add_desc(dl, (uintptr_t)addr, (size_t)len, 0, NULL, 0);
        if (s == NX_SUCCESS) s = X.register_mem(p->agent, dl, p->opt);
        if (dl) X.destroy_reg_dlist(dl);
        Py_END_ALLOW_THREADS
        if (s != NX_SUCCESS)
            set_err(err, sizeof err, "NIXL could not register [0x%llx, 0x%llx) with UCX (status %d %s: not mapped?)",
                    (unsigned long long)addr, (unsigned long long)(addr + len), s, status_name(s));
        else {
            uint32_t n = g->n + 1;
            uint64_t *ns = realloc(g->start, n * sizeof *ns);
            if (ns) g->start = ns;
            uint64_t *ne = realloc(g->end, n * sizeof *ne);
            if (ne) g->end = ne;
            uint64_t *nm = realloc(g->maxend, n * sizeof *nm);
            if (nm) g->maxend = nm;
            if (!ns || !ne || !nm) set_err(err, sizeof err, "out of memory for a registration");
            else {
                memmove(g->start + at + 1, g->start + at, (g->n - at) * sizeof *ns);
                memmove(g->end + at + 1, g->end + at, (g->n - at) * sizeof *ne);
                g->start[at] = addr;
                g->end[at] = addr + len;
                g->n = n;
                ranges_index(g);
            }
        }
    }
    pthread_mutex_unlock(&p->mu);
    if (err[0]) return raise_msg(err);
    Py_RETURN_NONE;
}

/* descriptor() -> bytes: this agent's NIXL metadata, for a peer's connect. */
static PyObject *Poster_descriptor(PyObject *self, PyObject *noargs) {
    Poster *p = (Poster *)self;
    void *data = NULL;
    size_t len = 0;
    int s;
    lock_py(p);
    if (check_open(p, "descriptor")) { pthread_mutex_unlock(&p->mu); return NULL; }
    s = X.get_local_md(p->agent, &data, &len);
    pthread_mutex_unlock(&p->mu);
    if (s != NX_SUCCESS) return raise_fmt("NIXL could not export agent '%s''s metadata (status %d %s)", p->name, s,
                                          status_name(s));
    PyObject *out = PyBytes_FromStringAndSize(data, (Py_ssize_t)len);
    free(data); /* malloc'd by the C API */
    return out;
}

/* connect(descriptor) -> peer slot. */
static PyObject *Poster_connect(PyObject *self, PyObject *arg) {
    Poster *p = (Poster *)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0) {
        PyErr_Clear();
        return raise_fmt("connect: descriptor must be bytes, got %.100s", Py_TYPE(arg)->tp_name);
    }
    if ((size_t)view.len > MAX_DESCRIPTOR) {
        Py_ssize_t n = view.len;
        PyBuffer_Release(&view);
        return raise_fmt("connect: descriptor of %zd bytes refused: at most %u accepted", n, MAX_DESCRIPTOR);
    }
    uint8_t *copy = malloc(view.len ? (size_t)view.len : 1);
    if (!copy) { PyBuffer_Release(&view); return PyErr_NoMemory(); }
    memcpy(copy, view.buf, view.len);
    size_t n = (size_t)view.len;
    PyBuffer_Release(&view);
    char err[ERRLEN] = "";
    long slot = -1;
    Parsed md;
    memset(&md, 0, sizeof md);
    lock_py(p);
    if (check_open(p, "connect")) { pthread_mutex_unlock(&p->mu); free(copy); return NULL; }
    Py_BEGIN_ALLOW_THREADS
    if (parse_descriptor(copy, n, &md, err, sizeof err) == 0) {
        long free_slot = -1, old_slot = -1;
        for (long i = 0; i < MAX_PEERS; i++) {
            Peer *pe = &p->peers[i];
            if (pe->state == SLOT_CONNECTED && strcmp(pe->name, md.name) == 0) { slot = i; break; }
            if (pe->state == SLOT_FREE && free_slot < 0) free_slot = i;
            if (pe->state == SLOT_DISCONNECTED && old_slot < 0) old_slot = i;
        }
        if (strcmp(md.name, p->name) == 0)
            set_err(err, sizeof err, "connect: the descriptor is this poster's own (agent '%s')", p->name);
        else if (slot >= 0) {
            set_err(err, sizeof err, "connect: agent '%s' is connected already as peer %ld (disconnect it first)",
                    md.name, slot);
            slot = -1;
        } else if ((slot = free_slot >= 0 ? free_slot : old_slot) < 0)
            set_err(err, sizeof err, "connect: %d peers connected already, at most %d", MAX_PEERS, MAX_PEERS);
        else {
            char *loaded_name = NULL;
            int s = X.load_remote_md(p->agent, copy, n, &loaded_name);
            if (s != NX_SUCCESS)
                set_err(err, sizeof err, "NIXL refused the descriptor of agent '%s' (loadRemoteMD status %d %s)",
                        md.name, s, status_name(s));
            else if (!loaded_name || strcmp(loaded_name, md.name) != 0) {
                set_err(err, sizeof err, "NIXL loaded agent '%s' from a descriptor naming '%s'",
                        loaded_name ? loaded_name : "(none)", md.name);
                X.invalidate_remote_md(p->agent, loaded_name ? loaded_name : md.name);
            } else {
                Peer *pe = &p->peers[slot];
                ranges_free(&pe->dram);
                free(pe->name);
                pe->name = strdup(md.name);
                if (!pe->name) {
                    set_err(err, sizeof err, "out of memory");
                    X.invalidate_remote_md(p->agent, md.name);
                } else {
                    pe->dram = md.dram;
                    memset(&md.dram, 0, sizeof md.dram);
                    pe->state = SLOT_CONNECTED;
                    pe->live = pe->abandoned = 0;
                }
            }
            free(loaded_name); /* strdup'd by the C API */
        }
    }
    ranges_free(&md.dram);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&p->mu);
    free(copy);
    if (err[0]) return raise_msg(err);
    return PyLong_FromLong(slot);
}

static int parse_peer(PyObject *o, uint32_t *out) {
    PyObject *idx = PyNumber_Index(o);
    if (!idx) { PyErr_Clear(); raise_fmt("peer: expected an int, got %.100s", Py_TYPE(o)->tp_name); return -1; }
    long v = PyLong_AsLong(idx);
    Py_DECREF(idx);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        raise_fmt("unknown peer: %s", "out of range (not a slot connect returned)");
        return -1;
    }
    if (v < 0 || v >= MAX_PEERS) {
        raise_fmt("unknown peer %ld (not a slot connect returned)", v);
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* Wait (GIL released, mu not held between tries) for the abandoned writes (of one peer, or all: -1) to end. */
static uint32_t drain(Poster *p, int peer, double seconds) {
    uint32_t left;
    double deadline = mono() + seconds;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        left = drive_abandoned(p, peer);
        pthread_mutex_unlock(&p->mu);
        if (!left || mono() >= deadline) return left;
        nap_us(200);
    }
}

/* disconnect(peer): forget a peer (NIXL drops its metadata and its UCX endpoint). */
static PyObject *Poster_disconnect(PyObject *self, PyObject *arg) {
    Poster *p = (Poster *)self;
    uint32_t peer;
    if (parse_peer(arg, &peer)) return NULL;
    lock_py(p);
    if (check_open(p, "disconnect")) { pthread_mutex_unlock(&p->mu); return NULL; }
    Peer *pe = &p->peers[peer];
    if (pe->state != SLOT_CONNECTED) {
        int never = pe->state == SLOT_FREE;
        pthread_mutex_unlock(&p->mu);
        return raise_fmt("disconnect: %s peer %u", never ? "unknown" : "already disconnected", peer);
    }
    if (pe->live) {
        uint32_t live = pe->live;
        pthread_mutex_unlock(&p->mu);
        return raise_fmt("disconnect: peer %u has %u writes posted and not released", peer, live);
    }
    pthread_mutex_unlock(&p->mu);
    uint32_t left;
    Py_BEGIN_ALLOW_THREADS
    left = drain(p, (int)peer, DRAIN_S);
    Py_END_ALLOW_THREADS
    lock_py(p);
    if (p->closed || !p->peers) {
        pthread_mutex_unlock(&p->mu);
        return raise_fmt("disconnect: the nixl poster '%s' was closed meanwhile", p->name);
    }
    pe = &p->peers[peer];
    if (!left && (pe->state != SLOT_CONNECTED || pe->live)) {
        pthread_mutex_unlock(&p->mu);
        return raise_fmt("disconnect: peer %u changed while its writes drained (a concurrent call)", peer);
    }
    if (left || pe->abandoned) {
        left = pe->abandoned;
        pthread_mutex_unlock(&p->mu);
        return raise_fmt("disconnect: %u abandoned writes to peer %u did not end within %.1f s; the peer stays "
                         "connected", left, peer, DRAIN_S);
    }
    /* NIXL may have dropped the peer itself (a disconnected remote): then invalidation finds nothing, fine. */
    X.invalidate_remote_md(p->agent, pe->name);
    free(pe->name);
    pe->name = NULL;
    ranges_free(&pe->dram);
    pe->state = SLOT_DISCONNECTED;
    pthread_mutex_unlock(&p->mu);
    Py_RETURN_NONE;
}

/* A field of write: a uint64 buffer (used in place) or a sequence of ints (copied). */
typedef struct {
    Py_buffer view;
    int has_view;
    uint64_t *own;
    const uint64_t *v;
    Py_ssize_t n;
} U64s;

static void u64s_release(U64s *a) {
    if (a->has_view) PyBuffer_Release(&a->view);
    free(a->own);
    memset(a, 0, sizeof *a);
}

static int is_u64_format(const char *f) {
    if (!f) return 0;
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return (f[0] == 'Q' || f[0] == 'L') && f[1] == 0;
}

static int u64s_get(PyObject *o, const char *field, U64s *a) {
    memset(a, 0, sizeof *a);
    if (PyObject_CheckBuffer(o) && !PyBytes_Check(o) && !PyByteArray_Check(o)) {
        if (PyObject_GetBuffer(o, &a->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
            if (a->view.itemsize == 8 && is_u64_format(a->view.format)) {
                a->has_view = 1;
                a->n = a->view.len / 8;
                a->v = a->view.buf;
                if (a->n > (Py_ssize_t)MAX_FRAGS) {
                    raise_fmt("%s: %zd fragments, at most %u", field, a->n, MAX_FRAGS);
                    u64s_release(a);
                    return -1;
                }
                return 0;
            }
            PyBuffer_Release(&a->view); /* another element type: read it as a sequence of ints */
        } else {
            PyErr_Clear();
        }
    }
    if (PyBytes_Check(o) || PyByteArray_Check(o) || PyUnicode_Check(o) || !PySequence_Check(o)) {
        raise_fmt("%s: expected a sequence of ints or a uint64 array, got %.100s", field, Py_TYPE(o)->tp_name);
        return -1;
    }
    Py_ssize_t n = PySequence_Size(o);
    if (n < 0) { PyErr_Clear(); raise_fmt("%s: has no length", field); return -1; }
    if (n > (Py_ssize_t)MAX_FRAGS) { raise_fmt("%s: %zd fragments, at most %u", field, n, MAX_FRAGS); return -1; }
    PyObject *seq = PySequence_Fast(o, field);
    if (!seq) { PyErr_Clear(); raise_fmt("%s: not a sequence", field); return -1; }
    n = PySequence_Fast_GET_SIZE(seq);
    a->own = malloc((n ? n : 1) * sizeof(uint64_t));
    if (!a->own) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        char name[64];
        snprintf(name, sizeof name, "%s[%zd]", field, i);
        if (parse_u64(PySequence_Fast_GET_ITEM(seq, i), name, &a->own[i])) {
            Py_DECREF(seq);
            u64s_release(a);
            return -1;
        }
    }
    Py_DECREF(seq);
    a->v = a->own;
    a->n = n;
    return 0;
}

/* write(peer, src, dst, lengths, timeout_s): one WRITE of every fragment, polled to its end with the GIL released. */
static PyObject *Poster_write(PyObject *self, PyObject *args) {
    Poster *p = (Poster *)self;
    PyObject *opeer, *osrc, *odst, *olen;
    double timeout_s = 10.0;
    uint32_t peer;
    if (!PyArg_ParseTuple(args, "OOOO|d:write", &opeer, &osrc, &odst, &olen, &timeout_s)) return NULL;
    if (!(timeout_s > 0) || !isfinite(timeout_s) || timeout_s > 1e6)
        return raise_fmt("write: timeout_s must be positive, finite and at most 1e6, got %g", timeout_s);
    if (parse_peer(opeer, &peer)) return NULL;
    U64s s, d, l;
    if (u64s_get(osrc, "src", &s)) return NULL;
    if (u64s_get(odst, "dst", &d)) { u64s_release(&s); return NULL; }
    if (u64s_get(olen, "lengths", &l)) { u64s_release(&s); u64s_release(&d); return NULL; }
    PyObject *out = NULL;
    if (s.n != d.n || s.n != l.n)
        raise_fmt("write: src, dst and lengths differ in length: %zd, %zd and %zd", s.n, d.n, l.n);
    else {
        char err[ERRLEN] = "";
        int rc, st = KVN_FAILED, timed_out = 0;
        void *h = NULL;
        Py_BEGIN_ALLOW_THREADS
        double t0 = mono(), deadline = t0 + timeout_s;
        rc = vt_post_write(p, peer, s.v, d.v, l.v, (uint32_t)s.n, &h, err, sizeof err);
        if (rc == 0) {
            for (;;) {
                st = vt_poll(p, h, err, sizeof err);
                if (st != KVN_PENDING) break;
                double now = mono();
                if (now >= deadline) { timed_out = 1; break; }
                if (now - t0 < 0.002) sched_yield(); /* hot: most writes end within microseconds */
                else nap_us(50);
            }
            vt_release(p, h); /* still pending (timed out): abandoned, driven to its end later */
        }
        Py_END_ALLOW_THREADS
        if (rc != 0) raise_msg(err);
        else if (timed_out)
            raise_fmt("the write of %zd fragments to peer %u did not end within %g s (abandoned: driven to its end by "
                      "later writes and by close)", s.n, peer, timeout_s);
        else if (st != KVN_DONE) raise_msg(err);
        else { Py_INCREF(Py_None); out = Py_None; }
    }
    u64s_release(&s);
    u64s_release(&d);
    u64s_release(&l);
    return out;
}

static void capsule_free(PyObject *cap) {
    PyObject *owner = PyCapsule_GetContext(cap);
    Py_XDECREF(owner);
}

/* capsule() -> PyCapsule(KVN_POSTER_CAPSULE) holding this poster's kvn_poster_ref; it keeps the poster alive. */
static PyObject *Poster_capsule(PyObject *self, PyObject *noargs) {
    Poster *p = (Poster *)self;
    lock_py(p);
    int bad = check_open(p, "capsule");
    pthread_mutex_unlock(&p->mu);
    if (bad) return NULL;
    PyObject *cap = PyCapsule_New(&p->ref, KVN_POSTER_CAPSULE, capsule_free);
    if (!cap) return NULL;
    Py_INCREF(self);
    if (PyCapsule_SetContext(cap, self) != 0) { Py_DECREF(self); Py_DECREF(cap); return NULL; }
    return cap;
}

/* close(): idempotent; refuses while writes are posted and not released; drains abandoned ones (bounded). */
static PyObject *Poster_close(PyObject *self, PyObject *noargs) {
    Poster *p = (Poster *)self;
    if (!p->mu_ready) Py_RETURN_NONE;
    lock_py(p);
    if (p->closed || !p->agent) { p->closed = 1; pthread_mutex_unlock(&p->mu); Py_RETURN_NONE; }
    if (p->live) {
        uint32_t live = p->live;
        pthread_mutex_unlock(&p->mu);
        return raise_fmt("close: %u writes of the nixl poster '%s' are posted and not released (poll and release "
                         "them first)", live, p->name);
    }
    pthread_mutex_unlock(&p->mu);
    uint32_t left;
    Py_BEGIN_ALLOW_THREADS
    left = drain(p, -1, DRAIN_S);
    Py_END_ALLOW_THREADS
    lock_py(p);
    if (p->closed) { pthread_mutex_unlock(&p->mu); Py_RETURN_NONE; }
    if (left || p->abandoned || p->live) {
        uint32_t a = p->abandoned, live = p->live;
        pthread_mutex_unlock(&p->mu);
        if (live) return raise_fmt("close: %u writes were posted while close drained (a concurrent call)", live);
        return raise_fmt("close: %u abandoned writes did not end within %.1f s; the poster stays open with its "
                         "registrations (close again later)", a, DRAIN_S);
    }
    p->closed = 1;
    Py_BEGIN_ALLOW_THREADS
    teardown(p);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&p->mu);
    Py_RETURN_NONE;
}

static void Poster_dealloc(PyObject *self) {
    Poster *p = (Poster *)self;
    if (p->mu_ready) {
        pthread_mutex_lock(&p->mu);
        if (!p->closed && p->agent) {
            /* No capsule is alive (each holds a reference), so nobody posts any more; what is still in flight
             * gets a short drain. A write that does not end leaves the agent and its registrations alive (leaked)
             * rather than freed under it. */
            int pending = 0;
            double deadline = mono() + 1.0;
            for (;;) {
                for (Handle *h = p->handles; h; h = h->next) handle_check(p, h);
                pending = 0;
                Handle *h = p->handles, *next;
                for (; h; h = next) {
                    next = h->next;
                    if (h->state == H_PENDING) pending++;
                    else handle_free(p, h);
                }
                if (!pending || mono() >= deadline) break;
                pthread_mutex_unlock(&p->mu);
                nap_us(200);
                pthread_mutex_lock(&p->mu);
            }
            if (!pending) teardown(p);
            p->closed = 1;
        }
        pthread_mutex_unlock(&p->mu);
        if (!p->agent) pthread_mutex_destroy(&p->mu);
    }
    Py_TYPE(self)->tp_free(self);
}

static PyObject *Poster_get_in_flight(PyObject *self, void *closure) {
    Poster *p = (Poster *)self;
    if (!p->mu_ready) return PyLong_FromLong(0);
    lock_py(p);
    uint32_t n = p->live + p->abandoned;
    pthread_mutex_unlock(&p->mu);
    return PyLong_FromUnsignedLong(n);
}

static PyObject *Poster_get_name(PyObject *self, void *closure) { return PyUnicode_FromString(((Poster *)self)->name); }

static PyObject *Poster_get_closed(PyObject *self, void *closure) {
    Poster *p = (Poster *)self;
    if (!p->mu_ready) Py_RETURN_TRUE;
    lock_py(p);
    int c = p->closed || !p->agent;
    pthread_mutex_unlock(&p->mu);
    return PyBool_FromLong(c);
}

static PyMethodDef Poster_methods[] = {
    {"register", Poster_register, METH_VARARGS, "register(addr, length): host memory to write from or into."},
    {"descriptor", Poster_descriptor, METH_NOARGS, "descriptor() -> bytes: this agent's NIXL metadata."},
    {"connect", Poster_connect, METH_O, "connect(descriptor) -> peer: load a peer's NIXL metadata (checked)."},
    {"disconnect", Poster_disconnect, METH_O, "disconnect(peer): forget a peer."},
    {"write", Poster_write, METH_VARARGS, "write(peer, src, dst, lengths, timeout_s=10.0): one WRITE, to its end."},
    {"capsule", Poster_capsule, METH_NOARGS, "capsule() -> PyCapsule named kvcore_native.poster (kvn_poster_ref)."},
    {"close", Poster_close, METH_NOARGS, "close(): drain abandoned writes, drop registrations and the agent."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Poster_getset[] = {
    {"in_flight", Poster_get_in_flight, NULL, "writes posted and not released, plus abandoned ones pending", NULL},
    {"name", Poster_get_name, NULL, "the NIXL agent name", NULL},
    {"closed", Poster_get_closed, NULL, "True once closed (or never initialized)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PosterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcore_native._nixl.Poster",
    .tp_basicsize = sizeof(Poster),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Poster(name, params): one NIXL agent (UCX backend) moving bytes by one-sided WRITE.",
    .tp_new = Poster_new,
    .tp_init = Poster_init,
    .tp_dealloc = Poster_dealloc,
    .tp_methods = Poster_methods,
    .tp_getset = Poster_getset,
};

static PyObject *is_loaded(PyObject *self, PyObject *noargs) { return PyBool_FromLong(loaded); }

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "load(path): open NIXL's C API (libnixl_capi.so) at path for this module."},
    {"loaded", is_loaded, METH_NOARGS, "loaded() -> bool: whether load() succeeded."},
    {"set_error_type", set_error_type, METH_O, "set_error_type(cls): the exception raised on refusal or failure."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvcore_native._nixl",
    .m_doc = "A kvn_poster over NIXL's C API, opened at run time.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__nixl(void) {
    if (PyType_Ready(&PosterType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&PosterType);
    if (PyModule_AddObject(m, "Poster", (PyObject *)&PosterType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_PEERS", MAX_PEERS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_REGISTRATIONS", MAX_REGS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_FRAGMENTS", MAX_FRAGS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_HANDLES", MAX_HANDLES) < 0 ||
        PyModule_AddIntConstant(m, "MAX_DESCRIPTOR", MAX_DESCRIPTOR) < 0 ||
        PyModule_AddStringConstant(m, "CAPSULE_NAME", KVN_POSTER_CAPSULE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
