/*
 * tcp_send_cpu.c - CPU cost of sending bytes over one TCP loopback connection.
 *
 * Measures, for several send methods, the CPU-seconds per GiB that a sender
 * spends pushing a payload through one TCP connection on 127.0.0.1, plus the
 * CPU of the receiver (a forked process that recv()s into one reused 4 MiB
 * buffer) and the wall throughput. Sending the bytes at all is the floor for
 * a server's get CPU per GiB on loopback: stowd's get CPU is compared to it
 * in docs/benchmarks.md.
 *
 * Methods: send (one blocking loop, partial writes handled), writev (64 KiB
 * iovecs in IOV_MAX batches), MSG_ZEROCOPY (1 MiB sends, error-queue
 * completions all drained before the clock stops; on loopback the kernel
 * copies anyway, and the table says whether completions carried
 * SO_EE_CODE_ZEROCOPY_COPIED), and vmsplice into a pipe + splice to the
 * socket. Each rep uses a fresh receiver child, which reports its byte count
 * and its own CPU (getrusage around its recv loop) back over the socket; the
 * sender checks the count. Sender CPU is getrusage(RUSAGE_SELF) user+sys
 * around the send, including waiting for zerocopy completions (loopback
 * softirq work, i.e. the TCP receive path, is charged to whichever task it
 * runs in, mostly the sender). Wall time runs from the first send to the
 * receiver's report (all bytes received); GB/s = 1e9 B/s. Medians over reps.
 * No signal handlers are installed (SIGPIPE is ignored): no EINTR to handle.
 *
 * Build: cc -O2 -o /tmp/tcp_send_cpu bench/tcp_send_cpu.c
 * Usage: /tmp/tcp_send_cpu [--gib N (1)] [--reps R (3)] [--thp]
 *        --thp: madvise(MADV_HUGEPAGE) the payload (default: 4 KiB pages
 *        unless transparent_hugepage is "always").
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/errqueue.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SO_ZEROCOPY
#define SO_ZEROCOPY 60
#endif
#ifndef MSG_ZEROCOPY
#define MSG_ZEROCOPY 0x4000000
#endif

#define MIB (1UL << 20)
#define GIB (1UL << 30)
#define RECV_BUF (4 * MIB)
#define MAX_REPS 64

struct report { /* receiver -> sender, after EOF */
    uint64_t bytes;
    double cpu_s;
};

static char *buf;
static size_t size;
static char zc_note[96];

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void fail(const char *msg) {
    fprintf(stderr, "%s\n", msg);
    exit(1);
}

static double cpu_now(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) < 0)
        die("getrusage");
    return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec +
           (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void receiver(const struct sockaddr_in *addr) {
    char *rb = malloc(RECV_BUF);
    if (!rb)
        die("receiver malloc");
    memset(rb, 1, RECV_BUF);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (const struct sockaddr *)addr, sizeof *addr) < 0)
        die("receiver connect");
    struct report rep = {0, 0};
    double c0 = cpu_now();
    for (;;) {
        ssize_t r = recv(fd, rb, RECV_BUF, 0);
        if (r < 0)
            die("receiver recv");
        if (r == 0)
            break;
        rep.bytes += r;
    }
    rep.cpu_s = cpu_now() - c0;
    if (send(fd, &rep, sizeof rep, 0) != sizeof rep)
        die("receiver report send");
    close(fd);
    _exit(0);
}

static void m_send(int fd) { /* one loop, chunks under 2 GiB, partial writes */
    for (size_t off = 0, max = INT_MAX & ~4095; off < size;) {
        ssize_t r = send(fd, buf + off, size - off < max ? size - off : max, 0);
        if (r < 0)
            die("send");
        off += r;
    }
}

