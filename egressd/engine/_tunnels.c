/*
 * egressd.engine._tunnels: the native tunnel front (Linux).
 *
 * Why: at thousands of short tunnels a second, the Python work per connection (asyncio protocol
 * objects, the head parse, the decision, the records) costs more CPU than tinyproxy spends on a
 * whole tunnel. This module accepts on egressd's proxy port and serves, without running any Python,
 * exactly one kind of connection: a CONNECT whose complete head is byte for byte one that the Python
 * lean path decided, admitted and connected before ("remember"), while the policy object, the
 * issued credentials and the redirect memory are unchanged (any change calls "invalidate") and the
 * entry is younger than its ttl. It connects to the address that connect used, answers 200, and
 * relays both ways. Everything else -- a head it has not seen, plain HTTP, a malformed or partial
 * head at 16 KiB, a failed connect -- is handed to Python with the bytes read so far (miss()), and
 * the Python path decides it exactly as it would have without this module. A TLS ClientHello is
 * checked by Python (hello()); records go through Python callbacks (opened/closed/timed_out).
 *
 * It has no thread: its epoll fd is watched by the asyncio loop, which calls poll(). Everything
 * runs with the GIL held.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define READ_CHUNK (256 * 1024)
#define HEAD_LIMIT 16384   /* longer heads go to Python, which applies its own limits */
#define HELLO_LIMIT (80 * 1024)
#define MAX_EVENTS 256
#define TABLE_SIZE 1024    /* buckets */
#define TABLE_MAX 1024     /* entries; the table is emptied when full */
#define COALESCE_MIN (16 * 1024)
#define COALESCE_MAX (128 * 1024)
#define COALESCE_WINDOW 0.002
#define COALESCE_RATE 1073741824.0
#define COALESCE_PAUSE 0.001
#define SWEEP_EVERY 1.0

static const char ESTABLISHED[] = "HTTP/1.1 200 Connection established\r\n\r\n";

/* ST_EXCHANGE: a remembered plain-HTTP request sent; its response is fed to Python (feed) */
enum { ST_HEAD, ST_CONNECTING, ST_HELLO, ST_RELAY, ST_EXCHANGE, ST_CLOSING };
enum { K_LISTEN = 1, K_TIMER, K_CLIENT, K_UP };

typedef struct Conn Conn;

typedef struct Side {
    int kind; /* K_CLIENT or K_UP; first member: epoll data points here */
    int fd;
    Conn *conn;
    uint32_t events;   /* registered interest, 0 = not in the epoll set */
    char *pend;        /* bytes still to write to this side */
    size_t pend_len, pend_off;
    int eof;           /* this side sent EOF */
    int closed;        /* fd closed */
    int paused;        /* coalescing tick */
    double pause_until;
    double last_bulk, burst_start;
    double burst_bytes;
} Side;

struct Conn {
    Side client, up;
    int stage;
    int dead;
    double deadline; /* head or connect deadline, 0 = none */
    double started, last_active;
    char *buf;
    size_t len, cap, head_len;
    PyObject *meta;
    PyObject *outgoing; /* a request: the head to send upstream (NULL: a tunnel) */
    PyObject *feed;     /* a request: Python's response reader, feed(bytes | None) -> (bytes, done) */
    unsigned long long serial;
    double connect_started;
    long long bytes_up, bytes_down;
    int reported; /* opened() was called: closed() is owed */
    int coalesce;
    int timed;           /* in the timed list: a deadline, or a side in a coalescing tick */
    Conn *prev, *next;   /* every live conn */
    Conn *tprev, *tnext; /* the timed list */
};

typedef struct Entry {
    struct Entry *next;
    uint64_t hash;
    char *key;
    size_t klen;
    struct sockaddr_storage addr;
    socklen_t alen;
    double expires, connect_timeout;
    PyObject *meta;
    PyObject *outgoing; /* NULL: a CONNECT head; else a plain-HTTP request head and what goes upstream */
} Entry;

typedef struct {
    PyObject_HEAD
    int ep, tfd, lfd;
    int listen_kind, timer_kind; /* epoll data for the listener and the timer */
    double armed;                /* deadline the timer is armed for, 0 = disarmed */
    double next_sweep;
    double accept_paused_until; /* out of fds or memory: not accepting for a moment */
    double header_timeout, idle_timeout;
    int audit;
    int coalesce;
    int in_poll, closed;
    unsigned long long generation, serials;
    long long hits, misses, nactive, nupstreams;
    size_t nentries;
    Entry *table[TABLE_SIZE];
    Conn *conns;     /* live */
    Conn *timed;     /* live, with a deadline or a paused side: what the timer looks at */
    Conn *graveyard; /* freed after the current poll */
    PyObject *on_miss, *on_hello, *on_opened, *on_closed, *on_timed_out, *on_request;
    char *rbuf;
} Front;

static double now_mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t hash_bytes(const char *p, size_t n) {
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)p[i];
        h *= 1099511628211ULL;
    }
    return h;
}

/* "ip:port" of the client, as the Python path writes it in records */
static PyObject *peer_text(int fd) {
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    char ip[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (getpeername(fd, (struct sockaddr *)&ss, &len) == 0) {
        if (ss.ss_family == AF_INET) {
            struct sockaddr_in *a = (struct sockaddr_in *)&ss;
            inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
            port = ntohs(a->sin_port);
        } else if (ss.ss_family == AF_INET6) {
            struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
            inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof ip);
            port = ntohs(a->sin6_port);
        }
    }
    return PyUnicode_FromFormat("%s:%d", ip, port);
}

/* -- the table of remembered heads ------------------------------------------------------------ */

