/*
 * tcp_relay.c - a plain two-hop tcp relay: the floor for a stowd that
 * forwards a client's bytes to another stowd (issue 19).
 *
 * Listens on LISTEN_HOST:LISTEN_PORT (0: the OS picks), prints the port on
 * stdout, accepts one connection, connects onward to DEST_HOST:DEST_PORT
 * and forwards the byte stream one way with a plain read/write loop
 * through one reused buffer (default 1 MiB), partial writes handled. At
 * EOF it shuts the onward connection's write side, prints the bytes it
 * forwarded, and exits 0. Any error: a message on stderr, exit 1. No
 * splice, no zero copy: the bytes cross user space once, as they do in a
 * program that reads a frame and writes it on.
 *
 * Build: cc -O2 -o /tmp/tcp_relay bench/tcp_relay.c (bench/peer_bench.py
 * builds it into its temporary directory).
 * Usage: /tmp/tcp_relay LISTEN_HOST LISTEN_PORT DEST_HOST DEST_PORT [BUF_BYTES]
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void fail(const char *msg) {
    fprintf(stderr, "tcp_relay: %s\n", msg);
    exit(1);
}

static struct sockaddr_in address(const char *host, const char *port) {
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    char *end;
    long p = strtol(port, &end, 10);
    if (*end || p < 0 || p > 65535)
        fail("bad port");
    a.sin_port = htons((uint16_t)p);
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1)
        fail("bad IPv4 address");
    return a;
}

int main(int argc, char **argv) {
    if (argc < 5 || argc > 6)
        fail("usage: tcp_relay LISTEN_HOST LISTEN_PORT DEST_HOST DEST_PORT [BUF_BYTES]");
    struct sockaddr_in listen_at = address(argv[1], argv[2]);
    struct sockaddr_in dest = address(argv[3], argv[4]);
    size_t cap = argc == 6 ? strtoul(argv[5], NULL, 10) : 1 << 20;
    if (cap < 4096)
        fail("buffer under 4096 bytes");
    signal(SIGPIPE, SIG_IGN);
    char *buf = malloc(cap);
    if (!buf)
        die("malloc");
    memset(buf, 0, cap); /* touched: no page faults while forwarding */

    int ls = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    if (ls < 0 || setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0)
        die("socket");
    if (bind(ls, (struct sockaddr *)&listen_at, sizeof listen_at) < 0 || listen(ls, 1) < 0)
        die("bind/listen");
    socklen_t len = sizeof listen_at;
    if (getsockname(ls, (struct sockaddr *)&listen_at, &len) < 0)
        die("getsockname");
    printf("%u\n", ntohs(listen_at.sin_port));
    fflush(stdout);

    int in = accept(ls, NULL, NULL);
    if (in < 0)
        die("accept");
    close(ls);
    int out = socket(AF_INET, SOCK_STREAM, 0);
    if (out < 0 || connect(out, (struct sockaddr *)&dest, sizeof dest) < 0)
        die("connect onward");

    uint64_t total = 0;
    for (;;) {
        ssize_t r = read(in, buf, cap);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            die("read");
        }
        if (r == 0)
            break;
        for (ssize_t off = 0; off < r;) {
            ssize_t w = write(out, buf + off, r - off);
            if (w < 0) {
                if (errno == EINTR)
                    continue;
                die("write");
            }
            off += w;
        }
        total += r;
    }
    if (shutdown(out, SHUT_WR) < 0)
        die("shutdown");
    close(in);
    close(out);
    printf("%llu\n", (unsigned long long)total);
    return 0;
}
