"""Isolated execution of untrusted code, and judging it.

    from hpcrl.sandbox.auto import make_backend
    from hpcrl.sandbox.spec import ExecSpec
    result = make_backend(cfg.sandbox).run(ExecSpec.single("python", "print(1)"))

Modules: `spec` (ExecSpec, Limits) and `result` (ExecResult, SandboxError) are shared by the
backends `bwrap` (local, CI) and `apptainer` (clusters), whose common part is `backend`
(compile-then-run, sessions, status rules), and `auto` picks the one a config names;
`languages` is the language registry; `cgroups`, `process`, `launcher` (a sandbox's command
line: one small C helper built from `launch.c` for cgroups, slot uid, parent-death signal, its
own pid namespace and capped tmpfs, then bwrap, then the helper again, waiting for the files and
the command: a backend keeps each slot's next sandbox started), `seccomp` (the system calls a program may not make) and
`uids` (slot uids: a host-wide pool, each uid nobody's and one sandbox's at a time) are the
machinery; `judge` (with `pyharness`, `harness_wire` and `warm`) decides pass/fail outside the
sandbox; `pool`, `server` and `client` serve it all over ZeroMQ; `session` (with `workspace`:
a per-session directory, tmpfs-capped as root, handled without following links) keeps files
across operations on one server. CLI: `hpcrl sandbox exec|session|info|build-image|serve`.
"""