static void entry_free(Entry *e) {
    Py_XDECREF(e->meta);
    Py_XDECREF(e->outgoing);
    PyMem_Free(e->key);
    PyMem_Free(e);
}

static void table_clear(Front *f) {
    for (int i = 0; i < TABLE_SIZE; i++) {
        Entry *e = f->table[i];
        f->table[i] = NULL;
        while (e) {
            Entry *next = e->next;
            entry_free(e);
            e = next;
        }
    }
    f->nentries = 0;
}

/* the link that points at key's entry, or at the NULL that ends its bucket */
static Entry **table_link(Front *f, const char *key, size_t klen) {
    uint64_t h = hash_bytes(key, klen);
    Entry **pp = &f->table[h % TABLE_SIZE];
    while (*pp && !((*pp)->hash == h && (*pp)->klen == klen && memcmp((*pp)->key, key, klen) == 0))
        pp = &(*pp)->next;
    return pp;
}

static void table_unlink(Front *f, Entry **pp) {
    Entry *e = *pp;
    *pp = e->next;
    entry_free(e);
    f->nentries--;
}

static void table_remove(Front *f, const char *key, size_t klen) {
    Entry **pp = table_link(f, key, klen);
    if (*pp) table_unlink(f, pp);
}

static Entry *table_find(Front *f, const char *key, size_t klen, double now) {
    Entry **pp = table_link(f, key, klen);
    if (*pp == NULL) return NULL;
    if ((*pp)->expires < now) {
        table_unlink(f, pp);
        return NULL;
    }
    return *pp;
}

/* -- epoll interest ---------------------------------------------------------------------------- */

static Side *other(Side *s) { return s->kind == K_CLIENT ? &s->conn->up : &s->conn->client; }

static uint32_t wanted(Side *s) {
    Conn *c = s->conn;
    if (s->closed) return 0;
    uint32_t ev = 0;
    if (s->pend_len > s->pend_off) ev |= EPOLLOUT;
    if (s->kind == K_UP && c->stage == ST_CONNECTING) return EPOLLOUT;
    int reads = 0;
    switch (c->stage) {
    case ST_HEAD: reads = s->kind == K_CLIENT; break;
    case ST_HELLO: case ST_RELAY: reads = 1; break;
    case ST_EXCHANGE: reads = 1; break; /* what the client sends now is read and dropped */
    default: reads = 0;
    }
    Side *o = other(s);
    /* back-pressure: not reading while the far side still has bytes to take */
    if (reads && !s->eof && !s->paused && !(o->pend_len > o->pend_off)) ev |= EPOLLIN;
    return ev;
}

static int update(Front *f, Side *s) {
    if (s->closed || s->fd < 0) return 0;
    uint32_t ev = wanted(s);
    if (ev == s->events) return 0;
    struct epoll_event e = {.events = ev, .data = {.ptr = s}};
    int r;
    if (s->events == 0) r = epoll_ctl(f->ep, EPOLL_CTL_ADD, s->fd, &e);
    else if (ev == 0) r = epoll_ctl(f->ep, EPOLL_CTL_DEL, s->fd, &e);
    else r = epoll_ctl(f->ep, EPOLL_CTL_MOD, s->fd, &e);
    if (r == 0) s->events = ev;
    return r;
}

/* -- timers ------------------------------------------------------------------------------------ */

static void arm(Front *f, double when) {
    /* the timer fires at the earliest of: a deadline, the end of a coalescing tick, the sweep */
    if (f->armed != 0 && f->armed <= when && f->armed > 0) return;
    struct itimerspec its;
    memset(&its, 0, sizeof its);
    if (when <= 0) when = 1e-9;
    its.it_value.tv_sec = (time_t)when;
    its.it_value.tv_nsec = (long)((when - (double)(time_t)when) * 1e9);
    if (its.it_value.tv_sec == 0 && its.it_value.tv_nsec == 0) its.it_value.tv_nsec = 1;
    if (timerfd_settime(f->tfd, TFD_TIMER_ABSTIME, &its, NULL) == 0) f->armed = when;
}

static void timed_add(Front *f, Conn *c) {
    if (c->timed) return;
    c->timed = 1;
    c->tprev = NULL;
    c->tnext = f->timed;
    if (f->timed) f->timed->tprev = c;
    f->timed = c;
}

static void timed_remove(Front *f, Conn *c) {
    if (!c->timed) return;
    c->timed = 0;
    if (c->tprev) c->tprev->tnext = c->tnext;
    else f->timed = c->tnext;
    if (c->tnext) c->tnext->tprev = c->tprev;
    c->tprev = c->tnext = NULL;
}

/* -- closing ----------------------------------------------------------------------------------- */

static void side_close(Front *f, Side *s) {
    if (s->closed) return;
    s->closed = 1;
    if (s->fd >= 0) {
        if (s->kind == K_UP) f->nupstreams--;
        close(s->fd); /* leaves the epoll set by itself */
        s->fd = -1;
    }
    s->events = 0;
    PyMem_Free(s->pend);
    s->pend = NULL;
    s->pend_len = s->pend_off = 0;
}

static void report_closed(Front *f, Conn *c) {
    if (!c->reported || f->on_closed == NULL || f->on_closed == Py_None) return;
    c->reported = 0;
    PyObject *r = PyObject_CallFunction(f->on_closed, "KLL", c->serial, c->bytes_up, c->bytes_down);
    if (r == NULL) PyErr_WriteUnraisable(f->on_closed);
    Py_XDECREF(r);
}

static void conn_bury(Front *f, Conn *c) {
    if (c->dead) return;
    c->dead = 1;
    f->nactive--;
    timed_remove(f, c);
    if (c->prev) c->prev->next = c->next;
    else f->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    c->prev = NULL;
    c->next = f->graveyard;
    f->graveyard = c;
    report_closed(f, c);
}

