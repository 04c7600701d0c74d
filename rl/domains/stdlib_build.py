"""Build the `stdlib-repair` task list: seeded mutants of stdlib modules that their own tests catch.

    hpcrl domains build stdlib-repair [--seed 0] [--per-module 24] [--jobs 2] [--force]
    manifest = build(out_dir, modules=("shlex",), per_module=4, sandbox=cfg.sandbox)  # in code

For each allow-listed module (stdlib_repair.MODULES): find its source where the sandbox's
`python3` keeps its stdlib (the sandbox binds the host's /usr, so that is a host path) and its
unittest file (that stdlib's `test/`, else the `test` package of the interpreter running hpcrl
when it is the same minor version: Debian's python3 ships only test.support); run the original
through the submit check (stdlib_repair.RUNNER, with its runtime confinement) in the real
sandbox — a module whose original fails is left out, with the reason in the manifest — then
`per_module` mutants picked with the seed (mutate.sample_sites), each run the same way. A
mutant is kept when its tests fail within ten times the original's time, at least 5 s
(`timeout_s` in the manifest; the submit check uses it too): a mutant that hangs is dropped,
it would cost every episode the whole limit.
The manifest (JSON, written atomically) lists the kept mutations as text edits of the original
and each file's sha256, so the same files and seed always give the same tasks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hpcrl.core.config import SandboxConfig
from hpcrl.rl.domains.mutate import apply, mutation_sites, sample_sites
from hpcrl.rl.domains.stdlib_repair import MODULES, MUTATOR_VERSION, check_spec, check_verdict
from hpcrl.sandbox.pool import SlotPool
from hpcrl.sandbox.spec import ExecSpec, Limits

__all__ = ["build", "locate"]

_PROBE = "import sys, sysconfig; print(sys.version.split()[0]); print(sysconfig.get_paths()['stdlib'])"


def locate(module: str, stdlib: str) -> tuple[Path, Path] | str:
    """(module source, unittest file), or why the module cannot be used."""
    src = Path(stdlib) / f"{module}.py"
    if not src.is_file():
        return f"no {src}"
    for tests in (Path(stdlib) / "test", _own_tests(stdlib)):
        if tests is not None and (tests / f"test_{module}.py").is_file():
            return src, tests / f"test_{module}.py"
    return f"no test_{module}.py in {stdlib}/test (install the python3 test suite) nor in this interpreter's"


def _own_tests(stdlib: str) -> Path | None:
    """The `test` package of the interpreter running hpcrl, when it is the sandbox's minor version."""
    v = sys.version_info
    if not stdlib.rstrip("/").endswith(f"python{v.major}.{v.minor}"):
        return None
    try:
        import test  # the stdlib's test package (pyenv and python.org builds ship it)

        return Path(test.__file__).parent
    except ImportError:
        return None


def _check(backend, source: str, test_text: str, module: str, test: str, timeout_s: float) -> tuple[str, float]:
    """Run the submit check on `source`: ('pass' | 'fail' | 'timeout' | 'error: ...' | 'fail: why', seconds)."""
    nonce = secrets.token_hex(16)
    res = backend.run(check_spec(module, test, source, test_text, nonce, timeout_s))
    verdict, detail = check_verdict(res, nonce)
    if verdict == "error":
        return f"error: {detail}", res.wall_s
    if verdict == "fail" and detail.startswith("refused:"):
        return f"fail ({detail})", res.wall_s
    return verdict, res.wall_s


def build(
    out_dir: Path,
    *,
    modules: tuple[str, ...] = MODULES,
    seed: int = 0,
    per_module: int = 24,
    sandbox: Any = None,
    jobs: int = 2,
    timeout_s: float = 60.0,
    log=print,
) -> dict:
    """Build (or rebuild) `out_dir/manifest.json`; `sandbox` is a SandboxConfig (default: the
    config's defaults), `jobs` the sandbox slots run at once. Returns the manifest."""

    t0 = time.monotonic()
    pool = SlotPool.from_config(sandbox or SandboxConfig(), slots=jobs)
    try:
        probe = pool.map(lambda b, _: b.run(_probe_spec()), [0])[0]
        if probe.status != "ok":
            raise RuntimeError(f"the sandbox's python3 did not run ({probe.status}): {probe.stderr[-300:]!r}")
        version, stdlib = probe.stdout.decode().split()
        manifest: dict = {
            "format": 1,
            "mutator": MUTATOR_VERSION,
            "seed": seed,
            "per_module": per_module,
            "python": version,
            "stdlib": stdlib,
            "modules": {},
            "mutants": [],
        }
        for module in modules:
            found = locate(module, stdlib)
            if isinstance(found, str):
                manifest["modules"][module] = {"status": f"skipped: {found}"}
                log(f"{module}: skipped ({found})")
                continue
            src_path, test_path = found
            source, test_text = src_path.read_text(), test_path.read_text()
            info = {
                "source": str(src_path),
                "test": str(test_path),
                "source_sha256": hashlib.sha256(src_path.read_bytes()).hexdigest(),
                "test_sha256": hashlib.sha256(test_path.read_bytes()).hexdigest(),
            }
            manifest["modules"][module] = info
            check = functools.partial(_check, test_text=test_text, module=module, test=test_path.stem)
            verdict, wall = pool.map(lambda b, s: check(b, s, timeout_s=timeout_s), [source])[0]  # noqa: B023
            info["original_s"] = round(wall, 3)
            if verdict != "pass":
                info["status"] = f"skipped: the original does not pass its tests in the sandbox ({verdict})"
                log(f"{module}: {info['status']}")
                continue
            # A mutant's tests get ten times the original's time (at least 5 s): past that it hangs.
            limit_s = info["timeout_s"] = round(min(timeout_s, max(5.0, 10 * wall)), 1)
            picked = sample_sites(mutation_sites(source), seed=_seed(seed, module), n=per_module)
            mutated = [apply(source, m) for m in picked]
            results = pool.map(lambda b, s: check(b, s, timeout_s=limit_s), mutated)  # noqa: B023 (map returns first)
            kept = [m for m, (v, _) in zip(picked, results) if v.startswith("fail")]
            info.update(status="ok", tried=len(picked), kept=len(kept))
            info["outcomes"] = dict(sorted(Counter(r.split(" (")[0] for r, _ in results).items()))
            for n, m in enumerate(kept):
                manifest["mutants"].append({"id": f"{module}-{n}", "module": module, **m.to_json()})
            log(f"{module}: kept {len(kept)} of {len(picked)} mutants ({info['outcomes']})")
        manifest["build_s"] = round(time.monotonic() - t0, 1)
    finally:
        pool.close()
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".manifest.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out_dir / "manifest.json")
    return manifest


def _probe_spec():

    return ExecSpec.single("bash", f'exec python3 -I -c "{_PROBE}"\n', limits=Limits(wall_s=30))


def _seed(seed: int, module: str) -> int:
    """One stream per module, so adding a module to the list leaves the others' mutants as they were."""
    return int(hashlib.sha256(f"{seed}:{module}".encode()).hexdigest()[:16], 16)
