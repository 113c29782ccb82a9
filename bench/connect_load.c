/*
 * Workload 2's load generator in C: CONCURRENCY connections each doing, in a loop, connect +
 * (CONNECT head, the proxy's 2xx) + one small GET + the whole response (Content-Length) + close.
 * Why C: the Python generator spends more CPU per tunnel than the proxies under test, so on one
 * load core it, not the proxy, set the rate (⚑).
 *
 *   connect_load HOST PORT CONCURRENCY WARMUP_S SECONDS CONNECT_HEAD REQUEST
 *
 * CONNECT_HEAD empty = direct. Prints "WINDOW_START" and "WINDOW_END" lines when the measured
 * window opens and closes (the bench samples the proxy's CPU between them), then one JSON line:
 * {"ops", "errors", "seconds", "first_error", "latencies_us": [socket() to tunnel usable, ...]}.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { CONNECTING, WAIT_PROXY, WAIT_RESPONSE };

typedef struct {
    int fd, state;
    double t0, t_ready, deadline;
    char buf[16384];
    size_t len;
    long want; /* bytes of the whole response, -1 until its head is read */
} Conn;

static struct sockaddr_in target;
static const char *connect_head, *request;
static size_t connect_len, request_len;
static int ep;
static long ops, errors;
static char first_error[200];
static long *lat;
static size_t nlat, caplat;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void note_error(const char *what) {
    errors++;
    if (!first_error[0]) snprintf(first_error, sizeof first_error, "%s: %s", what, strerror(errno));
}

static int start(Conn *c) {
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c->fd < 0) return -1;
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->t0 = now();
    c->deadline = c->t0 + 10.0;
    c->len = 0;
    c->want = -1;
    c->state = CONNECTING;
    if (connect(c->fd, (struct sockaddr *)&target, sizeof target) < 0 && errno != EINPROGRESS) {
        close(c->fd);
        return -1;
    }
    struct epoll_event e = {.events = EPOLLOUT, .data = {.ptr = c}};
    return epoll_ctl(ep, EPOLL_CTL_ADD, c->fd, &e);
}

static void restart(Conn *c) {
    close(c->fd);
    while (start(c) < 0) note_error("socket/connect");
}

static long content_length(const char *head, size_t n) {
    const char *p = head;
    const char *end = head + n;
    while (p < end) {
        const char *line = memmem(p, (size_t)(end - p), "\r\n", 2);
        if (line == NULL) break;
        if ((size_t)(line - p) > 15 && strncasecmp(p, "content-length:", 15) == 0) return atol(p + 15);
        p = line + 2;
    }
    return 0;
}

static void on_event(Conn *c, double t_measure, double t_end) {
    if (c->state == CONNECTING) {
        int err = 0;
        socklen_t l = sizeof err;
        getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &l);
        if (err) {
            errno = err;
            note_error("connect");
            restart(c);
            return;
        }
        struct epoll_event e = {.events = EPOLLIN, .data = {.ptr = c}};
        epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &e);
        if (connect_len) {
            c->state = WAIT_PROXY;
            if (write(c->fd, connect_head, connect_len) != (ssize_t)connect_len) note_error("write");
        } else {
            c->state = WAIT_RESPONSE;
            c->t_ready = now();
            if (write(c->fd, request, request_len) != (ssize_t)request_len) note_error("write");
        }
        return;
    }
    ssize_t n = read(c->fd, c->buf + c->len, sizeof c->buf - c->len);
    if (n < 0 && errno == EAGAIN) return;
    if (n <= 0) {
        if (n == 0) errno = ECONNRESET;
        note_error("read");
        restart(c);
        return;
    }
    c->len += (size_t)n;
    char *end = memmem(c->buf, c->len, "\r\n\r\n", 4);
    if (c->state == WAIT_PROXY) {
        if (end == NULL) return;
        if (c->len < 12 || c->buf[9] != '2') {
            errno = EPROTO;
            note_error("CONNECT refused");
            restart(c);
            return;
        }
        c->t_ready = now();
        size_t rest = c->len - (size_t)(end + 4 - c->buf);
        memmove(c->buf, end + 4, rest);
        c->len = rest;
        c->state = WAIT_RESPONSE;
        if (write(c->fd, request, request_len) != (ssize_t)request_len) note_error("write");
        end = c->len >= 4 ? memmem(c->buf, c->len, "\r\n\r\n", 4) : NULL;
    }
    if (c->want < 0) {
        if (end == NULL) return;
        c->want = (long)(end + 4 - c->buf) + content_length(c->buf, (size_t)(end - c->buf) + 2);
    }
    if ((long)c->len < c->want) return;
    double t1 = now();
    if (t1 >= t_measure && t1 <= t_end) {
        ops++;
        if (nlat == caplat) {
            caplat = caplat ? caplat * 2 : 65536;
            lat = realloc(lat, caplat * sizeof *lat);
        }
        lat[nlat++] = (long)((c->t_ready - c->t0) * 1e6);
    }
    restart(c);
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s HOST PORT CONCURRENCY WARMUP SECONDS CONNECT_HEAD REQUEST\n", argv[0]);
        return 2;
    }
    target.sin_family = AF_INET;
    target.sin_port = htons((unsigned short)atoi(argv[2]));
    if (inet_pton(AF_INET, argv[1], &target.sin_addr) != 1) return 2;
    int concurrency = atoi(argv[3]);
    double warmup = atof(argv[4]), seconds = atof(argv[5]);
    connect_head = argv[6];
    connect_len = strlen(connect_head);
    request = argv[7];
    request_len = strlen(request);
    ep = epoll_create1(0);
    Conn *conns = calloc((size_t)concurrency, sizeof(Conn));
    double t_begin = now(), t_measure = t_begin + warmup, t_end = t_measure + seconds;
    for (int i = 0; i < concurrency; i++)
        while (start(&conns[i]) < 0) note_error("socket/connect");
    int window = 0;
    struct epoll_event events[256];
    for (;;) {
        double t = now();
        if (!window && t >= t_measure) {
            window = 1;
            errors = 0;
            first_error[0] = 0;
            printf("WINDOW_START\n");
            fflush(stdout);
        }
        if (t >= t_end) break;
        int n = epoll_wait(ep, events, 256, 10);
        for (int i = 0; i < n; i++) on_event(events[i].data.ptr, t_measure, t_end);
        t = now();
        for (int i = 0; i < concurrency; i++)
            if (conns[i].deadline < t) {
                errno = ETIMEDOUT;
                note_error("tunnel");
                restart(&conns[i]);
            }
    }
    printf("WINDOW_END\n");
    fflush(stdout);
    printf("{\"ops\": %ld, \"errors\": %ld, \"seconds\": %.6f, \"first_error\": \"%s\", \"latencies_us\": [", ops,
           errors, seconds, first_error);
    for (size_t i = 0; i < nlat; i++) printf(i ? ",%ld" : "%ld", lat[i]);
    printf("]}\n");
    return 0;
}
