/* hpcrl-launch: what runs between the sandbox server and bwrap, in one process and one fork.
 *
 *   hpcrl-launch [--cgroup PROCS_FILE]... [--uid UID] --server PID [--mount FSTAB_LINE]... -- bwrap ...
 *
 * The steps, in this order (sandbox/launcher.py says why each is there):
 *   1. as root: this pid into each PROCS_FILE (the run's cgroups);
 *   2. --uid: drop to UID/UID (no groups, empty bounding/inheritable/ambient capability sets,
 *      no_new_privs); then, always, SIGKILL when the parent (the server) dies, and stop if
 *      that parent is no longer PID (it died before the signal was armed);
 *   3. new user (UID mapped to root), mount (propagation private) and pid namespaces;
 *   4. fork: the child is pid 1 of the new pid namespace, armed to die with this process; this
 *      process waits for it and ends as it ended (its exit status, or killed by its signal);
 *   5. the child stops if this process is already gone (it died before the signal was armed),
 *      mounts a small tmpfs over /tmp and each --mount line (fstab syntax: SOURCE DIR TYPE
 *      OPTIONS; nosuid, nodev, noexec, ro are flags, X-mount.mkdir makes DIR, the rest is data),
 *      and execs the rest of the command line.
 * Exit status 125: a step refused (a message starting with "hpcrl-launch:" on stderr; an
 * orphaned step stops silently, for nobody is listening any more).
 *
 * The same binary is the sandbox's first program (`--exec [RLIMIT]... --`, what bwrap runs as
 * the program's uid, under the seccomp filter): a sandbox is started before anybody knows what
 * will run in it, and this waits. It writes READY to stdout, reads from stdin the files for
 * /work and the command (format below, written by sandbox/launcher.py's `exec_header`),
 * writes them, sets the rlimits (prlimit's options: --cpu=SOFT:HARD, --fsize=N, ...), writes
 * EXEC to stdout and execs the command; what else is on stdin is the program's. The program
 * cannot have written before EXEC, so the server knows these markers are ours. A failure
 * writes FAIL to stdout (and why to stderr) and exits 125.
 *   header: "HPX1", u32 nfiles, per file {u32 mode, u32 path length, path, u64 size, bytes},
 *           u32 argc, per argument {u32 length, bytes}; little-endian.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include <grp.h>
#include <stdint.h>
#include <sys/resource.h>

#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#endif

#define TMPFS_DIR "/tmp"
#define MAX_LIST 16

static void die(const char *what, const char *arg) {
    fprintf(stderr, "hpcrl-launch: %s%s%s: %s\n", what, arg ? " " : "", arg ? arg : "", strerror(errno));
    _exit(125);
}

static int write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t n = strlen(text);
    ssize_t w = write(fd, text, n);
    int saved = errno;
    close(fd);
    errno = saved;
    return w == (ssize_t)n ? 0 : -1;
}

static void drop_to(uid_t uid) {
    /* The bounding set first: dropping from it needs CAP_SETPCAP, which the uid change takes away. */
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL) die("cannot clear ambient capabilities", NULL);
    for (int cap = 0; prctl(PR_CAPBSET_READ, cap, 0, 0, 0) >= 0; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0) die("cannot drop from the bounding set", NULL);
    if (setgroups(0, NULL) < 0) die("cannot clear the groups", NULL);
    if (setresgid(uid, uid, uid) < 0) die("cannot set the gid", NULL);
    if (setresuid(uid, uid, uid) < 0) die("cannot set the uid", NULL);
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &hdr, data) < 0) die("cannot clear the capabilities", NULL);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) die("cannot set no_new_privs", NULL);
    /* The uid change made us undumpable, which leaves /proc/self/{uid,gid}_map root's to write;
     * an exec (the setpriv -> unshare of old) would make us dumpable again just the same. */
    if (prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) < 0) die("cannot set dumpable", NULL);
}