static void conn_abort(Front *f, Conn *c) {
    side_close(f, &c->client);
    side_close(f, &c->up);
    conn_bury(f, c);
}

/* a side that has nothing left to write is closed; the conn goes when both are */
static void closing_progress(Front *f, Conn *c) {
    if (!(c->client.pend_len > c->client.pend_off)) side_close(f, &c->client);
    if (!(c->up.pend_len > c->up.pend_off)) side_close(f, &c->up);
    if (c->client.closed && c->up.closed) conn_bury(f, c);
    else {
        if (update(f, &c->client) || update(f, &c->up)) conn_abort(f, c);
    }
}

static void conn_finish(Front *f, Conn *c) {
    /* one side said EOF: like the Python relay, the tunnel closes once the written bytes are out */
    c->stage = ST_CLOSING;
    c->deadline = 0;
    closing_progress(f, c);
}

static void conn_free(Conn *c) {
    PyMem_Free(c->client.pend);
    PyMem_Free(c->up.pend);
    PyMem_Free(c->buf);
    Py_XDECREF(c->meta);
    Py_XDECREF(c->outgoing);
    Py_XDECREF(c->feed);
    PyMem_Free(c);
}

/* -- writing ----------------------------------------------------------------------------------- */

/* write to dst now, keep what the kernel did not take; -1 on a fatal error */
static int send_to(Front *f, Side *dst, const char *data, size_t n) {
    if (dst->closed) return -1;
    if (dst->pend_len > dst->pend_off) {
        size_t have = dst->pend_len - dst->pend_off;
        char *p = PyMem_Malloc(have + n);
        if (p == NULL) return -1;
        memcpy(p, dst->pend + dst->pend_off, have);
        memcpy(p + have, data, n);
        PyMem_Free(dst->pend);
        dst->pend = p;
        dst->pend_off = 0;
        dst->pend_len = have + n;
        return 0;
    }
    ssize_t w = send(dst->fd, data, n, MSG_NOSIGNAL);
    if (w < 0) {
        if (errno != EAGAIN && errno != EINTR) return -1;
        w = 0;
    }
    if ((size_t)w < n) {
        size_t rest = n - (size_t)w;
        char *p = PyMem_Malloc(rest);
        if (p == NULL) return -1;
        memcpy(p, data + w, rest);
        PyMem_Free(dst->pend);
        dst->pend = p;
        dst->pend_off = 0;
        dst->pend_len = rest;
    }
    return 0;
}

static void on_writable(Front *f, Side *s) {
    Conn *c = s->conn;
    while (s->pend_len > s->pend_off) {
        ssize_t w = send(s->fd, s->pend + s->pend_off, s->pend_len - s->pend_off, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EAGAIN || errno == EINTR) break;
            conn_abort(f, c);
            return;
        }
        s->pend_off += (size_t)w;
        c->last_active = now_mono();
    }
    if (s->pend_off >= s->pend_len) {
        PyMem_Free(s->pend);
        s->pend = NULL;
        s->pend_len = s->pend_off = 0;
    }
    if (c->stage == ST_CLOSING) {
        closing_progress(f, c);
        return;
    }
    if (update(f, s) || update(f, other(s))) conn_abort(f, c);
}

/* -- handing a connection to Python ------------------------------------------------------------ */

/* earlier: None, or (meta, seconds) of a remembered address that did not answer in time */
static void hand_off_after(Front *f, Conn *c, double now, PyObject *earlier) {
    int fd = c->client.fd;
    if (c->client.events) {
        struct epoll_event e = {0};
        epoll_ctl(f->ep, EPOLL_CTL_DEL, fd, &e);
        c->client.events = 0;
    }
    side_close(f, &c->up);
    c->client.fd = -1;
    c->client.closed = 1;
    c->reported = 0;
    f->misses++;
    conn_bury(f, c);
    PyObject *data = PyBytes_FromStringAndSize(c->buf ? c->buf : "", (Py_ssize_t)c->len);
    PyObject *r = NULL;
    if (data != NULL) r = PyObject_CallFunction(f->on_miss, "iOdO", fd, data, now - c->started, earlier);
    Py_XDECREF(data);
    if (r == NULL) {
        PyErr_WriteUnraisable(f->on_miss);
        close(fd); /* Python did not take it: closed, never let through */
    } else if (r == Py_False) {
        close(fd);
    }
    Py_XDECREF(r);
}

static void hand_off(Front *f, Conn *c, double now) { hand_off_after(f, c, now, Py_None); }

/* -- the head ---------------------------------------------------------------------------------- */

static int buf_room(Conn *c, size_t want) {
    if (c->cap - c->len >= want) return 0;
    size_t cap = c->cap ? c->cap : 1024;
    while (cap - c->len < want) cap *= 2;
    char *p = PyMem_Realloc(c->buf, cap);
    if (p == NULL) return -1;
    c->buf = p;
    c->cap = cap;
    return 0;
}

static void start_connect(Front *f, Conn *c, Entry *e, double now);
static void relay_started(Conn *c);

/* the remembered address failed (refused, error, connect_timeout): forget the head, and let the
 * Python path connect again and answer with its own refusal and record. After a timeout Python is
 * told the time spent (it counts against its 2x connect_timeout) and tries that address last. */
static void connect_failed(Front *f, Conn *c, double now, int timed_out) {
    PyObject *earlier = NULL;
    if (timed_out && c->meta != NULL) {
        earlier = Py_BuildValue("(Od)", c->meta, now - c->connect_started);
        if (earlier == NULL) PyErr_Clear();
    }
    table_remove(f, c->buf, c->head_len);
    hand_off_after(f, c, now, earlier ? earlier : Py_None);
    Py_XDECREF(earlier);
}

