/* kvcore_native._lane: the native per-request path of one process (issue 30's steps 2 and 3).
 *
 * A lane is one C thread that owns ZeroMQ sockets of its own (a ROUTER bound on loopback for the requests other
 * lanes send this one, a DEALER per lane this one asks) and moves KV through a poster (kvn_poster.h: NIXL or UCX
 * in C). No Python runs on its hops; Python only makes the engine's calls:
 *
 *   context side: admit(peer) -> token        a poster peer may ask this lane, presenting the token
 *                 offer(ticket, proof, layout, ids)  these source blocks answer the request with this ticket
 *                                             whose requester proves ``proof``
 *                 decline(ticket, why)        a request with this ticket is answered DECLINED (nothing moved:
 *                                             the requester asks again on its slower path)
 *                 withdraw(ticket)            the offer or decline is gone (False: its write is in flight)
 *   generation:   connect(endpoint) -> conn   a lane to ask
 *                 request(conn, token, ticket, proof, nonce, layout, ids, timeout_ms)
 *                 cancel(nonce)
 *   both:         completions(), wait(timeout_s), stats(), close()
 *
 * The context pairs a request with its offer by ticket (whichever comes first waits for the other, bounded in
 * count, bytes and time), checks that the request's proof is the offer's (kvcore: the ticket is a digest of the
 * request id, the proof one of its secret ticket; a request without the right proof is answered DECLINED and the
 * offer stays for its rightful requester, whose slower path refuses the other with its own error), checks that
 * the fragments agree, posts one WRITE from the offered blocks into the
 * requester's and answers with a RESULT that echoes the request's nonce; both sides queue a completion for
 * Python. Frames (little-endian):
 *   REQ    magic u32, type u8 = 1, 3 pad, token[16], ticket[16], nonce[16], n u32, timeout_ms u32,
 *          digest[16] (of the source layout the requester planned against), proof[16], then n x (dst u64, len u64)
 *   RESULT magic u32, type u8 = 2, status u8, 2 pad, nonce[16], ticket[16], errlen u32, 4 pad, err[errlen]
 *   CANCEL magic u32, type u8 = 3, 3 pad, token[16], ticket[16], nonce[16]
 * Everything a peer sends is checked before use: a frame of the wrong size or magic, an unknown token, a result
 * for no request of this lane's, is dropped and counted, never answered with data.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "kvn_poster.h"
#include "kvn_zmq.h"

#define MAGIC 0x314C564Bu /* "KVL1" */
enum { T_REQ = 1, T_RESULT = 2, T_CANCEL = 3 };
enum { S_OK = 0, S_FAILED = 1, S_CANCELLED = 2, S_TIMED_OUT = 3, S_DECLINED = 4 };
#define KEY 16
#define REQ_HEAD 96
#define RES_HEAD 48
#define CANCEL_BYTES 56
#define MAX_ERR 1024
#define MAX_FRAGS 131072
#define MAX_FRAME (REQ_HEAD + 16 * MAX_FRAGS)
#define MAX_TIMEOUT_MS 600000u
/* A requester waits this much longer than the request's timeout before it gives up on an answer: the writer's
 * own end of the wait (its answer) comes first. */
#define ANSWER_MARGIN_S 1.0
/* After that, how long a late answer is still taken (it settles what the timeout left in doubt). */
#define LATE_ANSWER_S 60.0
/* A write moves in pieces of about this many bytes (a fragment is never cut), one piece in flight per request, and
 * the thread serves its sockets between pieces: a request arriving beside a large one waits for one piece (16 MiB:
 * a few ms of copy over CMA), not for all of it. Lane(piece_bytes=...) sets another size. */
#define PIECE_BYTES (16u << 20)
/* While requests come and go beside a large write (one arrived beside it within BUSY_S), its pieces are a quarter as large:
 * the newcomers wait for a shorter copy. */
#define BUSY_S 0.01
#define MAX_LAYOUTS 256
#define MAX_LAYOUT_FRAGS 4096
#define MAX_TOKENS 4096
#define MAX_CONNS 4096
#define BUCKETS 4096