static void m_writev(int fd) {
    static struct iovec iov[IOV_MAX];
    size_t off = 0;
    while (off < size) {
        int cnt = 0;
        for (size_t o = off; o < size && cnt < IOV_MAX; o += 64 * 1024, cnt++) {
            iov[cnt].iov_base = buf + o;
            iov[cnt].iov_len = size - o < 64 * 1024 ? size - o : 64 * 1024;
        }
        ssize_t r = writev(fd, iov, cnt);
        if (r < 0)
            die("writev");
        off += r;
    }
}

struct zc {
    uint64_t issued, done, notes, copied;
};

/* Read queued completions; if block, first wait (up to 10 s) for one. */
static void zc_drain(int fd, struct zc *z, int block) {
    struct pollfd p = {.fd = fd, .events = 0};
    int r = poll(&p, 1, block ? 10000 : 0);
    if (r < 0)
        die("poll(POLLERR)");
    if (r == 0 && block)
        fail("timed out waiting for MSG_ZEROCOPY completions");
    for (;;) {
        char ctrl[256];
        struct msghdr m = {.msg_control = ctrl, .msg_controllen = sizeof ctrl};
        if (recvmsg(fd, &m, MSG_ERRQUEUE) < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return;
            die("recvmsg(MSG_ERRQUEUE)");
        }
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
            if (!(c->cmsg_level == SOL_IP && c->cmsg_type == IP_RECVERR))
                continue;
            struct sock_extended_err *e = (void *)CMSG_DATA(c);
            if (e->ee_origin != SO_EE_ORIGIN_ZEROCOPY || e->ee_errno != 0)
                fail("unexpected error-queue entry (not a zerocopy completion)");
            z->done += (uint32_t)(e->ee_data - e->ee_info) + 1;
            z->notes++;
            if (e->ee_code & SO_EE_CODE_ZEROCOPY_COPIED)
                z->copied++;
        }
    }
}

static void m_zerocopy(int fd) {
    int one = 1;
    if (setsockopt(fd, SOL_SOCKET, SO_ZEROCOPY, &one, sizeof one) < 0)
        die("setsockopt(SO_ZEROCOPY)");
    struct zc z = {0};
    for (size_t off = 0; off < size;) {
        size_t n = size - off < MIB ? size - off : MIB;
        ssize_t r = send(fd, buf + off, n, MSG_ZEROCOPY);
        if (r < 0 && errno == ENOBUFS) { /* optmem full: wait for completions */
            zc_drain(fd, &z, 1);
            continue;
        }
        if (r < 0)
            die("send(MSG_ZEROCOPY)");
        off += r;
        z.issued++;
        zc_drain(fd, &z, 0);
    }
    while (z.done < z.issued)
        zc_drain(fd, &z, 1);
    snprintf(zc_note, sizeof zc_note, "%llu sends, %llu notifications, %llu COPIED (last rep)",
             (unsigned long long)z.issued, (unsigned long long)z.notes,
             (unsigned long long)z.copied);
}