static void map_root(uid_t uid, gid_t gid) {
    char line[64];
    if (write_file("/proc/self/setgroups", "deny") < 0 && errno != ENOENT) die("cannot write", "/proc/self/setgroups");
    snprintf(line, sizeof line, "0 %u 1", (unsigned)uid);
    if (write_file("/proc/self/uid_map", line) < 0) die("cannot write", "/proc/self/uid_map");
    snprintf(line, sizeof line, "0 %u 1", (unsigned)gid);
    if (write_file("/proc/self/gid_map", line) < 0) die("cannot write", "/proc/self/gid_map");
}

/* One fstab line: SOURCE DIR TYPE OPTIONS [DUMP PASS]. */
static void mount_line(char *line) {
    char *save = NULL;
    char *src = strtok_r(line, " \t", &save), *dir = strtok_r(NULL, " \t", &save);
    char *type = strtok_r(NULL, " \t", &save), *opts = strtok_r(NULL, " \t", &save);
    if (!src || !dir || !type || !opts) {
        errno = EINVAL;
        die("bad mount line for", dir);
    }
    unsigned long flags = 0;
    int mkdir_first = 0;
    char data[512] = "";
    char *osave = NULL;
    for (char *o = strtok_r(opts, ",", &osave); o; o = strtok_r(NULL, ",", &osave)) {
        if (!strcmp(o, "nosuid")) flags |= MS_NOSUID;
        else if (!strcmp(o, "nodev")) flags |= MS_NODEV;
        else if (!strcmp(o, "noexec")) flags |= MS_NOEXEC;
        else if (!strcmp(o, "ro")) flags |= MS_RDONLY;
        else if (!strcmp(o, "X-mount.mkdir")) mkdir_first = 1;
        else {
            if (strlen(data) + strlen(o) + 2 > sizeof data) {
                errno = E2BIG;
                die("mount options too long for", dir);
            }
            if (*data) strcat(data, ",");
            strcat(data, o);
        }
    }
    if (mkdir_first && mkdir(dir, 0755) < 0 && errno != EEXIST) die("cannot make", dir);
    if (mount(src, dir, type, flags, *data ? data : NULL) < 0) die("cannot mount the sandbox's", dir);
}

/* -- the sandbox's first program (--exec) ------------------------------------------------ */

static const char READY[] = "\0hpcrl-ready\n", EXEC[] = "\0hpcrl-exec\n", FAIL[] = "\0hpcrl-fail\n";
#define MARK(m) (m), sizeof(m) - 1 /* the markers hold a NUL of their own: sizeof, not strlen */

static void put(const char *buf, size_t n) {
    while (n > 0) {
        ssize_t w = write(1, buf, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) _exit(125); /* nobody reads our stdout: the server is gone */
        buf += w, n -= (size_t)w;
    }
}

static void fail(const char *what, const char *arg) {
    int saved = errno;
    put(MARK(FAIL));
    errno = saved;
    die(what, arg);
}

static void get(void *buf, size_t n) {
    char *p = buf;
    while (n > 0) {
        ssize_t r = read(0, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            if (r == 0) errno = EPIPE;
            fail("the command ended early on stdin", NULL);
        }
        p += r, n -= (size_t)r;
    }
}

static uint64_t get_le(int bytes) {
    unsigned char b[8];
    uint64_t v = 0;
    get(b, (size_t)bytes);
    for (int i = bytes - 1; i >= 0; i--) v = (v << 8) | b[i];
    return v;
}

static char *get_string(uint64_t max, const char *what) {
    uint64_t n = get_le(4);
    if (n > max) {
        errno = E2BIG;
        fail("too long:", what);
    }
    char *s = malloc(n + 1);
    if (!s) fail("out of memory for", what);
    get(s, n);
    s[n] = 0;
    if (strlen(s) != n) {
        errno = EINVAL;
        fail("a NUL inside", what);
    }
    return s;
}

/* PATH relative, no "." or ".." component (the server's SourceFile checks the same); its
 * directories made 0755 under the working directory (/work). */