static double mono(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static PyObject *LaneError; /* kvcore_native.errors.NativeLaneError, set by set_error_type */

static PyObject *lane_error(const char *fmt, ...) {
    char msg[1200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    PyErr_SetString(LaneError ? LaneError : PyExc_RuntimeError, msg);
    return NULL;
}

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static unsigned bucket(const uint8_t *key) { return (unsigned)(get64(key) ^ get64(key + 8)) & (BUCKETS - 1); }

/* A source or destination layout: block b is fragments base[f] + b * stride[f] of size[f], f < nfrag. */
typedef struct { uint32_t nfrag; uint64_t blocks; uint64_t *base, *stride, *size; uint8_t digest[KEY]; } Layout;

/* Context side: one ticket's offer and/or request, joined when both came. */
typedef struct Job {
    struct Job *next;
    struct Job *anext, *aprev; /* the active list: joined (offer and request) or in flight */
    uint8_t ticket[KEY];
    int offered, requested, in_flight, active, withdrawn, declined;
    int cancelled;        /* its receiver cancelled it before any offer: the offer, when it comes, is refused */
    char *why;            /* declined: the reason told the requester */
    uint8_t odigest[KEY], rdigest[KEY]; /* the offer's source layout; the one the request planned against */
    uint8_t oproof[KEY], rproof[KEY];   /* what the offer wants proved; what the request proved */
    uint32_t n;           /* fragments of the offer (src, len) */
    uint64_t *src, *len;
    uint32_t rn;          /* fragments of the request (dst, rlen) */
    uint64_t *dst, *rlen;
    uint8_t nonce[KEY];
    uint8_t ident[256];
    int identlen;
    uint32_t peer;
    double expires;       /* a request waiting for its offer answers FAILED then */
    uint32_t sent, end;   /* fragments [sent, end) are the piece in flight; [0, sent) landed */
    void *handle;
    size_t bytes;         /* held for the byte cap */
} Job;

/* Generation side: one request asked and not answered yet. */
typedef struct Pending {
    struct Pending *next;
    uint8_t nonce[KEY], ticket[KEY], token[KEY];
    uint32_t conn;
    double deadline;
    int timed_out;         /* reported TIMED_OUT: kept until LATE_ANSWER_S for the final answer */
} Pending;

typedef struct Completion {
    struct Completion *next;
    int side;              /* 0: context, 1: generation */
    int status;
    uint32_t peer;         /* context: the requester's poster peer; generation: the connection */
    uint8_t ticket[KEY], nonce[KEY];
    char err[MAX_ERR + 1];
} Completion;

typedef struct Out { struct Out *next; uint32_t conn; size_t len; uint8_t data[]; } Out;

typedef struct { uint8_t token[KEY]; uint32_t peer; int used; } Token;
typedef struct { void *sock; int used, closing; uint32_t pending; } Conn; /* closing: closed once pending is 0 */

typedef struct {
    PyObject_HEAD
    PyObject *poster;          /* keeps the poster (and its capsule's pointer) alive */
    kvn_poster_ref *pr;
    pthread_mutex_t mu;
    pthread_cond_t cv;         /* completions queued */
    pthread_t thread;
    int inited, started, stop, closed, poked;
    int curve;                 /* 1: every socket speaks CURVE (the ROUTER as server, the DEALERs as clients) */
    uint8_t client_public[32], client_secret[32];
    void *router, *wake_rx, *wake_tx;
    char endpoint[256];
    Layout layouts[MAX_LAYOUTS];
    int nlayouts;
    Token tokens[MAX_TOKENS];
    int tokens_hi;             /* tokens[tokens_hi:] are unused */
    Conn conns[MAX_CONNS];
    int nconns;
    Job *jobs[BUCKETS];
    Job *active;               /* jobs the thread starts or polls */
    Pending *pend[BUCKETS];
    Completion *done_head, *done_tail;
    Out *out_head, *out_tail;
    size_t job_count, job_bytes, pend_count, max_jobs, max_job_bytes, max_pending;
    uint64_t piece_bytes;
    double last_request;       /* when the last request arrived (pieces turn fine while requests come) */
    double next_expiry;
    uint64_t st_requests, st_results_sent, st_results_received, st_rejected, st_ok, st_failed, st_posts;
    uint64_t st_proof_declines; /* requests declined for a proof that is not their offer's */
    char thread_error[256];
    uint8_t *rxbuf;
} Lane;

static void lock(Lane *l) {
    if (pthread_mutex_trylock(&l->mu) == 0) return;
    if (PyGILState_Check()) {  /* the lane's thread may hold it for a moment: never wait with the GIL */
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&l->mu);
        Py_END_ALLOW_THREADS
    } else {
        pthread_mutex_lock(&l->mu);
    }
}
static void unlock(Lane *l) { pthread_mutex_unlock(&l->mu); }

/* lock, for a Python call: 0 with an error set when the lane closed meanwhile. */
static int lock_open(Lane *l) {
    lock(l);
    if (!l->closed) return 1;
    unlock(l);
    lane_error("the lane is closed");
    return 0;
}
static void wake(Lane *l) { Z.send(l->wake_tx, "", 0, Z_DONTWAIT); } /* under mu: one writer at a time */

/* --- tables (callers hold mu) -------------------------------------------------------------------------------- */

static Job *job_find(Lane *l, const uint8_t *ticket) {
    for (Job *j = l->jobs[bucket(ticket)]; j; j = j->next)
        if (!memcmp(j->ticket, ticket, KEY)) return j;
    return NULL;
}

static Job *job_new(Lane *l, const uint8_t *ticket) {
    if (l->job_count >= l->max_jobs) return NULL;
    Job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    memcpy(j->ticket, ticket, KEY);
    unsigned b = bucket(ticket);
    j->next = l->jobs[b];
    l->jobs[b] = j;
    l->job_count++;
    return j;
}

static void activate(Lane *l, Job *j) {
    if (j->active) return;
    j->active = 1;
    j->aprev = NULL;
    j->anext = l->active;
    if (l->active) l->active->aprev = j;
    l->active = j;
}

/* Take a job off the active list (a no-op when it is not on it). */
static void deactivate(Lane *l, Job *j) {
    if (!j->active) return;
    if (j->aprev) j->aprev->anext = j->anext; else l->active = j->anext;
    if (j->anext) j->anext->aprev = j->aprev;
    j->active = 0;
    j->aprev = j->anext = NULL;
}

static void job_free(Lane *l, Job *j) {
    deactivate(l, j);
    Job **p = &l->jobs[bucket(j->ticket)];
    while (*p && *p != j) p = &(*p)->next;
    if (*p) *p = j->next;
    l->job_count--;
    l->job_bytes -= j->bytes;
    free(j->src); free(j->len); free(j->dst); free(j->rlen); free(j->why);
    free(j);
}

static Pending *pend_find(Lane *l, const uint8_t *nonce) {
    for (Pending *p = l->pend[bucket(nonce)]; p; p = p->next)
        if (!memcmp(p->nonce, nonce, KEY)) return p;
    return NULL;
}

static void pend_free(Lane *l, Pending *q) {
    Pending **p = &l->pend[bucket(q->nonce)];
    while (*p && *p != q) p = &(*p)->next;
    if (*p) *p = q->next;
    l->pend_count--;
    if (q->conn < (uint32_t)l->nconns && l->conns[q->conn].pending) l->conns[q->conn].pending--;
    free(q);
}

static void complete(Lane *l, int side, uint32_t peer, const uint8_t *ticket, const uint8_t *nonce, int status,
                     const char *err) {
    Completion *c = calloc(1, sizeof *c);
    if (!c) return; /* out of memory: the Python side's deadline ends the request */
    c->side = side;
    c->status = status;
    c->peer = peer;
    memcpy(c->ticket, ticket, KEY);
    memcpy(c->nonce, nonce, KEY);
    snprintf(c->err, sizeof c->err, "%s", err ? err : "");
    if (l->done_tail) l->done_tail->next = c; else l->done_head = c;
    l->done_tail = c;
    if (status == S_OK) l->st_ok++; else l->st_failed++;
    pthread_cond_broadcast(&l->cv);
}

static int token_peer(Lane *l, const uint8_t *token, uint32_t *peer) {
    for (int i = 0; i < l->tokens_hi; i++)
        if (l->tokens[i].used && !memcmp(l->tokens[i].token, token, KEY)) { *peer = l->tokens[i].peer; return 1; }
    return 0;
}

/* --- the thread ---------------------------------------------------------------------------------------------- */

/* Answer a request (context side) on the ROUTER. */
static void send_result(Lane *l, const uint8_t *ident, int identlen, const uint8_t *nonce, const uint8_t *ticket,
                        int status, const char *err) {
    uint8_t f[RES_HEAD + MAX_ERR];
    size_t el = err ? strnlen(err, MAX_ERR) : 0;
    memset(f, 0, RES_HEAD);
    put32(f, MAGIC);
    f[4] = T_RESULT;
    f[5] = (uint8_t)status;
    memcpy(f + 8, nonce, KEY);
    memcpy(f + 24, ticket, KEY);
    put32(f + 40, (uint32_t)el);
    if (el) memcpy(f + RES_HEAD, err, el);
    if (Z.send(l->router, ident, identlen, Z_SNDMORE | Z_DONTWAIT) >= 0) Z.send(l->router, f, RES_HEAD + el, Z_DONTWAIT);
    l->st_results_sent++;
}

/* Post the piece of an in-flight job that starts at fragment j->sent (the poster is called outside mu): 1, or 0
 * with the reason in err. */
static int post_piece(Lane *l, Job *j, char *err, size_t errlen) {
    uint64_t bytes = 0, cap = mono() - l->last_request < BUSY_S ? l->piece_bytes / 4 : l->piece_bytes;
    uint32_t k = j->sent;
    do bytes += j->len[k++];
    while (k < j->n && bytes + j->len[k] <= cap);
    j->end = k;
    uint32_t peer = j->peer, a = j->sent;
    unlock(l);
    void *h = NULL;
    int rc = l->pr->vt->post_write(l->pr->self, peer, j->src + a, j->dst + a, j->len + a, k - a, &h, err, errlen);
    pthread_mutex_lock(&l->mu);
    l->st_posts++;
    if (rc == 0) { j->handle = h; return 1; }
    if (!err[0]) snprintf(err, errlen, "the %s poster refused the write", l->pr->vt->backend);
    return 0;
}

/* Drop a job's request part (not in flight), keeping its offer: off the active list, its destinations freed. */
static void unrequest(Lane *l, Job *j) {
    deactivate(l, j);
    free(j->dst); free(j->rlen);
    j->dst = j->rlen = NULL;
    size_t bytes = 16 * (size_t)j->rn;
    l->job_bytes -= bytes;
    j->bytes -= bytes;
    j->requested = 0;
    j->rn = 0;
}

/* A job whose offer and request both came: check they agree, then post (outside mu). The lane's thread only,
 * under mu on entry and exit; the job is freed when it failed. */
static void start_job(Lane *l, Job *j) {
    char err[512] = "";
    if (memcmp(j->rproof, j->oproof, KEY)) {
        /* Not the offer's requester: DECLINED (nothing moved; its slower path refuses it with its own error), and
         * the offer waits for the rightful request as if this one never came. */
        send_result(l, j->ident, j->identlen, j->nonce, j->ticket, S_DECLINED,
                    "the request's proof is not the one its offer wants: ask on the control plane");
        l->st_proof_declines++;
        unrequest(l, j);
        return;
    }
    if (memcmp(j->rdigest, j->odigest, KEY)) {
        snprintf(err, sizeof err, "the request was planned against another source layout than the offer's");
    } else if (j->rn != j->n) {
        snprintf(err, sizeof err, "the request has %u fragments, the offer %u (layouts differ)", j->rn, j->n);
    } else {
        for (uint32_t i = 0; i < j->n; i++)
            if (j->rlen[i] != j->len[i]) {
                snprintf(err, sizeof err, "fragment %u: the request's is %llu bytes, the offer's %llu", i,
                         (unsigned long long)j->rlen[i], (unsigned long long)j->len[i]);
                break;
            }
    }
    if (!err[0]) {
        j->in_flight = 1;
        j->sent = 0;
        if (post_piece(l, j, err, sizeof err)) return;
        j->in_flight = 0;
    }
    send_result(l, j->ident, j->identlen, j->nonce, j->ticket, S_FAILED, err);
    complete(l, 0, j->peer, j->ticket, j->nonce, S_FAILED, err);
    job_free(l, j);
}

static void on_request(Lane *l, const uint8_t *ident, int identlen, const uint8_t *f, size_t len) {
    uint32_t n = get32(f + 56), timeout_ms = get32(f + 60), peer;
    if (n == 0 || n > MAX_FRAGS || len != REQ_HEAD + 16 * (size_t)n || identlen > 255 ||
        !token_peer(l, f + 8, &peer)) { l->st_rejected++; return; }
    l->st_requests++;
    if (l->active) l->last_request = mono(); /* it came beside a write: that write's next pieces turn fine */
    const uint8_t *ticket = f + 24, *nonce = f + 40;
    Job *j = job_find(l, ticket);
    if (j && j->declined && !j->requested) {
        send_result(l, ident, identlen, nonce, ticket, S_DECLINED, j->why);
        job_free(l, j);
        return;
    }
    if (j && j->cancelled && !j->requested) j->cancelled = 0; /* asked again: the request is live once more */
    if (j && j->requested && !j->offered) { /* two requesters before the offer: the newcomer takes the slower path,
                                             * which tells the rightful one from the other (a first comer cannot
                                             * lock the rightful requester out; the offer declines a wrong one) */
        send_result(l, ident, identlen, nonce, ticket, S_DECLINED,
                    "another request for this ticket waits on the lane: ask on the control plane");
        return;
    }
    size_t bytes = 16 * (size_t)n;
    const char *refuse = NULL;
    if (j && j->requested) refuse = "a request with this ticket is already being served";
    else if (l->job_bytes + bytes > l->max_job_bytes) refuse = "the lane holds too many waiting request bytes";
    else if (!j && !(j = job_new(l, ticket))) refuse = "the lane holds too many waiting requests";
    if (refuse) { send_result(l, ident, identlen, nonce, ticket, S_FAILED, refuse); return; }
    j->dst = malloc(8 * (size_t)n);
    j->rlen = malloc(8 * (size_t)n);
    if (!j->dst || !j->rlen) {
        free(j->dst); free(j->rlen); j->dst = j->rlen = NULL;
        send_result(l, ident, identlen, nonce, ticket, S_FAILED, "out of memory");
        if (!j->offered) job_free(l, j);
        return;
    }
    for (uint32_t i = 0; i < n; i++) { j->dst[i] = get64(f + REQ_HEAD + 16 * i); j->rlen[i] = get64(f + REQ_HEAD + 16 * i + 8); }
    memcpy(j->rdigest, f + 64, KEY);
    memcpy(j->rproof, f + 80, KEY);
    j->requested = 1;
    j->rn = n;
    j->bytes += bytes;
    l->job_bytes += bytes;
    memcpy(j->nonce, nonce, KEY);
    memcpy(j->ident, ident, identlen);
    j->identlen = identlen;
    j->peer = peer;
    if (timeout_ms == 0 || timeout_ms > MAX_TIMEOUT_MS) timeout_ms = MAX_TIMEOUT_MS;
    j->expires = mono() + timeout_ms / 1000.0;
    if (j->expires < l->next_expiry) l->next_expiry = j->expires;
    if (j->offered) activate(l, j);
}

static void on_cancel(Lane *l, const uint8_t *ident, int identlen, const uint8_t *f, size_t len) {
    uint32_t peer;
    if (len != CANCEL_BYTES || !token_peer(l, f + 8, &peer)) { l->st_rejected++; return; }
    Job *j = job_find(l, f + 24);
    if (!j || !j->requested || j->in_flight || memcmp(j->nonce, f + 40, KEY) || j->peer != peer) return;
    send_result(l, ident, identlen, j->nonce, j->ticket, S_CANCELLED, "cancelled by the receiver");
    if (j->offered || j->declined) {
        if (j->offered) complete(l, 0, j->peer, j->ticket, j->nonce, S_CANCELLED, "cancelled by the receiver");
        job_free(l, j);
        return;
    }
    /* Not offered yet: a mark stays until the request's timeout, so the offer that comes is told (offer() returns
     * False) and the sender ends the request instead of waiting for a receiver that is gone. */
    free(j->dst); free(j->rlen);
    j->dst = j->rlen = NULL;
    l->job_bytes -= j->bytes;
    j->bytes = 0;
    j->requested = 0;
    j->cancelled = 1;
    j->rn = 0;
}

static void on_result(Lane *l, uint32_t conn, const uint8_t *f, size_t len) {
    if (len < RES_HEAD) { l->st_rejected++; return; }
    uint32_t el = get32(f + 40);
    Pending *p = pend_find(l, f + 8);
    if (el > MAX_ERR || len != RES_HEAD + el || (f[5] != S_OK && f[5] != S_FAILED && f[5] != S_CANCELLED && f[5] != S_DECLINED) || !p || p->conn != conn ||
        memcmp(p->ticket, f + 24, KEY)) { l->st_rejected++; return; }
    char err[MAX_ERR + 1];
    memcpy(err, f + RES_HEAD, el);
    err[el] = 0;
    l->st_results_received++;
    complete(l, 1, p->conn, p->ticket, p->nonce, f[5], err);
    pend_free(l, p);
}

/* Requests that waited too long for their offer, and results that did not come in time (under mu). */
static void expire(Lane *l, double now) {
    double next = now + 3600;
    for (int b = 0; b < BUCKETS; b++) {
        for (Job *j = l->jobs[b], *nx; j; j = nx) {
            nx = j->next;
            if (j->cancelled && !j->requested) {
                if (j->expires <= now) job_free(l, j);
                else if (j->expires < next) next = j->expires;
                continue;
            }
            if (!j->requested || j->in_flight) continue;
            if (j->declined) {
                send_result(l, j->ident, j->identlen, j->nonce, j->ticket, S_DECLINED, j->why);
                job_free(l, j);
            } else if (j->withdrawn) { /* no completion: Python withdrew it and knows */
                send_result(l, j->ident, j->identlen, j->nonce, j->ticket, S_CANCELLED, "withdrawn by the sender");
                job_free(l, j);
            } else if (j->expires <= now) {
                send_result(l, j->ident, j->identlen, j->nonce, j->ticket, S_FAILED,
                            "no offer for this ticket within the request's timeout");
                if (j->offered) complete(l, 0, j->peer, j->ticket, j->nonce, S_FAILED, "the request's timeout passed");
                job_free(l, j);
            } else if (j->expires < next) next = j->expires;
        }
        for (Pending *p = l->pend[b], *nx; p; p = nx) {
            nx = p->next;
            if (p->deadline <= now && p->timed_out) {
                pend_free(l, p); /* no final answer came: the requester's fencing settles it */
            } else if (p->deadline <= now) {
                complete(l, 1, p->conn, p->ticket, p->nonce, S_TIMED_OUT,
                         "no result within the request's timeout (the write may still land)");
                p->timed_out = 1;
                p->deadline = now + LATE_ANSWER_S;
                if (p->deadline < next) next = p->deadline;
            } else if (p->deadline < next) next = p->deadline;
        }
    }
    l->next_expiry = next;
}

/* Start the joined jobs and poll the writes in flight (under mu; the poster is called outside it). Returns how
 * many writes are still in flight. A job in flight is the thread's alone: Python's calls leave it be. */
static int drive(Lane *l) {
    for (;;) { /* start_job posts (in flight) or frees: each pass takes one job off the "to start" set */
        Job *j = l->active;
        while (j && (j->in_flight || j->withdrawn)) j = j->anext;
        if (!j) break;
        start_job(l, j);
    }
    int left = 0;
    for (Job *j = l->active, *nx; j; j = nx) {
        nx = j->anext;
        if (!j->in_flight || !j->handle) continue;
        char err[512] = "";
        void *h = j->handle;
        unlock(l);
        int st = l->pr->vt->poll(l->pr->self, h, err, sizeof err);
        if (st != KVN_PENDING) l->pr->vt->release(l->pr->self, h);
        pthread_mutex_lock(&l->mu);
        nx = j->anext; /* j itself is ours while in flight; its neighbours may have changed */
        if (st == KVN_PENDING) { left++; continue; }
        j->handle = NULL;
        if (st == KVN_DONE && j->end < j->n) { /* the next piece, once this turn served the sockets */
            j->sent = j->end;
            if (post_piece(l, j, err, sizeof err)) { left++; nx = j->anext; continue; }
            st = KVN_FAILED;
            nx = j->anext;
        }
        if (st == KVN_FAILED && j->sent) {
            char why[512];
            snprintf(why, sizeof why, "after %u of %u fragments: %s", j->sent, j->n, err);
            snprintf(err, sizeof err, "%s", why);
        }
        int status = st == KVN_DONE ? S_OK : S_FAILED;
        send_result(l, j->ident, j->identlen, j->nonce, j->ticket, status, err);
        complete(l, 0, j->peer, j->ticket, j->nonce, status, err);
        job_free(l, j);
    }
    return left;
}

static void *run(void *arg) {
    Lane *l = arg;
    zpollitem items[2 + MAX_CONNS];
    uint32_t conn_of[2 + MAX_CONNS];
    uint8_t ident[256];
    int in_flight = 0;
    pthread_mutex_lock(&l->mu);
    for (;;) {
        if (l->stop) break;
        for (int c = 0; c < l->nconns; c++) /* connections Python let go, once nothing waits for an answer there */
            if (l->conns[c].used && l->conns[c].closing && !l->conns[c].pending) {
                Z.close(l->conns[c].sock);
                l->conns[c] = (Conn){0};
            }
        int n = 0;
        items[n++] = (zpollitem){l->wake_rx, 0, Z_POLLIN, 0};
        items[n++] = (zpollitem){l->router, 0, Z_POLLIN, 0};
        for (int c = 0; c < l->nconns; c++)
            if (l->conns[c].used) { conn_of[n] = (uint32_t)c; items[n++] = (zpollitem){l->conns[c].sock, 0, Z_POLLIN, 0}; }
        double now = mono();
        long timeout = in_flight ? 0 : (long)((l->next_expiry - now) * 1000) + 1;
        if (timeout > 50) timeout = 50;
        if (timeout < 0) timeout = 0;
        pthread_mutex_unlock(&l->mu);
        if (in_flight) sched_yield(); /* writes in flight are polled without a pause, as an agent's caller does */
        int rc = Z.poll(items, n, timeout);
        pthread_mutex_lock(&l->mu);
        if (rc < 0 && Z.errno_() != EINTR) {
            snprintf(l->thread_error, sizeof l->thread_error, "zmq_poll: %s", Z.strerror(Z.errno_()));
            break;
        }
        if (rc > 0 && items[0].revents) while (Z.recv(l->wake_rx, ident, sizeof ident, Z_DONTWAIT) >= 0) {}
        while (l->out_head) { /* requests and cancels Python queued */
            Out *o = l->out_head;
            int sent = o->conn < (uint32_t)l->nconns && l->conns[o->conn].used &&
                       Z.send(l->conns[o->conn].sock, o->data, o->len, Z_DONTWAIT) >= 0;
            Pending *p = !sent && o->data[4] == T_REQ ? pend_find(l, o->data + 40) : NULL;
            if (p) { /* never sent: nothing can land */
                complete(l, 1, p->conn, p->ticket, p->nonce, S_FAILED, "the request could not be sent to the lane");
                pend_free(l, p);
            }
            l->out_head = o->next;
            if (!l->out_head) l->out_tail = NULL;
            free(o);
        }
        if (rc > 0 && items[1].revents) {
            for (int k = 0; k < 256; k++) {
                int il = Z.recv(l->router, ident, sizeof ident, Z_DONTWAIT);
                if (il < 0) break;
                int more = 0;
                size_t ml = sizeof more;
                Z.getsockopt(l->router, Z_RCVMORE, &more, &ml);
                if (!more) { l->st_rejected++; continue; }
                int fl = Z.recv(l->router, l->rxbuf, MAX_FRAME, Z_DONTWAIT);
                Z.getsockopt(l->router, Z_RCVMORE, &more, &ml);
                int extra = 0;
                while (more) { /* a multipart message of more than one body: not ours */
                    Z.recv(l->router, ident, 0, Z_DONTWAIT);
                    extra = 1;
                    Z.getsockopt(l->router, Z_RCVMORE, &more, &ml);
                }
                if (fl < 8 || fl > MAX_FRAME || extra || il > (int)sizeof ident || get32(l->rxbuf) != MAGIC) {
                    l->st_rejected++;
                    continue;
                }
                if (l->rxbuf[4] == T_REQ && fl >= REQ_HEAD) on_request(l, ident, il, l->rxbuf, (size_t)fl);
                else if (l->rxbuf[4] == T_CANCEL) on_cancel(l, ident, il, l->rxbuf, (size_t)fl);
                else l->st_rejected++;
            }
        }
        for (int i = 2; rc > 0 && i < n; i++) {
            if (!items[i].revents) continue;
            uint32_t c = conn_of[i];
            for (int k = 0; k < 256 && c < (uint32_t)l->nconns && l->conns[c].used; k++) {
                int fl = Z.recv(l->conns[c].sock, l->rxbuf, MAX_ERR + RES_HEAD, Z_DONTWAIT);
                if (fl < 0) break;
                if (fl > MAX_ERR + RES_HEAD || get32(l->rxbuf) != MAGIC || l->rxbuf[4] != T_RESULT) { l->st_rejected++; continue; }
                on_result(l, c, l->rxbuf, (size_t)fl);
            }
        }
        in_flight = drive(l);
        if (mono() >= l->next_expiry) expire(l, mono());
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

/* --- the Python type ----------------------------------------------------------------------------------------- */

static void lane_shutdown(Lane *l) {
    if (l->started) {
        lock(l);
        l->stop = 1;
        wake(l);
        unlock(l);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(l->thread, NULL);
        Py_END_ALLOW_THREADS
        l->started = 0;
    }
    lock(l); /* a call racing with close finds the lane closed once it has the lock */
    if (l->closed) { unlock(l); return; }
    l->closed = 1;
    pthread_cond_broadcast(&l->cv); /* threads in wait() return */
    /* Writes still in flight are handed back to the poster, which drives them to their end before its close. */
    for (int b = 0; b < BUCKETS; b++)
        while (l->jobs[b]) {
            Job *j = l->jobs[b];
            if (j->in_flight && j->handle) l->pr->vt->release(l->pr->self, j->handle);
            job_free(l, j);
        }
    for (int b = 0; b < BUCKETS; b++) while (l->pend[b]) pend_free(l, l->pend[b]);
    while (l->done_head) { Completion *c = l->done_head; l->done_head = c->next; free(c); }
    l->done_tail = NULL;
    while (l->out_head) { Out *o = l->out_head; l->out_head = o->next; free(o); }
    for (int c = 0; c < l->nconns; c++) if (l->conns[c].used) Z.close(l->conns[c].sock);
    if (l->router) Z.close(l->router);
    if (l->wake_rx) Z.close(l->wake_rx);
    if (l->wake_tx) Z.close(l->wake_tx);
    l->router = l->wake_rx = l->wake_tx = NULL;
    for (int i = 0; i < l->nlayouts; i++) { free(l->layouts[i].base); free(l->layouts[i].stride); free(l->layouts[i].size); }
    l->nlayouts = 0;
    free(l->rxbuf);
    l->rxbuf = NULL;
    unlock(l);
}

static void Lane_dealloc(Lane *l) {
    if (l->inited) {
        lane_shutdown(l);
        pthread_mutex_destroy(&l->mu);
        pthread_cond_destroy(&l->cv);
    }
    Py_XDECREF(l->poster);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

enum { Z_CURVE_SERVER = 47, Z_CURVE_PUBLICKEY = 48, Z_CURVE_SECRETKEY = 49, Z_CURVE_SERVERKEY = 50 };

/* A 32-byte CURVE key from bytes (None: 0, no key), or -1 with an error. */
static int curve_key(PyObject *o, uint8_t *key, const char *what) {
    if (o == Py_None) return 0;
    char *buf;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(o, &buf, &n) != 0) return -1;
    if (n != 32) { lane_error("%s must be a 32-byte CURVE key, got %zd bytes", what, n); return -1; }
    memcpy(key, buf, 32);
    return 1;
}

/* Lane(poster, capsule, bind, max_jobs, max_job_bytes, max_pending, server_secret, client_public, client_secret,
 * piece_bytes): the three keys are 32-byte CURVE keys, or all None (no encryption). */
static int Lane_init(Lane *l, PyObject *args, PyObject *kw) {
    PyObject *poster, *cap, *oss, *ocp, *ocs;
    const char *bind;
    Py_ssize_t max_jobs, max_job_bytes, max_pending;
    unsigned long long piece_bytes = PIECE_BYTES;
    uint8_t server_secret[32];
    if (!PyArg_ParseTuple(args, "OOsnnnOOO|K", &poster, &cap, &bind, &max_jobs, &max_job_bytes, &max_pending, &oss,
                          &ocp, &ocs, &piece_bytes))
        return -1;
    if (piece_bytes < 4096) { lane_error("piece_bytes must be at least 4096, got %llu", piece_bytes); return -1; }
    int k1 = curve_key(oss, server_secret, "server_secret"), k2 = curve_key(ocp, l->client_public, "client_public"),
        k3 = curve_key(ocs, l->client_secret, "client_secret");
    if (k1 < 0 || k2 < 0 || k3 < 0) return -1;
    if (k1 != k2 || k2 != k3) { lane_error("CURVE needs all three keys, or none"); return -1; }
    l->curve = k1;
    if (l->inited) { lane_error("a lane is initialized once"); return -1; }
    if (!zctx) { lane_error("libzmq is not loaded: call load() first"); return -1; }
    kvn_poster_ref *pr = PyCapsule_GetPointer(cap, KVN_POSTER_CAPSULE);
    if (!pr) return -1;
    if (!pr->vt || pr->vt->abi != KVN_POSTER_ABI) {
        lane_error("the poster speaks poster ABI %d, this lane %d", pr->vt ? pr->vt->abi : -1, KVN_POSTER_ABI);
        return -1;
    }
    if (max_jobs < 1 || max_job_bytes < 1 || max_pending < 1) { lane_error("the lane's caps must be positive"); return -1; }
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    l->inited = 1;
    Py_INCREF(poster);
    l->poster = poster;
    l->pr = pr;
    l->max_jobs = (size_t)max_jobs;
    l->max_job_bytes = (size_t)max_job_bytes;
    l->max_pending = (size_t)max_pending;
    l->piece_bytes = piece_bytes;
    l->next_expiry = mono() + 3600;
    l->rxbuf = malloc(MAX_FRAME);
    char addr[64];
    size_t n = sizeof l->endpoint;
    snprintf(addr, sizeof addr, "inproc://kvcore-native-lane-%p", (void *)l);
    l->router = kvn_socket(Z_ROUTER, MAX_FRAME);
    l->wake_rx = kvn_socket(Z_PAIR, 64);
    l->wake_tx = kvn_socket(Z_PAIR, 64);
    const char *bad = NULL;
    if (!l->rxbuf) bad = "out of memory";
    else if (!l->router || !l->wake_rx || !l->wake_tx) bad = "zmq_socket";
    else if (l->curve && (Z.setsockopt(l->router, Z_CURVE_SERVER, &(int){1}, sizeof(int)) != 0 ||
                          Z.setsockopt(l->router, Z_CURVE_SECRETKEY, server_secret, 32) != 0)) bad = "CURVE";
    else if (Z.bind(l->router, bind) != 0) bad = "bind";
    else if (Z.getsockopt(l->router, Z_LAST_ENDPOINT, l->endpoint, &n) != 0) bad = "its endpoint";
    else if (Z.bind(l->wake_rx, addr) != 0 || Z.connect(l->wake_tx, addr) != 0) bad = "inproc wake-up";
    if (bad) {
        lane_error("lane: %s failed%s%s (bind %.200s)", bad, l->rxbuf ? ": " : "", l->rxbuf ? Z.strerror(Z.errno_()) : "", bind);
        lane_shutdown(l);
        return -1;
    }
    int rc = pthread_create(&l->thread, NULL, run, l);
    if (rc) { errno = rc; PyErr_SetFromErrno(PyExc_OSError); lane_shutdown(l); return -1; }
    l->started = 1;
    return 0;
}

static int check_open(Lane *l) {
    if (!l->poster) { lane_error("the lane was not initialized"); return 0; }
    if (l->closed) { lane_error("the lane is closed"); return 0; }
    return 1;
}

static int get_key(PyObject *o, uint8_t *key, const char *what) {
    Py_buffer b;
    if (PyObject_GetBuffer(o, &b, PyBUF_SIMPLE) != 0) return 0;
    int ok = b.len == KEY;
    if (ok) memcpy(key, b.buf, KEY);
    PyBuffer_Release(&b);
    if (!ok) lane_error("%s must be %d bytes", what, KEY);
    return ok;
}

/* A contiguous buffer of n uint64 (block ids), or an error. */
static int get_u64s(PyObject *o, Py_buffer *b, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return 0;
    const char *fmt = b->format ? b->format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
    if (b->itemsize != 8 || !(fmt[0] == 'Q' || fmt[0] == 'L' || fmt[0] == 'q' || fmt[0] == 'l') || fmt[1]) {
        PyBuffer_Release(b);
        lane_error("%s must be a contiguous buffer of 64-bit integers (numpy uint64 or int64)", what);
        return 0;
    }
    return 1;
}

/* Fragments of blocks ids[0:n] in layout k: out arrays of n * nfrag (malloc'd), or an error (GIL held). */
static int expand(Lane *l, int k, const uint64_t *ids, Py_ssize_t n, uint64_t **addr, uint64_t **size, uint32_t *count) {
    if (k < 0 || k >= l->nlayouts) { lane_error("unknown layout %d", k); return 0; }
    Layout *y = &l->layouts[k];
    if (n <= 0 || (uint64_t)n * y->nfrag > MAX_FRAGS) {
        lane_error("%zd blocks of %u fragments: a lane request holds 1 to %d fragments", n, y->nfrag, MAX_FRAGS);
        return 0;
    }
    size_t m = (size_t)n * y->nfrag;
    *addr = malloc(8 * m);
    *size = malloc(8 * m);
    if (!*addr || !*size) { free(*addr); free(*size); PyErr_NoMemory(); return 0; }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t b = ids[i];
        if (b >= y->blocks) {
            free(*addr); free(*size);
            lane_error("block id %llu is outside the layout's %llu blocks", (unsigned long long)(int64_t)b,
                       (unsigned long long)y->blocks);
            return 0;
        }
        for (uint32_t f = 0; f < y->nfrag; f++) {
            (*addr)[i * y->nfrag + f] = y->base[f] + b * y->stride[f];
            (*size)[i * y->nfrag + f] = y->size[f];
        }
    }
    *count = (uint32_t)m;
    return 1;
}

/* layout(bases, strides, sizes, blocks, digest) -> int */
static PyObject *Lane_layout(Lane *l, PyObject *args) {
    PyObject *ob, *os, *oz, *od;
    unsigned long long blocks;
    uint8_t digest[KEY];
    if (!PyArg_ParseTuple(args, "OOOKO", &ob, &os, &oz, &blocks, &od) || !check_open(l) ||
        !get_key(od, digest, "digest"))
        return NULL;
    Py_buffer b, s, z;
    if (!get_u64s(ob, &b, "bases")) return NULL;
    if (!get_u64s(os, &s, "strides")) { PyBuffer_Release(&b); return NULL; }
    if (!get_u64s(oz, &z, "sizes")) { PyBuffer_Release(&b); PyBuffer_Release(&s); return NULL; }
    Py_ssize_t f = b.len / 8;
    PyObject *out = NULL;
    if (f < 1 || f > MAX_LAYOUT_FRAGS || s.len != b.len || z.len != b.len) lane_error("a layout has 1 to %d fragments per block, as many bases, strides and sizes", MAX_LAYOUT_FRAGS);
    else if (blocks < 1) lane_error("a layout has at least one block");
    else {
        const uint64_t *B = b.buf, *S = s.buf, *Zs = z.buf;
        int bad = 0;
        for (Py_ssize_t i = 0; i < f && !bad; i++) {
            unsigned __int128 last = (unsigned __int128)B[i] + (unsigned __int128)S[i] * (blocks - 1) + Zs[i];
            if (Zs[i] == 0 || last > UINT64_MAX) bad = 1;
        }
        if (bad) lane_error("a layout fragment is empty or runs past the end of the address space");
        else {
            if (!lock_open(l)) {}
            else if (l->nlayouts >= MAX_LAYOUTS) { unlock(l); lane_error("a lane holds at most %d layouts", MAX_LAYOUTS); }
            else {
                Layout *y = &l->layouts[l->nlayouts];
                y->base = malloc(8 * f); y->stride = malloc(8 * f); y->size = malloc(8 * f);
                if (!y->base || !y->stride || !y->size) { free(y->base); free(y->stride); free(y->size); unlock(l); PyErr_NoMemory(); }
                else {
                    memcpy(y->base, B, 8 * f); memcpy(y->stride, S, 8 * f); memcpy(y->size, Zs, 8 * f);
                    y->nfrag = (uint32_t)f;
                    memcpy(y->digest, digest, KEY);
                    y->blocks = blocks;
                    out = PyLong_FromLong(l->nlayouts++);
                    unlock(l);
                }
            }
        }
    }
    PyBuffer_Release(&b); PyBuffer_Release(&s); PyBuffer_Release(&z);
    return out;
}

/* admit(peer) -> token: the poster peer `peer` may ask this lane, presenting the token. */
static PyObject *Lane_admit(Lane *l, PyObject *args) {
    unsigned int peer;
    if (!PyArg_ParseTuple(args, "I", &peer) || !check_open(l)) return NULL;
    uint8_t token[KEY];
    if (getrandom(token, KEY, 0) != KEY) return PyErr_SetFromErrno(PyExc_OSError);
    if (!lock_open(l)) return NULL;
    int slot = -1;
    for (int i = 0; i < MAX_TOKENS && slot < 0; i++) if (!l->tokens[i].used) slot = i;
    if (slot >= 0) { memcpy(l->tokens[slot].token, token, KEY); l->tokens[slot].peer = peer; l->tokens[slot].used = 1;
                    if (slot >= l->tokens_hi) l->tokens_hi = slot + 1; }
    unlock(l);
    if (slot < 0) return lane_error("a lane admits at most %d peers", MAX_TOKENS);
    return PyBytes_FromStringAndSize((const char *)token, KEY);
}

/* revoke(token) -> bool: the token is no longer accepted (requests already joined to an offer go on). */
static PyObject *Lane_revoke(Lane *l, PyObject *args) {
    PyObject *o;
    uint8_t token[KEY];
    if (!PyArg_ParseTuple(args, "O", &o) || !check_open(l) || !get_key(o, token, "token")) return NULL;
    int found = 0;
    if (!lock_open(l)) return NULL;
    for (int i = 0; i < MAX_TOKENS; i++)
        if (l->tokens[i].used && !memcmp(l->tokens[i].token, token, KEY)) { l->tokens[i].used = 0; found = 1; }
    unlock(l);
    return PyBool_FromLong(found);
}

/* offer(ticket, proof, layout, block_ids) -> bool: the source blocks of the request with this ticket, for the
 * requester that proves ``proof``; False: its receiver cancelled it on this lane before the offer (nothing is
 * offered). */
static PyObject *Lane_offer(Lane *l, PyObject *args) {
    PyObject *ot, *op, *oi;
    int k;
    uint8_t ticket[KEY], proof[KEY];
    if (!PyArg_ParseTuple(args, "OOiO", &ot, &op, &k, &oi) || !check_open(l) || !get_key(ot, ticket, "ticket") ||
        !get_key(op, proof, "proof"))
        return NULL;
    Py_buffer ids;
    if (!get_u64s(oi, &ids, "block_ids")) return NULL;
    uint64_t *src, *len;
    uint32_t n;
    if (!lock_open(l)) { PyBuffer_Release(&ids); return NULL; }
    int ok = expand(l, k, ids.buf, ids.len / 8, &src, &len, &n);
    PyBuffer_Release(&ids);
    if (!ok) { unlock(l); return NULL; }
    Job *j = job_find(l, ticket);
    if (j && j->cancelled && !j->requested) { /* its receiver is gone: nothing to offer */
        job_free(l, j);
        unlock(l);
        free(src);
        free(len);
        Py_RETURN_FALSE;
    }
    const char *refuse = NULL;
    size_t bytes = 16 * (size_t)n;
    if (j && (j->offered || j->declined || j->withdrawn)) refuse = "this ticket is offered or declined already";
    else if (l->job_bytes + bytes > l->max_job_bytes) refuse = "the lane holds too many offered bytes";
    else if (!j && !(j = job_new(l, ticket))) refuse = "the lane holds too many offers";
    if (refuse) { unlock(l); free(src); free(len); return lane_error("offer: %s", refuse); }
    j->src = src;
    j->len = len;
    j->n = n;
    memcpy(j->odigest, l->layouts[k].digest, KEY);
    memcpy(j->oproof, proof, KEY);
    j->offered = 1;
    j->bytes += bytes;
    l->job_bytes += bytes;
    if (j->requested) { /* the request came first: the lane's thread posts (never this one, which holds the GIL) */
        activate(l, j);
        wake(l);
    }
    unlock(l);
    Py_RETURN_TRUE;
}

/* decline(ticket, why): a request with this ticket (waiting now, or to come) is answered DECLINED with ``why``:
 * nothing moved, the requester asks again on its slower path. No completion on this side. */
static PyObject *Lane_decline(Lane *l, PyObject *args) {
    PyObject *ot;
    const char *why;
    uint8_t ticket[KEY];
    if (!PyArg_ParseTuple(args, "Os", &ot, &why) || !check_open(l) || !get_key(ot, ticket, "ticket")) return NULL;
    char *copy = strndup(why, MAX_ERR);
    if (!copy) return PyErr_NoMemory();
    if (!lock_open(l)) { free(copy); return NULL; }
    Job *j = job_find(l, ticket);
    const char *refuse = NULL;
    if (j && (j->offered || j->declined || j->withdrawn)) refuse = "this ticket is offered or declined already";
    else if (!j && !(j = job_new(l, ticket))) refuse = "the lane holds too many offers";
    if (refuse) { unlock(l); free(copy); return lane_error("decline: %s", refuse); }
    j->declined = 1;
    j->why = copy;
    if (j->requested) { /* the lane's thread answers it (it owns the ROUTER) */
        l->next_expiry = 0;
        wake(l);
    }
    unlock(l);
    Py_RETURN_NONE;
}

/* withdraw(ticket) -> bool: True, the offer is gone (a waiting request is answered CANCELLED); False, its write
 * is in flight or it was never offered (its completion tells the end). */
static PyObject *Lane_withdraw(Lane *l, PyObject *args) {
    PyObject *ot;
    uint8_t ticket[KEY];
    if (!PyArg_ParseTuple(args, "O", &ot) || !check_open(l) || !get_key(ot, ticket, "ticket")) return NULL;
    if (!lock_open(l)) return NULL;
    Job *j = job_find(l, ticket);
    int gone = 0;
    if (j && (j->offered || j->declined || j->cancelled) && !j->in_flight && !j->withdrawn) {
        if (j->requested) { /* the lane's thread answers CANCELLED (it owns the ROUTER) and frees it */
            j->withdrawn = 1;
            l->next_expiry = 0;
            wake(l);
        } else {
            job_free(l, j);
        }
        gone = 1;
    }
    unlock(l);
    return PyBool_FromLong(gone);
}

static int queue_out(Lane *l, uint32_t conn, const uint8_t *data, size_t len) {
    Out *o = malloc(sizeof *o + len);
    if (!o) return 0;
    o->next = NULL;
    o->conn = conn;
    o->len = len;
    memcpy(o->data, data, len);
    if (l->out_tail) l->out_tail->next = o; else l->out_head = o;
    l->out_tail = o;
    wake(l);
    return 1;
}

/* connect(endpoint, server_public) -> conn: server_public is the lane's 32-byte CURVE key (None: no CURVE, as
 * this lane was made). */
static PyObject *Lane_connect(Lane *l, PyObject *args) {
    const char *ep;
    PyObject *ok;
    uint8_t server_public[32];
    if (!PyArg_ParseTuple(args, "sO", &ep, &ok) || !check_open(l)) return NULL;
    int k = curve_key(ok, server_public, "server_public");
    if (k < 0) return NULL;
    if (k != l->curve)
        return lane_error(l->curve ? "this lane speaks CURVE: the peer lane's public key is needed"
                                   : "this lane was made without CURVE keys: it cannot use a peer's public key");
    if (strncmp(ep, "tcp://", 6) != 0 || strlen(ep) > 255) return lane_error("a lane endpoint is tcp://host:port, not %.300s", ep);
    void *s = kvn_socket(Z_DEALER, RES_HEAD + MAX_ERR);
    if (!s) return lane_error("zmq_socket: %s", Z.strerror(Z.errno_()));
    if (l->curve && (Z.setsockopt(s, Z_CURVE_SERVERKEY, server_public, 32) != 0 ||
                     Z.setsockopt(s, Z_CURVE_PUBLICKEY, l->client_public, 32) != 0 ||
                     Z.setsockopt(s, Z_CURVE_SECRETKEY, l->client_secret, 32) != 0)) {
        Z.close(s);
        return lane_error("CURVE keys refused: %s", Z.strerror(Z.errno_()));
    }
    if (Z.connect(s, ep) != 0) { Z.close(s); return lane_error("connect to %.300s: %s", ep, Z.strerror(Z.errno_())); }
    if (!lock_open(l)) { Z.close(s); return NULL; }
    int c = -1;
    for (int i = 0; i < l->nconns && c < 0; i++) if (!l->conns[i].used) c = i;
    if (c < 0 && l->nconns < MAX_CONNS) c = l->nconns++;
    if (c >= 0) { l->conns[c].sock = s; l->conns[c].used = 1; wake(l); }
    unlock(l);
    if (c < 0) { Z.close(s); return lane_error("a lane connects to at most %d lanes", MAX_CONNS); }
    return PyLong_FromLong(c);
}

/* request(conn, token, ticket, proof, nonce, layout, block_ids, timeout_ms) */
static PyObject *Lane_request(Lane *l, PyObject *args) {
    unsigned int conn, timeout_ms;
    int k;
    PyObject *otk, *oti, *opr, *ono, *oi;
    uint8_t token[KEY], ticket[KEY], proof[KEY], nonce[KEY];
    if (!PyArg_ParseTuple(args, "IOOOOiOI", &conn, &otk, &oti, &opr, &ono, &k, &oi, &timeout_ms) || !check_open(l) ||
        !get_key(otk, token, "token") || !get_key(oti, ticket, "ticket") || !get_key(opr, proof, "proof") ||
        !get_key(ono, nonce, "nonce"))
        return NULL;
    if (timeout_ms == 0 || timeout_ms > MAX_TIMEOUT_MS) return lane_error("timeout_ms must be 1 to %u", MAX_TIMEOUT_MS);
    Py_buffer ids;
    if (!get_u64s(oi, &ids, "block_ids")) return NULL;
    uint64_t *dst, *len;
    uint32_t n;
    if (!lock_open(l)) { PyBuffer_Release(&ids); return NULL; }
    int ok = expand(l, k, ids.buf, ids.len / 8, &dst, &len, &n);
    PyBuffer_Release(&ids);
    if (!ok) { unlock(l); return NULL; }
    const char *refuse = NULL;
    if (conn >= (unsigned)l->nconns || !l->conns[conn].used || l->conns[conn].closing) refuse = "unknown connection";
    else if (pend_find(l, nonce)) refuse = "a request with this nonce is pending";
    else if (l->pend_count >= l->max_pending) refuse = "the lane holds too many pending requests";
    size_t flen = REQ_HEAD + 16 * (size_t)n;
    uint8_t *f = refuse ? NULL : malloc(flen);
    Pending *p = refuse ? NULL : calloc(1, sizeof *p);
    if (!refuse && (!f || !p)) refuse = "out of memory";
    if (!refuse) {
        memset(f, 0, REQ_HEAD);
        put32(f, MAGIC);
        f[4] = T_REQ;
        memcpy(f + 8, token, KEY);
        memcpy(f + 24, ticket, KEY);
        memcpy(f + 40, nonce, KEY);
        put32(f + 56, n);
        put32(f + 60, timeout_ms);
        memcpy(f + 64, l->layouts[k].digest, KEY);
        memcpy(f + 80, proof, KEY);
        for (uint32_t i = 0; i < n; i++) { put64(f + REQ_HEAD + 16 * i, dst[i]); put64(f + REQ_HEAD + 16 * i + 8, len[i]); }
        memcpy(p->nonce, nonce, KEY);
        memcpy(p->ticket, ticket, KEY);
        memcpy(p->token, token, KEY);
        p->conn = conn;
        p->deadline = mono() + timeout_ms / 1000.0 + ANSWER_MARGIN_S;
        if (!queue_out(l, conn, f, flen)) refuse = "out of memory";
    }
    if (!refuse) {
        unsigned b = bucket(nonce);
        p->next = l->pend[b];
        l->pend[b] = p;
        l->pend_count++;
        l->conns[conn].pending++;
        if (p->deadline < l->next_expiry) l->next_expiry = p->deadline;
        p = NULL;
    }
    unlock(l);
    free(f); free(p); free(dst); free(len);
    if (refuse) return lane_error("request: %s", refuse);
    Py_RETURN_NONE;
}

/* cancel(nonce) -> bool: ask the context to drop a request that is not being written yet; its completion
 * (CANCELLED, or the write's own end) still comes. False: no such pending request. */
static PyObject *Lane_cancel(Lane *l, PyObject *args) {
    PyObject *o;
    uint8_t nonce[KEY];
    if (!PyArg_ParseTuple(args, "O", &o) || !check_open(l) || !get_key(o, nonce, "nonce")) return NULL;
    if (!lock_open(l)) return NULL;
    Pending *p = pend_find(l, nonce);
    int ok = 0;
    if (p) {
        uint8_t f[CANCEL_BYTES];
        memset(f, 0, sizeof f);
        put32(f, MAGIC);
        f[4] = T_CANCEL;
        memcpy(f + 8, p->token, KEY);
        memcpy(f + 24, p->ticket, KEY);
        memcpy(f + 40, p->nonce, KEY);
        ok = queue_out(l, p->conn, f, sizeof f);
    }
    unlock(l);
    return PyBool_FromLong(ok);
}

/* disconnect(conn) -> bool: this lane asks that lane no more. Requests pending there still get their answers
 * (or their timeouts); the socket closes once none is left. False: no such connection (or closing already). */
static PyObject *Lane_disconnect(Lane *l, PyObject *args) {
    unsigned int conn;
    if (!PyArg_ParseTuple(args, "I", &conn) || !check_open(l)) return NULL;
    if (!lock_open(l)) return NULL;
    int ok = conn < (unsigned)l->nconns && l->conns[conn].used && !l->conns[conn].closing;
    if (ok) {
        l->conns[conn].closing = 1;
        wake(l);
    }
    unlock(l);
    return PyBool_FromLong(ok);
}

/* forget(nonce) -> bool: drop a pending request with no completion (its requester settled it otherwise: the
 * writer was fenced); a late answer to it is then dropped and counted. False: no such request. */
static PyObject *Lane_forget(Lane *l, PyObject *args) {
    PyObject *o;
    uint8_t nonce[KEY];
    if (!PyArg_ParseTuple(args, "O", &o) || !check_open(l) || !get_key(o, nonce, "nonce")) return NULL;
    if (!lock_open(l)) return NULL;
    Pending *p = pend_find(l, nonce);
    if (p) pend_free(l, p);
    unlock(l);
    return PyBool_FromLong(p != NULL);
}

static const char *STATUS[] = {"ok", "failed", "cancelled", "timed_out", "declined"};

/* completions() -> [(side, ticket, nonce, peer, status, error)]: side "context" (peer: the requester's poster
 * peer) or "generation" (peer: the connection). */
static PyObject *Lane_completions(Lane *l, PyObject *noargs) {
    if (!l->poster) return lane_error("the lane was not initialized");
    lock(l);
    Completion *c = l->done_head;
    l->done_head = l->done_tail = NULL;
    unlock(l);
    PyObject *out = PyList_New(0);
    while (c) {
        Completion *nx = c->next;
        PyObject *t = out ? Py_BuildValue("(sy#y#Iss)", c->side ? "generation" : "context", (const char *)c->ticket,
                                          (Py_ssize_t)KEY, (const char *)c->nonce, (Py_ssize_t)KEY, c->peer,
                                          STATUS[c->status <= S_DECLINED ? c->status : S_FAILED], c->err) : NULL;
        if (!t || PyList_Append(out, t) != 0) Py_CLEAR(out);
        Py_XDECREF(t);
        free(c);
        c = nx;
    }
    return out;
}

/* wait(timeout_s) -> bool: until a completion is queued (True) or the time passed (False), GIL released. */
static PyObject *Lane_wait(Lane *l, PyObject *args) {
    double timeout_s;
    if (!PyArg_ParseTuple(args, "d", &timeout_s) || !check_open(l)) return NULL;
    int got;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&l->mu);
    double deadline = mono() + (timeout_s > 0 ? timeout_s : 0);
    while (!l->done_head && !l->closed && !l->poked) {
        double left = deadline - mono();
        if (left <= 0) break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long ns = ts.tv_nsec + (long)((left > 1 ? 1 : left) * 1e9);
        ts.tv_sec += ns / 1000000000L;
        ts.tv_nsec = ns % 1000000000L;
        pthread_cond_timedwait(&l->cv, &l->mu, &ts);
    }
    got = l->done_head != NULL || l->poked;
    l->poked = 0;
    pthread_mutex_unlock(&l->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(got);
}

/* poke(): wake a thread in wait() (it returns True): news came from elsewhere. */
static PyObject *Lane_poke(Lane *l, PyObject *noargs) {
    if (!l->inited) return lane_error("the lane was not initialized");
    lock(l);
    l->poked = 1;
    pthread_cond_broadcast(&l->cv);
    unlock(l);
    Py_RETURN_NONE;
}

static PyObject *Lane_stats(Lane *l, PyObject *noargs) {
    if (!l->poster) return lane_error("the lane was not initialized");
    lock(l);
    size_t in_flight = 0, waiting = 0, declined = 0, conns = 0;
    for (int c = 0; c < l->nconns; c++) conns += l->conns[c].used != 0;
    for (int b = 0; b < BUCKETS; b++)
        for (Job *j = l->jobs[b]; j; j = j->next) {
            if (j->in_flight) in_flight++;
            else if ((j->declined || j->cancelled) && !j->requested) declined++;
            else waiting++;
        }
    PyObject *d = Py_BuildValue(
        "{s:n,s:n,s:n,s:n,s:n,s:n,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:s}", "connections", (Py_ssize_t)conns,
        "jobs_waiting", (Py_ssize_t)waiting,
        "declines", (Py_ssize_t)declined, "writes_in_flight",
        (Py_ssize_t)in_flight, "job_bytes", (Py_ssize_t)l->job_bytes, "pending", (Py_ssize_t)l->pend_count,
        "requests_served", (unsigned long long)l->st_requests, "posts", (unsigned long long)l->st_posts,
        "results_sent", (unsigned long long)l->st_results_sent, "results_received",
        (unsigned long long)l->st_results_received, "ok", (unsigned long long)l->st_ok, "failed",
        (unsigned long long)l->st_failed, "rejected_frames", (unsigned long long)l->st_rejected, "proof_declines",
        (unsigned long long)l->st_proof_declines, "thread_error",
        l->thread_error);
    unlock(l);
    return d;
}

static PyObject *Lane_close(Lane *l, PyObject *noargs) {
    if (l->inited) lane_shutdown(l);
    Py_RETURN_NONE;
}

static PyObject *Lane_endpoint(Lane *l, void *closure) { return PyUnicode_FromString(l->endpoint); }

static PyMethodDef Lane_methods[] = {
    {"layout", (PyCFunction)Lane_layout, METH_VARARGS, "layout(bases, strides, sizes, blocks) -> layout id"},
    {"admit", (PyCFunction)Lane_admit, METH_VARARGS, "admit(peer) -> token"},
    {"revoke", (PyCFunction)Lane_revoke, METH_VARARGS, "revoke(token) -> bool"},
    {"offer", (PyCFunction)Lane_offer, METH_VARARGS, "offer(ticket, proof, layout, block_ids)"},
    {"decline", (PyCFunction)Lane_decline, METH_VARARGS, "decline(ticket, why)"},
    {"withdraw", (PyCFunction)Lane_withdraw, METH_VARARGS, "withdraw(ticket) -> bool"},
    {"connect", (PyCFunction)Lane_connect, METH_VARARGS, "connect(endpoint) -> conn"},
    {"request", (PyCFunction)Lane_request, METH_VARARGS,
     "request(conn, token, ticket, proof, nonce, layout, block_ids, timeout_ms)"},
    {"cancel", (PyCFunction)Lane_cancel, METH_VARARGS, "cancel(nonce) -> bool"},
    {"forget", (PyCFunction)Lane_forget, METH_VARARGS, "forget(nonce) -> bool"},
    {"disconnect", (PyCFunction)Lane_disconnect, METH_VARARGS, "disconnect(conn) -> bool"},
    {"completions", (PyCFunction)Lane_completions, METH_NOARGS, "completions() -> [(side, key, status, error)]"},
    {"wait", (PyCFunction)Lane_wait, METH_VARARGS, "wait(timeout_s) -> bool"},
    {"poke", (PyCFunction)Lane_poke, METH_NOARGS, "poke(): wake a thread in wait()"},
    {"stats", (PyCFunction)Lane_stats, METH_NOARGS, "stats() -> dict"},
    {"close", (PyCFunction)Lane_close, METH_NOARGS, "close()"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Lane_getset[] = {
    {"endpoint", (getter)Lane_endpoint, NULL, "the ROUTER's endpoint", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvcore_native._lane.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lane_init,
    .tp_dealloc = (destructor)Lane_dealloc,
    .tp_methods = Lane_methods,
    .tp_getset = Lane_getset,
    .tp_doc = "The native per-request path of one process (see kvcore_native.lane).",
};

static PyObject *load(PyObject *self, PyObject *args) {
    const char *path;
    char err[512];
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    if (kvn_zmq_load(path, err, sizeof err)) return PyErr_Format(PyExc_OSError, "kvcore_native: %s", err);
    Py_RETURN_NONE;
}

static PyObject *set_error_type(PyObject *self, PyObject *args) {
    PyObject *t;
    if (!PyArg_ParseTuple(args, "O", &t)) return NULL;
    Py_XSETREF(LaneError, Py_NewRef(t));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "load(path): open libzmq at path (pyzmq's own) for this module."},
    {"set_error_type", set_error_type, METH_VARARGS, "set_error_type(cls): the exception the lane raises."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "kvcore_native._lane", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__lane(void) {
    if (PyType_Ready(&LaneType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Lane", (PyObject *)&LaneType) < 0) { Py_DECREF(m); return NULL; }
    PyModule_AddIntConstant(m, "MAX_FRAGS", MAX_FRAGS);
    return m;
}
