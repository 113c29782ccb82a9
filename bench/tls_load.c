/*
 * Workload 1 (TLS) in C with OpenSSL: the client that pushes the bytes through one CONNECT tunnel,
 * and the TLS sink that reads them. Why C: with Python's ssl module on both ends, the one load core
 * (client + sink) ran out before the faster proxies did, so the TLS line measured the load side (⚑).
 * The exchange is the Python one's: the client sends an 8-byte big-endian length, then the bytes;
 * the sink answers one byte 0x01 once it has read them all. The sink decrypts only the length
 * record and counts the bytes of the records after it (count_records): an upstream elsewhere would
 * decrypt on its own CPU, not on the load core.
 *
 *   tls_load sink PORT CERT_CHAIN KEY
 *   tls_load send HOST PORT CONNECT_HEAD SERVER_NAME NBYTES CA_FILE
 *
 * send: CONNECT_HEAD empty = direct to HOST:PORT, else that head is sent to the proxy at HOST:PORT
 * first and a 2xx awaited. SERVER_NAME is verified against the certificate (an IP literal as an IP).
 * The client writes as OpenSSL does for any caller (curl, git): SSL_write of large buffers, one
 * socket write per TLS record. Prints "WINDOW_START" and "WINDOW_END" around the timed transfer
 * (the bench samples the proxy's CPU between them), then {"seconds": S, "bytes": N, "cipher": C}.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CHUNK (4 * 1024 * 1024) /* the sink's reads */
#define WRITE (256 * 1024)       /* the client's SSL_write()s, of one buffer the cache keeps */

static void die(const char *what) {
    fprintf(stderr, "tls_load: %s: %s\n", what, errno ? strerror(errno) : "");
    ERR_print_errors_fp(stderr);
    exit(1);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int read_full(SSL *ssl, unsigned char *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        size_t r = 0;
        if (!SSL_read_ex(ssl, buf + got, n - got, &r)) return -1;
        got += r;
    }
    return 0;
}

/* -- sink ------------------------------------------------------------------------------------- */
static SSL_CTX *server_ctx;

/* After the first record (the length, read with OpenSSL), the sink counts the client's records
 * without decrypting them: each must be a TLS 1.3 application-data record (23 03 03 LEN) carrying
 * LEN - 17 bytes of data (content-type byte + 16-byte AEAD tag; OpenSSL does not pad). Its reads
 * are plain recv() of up to 4 MiB. The ack is written with OpenSSL (the write side is untouched). */
static int count_records(int fd, unsigned char *buf, uint64_t want) {
    uint64_t got = 0;
    unsigned char head[5];
    size_t head_len = 0, skip = 0;
    while (got < want || skip > 0 || head_len > 0) { /* until the last record's last byte */
        ssize_t n = recv(fd, buf, CHUNK, 0);
        if (n <= 0) {
            if (n < 0 && errno == EINTR) continue;
            return -1;
        }
        size_t i = 0;
        while (i < (size_t)n) {
            if (skip) {
                size_t take = (size_t)n - i < skip ? (size_t)n - i : skip;
                skip -= take;
                i += take;
                continue;
            }
            head[head_len++] = buf[i++];
            if (head_len < 5) continue;
            head_len = 0;
            skip = (size_t)head[3] << 8 | head[4];
            if (head[0] != 23 || head[1] != 3 || head[2] != 3 || skip < 18 || skip > 16384 + 256) return -1;
            got += skip - 17;
        }
    }
    return got == want ? 0 : -1;
}

static void sink_failed(const char *what) {
    fprintf(stderr, "tls_load sink: %s failed (%s)\n", what, errno ? strerror(errno) : "no errno");
    ERR_print_errors_fp(stderr);
}

static void *sink_connection(void *arg) {
    int fd = (int)(intptr_t)arg, one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    SSL *ssl = SSL_new(server_ctx);
    unsigned char *buf = malloc(CHUNK);
    unsigned char header[8];
    if (!ssl || !buf) goto out;
    SSL_set_fd(ssl, fd);
    if (SSL_accept(ssl) != 1) goto out; /* the bench's port probes connect and close at once */
    if (read_full(ssl, header, 8) < 0) {
        sink_failed("reading the length");
        goto out;
    }
    uint64_t want = 0;
    for (int i = 0; i < 8; i++) want = want << 8 | header[i];
    if (SSL_has_pending(ssl)) {
        sink_failed("OpenSSL read past the length record");
        goto out;
    }
    if (count_records(fd, buf, want) < 0) {
        sink_failed("counting the records");
        goto out;
    }
    size_t w;
    if (SSL_write_ex(ssl, "\x01", 1, &w)) {
        while (recv(fd, buf, CHUNK, 0) > 0) {
        } /* wait for the client to close first (no TIME_WAIT here) */
    }
out:
    if (ssl) SSL_free(ssl);
    free(buf);
    close(fd);
    return NULL;
}