static void put_file(const char *path, mode_t mode, uint64_t size) {
    char dir[4096];
    if (!*path || path[0] == '/' || strlen(path) >= sizeof dir) {
        errno = EINVAL;
        fail("bad file path", path);
    }
    for (const char *c = path; *c; c = strchr(c, '/') ? strchr(c, '/') + 1 : c + strlen(c)) {
        if (c[0] == '.' && (c[1] == '/' || c[1] == 0 || (c[1] == '.' && (c[2] == '/' || c[2] == 0)))) {
            errno = EINVAL;
            fail("bad file path", path);
        }
    }
    strcpy(dir, path);
    for (char *slash = strchr(dir, '/'); slash; slash = strchr(slash + 1, '/')) {
        *slash = 0;
        if (mkdir(dir, 0755) < 0 && errno != EEXIST) fail("cannot make", dir);
        *slash = '/';
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) fail("cannot create", path);
    char buf[65536];
    while (size > 0) {
        size_t n = size < sizeof buf ? (size_t)size : sizeof buf;
        get(buf, n);
        for (size_t off = 0; off < n;) {
            ssize_t w = write(fd, buf + off, n - off);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) fail("cannot write", path);
            off += (size_t)w;
        }
        size -= n;
    }
    if (fchmod(fd, mode & 0755) < 0 || close(fd) < 0) fail("cannot finish", path);
}

static const struct {
    const char *name;
    int resource;
} RLIMITS[] = {{"cpu", RLIMIT_CPU},     {"fsize", RLIMIT_FSIZE}, {"nproc", RLIMIT_NPROC}, {"nofile", RLIMIT_NOFILE},
               {"core", RLIMIT_CORE},   {"data", RLIMIT_DATA},   {"as", RLIMIT_AS}};

/* One prlimit option: --NAME=SOFT:HARD or --NAME=BOTH. */
static void set_rlimit(const char *opt) {
    const char *eq = strchr(opt, '=');
    if (strncmp(opt, "--", 2) || !eq) {
        errno = EINVAL;
        fail("bad rlimit", opt);
    }
    for (size_t i = 0; i < sizeof RLIMITS / sizeof RLIMITS[0]; i++) {
        if (strlen(RLIMITS[i].name) != (size_t)(eq - opt - 2) || strncmp(opt + 2, RLIMITS[i].name, eq - opt - 2)) continue;
        char *end;
        struct rlimit rl;
        rl.rlim_cur = strtoull(eq + 1, &end, 10);
        rl.rlim_max = *end == ':' ? strtoull(end + 1, &end, 10) : rl.rlim_cur;
        if (*end) {
            errno = EINVAL;
            fail("bad rlimit", opt);
        }
        if (setrlimit(RLIMITS[i].resource, &rl) < 0) fail("cannot set rlimit", opt);
        return;
    }
    errno = EINVAL;
    fail("unknown rlimit", opt);
}