static void head_bytes(Front *f, Conn *c, double now) {
    static const char prefix[] = "CONNECT ";
    char *end = c->len >= 4 ? memmem(c->buf, c->len, "\r\n\r\n", 4) : NULL;
    if (end == NULL) {
        size_t check = c->len < 8 ? c->len : 8;
        if (c->len < 8 && memcmp(c->buf, prefix, check) == 0) return; /* "CONNECT " so far */
        /* a head in pieces: only heads that arrive whole are served here; Python reads the rest
         * (and refuses a malformed head at once, as it would have) */
        hand_off(f, c, now);
        return;
    }
    c->head_len = (size_t)(end - c->buf) + 4;
    Entry *e = table_find(f, c->buf, c->head_len, now);
    /* a remembered request is served alone: anything after it (pipelining, a body) is Python's */
    if (e == NULL || (e->outgoing != NULL && c->len != c->head_len)) {
        hand_off(f, c, now);
        return;
    }
    f->hits++;
    start_connect(f, c, e, now);
}

static void on_head_readable(Front *f, Conn *c, double now) {
    if (buf_room(c, 4096)) {
        conn_abort(f, c);
        return;
    }
    ssize_t n = read(c->client.fd, c->buf + c->len, c->cap - c->len);
    if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) return;
        conn_abort(f, c);
        return;
    }
    if (n == 0) {
        conn_abort(f, c); /* gone before a complete head: nothing was decided, nothing recorded */
        return;
    }
    c->len += (size_t)n;
    head_bytes(f, c, now);
}

/* -- connecting -------------------------------------------------------------------------------- */

static void start_connect(Front *f, Conn *c, Entry *e, double now) {
    int fd = socket(e->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        hand_off(f, c, now);
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    Py_INCREF(e->meta);
    c->meta = e->meta;
    Py_XINCREF(e->outgoing);
    c->outgoing = e->outgoing;
    f->nupstreams++;
    c->up.fd = fd;
    c->up.closed = 0;
    c->stage = ST_CONNECTING;
    c->connect_started = now;
    c->deadline = now + e->connect_timeout;
    timed_add(f, c);
    arm(f, c->deadline);
    if (connect(fd, (struct sockaddr *)&e->addr, e->alen) < 0 && errno != EINPROGRESS) {
        connect_failed(f, c, now, 0);
        return;
    }
    if (update(f, &c->up) || update(f, &c->client)) conn_abort(f, c);
}

static void forward_client_bytes(Front *f, Conn *c, const char *data, size_t n, double now);

/* the head and hello buffer is not needed once relaying: an idle tunnel keeps only its Conn */
static void relay_started(Conn *c) {
    PyMem_Free(c->buf);
    c->buf = NULL;
    c->len = c->cap = c->head_len = 0;
}

static void check_hello(Front *f, Conn *c, double now) {
    /* the first bytes of the tunnel: a TLS ClientHello is checked by Python (SNI rule) */
    if (c->len == 0) return;
    if ((unsigned char)c->buf[0] == 0x16) {
        PyObject *data = PyBytes_FromStringAndSize(c->buf, (Py_ssize_t)c->len);
        PyObject *r = NULL;
        if (data != NULL) r = PyObject_CallFunction(f->on_hello, "OOK", c->meta, data, c->serial);
        Py_XDECREF(data);
        long verdict = 2;
        if (r == NULL) PyErr_WriteUnraisable(f->on_hello);
        else verdict = PyLong_AsLong(r);
        Py_XDECREF(r);
        if (PyErr_Occurred()) {
            PyErr_Clear();
            verdict = 2;
        }
        if (c->dead) return;
        if (verdict == 0) { /* not complete yet */
            if (c->len > HELLO_LIMIT) conn_abort(f, c);
            return;
        }
        if (verdict != 1) {
            conn_abort(f, c); /* refused (Python recorded why) */
            return;
        }
    }
    c->stage = ST_RELAY;
    forward_client_bytes(f, c, c->buf, c->len, now);
    relay_started(c);
}

/* a remembered request: Python makes the response reader (and the records), the head goes up */
static void start_exchange(Front *f, Conn *c) {
    c->serial = ++f->serials;
    PyObject *peer = peer_text(c->client.fd);
    PyObject *feed = peer ? PyObject_CallFunction(f->on_request, "OKO", c->meta, c->serial, peer) : NULL;
    Py_XDECREF(peer);
    if (feed == NULL) {
        PyErr_WriteUnraisable(f->on_request);
        conn_abort(f, c);
        return;
    }
    c->feed = feed;
    c->reported = 1; /* closed() is owed: Python keeps this request's state until then */
    if (c->dead) return;
    c->bytes_up += (long long)c->head_len;
    c->stage = ST_EXCHANGE;
    relay_started(c);
    if (send_to(f, &c->up, PyBytes_AS_STRING(c->outgoing), (size_t)PyBytes_GET_SIZE(c->outgoing))) {
        conn_abort(f, c);
        return;
    }
    if (update(f, &c->client) || update(f, &c->up)) conn_abort(f, c);
}

/* upstream bytes (or NULL: the upstream ended) through Python's response reader to the client */
static void feed_response(Front *f, Conn *c, const char *data, size_t n) {
    PyObject *arg = data != NULL ? PyBytes_FromStringAndSize(data, (Py_ssize_t)n) : Py_NewRef(Py_None);
    PyObject *r = arg != NULL ? PyObject_CallOneArg(c->feed, arg) : NULL;
    Py_XDECREF(arg);
    if (c->dead) {
        Py_XDECREF(r);
        return;
    }
    PyObject *out = NULL;
    int done = 1;
    if (r == NULL || !PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(r, 0))) {
        if (r == NULL) PyErr_WriteUnraisable(c->feed);
        Py_XDECREF(r);
        conn_abort(f, c); /* fail closed: nothing more is forwarded */
        return;
    }
    out = PyTuple_GET_ITEM(r, 0);
    done = PyObject_IsTrue(PyTuple_GET_ITEM(r, 1)) != 0 || data == NULL;
    if (PyBytes_GET_SIZE(out) > 0 && send_to(f, &c->client, PyBytes_AS_STRING(out), (size_t)PyBytes_GET_SIZE(out))) {
        Py_DECREF(r);
        conn_abort(f, c);
        return;
    }
    Py_DECREF(r);
    if (done) {
        side_close(f, &c->up); /* the exchange is over: the client closes once it has it all */
        conn_finish(f, c);
        return;
    }
    if (update(f, &c->client) || update(f, &c->up)) conn_abort(f, c);
}

