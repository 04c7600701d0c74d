"""Prometheus metrics (core/metrics.py): families from a component's numbers, a real scrape of
every endpoint of a running `hpcrl run`, and the shipped alert rules, whose every metric must be
one the components export (and which pass `promtool check rules` where promtool is installed)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from hpcrl.core.metrics import families, read_endpoints
from hpcrl.rl.coordinator.report import read_status

from conftest import RUN_GUARD_S, wait_for
from test_run import finish, hpcrl

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "docs" / "prometheus.rules.yml"


def test_families_type_and_label_a_components_numbers():
    from prometheus_client import CollectorRegistry, generate_latest

    values = {"trajectories_total": 12, "busy_fraction": 0.5, "results_total:status": {"ok": 3, "timeout": 1}}
    values["skipped"] = "text"  # not a number: left out, never an error
    reg = CollectorRegistry()

    class C:
        def collect(self):
            return families(values, {"run": "r1", "component": "gen-0"})

    reg.register(C())
    text = generate_latest(reg).decode()
    assert re.search(r"# TYPE hpcrl_trajectories(_total)? counter", text)
    assert 'hpcrl_trajectories_total{component="gen-0",run="r1"} 12.0' in text
    assert "# TYPE hpcrl_busy_fraction gauge" in text
    assert 'hpcrl_results_total{component="gen-0",run="r1",status="timeout"} 1.0' in text
    assert "skipped" not in text


def _rule_metrics() -> set[str]:
    rules = yaml.safe_load(RULES.read_text())
    names = set()
    for group in rules["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert rule["alert"] and rule["expr"] and rule["annotations"]["summary"], rule
            names |= set(re.findall(r"\bhpcrl_\w+", rule["expr"]))
    return names


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian: prometheus)")
def test_alert_rules_pass_promtool():
    out = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


@pytest.mark.slow
def test_every_component_of_a_run_serves_its_metrics(tmp_path):
    proc = hpcrl(
        "run",
        "config.yaml",
        f"experiment.run_root={tmp_path}",
        "learner.max_steps=100000",
        "domains=[{name: arith/copy}, {name: synth, weight: 0.3}]",
        "metrics.bind_host=127.0.0.1",
        f"metrics.textfile_dir={tmp_path / 'prom'}",
        "metrics.textfile_every_s=1",
        "--run-id",
        "prom",
    )
    run_dir = tmp_path / "prom"
    want = {"store-0", "coordinator", "sandbox-0", "learner-0", "gen-0", "supervisor"}
    try:

        def ready():
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            step = ((read_status(run_dir) or {}).get("learner") or {}).get("step", 0)
            return step >= 3 and set(read_endpoints(run_dir)) >= want

        wait_for(ready, RUN_GUARD_S, what="three steps and every component's endpoint")
        urls = read_endpoints(run_dir)
        texts = {name: _scrape(urls[name]) for name in want}
        status = subprocess.run(
            [*proc.args[:3], "status", "--json", str(run_dir)], capture_output=True, text=True, timeout=120
        )
        textfiles = wait_for(lambda: sorted((tmp_path / "prom").glob("*.prom")), 60, what="the textfiles")
    finally:
        proc.send_signal(signal.SIGINT)
        finish(proc, RUN_GUARD_S)
    for name, text in texts.items():
        assert f'component="{name}"' in text and 'run="prom"' in text, (name, text[:500])
        assert "process_cpu_seconds_total" in text, name
    every = "\n".join(texts.values())
    for metric in (
        "hpcrl_learner_step",
        "hpcrl_episodes_total",
        "hpcrl_trajectories_per_s",
        "hpcrl_generator_trajectories_total",
        "hpcrl_store_rows_total",
        "hpcrl_store_free_bytes",
        "hpcrl_sandbox_results_total",
        "hpcrl_restarts_total",
    ):
        assert re.search(rf"^{metric}\{{", every, re.M), metric
    rows = re.findall(r"^hpcrl_generator_trajectories_total\{[^}]*\} (\S+)", texts["gen-0"], re.M)
    assert rows and float(rows[0]) > 0
    # Every metric an alert rule uses is one a component exports.
    exported = set(re.findall(r"^(hpcrl_\w+)\{", every, re.M))
    missing = {m for m in _rule_metrics() if m not in exported}
    assert not missing, f"alert rules use metrics nothing exports: {sorted(missing)}"
    snap = json.loads(status.stdout)
    by_name = {c["name"]: c for c in snap["components"]}
    assert by_name["gen-0"]["metrics_url"] == urls["gen-0"], by_name
    assert {p.name for p in textfiles} >= {f"hpcrl_prom_{n}.prom" for n in want}


# -- no listener by default; a bounded one when asked ---------------------------------------------

_SERVE = """
import sys, time
from pathlib import Path
from hpcrl.core.config import load_config
from hpcrl.core.metrics import provide, serve
run_dir = Path(sys.argv[1])
run_dir.mkdir(exist_ok=True)
provide(lambda: {"episodes_total": 7})
print(serve(run_dir, "gen-0", load_config(None, sys.argv[2:]).metrics), flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


def _metrics_process(run_dir: Path, *overrides: str) -> tuple[subprocess.Popen, str]:
    import sys

    cmd = [sys.executable, "-c", _SERVE, str(run_dir), *overrides]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))


def test_by_default_metrics_open_no_socket_and_go_to_the_runs_textfile(tmp_path):
    from listeners import listeners

    proc, url = _metrics_process(tmp_path / "run", "metrics.textfile_every_s=0.2")
    try:
        text = wait_for(
            lambda: (
                (tmp_path / "run" / "metrics" / "gen-0.prom").exists()
                and (tmp_path / "run" / "metrics" / "gen-0.prom").read_text()
            ),
            60,
            what="the textfile",
        )
        assert url == "None" and not listeners(proc.pid), listeners(proc.pid)
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert 'hpcrl_episodes_total{component="gen-0",run="run"} 7.0' in text
    assert json.loads((tmp_path / "run" / "metrics" / "gen-0.json").read_text())["url"] is None


def test_an_endpoint_holds_few_connections_and_drops_the_silent_ones(tmp_path):
    import socket
    import urllib.parse

    proc, url = _metrics_process(tmp_path / "run", "metrics.bind_host=127.0.0.1")
    half: list[socket.socket] = []
    try:
        port = urllib.parse.urlsplit(url).port
        before = _threads(proc.pid)
        for _ in range(100):  # each sends half a request and then nothing
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            half.append(s)
        assert "hpcrl_episodes_total" in _scrape(url)  # a scrape still gets through
        assert _threads(proc.pid) <= before, "a thread per connection"

        def all_closed() -> bool:
            for s in half:
                s.settimeout(30)
                try:
                    if s.recv(1) != b"":
                        return False
                except ConnectionResetError:
                    pass
            return True

        assert wait_for(all_closed, 120, what="the server to close every silent connection")
    finally:
        for s in half:
            s.close()
        proc.stdin.close()
        proc.wait(30)