_Noreturn static void sink(int port, const char *cert, const char *key) {
    server_ctx = SSL_CTX_new(TLS_server_method());
    if (!server_ctx || SSL_CTX_use_certificate_chain_file(server_ctx, cert) != 1 ||
        SSL_CTX_use_PrivateKey_file(server_ctx, key, SSL_FILETYPE_PEM) != 1)
        die("certificate");
    /* TLS 1.3 only (the record counting above); no read-ahead: OpenSSL must not read past the
     * length record. */
    SSL_CTX_set_min_proto_version(server_ctx, TLS1_3_VERSION);
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1, rcvbuf = 4 * 1024 * 1024;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    setsockopt(lfd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(lfd, 1024) < 0)
        die("listen");
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE) continue;
            die("accept");
        }
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, sink_connection, (void *)(intptr_t)fd) != 0) close(fd);
        pthread_attr_destroy(&attr);
    }
}

/* -- client ----------------------------------------------------------------------------------- */
static int open_tunnel(const char *host, int port, const char *connect_head) {
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1) die("HOST must be an IPv4 address");
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1, sndbuf = CHUNK;
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) die("connect");
    size_t len = strlen(connect_head);
    if (len) {
        if (write(fd, connect_head, len) != (ssize_t)len) die("send CONNECT");
        char head[4096];
        size_t got = 0;
        while (got < sizeof head - 1) { /* byte by byte: nothing of the tunnel is read early */
            ssize_t r = read(fd, head + got, 1);
            if (r <= 0) die("the proxy closed before answering CONNECT");
            got += (size_t)r;
            if (got >= 4 && memcmp(head + got - 4, "\r\n\r\n", 4) == 0) break;
        }
        head[got] = 0;
        if (strncmp(head, "HTTP/1.", 7) != 0 || head[9] != '2') {
            fprintf(stderr, "tls_load: CONNECT refused: %.60s\n", head);
            exit(2);
        }
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    return fd;
}

static int send_bytes(char **argv) {
    const char *host = argv[0], *connect_head = argv[2], *name = argv[3], *ca = argv[5];
    int port = atoi(argv[1]);
    uint64_t total = strtoull(argv[4], NULL, 10);
    SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
    if (!ctx || SSL_CTX_load_verify_locations(ctx, ca, NULL) != 1) die("CA file");
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    int fd = open_tunnel(host, port, connect_head);
    SSL *ssl = SSL_new(ctx);
    X509_VERIFY_PARAM *param = SSL_get0_param(ssl);
    unsigned char ip[16];
    if (inet_pton(AF_INET, name, ip) == 1 || inet_pton(AF_INET6, name, ip) == 1) {
        if (X509_VERIFY_PARAM_set1_ip_asc(param, name) != 1) die("server name");
    } else if (SSL_set_tlsext_host_name(ssl, name) != 1 || SSL_set1_host(ssl, name) != 1) {
        die("server name");
    }
    SSL_set_fd(ssl, fd);
    if (SSL_connect(ssl) != 1) die("TLS handshake");
    unsigned char *buf = malloc(WRITE), header[8];
    if (!buf) die("malloc");
    for (size_t i = 0; i < WRITE; i++) buf[i] = (unsigned char)(random() >> 7);
    for (int i = 0; i < 8; i++) header[i] = (unsigned char)(total >> (56 - 8 * i));
    size_t w;
    if (!SSL_write_ex(ssl, header, 8, &w)) die("send length");
    printf("WINDOW_START\n");
    fflush(stdout);
    double t0 = now();
    for (uint64_t left = total; left > 0;) {
        size_t n = left < WRITE ? (size_t)left : WRITE;
        if (!SSL_write_ex(ssl, buf, n, &w)) die("send");
        left -= w;
    }
    unsigned char ack = 0;
    if (read_full(ssl, &ack, 1) < 0 || ack != 1) die("the sink did not confirm the bytes (tunnel broken)");
    double elapsed = now() - t0;
    printf("WINDOW_END\n{\"seconds\": %.6f, \"bytes\": %llu, \"cipher\": \"%s\"}\n", elapsed,
           (unsigned long long)total, SSL_get_cipher_name(ssl));
    fflush(stdout);
    SSL_free(ssl);
    close(fd);
    SSL_CTX_free(ctx);
    free(buf);
    return 0;
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    if (argc == 5 && strcmp(argv[1], "sink") == 0) sink(atoi(argv[2]), argv[3], argv[4]);
    if (argc == 8 && strcmp(argv[1], "send") == 0) return send_bytes(argv + 2);
    fprintf(stderr,
            "usage: tls_load sink PORT CERT_CHAIN KEY\n"
            "       tls_load send HOST PORT CONNECT_HEAD SERVER_NAME NBYTES CA_FILE\n");
    return 2;
}