static void on_connected(Front *f, Conn *c, double now) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(c->up.fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
    if (err == EINPROGRESS || err == EALREADY) return;
    if (err != 0) {
        connect_failed(f, c, now, 0);
        return;
    }
    c->deadline = 0;
    c->stage = ST_HELLO;
    c->last_active = now;
    if (f->next_sweep < now) f->next_sweep = now + SWEEP_EVERY;
    arm(f, f->next_sweep); /* limits.idle_timeout from here on */
    if (c->outgoing != NULL) {
        start_exchange(f, c);
        return;
    }
    c->serial = ++f->serials;
    /* what followed the head is the tunnel's first bytes */
    memmove(c->buf, c->buf + c->head_len, c->len - c->head_len);
    c->len -= c->head_len;
    c->head_len = 0;
    if (f->audit && f->on_opened != NULL && f->on_opened != Py_None) {
        PyObject *peer = peer_text(c->client.fd);
        PyObject *r = peer ? PyObject_CallFunction(f->on_opened, "OKO", c->meta, c->serial, peer) : NULL;
        Py_XDECREF(peer);
        if (r == NULL) {
            PyErr_WriteUnraisable(f->on_opened);
            conn_abort(f, c); /* no record, no tunnel */
            return;
        }
        Py_DECREF(r);
        c->reported = 1;
        if (c->dead) return;
    }
    if (send_to(f, &c->client, ESTABLISHED, sizeof ESTABLISHED - 1)) {
        conn_abort(f, c);
        return;
    }
    check_hello(f, c, now);
    if (c->dead) return;
    if (update(f, &c->client) || update(f, &c->up)) conn_abort(f, c);
}

/* -- relaying ---------------------------------------------------------------------------------- */

static void forward_client_bytes(Front *f, Conn *c, const char *data, size_t n, double now) {
    c->bytes_up += (long long)n;
    c->last_active = now;
    if (send_to(f, &c->up, data, n)) conn_abort(f, c);
}

static void coalesce_after(Front *f, Side *s, size_t n, double now) {
    /* see fastpath.py: a streaming side pauses one tick after forwarding so the next read batches */
    if (n < COALESCE_MIN || !f->coalesce) return;
    if (now - s->last_bulk >= COALESCE_WINDOW) {
        s->burst_start = now;
        s->burst_bytes = 0;
    } else {
        s->burst_bytes += (double)n;
    }
    s->last_bulk = now;
    double elapsed = now - s->burst_start;
    if (s->burst_bytes > 0 && n < COALESCE_MAX && s->burst_bytes < COALESCE_RATE * elapsed && !s->paused) {
        s->paused = 1;
        s->pause_until = now + COALESCE_PAUSE;
        timed_add(f, s->conn);
        arm(f, s->pause_until);
    }
}

static void on_readable(Front *f, Side *s, double now) {
    Conn *c = s->conn;
    if (c->stage == ST_EXCHANGE && s->kind == K_CLIENT) {
        /* after a `Connection: close` request: read and dropped, as the Python path drops what
         * follows it (and a close then sends no reset); its EOF ends nothing */
        ssize_t n = read(s->fd, f->rbuf, READ_CHUNK);
        if (n < 0) {
            if (errno != EAGAIN && errno != EINTR) conn_abort(f, c);
            return;
        }
        if (n == 0) s->eof = 1;
        else c->bytes_up += n;
        if (update(f, s)) conn_abort(f, c);
        return;
    }
    if (c->stage == ST_EXCHANGE) {
        ssize_t n = read(s->fd, f->rbuf, READ_CHUNK);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
        c->last_active = now;
        if (n > 0) c->bytes_down += n;
        feed_response(f, c, n > 0 ? f->rbuf : NULL, n > 0 ? (size_t)n : 0);
        return;
    }
    ssize_t n = read(s->fd, f->rbuf, READ_CHUNK);
    if (n < 0) {
        if (errno != EAGAIN && errno != EINTR) conn_abort(f, c);
        return;
    }
    if (n == 0) {
        s->eof = 1;
        conn_finish(f, c);
        return;
    }
    if (c->stage == ST_HELLO && s->kind == K_CLIENT) {
        c->last_active = now;
        if (c->len == 0 && (unsigned char)f->rbuf[0] != 0x16) {
            c->stage = ST_RELAY; /* not TLS: relayed as it is, from here on */
            relay_started(c);
        } else {
            if (buf_room(c, (size_t)n)) {
                conn_abort(f, c);
                return;
            }
            memcpy(c->buf + c->len, f->rbuf, (size_t)n);
            c->len += (size_t)n;
            check_hello(f, c, now);
            if (!c->dead && (update(f, &c->client) || update(f, &c->up))) conn_abort(f, c);
            return;
        }
    }
    Side *dst = other(s);
    c->last_active = now;
    if (s->kind == K_CLIENT) c->bytes_up += n;
    else c->bytes_down += n;
    if (send_to(f, dst, f->rbuf, (size_t)n)) {
        conn_abort(f, c);
        return;
    }
    coalesce_after(f, s, (size_t)n, now);
    if (update(f, s) || update(f, dst)) conn_abort(f, c);
}

