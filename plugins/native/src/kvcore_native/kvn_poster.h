/* kvn_poster.h: a poster, one transport's native write path, as kvcore-native's lane drives it.
 *
 * A poster (kvcore_native.ucx.UcxPoster, kvcore_native.nixl.NixlPoster) is a Python object that owns one
 * transport endpoint of its own in this process: its memory registrations, its peers (slots returned by
 * connect) and its in-flight writes. Python sets it up (register, descriptor, connect, disconnect, close); the
 * lane's C thread moves bytes through the vtable below, reached by the poster's capsule() (a PyCapsule named
 * KVN_POSTER_CAPSULE holding a kvn_poster_ref, valid while the poster object lives: whoever holds the capsule
 * keeps a reference to the poster).
 *
 * Threads: every vtable call and every Python method takes the poster's own mutex, so any thread may call any
 * of them; none of them calls into Python or needs the GIL. A handle is polled and released by whoever posted
 * it. post_write never waits for the copy's end (a transport may copy inside it, as UCX over CMA does).
 */
#ifndef KVN_POSTER_H
#define KVN_POSTER_H

#include <stddef.h>
#include <stdint.h>

#define KVN_POSTER_CAPSULE "kvcore_native.poster"
#define KVN_POSTER_ABI 1

/* The transport's verdict on a handle (poll). */
enum { KVN_PENDING = 0, KVN_DONE = 1, KVN_FAILED = -1 };

typedef struct kvn_poster_vtable {
    int abi;             /* KVN_POSTER_ABI */
    const char *backend; /* "ucx", "nixl": kvcore's backend name */
    /* Start one WRITE of n fragments: local bytes [src[i], src[i] + len[i]) to the peer's [dst[i], dst[i] +
     * len[i]). On success store a handle in *out and return 0. On refusal (unknown or disconnected peer, a
     * fragment outside this side's registered memory or outside the peer's, n == 0, the transport's own
     * error) return -1 with a one-line message in err (NUL-terminated, at most errlen bytes): nothing moved
     * and no handle exists. */
    int (*post_write)(void *self, uint32_t peer, const uint64_t *src, const uint64_t *dst, const uint64_t *len,
                      uint32_t n, void **out, char *err, size_t errlen);
    /* Drive the transport once and report the handle: KVN_PENDING, KVN_DONE (every byte is in the peer's
     * memory) or KVN_FAILED (message in err). */
    int (*poll)(void *self, void *handle, char *err, size_t errlen);
    /* Forget a handle. A handle that is still KVN_PENDING is abandoned: the poster keeps it and drives it to
     * its end on later polls or at close, so that no registration is dropped under a write that may land. */
    void (*release)(void *self, void *handle);
} kvn_poster_vtable;

typedef struct kvn_poster_ref {
    const kvn_poster_vtable *vt;
    void *self;
} kvn_poster_ref;

#endif