static int exec_main(int argc, char **argv) {
    put(MARK(READY));
    char magic[4];
    get(magic, 4);
    if (memcmp(magic, "HPX1", 4)) {
        errno = EINVAL;
        fail("not a command on stdin", NULL);
    }
    for (uint64_t n = get_le(4), i = 0; i < n; i++) {
        mode_t mode = (mode_t)get_le(4);
        char *path = get_string(4095, "file path");
        put_file(path, mode, get_le(8));
        free(path);
    }
    uint64_t n = get_le(4);
    if (n == 0 || n > 4096) {
        errno = EINVAL;
        fail("bad argument count", NULL);
    }
    char **command = calloc(n + 1, sizeof *command);
    if (!command) fail("out of memory", NULL);
    for (uint64_t i = 0; i < n; i++) command[i] = get_string(1 << 20, "argument");
    for (int i = 2; i < argc && strcmp(argv[i], "--"); i++) set_rlimit(argv[i]);
    put(MARK(EXEC));
    execvp(command[0], command);
    fprintf(stderr, "hpcrl-launch: cannot run %s: %s\n", command[0], strerror(errno));
    return 127; /* after EXEC: the program's failure, as a shell reports a command it cannot run */
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--exec")) return exec_main(argc, argv);
    const char *cgroups[MAX_LIST];
    char *mounts[MAX_LIST];
    int ncg = 0, nmount = 0, have_uid = 0, i;
    uid_t uid = 0;
    pid_t server = 0;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--")) break;
        if (i + 1 >= argc) break;
        if (!strcmp(argv[i], "--cgroup") && ncg < MAX_LIST) cgroups[ncg++] = argv[++i];
        else if (!strcmp(argv[i], "--mount") && nmount < MAX_LIST) mounts[nmount++] = argv[++i];
        else if (!strcmp(argv[i], "--uid")) have_uid = 1, uid = (uid_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--server")) server = (pid_t)strtol(argv[++i], NULL, 10);
        else break;
    }
    if (i >= argc - 1 || strcmp(argv[i], "--") || server <= 0) {
        fprintf(stderr, "hpcrl-launch: usage: hpcrl-launch [--cgroup FILE]... [--uid UID] --server PID "
                        "[--mount FSTAB_LINE]... -- COMMAND...\n");
        return 125;
    }
    char **command = argv + i + 1;

    /* 1. The run's cgroups, as root, before anything else. */
    char self[32];
    snprintf(self, sizeof self, "%d\n", (int)getpid());
    for (i = 0; i < ncg; i++)
        if (write_file(cgroups[i], self) < 0) die("cannot join the cgroup", cgroups[i]);

    /* 2. The slot uid, then the parent-death signal (a uid change clears it). */
    if (have_uid) drop_to(uid);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) die("cannot arm the parent-death signal", NULL);
    if (getppid() != server) return 125; /* the server died before the signal was armed */

    /* 3. Namespaces: the user one maps our uid to root, in which the mounts below are allowed. */
    uid_t me = geteuid();
    gid_t mygid = getegid();
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID) < 0) die("cannot make the namespaces", NULL);
    map_root(me, mygid);
    if (mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) die("cannot make the mounts private", NULL);

    /* 4. pid 1 of the new pid namespace; `alive` tells it whether we still are. */
    int alive[2];
    if (pipe2(alive, O_CLOEXEC) < 0) die("cannot make a pipe", NULL);
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    sigprocmask(SIG_BLOCK, &block, &old);
    pid_t child = fork();
    if (child < 0) die("cannot fork", NULL);
    if (child > 0) {
        close(alive[0]);
        int status;
        while (waitpid(child, &status, 0) < 0)
            if (errno != EINTR) die("cannot wait for the sandbox", NULL);
        if (WIFEXITED(status)) return WEXITSTATUS(status);
        int sig = WTERMSIG(status);
        if (sig != SIGKILL) signal(sig, SIG_DFL);
        sigset_t only;
        sigemptyset(&only);
        sigaddset(&only, sig);
        sigprocmask(SIG_UNBLOCK, &only, NULL);
        kill(getpid(), sig); /* end as the sandbox ended */
        return 125;
    }
    sigprocmask(SIG_SETMASK, &old, NULL);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) die("cannot arm the parent-death signal", NULL);
    close(alive[1]);
    struct pollfd p = {alive[0], POLLIN, 0};
    if (poll(&p, 1, 0) != 0) return 125; /* EOF: the launcher died before the signal was armed */
    close(alive[0]);

    /* 5. The mounts, then bwrap. */
    if (mount("hpcrl", TMPFS_DIR, "tmpfs", 0, "size=65536,nr_inodes=16,mode=0700") < 0) die("cannot mount", TMPFS_DIR);
    for (i = 0; i < nmount; i++) mount_line(mounts[i]);
    execvp(command[0], command);
    die("cannot run", command[0]);
    return 125;
}
