"""`hpcrl domains list [--json]` and `hpcrl domains build` argument errors.

The listing reads stdlib-repair's task list from $HPCRL_CACHE_DIR: here a manifest written by
the test from real files and real mutation sites (not sandbox-verified: this checks the listing,
tests/test_stdlib_repair.py checks the build), and an empty cache for the not-built case.
"""

from __future__ import annotations

import hashlib
import json
import shlex as shlex_module
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.jobs.cli import main
from hpcrl.rl.domains import get_domain
from hpcrl.rl.domains.mutate import mutation_sites, sample_sites
from hpcrl.rl.domains.stdlib_repair import cache_dir

KEYS = ["name", "family", "tasks", "multi_step", "languages"]


def _manifest(root: Path, n: int) -> None:
    test = pytest.importorskip("test")  # the interpreter's own Lib/test (pyenv and python.org builds)
    src, tests = Path(shlex_module.__file__), Path(test.__file__).parent / "test_shlex.py"
    if not tests.is_file():
        pytest.skip(f"{tests} missing")
    sha = {k: hashlib.sha256(p.read_bytes()).hexdigest() for k, p in (("source", src), ("test", tests))}
    muts = sample_sites(mutation_sites(src.read_text()), seed=0, n=n)
    m = {
        "modules": {
            "shlex": {"status": "ok", "source": str(src), "test": str(tests)}
            | {f"{k}_sha256": v for k, v in sha.items()}
        },
        "mutants": [{"id": f"shlex-{i}", "module": "shlex", **x.to_json()} for i, x in enumerate(muts)],
    }
    out = cache_dir()
    out.mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps(m))


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_list_json_gives_every_family_with_its_task_count(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HPCRL_CACHE_DIR", str(tmp_path))
    _manifest(tmp_path, 7)
    rc, out, _ = _run(capsys, "domains", "list", "--json")
    assert rc == 0
    rows = json.loads(out)
    assert all(list(r) == KEYS for r in rows)
    by = {r["name"]: r for r in rows}
    assert by["stdlib-repair"] == {**by["stdlib-repair"], "tasks": 7, "multi_step": True, "languages": ["python"]}
    assert by["c-repair"]["tasks"] == get_domain("c-repair").size and by["c-repair"]["languages"] == ["c"]
    assert by["session-repair"]["multi_step"] and by["session-repair"]["tasks"] == 5
    assert by["arith"]["tasks"] is None  # every index a task of its own
    assert all(r["name"] == r["family"] for r in rows)
    rc, out, _ = _run(capsys, "domains", "list")
    assert rc == 0 and out.splitlines()[0].split() == ["name", "tasks", "multi-step", "languages"]
    assert any(line.split()[:2] == ["stdlib-repair", "7"] for line in out.splitlines())


def test_list_without_a_built_task_list_says_how_to_build_it(tmp_path, capsys):
    # A fresh process: get_domain caches domains per name, and this one must not be built.
    env = {"HPCRL_CACHE_DIR": str(tmp_path / "empty"), "PATH": "/usr/bin:/bin"}
    p = subprocess.run(
        [sys.executable, "-m", "hpcrl.jobs.cli", "domains", "list", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    row = next(r for r in json.loads(p.stdout) if r["name"] == "stdlib-repair")
    assert row["tasks"] is None and row["multi_step"] is True
    assert "hpcrl domains build stdlib-repair" in p.stderr


def test_build_refuses_modules_outside_the_allow_list(capsys):
    rc, _, err = _run(capsys, "domains", "build", "stdlib-repair", "--modules", "os,shlex")
    assert rc == 2 and "--modules: os not in the allow-list" in err and "\n" not in err.strip()


# -- hpcrl domains tasks / check, in a fresh process, through the real sandbox ----------------------

CHECK_UID = 61600  # apart from the other sandbox tests' slot uids


def _cli(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcrl.jobs.cli", "domains", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd or Path(__file__).resolve().parents[2],
    )


def test_tasks_json_lists_workspaces_and_reference_fixes():
    p = _cli("tasks", "c-repair", "--reference", "--json")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    d = get_domain("c-repair")
    assert [r["name"] for r in rows] == d.task_names() and all(list(r) == ["name", "files", "reference"] for r in rows)
    gcd = next(r for r in rows if r["name"] == "gcd")
    assert set(gcd["files"]) == {"Makefile", "src/lib.h", "src/lib.c", "tests/visible.c"}
    assert gcd["reference"]["src/lib.c"] != gcd["files"]["src/lib.c"] and "a % b" in gcd["reference"]["src/lib.c"]
    p = _cli("tasks", "synth", "--json")
    rows = json.loads(p.stdout)
    assert all(list(r) == ["name", "files"] and r["files"] == {"main.py": ""} for r in rows)
    assert {"sum-two", "min-max"} <= {r["name"] for r in rows}  # training and held-out problems alike


def _write(root: Path, files: dict[str, str]) -> Path:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


@pytest.mark.parametrize(
    "domain, task, fixed", [("c-repair", "gcd", True), ("c-repair", "gcd", False), ("session-repair", "rle", True),
                            ("synth", "sum-two", True), ("code-repair", "name-error", False)],
)  # fmt: skip
def test_check_judges_files_as_a_run_does(tmp_path, domain, task, fixed):
    from conftest import require_bwrap

    require_bwrap(CHECK_UID)
    d = get_domain(domain)
    t = d.named_task(task)
    files = d.reference(t) if fixed else d.workspace(t)
    submission = _write(tmp_path / "fix", {k: v for k, v in files.items() if v != d.workspace(t).get(k) or not fixed})
    config = tmp_path / "sandbox.yaml"
    config.write_text(f"sandbox:\n  uid_base: {CHECK_UID}\n  session_dir: /var/tmp/hpcrl-sessions-domains-cli\n")
    p = _cli("check", domain, "--task", task, "--files", str(submission), "--json", "--config", str(config))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert list(out) == ["domain", "task", "reward", "verdict"] and (out["domain"], out["task"]) == (domain, task)
    assert out["reward"] == (1.0 if fixed else 0.0), out


def test_check_refuses_bad_input_with_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    wrong_file = _write(tmp_path / "other", {"solution.py": "print(1)\n"})
    bad = [
        (("check", "nope", "--task", "x", "--files", str(tmp_path)), "unknown domain family 'nope'"),
        (("check", "c-repair", "--task", "nope", "--files", str(tmp_path)), "--task: c-repair: no task 'nope'"),
        (("check", "c-repair", "--task", "gcd", "--files", str(tmp_path / "missing")), "no such directory"),
        (("check", "c-repair", "--task", "gcd", "--files", str(empty)), "holds no files"),
        (("check", "arith/max2", "--task", "1", "--files", str(tmp_path)), "has no named tasks with a workspace"),
        (("tasks", "arith/max2", "--json"), "has no named tasks with a workspace"),
        (("check", "synth", "--task", "sum-two", "--files", str(wrong_file)), "no main.py there"),
    ]
    for argv, message in bad:
        p = _cli(*argv)
        assert p.returncode == 2 and message in p.stderr and p.stderr.count("\n") == 1, (argv, p.stderr)