/* -- accepting --------------------------------------------------------------------------------- */

static void on_accept(Front *f, double now) {
    for (int i = 0; i < 64; i++) {
        int fd = accept4(f->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                /* like asyncio: stop accepting for a moment instead of spinning on the listener */
                struct epoll_event e = {0};
                epoll_ctl(f->ep, EPOLL_CTL_DEL, f->lfd, &e);
                f->accept_paused_until = now + 0.1;
                arm(f, f->accept_paused_until);
            }
            return; /* EAGAIN, or an error of that one connection */
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        Conn *c = PyMem_Calloc(1, sizeof(Conn));
        if (c == NULL) {
            close(fd);
            return;
        }
        c->client.kind = K_CLIENT;
        c->client.fd = fd;
        c->client.conn = c;
        c->up.kind = K_UP;
        c->up.fd = -1;
        c->up.closed = 1;
        c->up.conn = c;
        c->stage = ST_HEAD;
        c->started = c->last_active = now;
        c->deadline = now + f->header_timeout;
        timed_add(f, c);
        c->next = f->conns;
        if (f->conns) f->conns->prev = c;
        f->conns = c;
        f->nactive++;
        arm(f, c->deadline);
        on_head_readable(f, c, now); /* the head is usually there already */
        if (!c->dead && c->stage == ST_HEAD && update(f, &c->client)) conn_abort(f, c);
    }
}

/* -- the timer --------------------------------------------------------------------------------- */

static void timed_out_head(Front *f, Conn *c) {
    if (f->audit && f->on_timed_out != NULL && f->on_timed_out != Py_None) {
        PyObject *peer = peer_text(c->client.fd);
        PyObject *r = peer ? PyObject_CallFunction(f->on_timed_out, "Od", peer, f->header_timeout) : NULL;
        Py_XDECREF(peer);
        if (r == NULL) PyErr_WriteUnraisable(f->on_timed_out);
        Py_XDECREF(r);
    }
    if (!c->dead) conn_abort(f, c);
}

static void on_timer(Front *f, double now) {
    uint64_t ticks;
    if (read(f->tfd, &ticks, sizeof ticks) < 0) { /* nothing */ }
    f->armed = 0;
    if (f->accept_paused_until != 0 && f->accept_paused_until <= now) {
        f->accept_paused_until = 0;
        if (f->lfd >= 0) {
            struct epoll_event el = {.events = EPOLLIN, .data = {.ptr = &f->listen_kind}};
            epoll_ctl(f->ep, EPOLL_CTL_ADD, f->lfd, &el);
        }
    }
    int sweep = now >= f->next_sweep;
    if (sweep) f->next_sweep = now + SWEEP_EVERY;
    double next = 0;
    for (Conn *c = f->timed, *n; c; c = n) {
        n = c->tnext;
        if (c->deadline != 0 && c->deadline <= now) {
            if (c->stage == ST_HEAD) timed_out_head(f, c);
            else if (c->stage == ST_CONNECTING) connect_failed(f, c, now, 1);
            else c->deadline = 0;
            if (c->dead) continue;
        }
        for (int i = 0; i < 2; i++) {
            Side *s = i ? &c->up : &c->client;
            if (s->paused) {
                if (s->pause_until <= now) {
                    s->paused = 0;
                    if (update(f, s)) {
                        conn_abort(f, c);
                        break;
                    }
                } else if (next == 0 || s->pause_until < next) next = s->pause_until;
            }
        }
        if (c->dead) continue;
        if (c->deadline != 0 && (next == 0 || c->deadline < next)) next = c->deadline;
        if (c->deadline == 0 && !c->client.paused && !c->up.paused) timed_remove(f, c);
    }
    if (sweep) {
        for (Conn *c = f->conns, *n; c; c = n) {
            n = c->next;
            if (c->stage >= ST_HELLO && now - c->last_active > f->idle_timeout) conn_abort(f, c);
        }
    }
    if (f->conns != NULL && (next == 0 || f->next_sweep < next)) next = f->next_sweep;
    if (f->accept_paused_until != 0 && (next == 0 || f->accept_paused_until < next)) next = f->accept_paused_until;
    if (next != 0) arm(f, next);
}

/* -- Python interface -------------------------------------------------------------------------- */

static void dispatch(Front *f, struct epoll_event *ev, double now) {
    int kind = *(int *)ev->data.ptr;
    if (kind == K_LISTEN) {
        on_accept(f, now);
        return;
    }
    if (kind == K_TIMER) {
        on_timer(f, now);
        return;
    }
    Side *s = ev->data.ptr;
    Conn *c = s->conn;
    if (c->dead || s->closed) return;
    uint32_t e = ev->events;
    if (c->stage == ST_CONNECTING && s->kind == K_UP) {
        if (e & (EPOLLOUT | EPOLLERR | EPOLLHUP)) on_connected(f, c, now);
        return;
    }
    if (e & EPOLLOUT) {
        on_writable(f, s);
        if (c->dead || s->closed) return;
    }
    if (e & (EPOLLIN | EPOLLERR | EPOLLHUP)) {
        if (s->events & EPOLLIN) {
            if (c->stage == ST_HEAD) on_head_readable(f, c, now);
            else on_readable(f, s, now);
        } else if (e & (EPOLLERR | EPOLLHUP)) {
            conn_abort(f, c); /* reset, or shut both ways, while not reading it: nothing more to do */
        }
    }
}

