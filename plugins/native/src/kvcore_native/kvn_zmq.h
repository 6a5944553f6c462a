/* kvn_zmq.h: libzmq for kvcore-native's modules, opened at run time by path (pyzmq's own library; its wheel ships
 * no header, so the few prototypes used are declared here). Each module that includes this file gets its own
 * table and context (static), filled by kvn_zmq_load. */
#ifndef KVN_ZMQ_H
#define KVN_ZMQ_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct { void *socket; int fd; short events; short revents; } zpollitem;

static struct {
    void *(*ctx_new)(void);
    int (*ctx_term)(void *);
    void *(*socket)(void *, int);
    int (*close)(void *);
    int (*bind)(void *, const char *);
    int (*connect)(void *, const char *);
    int (*send)(void *, const void *, size_t, int);
    int (*recv)(void *, void *, size_t, int);
    int (*poll)(zpollitem *, int, long);
    int (*setsockopt)(void *, int, const void *, size_t);
    int (*getsockopt)(void *, int, void *, size_t *);
    int (*errno_)(void);
    const char *(*strerror)(int);
} Z;
static void *zctx;

enum { Z_PAIR = 0, Z_DEALER = 5, Z_ROUTER = 6, Z_POLLIN = 1, Z_DONTWAIT = 1, Z_SNDMORE = 2, Z_RCVMORE = 13,
       Z_LINGER = 17, Z_MAXMSGSIZE = 22, Z_LAST_ENDPOINT = 32 };

/* Open libzmq at path and make this module's context: NULL, or why not (in err). Again: nothing. */
static const char *kvn_zmq_load(const char *path, char *err, size_t errlen) {
    if (zctx) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) { snprintf(err, errlen, "cannot open libzmq at %s: %s", path, dlerror()); return err; }
#define KVN_SYM(field, name) if (!(*(void **)&Z.field = dlsym(lib, name))) { \
        snprintf(err, errlen, "%s has no %s", path, name); return err; }
    KVN_SYM(ctx_new, "zmq_ctx_new") KVN_SYM(ctx_term, "zmq_ctx_term") KVN_SYM(socket, "zmq_socket")
    KVN_SYM(close, "zmq_close") KVN_SYM(bind, "zmq_bind") KVN_SYM(connect, "zmq_connect") KVN_SYM(send, "zmq_send")
    KVN_SYM(recv, "zmq_recv") KVN_SYM(poll, "zmq_poll") KVN_SYM(setsockopt, "zmq_setsockopt")
    KVN_SYM(getsockopt, "zmq_getsockopt") KVN_SYM(errno_, "zmq_errno") KVN_SYM(strerror, "zmq_strerror")
#undef KVN_SYM
    zctx = Z.ctx_new();
    if (!zctx) { snprintf(err, errlen, "zmq_ctx_new failed"); return err; }
    return NULL;
}

/* A socket that drops its queue at close and cuts off a peer whose message exceeds max_msg bytes. */
static void *kvn_socket(int type, int64_t max_msg) {
    void *s = Z.socket(zctx, type);
    int zero = 0;
    if (s && (Z.setsockopt(s, Z_LINGER, &zero, sizeof zero) != 0 ||
              Z.setsockopt(s, Z_MAXMSGSIZE, &max_msg, sizeof max_msg) != 0)) {
        Z.close(s);
        return NULL;
    }
    return s;
}

#endif
