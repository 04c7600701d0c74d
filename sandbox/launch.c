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

int main(int argc, char **argv) {
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