static PyObject *Front_poll(Front *f, PyObject *Py_UNUSED(ignored)) {
    if (f->closed || f->in_poll) Py_RETURN_NONE;
    f->in_poll = 1;
    struct epoll_event events[MAX_EVENTS];
    for (int round = 0; round < 4; round++) {
        int n = epoll_wait(f->ep, events, MAX_EVENTS, 0);
        if (n <= 0) break;
        double now = now_mono();
        for (int i = 0; i < n; i++) dispatch(f, &events[i], now);
        if (n < MAX_EVENTS) break;
    }
    while (f->graveyard) {
        Conn *c = f->graveyard;
        f->graveyard = c->next;
        conn_free(c);
    }
    f->in_poll = 0;
    Py_RETURN_NONE;
}

static PyObject *Front_remember(Front *f, PyObject *args) {
    const char *head, *ip;
    Py_ssize_t hlen;
    unsigned long long generation;
    int port;
    double connect_timeout, ttl;
    PyObject *meta, *outgoing = Py_None;
    if (!PyArg_ParseTuple(args, "y#KsiddO|O", &head, &hlen, &generation, &ip, &port, &connect_timeout, &ttl,
                          &meta, &outgoing))
        return NULL;
    if (outgoing != Py_None && !PyBytes_Check(outgoing)) {
        PyErr_SetString(PyExc_TypeError, "outgoing must be bytes or None");
        return NULL;
    }
    if (generation != f->generation || f->closed) Py_RETURN_FALSE; /* decided under what changed since */
    if (hlen > HEAD_LIMIT) Py_RETURN_FALSE;                          /* never read whole here */
    struct sockaddr_storage addr;
    memset(&addr, 0, sizeof addr);
    socklen_t alen;
    struct sockaddr_in *a4 = (struct sockaddr_in *)&addr;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&addr;
    if (inet_pton(AF_INET, ip, &a4->sin_addr) == 1) {
        a4->sin_family = AF_INET;
        a4->sin_port = htons((uint16_t)port);
        alen = sizeof *a4;
    } else if (inet_pton(AF_INET6, ip, &a6->sin6_addr) == 1) {
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons((uint16_t)port);
        alen = sizeof *a6;
    } else {
        PyErr_Format(PyExc_ValueError, "not an IP address: %s", ip);
        return NULL;
    }
    if (port <= 0 || port > 65535 || hlen < 4 || memcmp(head + hlen - 4, "\r\n\r\n", 4) != 0) {
        PyErr_SetString(PyExc_ValueError, "a complete head and a port are needed");
        return NULL;
    }
    if (f->nentries >= TABLE_MAX) table_clear(f);
    table_remove(f, head, (size_t)hlen);
    Entry *e = PyMem_Calloc(1, sizeof(Entry));
    if (e == NULL) return PyErr_NoMemory();
    e->key = PyMem_Malloc((size_t)hlen);
    if (e->key == NULL) {
        PyMem_Free(e);
        return PyErr_NoMemory();
    }
    memcpy(e->key, head, (size_t)hlen);
    e->klen = (size_t)hlen;
    e->hash = hash_bytes(head, (size_t)hlen);
    e->addr = addr;
    e->alen = alen;
    e->expires = now_mono() + ttl;
    e->connect_timeout = connect_timeout;
    Py_INCREF(meta);
    e->meta = meta;
    if (outgoing != Py_None) {
        Py_INCREF(outgoing);
        e->outgoing = outgoing;
    }
    Entry **bucket = &f->table[e->hash % TABLE_SIZE];
    e->next = *bucket;
    *bucket = e;
    f->nentries++;
    Py_RETURN_TRUE;
}

static PyObject *Front_invalidate(Front *f, PyObject *Py_UNUSED(ignored)) {
    f->generation++;
    table_clear(f);
    Py_RETURN_NONE;
}

static PyObject *Front_configure(Front *f, PyObject *args) {
    double header_timeout, idle_timeout;
    int audit, coalesce;
    if (!PyArg_ParseTuple(args, "ddpp", &header_timeout, &idle_timeout, &audit, &coalesce)) return NULL;
    f->header_timeout = header_timeout;
    f->idle_timeout = idle_timeout;
    f->audit = audit;
    f->coalesce = coalesce;
    Py_RETURN_NONE;
}

static PyObject *Front_stop_listening(Front *f, PyObject *Py_UNUSED(ignored)) {
    if (f->lfd >= 0) {
        struct epoll_event e = {0};
        epoll_ctl(f->ep, EPOLL_CTL_DEL, f->lfd, &e);
        f->lfd = -1; /* the socket itself belongs to Python */
    }
    Py_RETURN_NONE;
}

static void front_close_all(Front *f) {
    while (f->conns) {
        Conn *c = f->conns;
        conn_abort(f, c);
    }
    while (f->graveyard) {
        Conn *c = f->graveyard;
        f->graveyard = c->next;
        conn_free(c);
    }
}

/* every connection, the table and the epoll set: by close(), or when the object goes */
static void front_release(Front *f) {
    Front_stop_listening(f, NULL);
    front_close_all(f);
    table_clear(f);
    f->closed = 1;
    if (f->ep >= 0) close(f->ep);
    if (f->tfd >= 0) close(f->tfd);
    f->ep = f->tfd = -1;
}

static PyObject *Front_close(Front *f, PyObject *Py_UNUSED(ignored)) {
    if (f->closed) Py_RETURN_NONE;
    if (f->in_poll) {
        PyErr_SetString(PyExc_RuntimeError, "close() from inside poll()");
        return NULL;
    }
    front_release(f);
    Py_RETURN_NONE;
}

