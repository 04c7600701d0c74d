"""Isolated execution of untrusted code, and judging it.

    from hpcrl.sandbox.auto import make_backend
    from hpcrl.sandbox.spec import ExecSpec
    result = make_backend(cfg.sandbox).run(ExecSpec.single("python", "print(1)"))

Modules: `spec` (ExecSpec, Limits) and `result` (ExecResult, SandboxError) are shared by the
backends `bwrap` (local, CI) and `apptainer` (clusters), whose common part is `backend`
(compile-then-run, sessions, status rules), and `auto` picks the one a config names;
`languages` is the language registry; `cgroups` and `process` are the machinery; `judge`
(with `pyharness`, `harness_wire` and `warm`) decides pass/fail outside the sandbox; `pool`,
`server` and `client` serve it all over ZeroMQ. CLI: `hpcrl sandbox exec|info|build-image|serve`.
"""
