/* kvcore_native._floor: the threaded floor of a one-block request in C (kvcore bench's "native floor").
 *
 * The same shape as kvcore.tools.bench.floor's threaded floor, with no Python on the hops: on the context side
 * an echo thread owns a ROUTER on loopback and answers every frame with itself; on the generation side the
 * calling thread (the engine) hands each frame to an I/O thread that owns a DEALER (woken through an inproc
 * PAIR) and sleeps on a condition variable until the I/O thread read the echo. libzmq is pyzmq's own library,
 * opened at run time by path (kvn_zmq.h: the wheel ships no header, so the few prototypes are declared there).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "kvn_zmq.h"

#define FRAME_BYTES 256
#define MAX_FRAME 4096

static double mono(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static PyObject *zerr(const char *what) {
    int e = Z.errno_();
    PyErr_Format(PyExc_OSError, "kvcore_native: %s: %s", what, Z.strerror(e));
    return NULL;
}

/* load(path): open libzmq at ``path`` and make this module's context. */
static PyObject *load(PyObject *self, PyObject *args) {
    const char *path;
    char err[512];
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    if (kvn_zmq_load(path, err, sizeof err)) return PyErr_Format(PyExc_OSError, "kvcore_native: %s", err);
    Py_RETURN_NONE;
}

/* A socket that drops its queue at close and refuses (disconnects) a peer whose message exceeds MAX_FRAME. */
static void *socket_linger0(int type) { return kvn_socket(type, MAX_FRAME); }

/* --- the echo (context side) ------------------------------------------------------------------------- */

typedef struct { void *sock; pthread_t thread; int stop; /* __atomic */ } Echo;

static void *echo_run(void *arg) {
    Echo *e = arg;
    char id[256], buf[MAX_FRAME];
    while (!__atomic_load_n(&e->stop, __ATOMIC_ACQUIRE)) {
        zpollitem it = {e->sock, 0, Z_POLLIN, 0};
        if (Z.poll(&it, 1, 50) <= 0) continue;
        for (int i = 0; i < 1000; i++) {
            int il = Z.recv(e->sock, id, sizeof id, Z_DONTWAIT);
            if (il < 0) break;
            int bl = Z.recv(e->sock, buf, sizeof buf, Z_DONTWAIT);  /* a ROUTER delivers both parts at once */
            if (bl < 0 || il > (int)sizeof id || bl > (int)sizeof buf) continue;  /* truncated: not ours */
            if (Z.send(e->sock, id, il, Z_SNDMORE | Z_DONTWAIT) >= 0) Z.send(e->sock, buf, bl, Z_DONTWAIT);
        }
    }
    return NULL;
}

static void echo_free(PyObject *cap) {
    Echo *e = PyCapsule_GetPointer(cap, "kvcore_native.echo");
    if (!e) return;
    if (!__atomic_exchange_n(&e->stop, 1, __ATOMIC_ACQ_REL)) pthread_join(e->thread, NULL);
    if (e->sock) Z.close(e->sock);
    PyMem_RawFree(e);
}

/* echo_start() -> (echo, endpoint): a ROUTER on a free loopback port, answered by a thread of its own. */
static PyObject *echo_start(PyObject *self, PyObject *noargs) {
    if (!zctx) return PyErr_Format(PyExc_RuntimeError, "kvcore_native: load() libzmq first");
    Echo *e = PyMem_RawCalloc(1, sizeof *e);
    if (!e) return PyErr_NoMemory();
    char ep[256];
    size_t n = sizeof ep;
    e->sock = socket_linger0(Z_ROUTER);
    if (!e->sock || Z.bind(e->sock, "tcp://127.0.0.1:*") != 0 || Z.getsockopt(e->sock, Z_LAST_ENDPOINT, ep, &n) != 0) {
        zerr("echo socket");
        if (e->sock) Z.close(e->sock);
        PyMem_RawFree(e);
        return NULL;
    }
    int rc = pthread_create(&e->thread, NULL, echo_run, e);
    if (rc) { Z.close(e->sock); PyMem_RawFree(e); errno = rc; return PyErr_SetFromErrno(PyExc_OSError); }
    PyObject *cap = PyCapsule_New(e, "kvcore_native.echo", echo_free);
    if (!cap) { __atomic_store_n(&e->stop, 1, __ATOMIC_RELEASE); pthread_join(e->thread, NULL); Z.close(e->sock); PyMem_RawFree(e); return NULL; }
    return Py_BuildValue("(Ns)", cap, ep);
}