static void m_vmsplice(int fd) {
    int pfd[2];
    if (pipe(pfd) < 0)
        die("pipe");
    int psz = fcntl(pfd[1], F_SETPIPE_SZ, (int)MIB);
    if (psz < 0 && (psz = fcntl(pfd[1], F_GETPIPE_SZ)) < 0)
        die("F_GETPIPE_SZ");
    for (size_t off = 0; off < size;) {
        struct iovec iov = {buf + off, size - off < (size_t)psz ? size - off : (size_t)psz};
        ssize_t n = vmsplice(pfd[1], &iov, 1, 0);
        if (n < 0)
            die("vmsplice");
        off += n;
        while (n > 0) {
            ssize_t s = splice(pfd[0], NULL, fd, NULL, n, SPLICE_F_MOVE | SPLICE_F_MORE);
            if (s <= 0)
                die("splice");
            n -= s;
        }
    }
    snprintf(zc_note, sizeof zc_note, "pipe %d KiB", psz / 1024);
    close(pfd[0]);
    close(pfd[1]);
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int main(int argc, char **argv) {
    double gib = 1;
    int reps = 3, thp = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--gib") && i + 1 < argc)
            gib = atof(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--thp"))
            thp = 1;
        else
            fail("usage: tcp_send_cpu [--gib N] [--reps R (1-64)] [--thp]");
    }
    size = (size_t)(gib * GIB) & ~(size_t)4095;
    if (size == 0 || reps < 1 || reps > MAX_REPS)
        fail("usage: tcp_send_cpu [--gib N] [--reps R (1-64)] [--thp]");
    signal(SIGPIPE, SIG_IGN);
    double load0 = -1, load1 = -1;
    getloadavg(&load0, 1);

    buf = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED)
        die("mmap payload");
    if (thp && madvise(buf, size, MADV_HUGEPAGE) < 0)
        die("madvise(MADV_HUGEPAGE)");
    if (madvise(buf, size, MADV_DONTFORK) < 0) /* receivers don't share it */
        die("madvise(MADV_DONTFORK)");
    memset(buf, 0x5a, size);

    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = 0};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof addr;
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0 ||
        listen(lfd, 4) < 0 || getsockname(lfd, (struct sockaddr *)&addr, &alen) < 0)
        die("listen on 127.0.0.1");

    static const struct {
        const char *name;
        void (*fn)(int);
    } methods[] = {{"send", m_send},
                   {"writev 64 KiB iovecs", m_writev},
                   {"send MSG_ZEROCOPY 1 MiB", m_zerocopy},
                   {"vmsplice + splice", m_vmsplice}};
    enum { NM = sizeof methods / sizeof methods[0] };
    double snd[NM][MAX_REPS], rcv[NM][MAX_REPS], gbs[NM][MAX_REPS];
    char notes[NM][96];
    double per_gib = (double)GIB / size;

    for (int m = 0; m < NM; m++) {
        zc_note[0] = 0;
        for (int r = 0; r < reps; r++) {
            pid_t pid = fork();
            if (pid < 0)
                die("fork");
            if (pid == 0) {
                close(lfd);
                receiver(&addr);
            }
            int fd = accept(lfd, NULL, NULL);
            if (fd < 0)
                die("accept");
            double w0 = wall_now(), c0 = cpu_now();
            methods[m].fn(fd);
            double c1 = cpu_now();
            if (shutdown(fd, SHUT_WR) < 0)
                die("shutdown");
            struct report rep;
            ssize_t got = recv(fd, &rep, sizeof rep, MSG_WAITALL);
            double w1 = wall_now();
            int st;
            if (got != sizeof rep || waitpid(pid, &st, 0) < 0 || !WIFEXITED(st) ||
                WEXITSTATUS(st) != 0)
                fail("receiver failed (no report or nonzero exit)");
            if (rep.bytes != size) {
                fprintf(stderr, "%s: receiver counted %llu bytes, sent %zu\n", methods[m].name,
                        (unsigned long long)rep.bytes, size);
                return 1;
            }
            close(fd);
            snd[m][r] = (c1 - c0) * per_gib;
            rcv[m][r] = rep.cpu_s * per_gib;
            gbs[m][r] = size / (w1 - w0) / 1e9;
        }
        snprintf(notes[m], sizeof notes[m], "%s", zc_note);
    }
    getloadavg(&load1, 1);

    struct utsname u;
    uname(&u);
    printf("kernel %s, load average (1 min) before %.2f after %.2f, payload %.3g GiB%s, "
           "%d reps (medians), cmd:",
           u.release, load0, load1, (double)size / GIB, thp ? " (THP)" : "", reps);
    for (int i = 0; i < argc; i++)
        printf(" %s", argv[i]);
    printf("\n\n| method | sender CPU s/GiB | receiver CPU s/GiB | wall GB/s | notes |\n");
    printf("|---|---:|---:|---:|---|\n");
    for (int m = 0; m < NM; m++)
        printf("| %s | %.3f | %.3f | %.2f | %s |\n", methods[m].name, median(snd[m], reps),
               median(rcv[m], reps), median(gbs[m], reps), notes[m]);
    return 0;
}