static PyObject *Front_fileno(Front *f, PyObject *Py_UNUSED(ignored)) { return PyLong_FromLong(f->ep); }

static PyObject *Front_active(Front *f, PyObject *Py_UNUSED(ignored)) { return PyLong_FromLongLong(f->nactive); }

static PyObject *Front_upstreams(Front *f, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLongLong(f->nupstreams);
}

static PyObject *Front_stats(Front *f, PyObject *Py_UNUSED(ignored)) {
    size_t buffered = 0; /* the most bytes any side holds unwritten now */
    for (Conn *c = f->conns; c; c = c->next) {
        size_t a = c->client.pend_len - c->client.pend_off, b = c->up.pend_len - c->up.pend_off;
        if (a > buffered) buffered = a;
        if (b > buffered) buffered = b;
    }
    return Py_BuildValue("{sLsLsLsnsKsn}", "hits", f->hits, "misses", f->misses, "active", f->nactive, "entries",
                         (Py_ssize_t)f->nentries, "generation", f->generation, "buffered", (Py_ssize_t)buffered);
}

static PyObject *Front_generation(Front *f, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(f->generation);
}

static int Front_init(Front *f, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"listen_fd", "miss", "hello", "opened", "closed", "timed_out", "request", NULL};
    int lfd;
    PyObject *miss, *hello, *opened, *closedcb, *timed_out, *request;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOOOOO", kwlist, &lfd, &miss, &hello, &opened, &closedcb,
                                     &timed_out, &request))
        return -1;
    if (f->ep >= 0 || f->rbuf != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "already initialised");
        return -1;
    }
    f->rbuf = PyMem_Malloc(READ_CHUNK);
    if (f->rbuf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    f->ep = epoll_create1(EPOLL_CLOEXEC);
    f->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (f->ep < 0 || f->tfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    f->lfd = lfd;
    f->listen_kind = K_LISTEN;
    f->timer_kind = K_TIMER;
    struct epoll_event el = {.events = EPOLLIN, .data = {.ptr = &f->listen_kind}};
    struct epoll_event et = {.events = EPOLLIN, .data = {.ptr = &f->timer_kind}};
    if (epoll_ctl(f->ep, EPOLL_CTL_ADD, lfd, &el) < 0 || epoll_ctl(f->ep, EPOLL_CTL_ADD, f->tfd, &et) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    f->header_timeout = 10.0;
    f->idle_timeout = 300.0;
    f->coalesce = 1;
    f->next_sweep = now_mono() + SWEEP_EVERY;
    Py_INCREF(miss);
    Py_INCREF(hello);
    Py_INCREF(opened);
    Py_INCREF(closedcb);
    Py_INCREF(timed_out);
    Py_INCREF(request);
    f->on_request = request;
    f->on_miss = miss;
    f->on_hello = hello;
    f->on_opened = opened;
    f->on_closed = closedcb;
    f->on_timed_out = timed_out;
    return 0;
}

static PyObject *Front_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Front *f = (Front *)type->tp_alloc(type, 0);
    if (f != NULL) {
        f->ep = f->tfd = f->lfd = -1;
    }
    return (PyObject *)f;
}

static void Front_dealloc(Front *f) {
    if (!f->closed && !f->in_poll) front_release(f);
    Py_XDECREF(f->on_miss);
    Py_XDECREF(f->on_hello);
    Py_XDECREF(f->on_opened);
    Py_XDECREF(f->on_closed);
    Py_XDECREF(f->on_timed_out);
    Py_XDECREF(f->on_request);
    PyMem_Free(f->rbuf);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyMethodDef Front_methods[] = {
    {"poll", (PyCFunction)Front_poll, METH_NOARGS, "Serve what is ready; call when fileno() is readable."},
    {"remember", (PyCFunction)Front_remember, METH_VARARGS,
     "remember(head, generation, ip, port, connect_timeout, ttl, meta, outgoing=None) -> bool"},
    {"invalidate", (PyCFunction)Front_invalidate, METH_NOARGS, "Forget every remembered head."},
    {"configure", (PyCFunction)Front_configure, METH_VARARGS,
     "configure(header_timeout, idle_timeout, audit, coalesce)"},
    {"stop_listening", (PyCFunction)Front_stop_listening, METH_NOARGS, "Accept no more connections."},
    {"close", (PyCFunction)Front_close, METH_NOARGS, "Close every connection and the epoll set."},
    {"fileno", (PyCFunction)Front_fileno, METH_NOARGS, "The epoll fd to watch for readability."},
    {"active", (PyCFunction)Front_active, METH_NOARGS, "Connections open here now."},
    {"upstreams", (PyCFunction)Front_upstreams, METH_NOARGS, "Upstream connections open here now."},
    {"stats", (PyCFunction)Front_stats, METH_NOARGS, "Counters for tests and diagnostics."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Front_getset[] = {
    {"generation", (getter)Front_generation, NULL, "Bumped by invalidate().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FrontType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "egressd.engine._tunnels.Front",
    .tp_basicsize = sizeof(Front),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The native tunnel front: remembered CONNECT heads served without Python.",
    .tp_new = Front_new,
    .tp_init = (initproc)Front_init,
    .tp_dealloc = (destructor)Front_dealloc,
    .tp_methods = Front_methods,
    .tp_getset = Front_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "egressd.engine._tunnels", "The native tunnel front (Linux).", -1, NULL,
};

PyMODINIT_FUNC PyInit__tunnels(void) {
    if (PyType_Ready(&FrontType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&FrontType);
    if (PyModule_AddObject(m, "Front", (PyObject *)&FrontType) < 0) {
        Py_DECREF(&FrontType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