/* echo_stop(echo): stop its thread and close its socket (again: nothing). */
static PyObject *echo_stop(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    Echo *e = PyCapsule_GetPointer(cap, "kvcore_native.echo");
    if (!e) return NULL;
    if (!__atomic_exchange_n(&e->stop, 1, __ATOMIC_ACQ_REL)) {
        Py_BEGIN_ALLOW_THREADS
        pthread_join(e->thread, NULL);
        Py_END_ALLOW_THREADS
        Z.close(e->sock);
        e->sock = NULL;
    }
    Py_RETURN_NONE;
}

/* --- the threaded ping (generation side) ------------------------------------------------------------- */

typedef struct {
    void *dealer, *wake_rx, *wake_tx;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    long echoes;
    int pending, stop, failed;
} Ping;

static void *ping_io(void *arg) {
    Ping *p = arg;
    char frame[FRAME_BYTES], buf[MAX_FRAME];
    memset(frame, 0, sizeof frame);
    for (;;) {
        pthread_mutex_lock(&p->mu);
        int stop = p->stop, pending = p->pending;
        pthread_mutex_unlock(&p->mu);
        if (stop) return NULL;
        zpollitem it[2] = {{p->dealer, 0, Z_POLLIN, 0}, {p->wake_rx, 0, Z_POLLIN, 0}};
        if (Z.poll(it, 2, pending ? 1 : 20) < 0) {
            if (Z.errno_() == EINTR) continue;
            break;
        }
        if (it[1].revents) while (Z.recv(p->wake_rx, buf, sizeof buf, Z_DONTWAIT) >= 0) {}
        pthread_mutex_lock(&p->mu);
        pending = p->pending;
        p->pending = 0;
        pthread_mutex_unlock(&p->mu);
        for (; pending > 0; pending--)
            if (Z.send(p->dealer, frame, sizeof frame, Z_DONTWAIT) < 0) {  /* not yet connected: retry */
                pthread_mutex_lock(&p->mu);
                p->pending += pending;
                pthread_mutex_unlock(&p->mu);
                break;
            }
        if (it[0].revents) {
            long got = 0;
            while (Z.recv(p->dealer, buf, sizeof buf, Z_DONTWAIT) >= 0) got++;
            if (got) {
                pthread_mutex_lock(&p->mu);
                p->echoes += got;
                pthread_cond_signal(&p->cv);
                pthread_mutex_unlock(&p->mu);
            }
        }
    }
    pthread_mutex_lock(&p->mu);
    p->failed = Z.errno_();
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* ping_threaded(endpoint, n, timeout_s) -> list of seconds per round trip; raises TimeoutError with no echo. */
static PyObject *ping_threaded(PyObject *self, PyObject *args) {
    const char *endpoint;
    Py_ssize_t n;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "snd", &endpoint, &n, &timeout_s)) return NULL;
    if (!zctx) return PyErr_Format(PyExc_RuntimeError, "kvcore_native: load() libzmq first");
    if (n < 0 || n > 10000000) return PyErr_Format(PyExc_ValueError, "kvcore_native: n out of range: %zd", n);
    double *secs = PyMem_RawMalloc((n ? n : 1) * sizeof(double));
    if (!secs) return PyErr_NoMemory();
    Ping p;
    memset(&p, 0, sizeof p);
    pthread_mutex_init(&p.mu, NULL);
    pthread_cond_init(&p.cv, NULL);
    char addr[64];
    snprintf(addr, sizeof addr, "inproc://kvcore-native-ping-%p", (void *)&p);
    p.dealer = socket_linger0(Z_DEALER);
    p.wake_rx = socket_linger0(Z_PAIR);
    p.wake_tx = socket_linger0(Z_PAIR);
    PyObject *out = NULL;
    const char *bad = NULL;
    if (!p.dealer || !p.wake_rx || !p.wake_tx) bad = "zmq_socket";
    else if (Z.connect(p.dealer, endpoint) != 0) bad = "connect";
    else if (Z.bind(p.wake_rx, addr) != 0 || Z.connect(p.wake_tx, addr) != 0) bad = "inproc wake-up";
    pthread_t io;
    int started = 0, timed_out = 0, failed = 0;
    Py_ssize_t done = 0;
    int thread_rc = 0;
    if (!bad && (thread_rc = pthread_create(&io, NULL, ping_io, &p)) == 0) started = 1;
    if (started) {
        Py_BEGIN_ALLOW_THREADS
        for (; done < n; done++) {
            double t0 = mono(), deadline = t0 + timeout_s;
            pthread_mutex_lock(&p.mu);
            p.pending++;
            pthread_mutex_unlock(&p.mu);
            Z.send(p.wake_tx, "", 0, Z_DONTWAIT);  /* a wake-up already pending is enough */
            pthread_mutex_lock(&p.mu);
            while (p.echoes < done + 1 && !p.failed) {
                double left = deadline - mono();
                if (left <= 0) { timed_out = 1; break; }
                if (left > 0.05) left = 0.05;
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                long ns = ts.tv_nsec + (long)(left * 1e9);
                ts.tv_sec += ns / 1000000000L;
                ts.tv_nsec = ns % 1000000000L;
                pthread_cond_timedwait(&p.cv, &p.mu, &ts);
            }
            failed = p.failed;
            pthread_mutex_unlock(&p.mu);
            if (timed_out || failed) break;
            secs[done] = mono() - t0;
        }
        Py_END_ALLOW_THREADS
    }
    if (started) {
        pthread_mutex_lock(&p.mu);
        p.stop = 1;
        pthread_mutex_unlock(&p.mu);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(io, NULL);  /* its poll waits 20 ms at most */
        Py_END_ALLOW_THREADS
    }
    if (thread_rc) { errno = thread_rc; PyErr_SetFromErrno(PyExc_OSError); }
    else if (bad) zerr(bad);
    else if (failed) PyErr_Format(PyExc_OSError, "kvcore_native: the ping's I/O thread failed: %s", Z.strerror(failed));
    else if (timed_out) {
        char msg[512];  /* PyErr_Format has no float conversion */
        snprintf(msg, sizeof msg, "no echo from %.300s within %.1fs (native floor, round trip %zd)", endpoint,
                 timeout_s, done);
        PyErr_SetString(PyExc_TimeoutError, msg);
    }
    else if ((out = PyList_New(n))) {
        for (Py_ssize_t i = 0; i < n; i++) PyList_SET_ITEM(out, i, PyFloat_FromDouble(secs[i]));
    }
    if (p.dealer) Z.close(p.dealer);
    if (p.wake_rx) Z.close(p.wake_rx);
    if (p.wake_tx) Z.close(p.wake_tx);
    pthread_mutex_destroy(&p.mu);
    pthread_cond_destroy(&p.cv);
    PyMem_RawFree(secs);
    return out;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "load(path): open libzmq at path (pyzmq's own) for this module."},
    {"echo_start", echo_start, METH_NOARGS, "echo_start() -> (echo, endpoint): a loopback echo on its own thread."},
    {"echo_stop", echo_stop, METH_VARARGS, "echo_stop(echo): stop the echo's thread and close its socket."},
    {"ping_threaded", ping_threaded, METH_VARARGS,
     "ping_threaded(endpoint, n, timeout_s) -> seconds of each of n round trips through an I/O thread."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "kvcore_native._floor", .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__floor(void) { return PyModule_Create(&module); }
