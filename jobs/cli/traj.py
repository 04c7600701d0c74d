"""`hpcrl traj ls|stats|verify|export RUN_OR_DIR [--json]` and `hpcrl traj synth DIR --count N`.

    hpcrl traj ls runs/quickstart-20261202-101500-ab12        # shards: status, segments, rows, bytes
    hpcrl traj stats runs/...  --json                          # counts, reward by domain, policy versions
    hpcrl traj verify runs/... [--repair]                       # exit 1 if any segment/manifest is bad
    hpcrl traj export runs/... -o trajs.jsonl                   # one JSON object per trajectory
    hpcrl traj synth /tmp/store --count 1000 --seed 1          # prints "acked <total>" after each flush
    hpcrl traj trace runs/... 12                                # episode 12's life: leased, steps, stored, trained
    hpcrl traj show runs/... 12 [--json]                        # its steps: text, reward, sandbox command, tests

RUN_OR_DIR is a run directory (its `trajectories/` store is used) or a store directory; `trace`
needs a run directory or a run id under config.yaml's run_root (rl/audit/trace.py says what it joins).
`synth` writes through the real ShardWriter, so it doubles as a benchmark load and a fault
drill: every total it prints is durable, whatever happens to the process afterwards.
Exit codes: 0 ok, 1 verify found damage, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpcrl.jobs.cli import UsageError, add_run_args

# `hpcrl --help` imports every verb's module: what a verb runs is imported inside the verb (start-up speed).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "traj", help="inspect, verify, export or synthesize trajectory shards", description=__doc__.split("\n\n")[0]
    )
    verbs = p.add_subparsers(dest="traj_verb", metavar="ACTION", required=True)

    def store_cmd(name: str, help_: str):
        q = verbs.add_parser(name, help=help_, description=help_)
        q.add_argument("path", metavar="RUN_OR_DIR", help="run directory or trajectory store directory")
        q.add_argument("--json", action="store_true", help="machine-readable JSON output")
        return q

    store_cmd("ls", "list shards: status, segments, rows, bytes").set_defaults(func=run_ls)
    store_cmd("stats", "counts, reward by domain, policy-version spread, bytes").set_defaults(func=run_stats)
    q = store_cmd("verify", "check every segment against its checksum and manifest; exit 1 on damage")
    q.add_argument(
        "--repair",
        action="store_true",
        help="finalize shards whose writer died (keep verified segments, quarantine the rest)",
    )
    q.set_defaults(func=run_verify)
    q = store_cmd("export", "write every verified trajectory as JSON lines")
    q.add_argument("-o", "--output", default="-", help="output file (default: stdout)")
    q.set_defaults(func=run_export)
    q = store_cmd("show", "one stored trajectory step by step: text, reward, sandbox command and results")
    q.add_argument("id", help="episode number (every stored attempt) or trajectory id run/generator/episode")
    q.set_defaults(func=run_show)
    q = verbs.add_parser(
        "trace",
        help="one trajectory's life: leased, each step, stored where, trained or dropped and why",
        description="One trajectory's life from the run's records: leased to which generator, each step, "
        "the shard that stores it, the learner step that trained it or dropped it and why.",
    )
    add_run_args(q, dest="path")
    q.add_argument("id", help="episode number (every attempt) or trajectory id run/generator/episode")
    q.add_argument("--json", action="store_true", help="one JSON object: events and stored copies")
    q.set_defaults(func=run_trace)
    q = verbs.add_parser(
        "synth",
        help="write N synthetic trajectories through the real writer",
        description="Write synthetic multi-step trajectories with the shard writer, printing "
        "'acked <total>' after each durable flush.",
    )
    q.add_argument("path", metavar="DIR", help="run directory or store directory (created if missing)")
    q.add_argument("--count", type=int, required=True, help="number of trajectories")
    q.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    q.add_argument("--writer", default="synth", help="writer name; also the generator id in trajectory ids")
    q.add_argument("--first-episode", type=int, default=0, help="episode number of the first trajectory")
    q.add_argument("--flush-every", type=int, help="override store.flush_every")
    q.add_argument("--flush-interval", type=float, help="override store.flush_interval_s")
    q.add_argument("--shard-max-rows", type=int, help="override store.shard_max_rows")
    q.add_argument("--compression", choices=("none", "gzip", "lzf"), help="override store.compression")
    q.add_argument("--tiny", action="store_true", help="tiny trajectories (tens of tokens) for fast fault drills")
    q.set_defaults(func=run_synth)


def _store(args: argparse.Namespace) -> Path:
    from hpcrl.rl.store.reader import resolve_store

    store = resolve_store(args.path)
    if not store.is_dir():
        raise UsageError(f"{args.path}: no such directory; pass a run directory or a trajectory store")
    return store


def _emit(args: argparse.Namespace, data, lines: list[str]) -> None:
    if args.json:
        print(json.dumps(data, indent=1, sort_keys=True))
    else:
        print("\n".join(lines))


def run_ls(args: argparse.Namespace) -> int:
    from hpcrl.rl.store.verify import list_store, store_lease_s

    store = _store(args)
    shards = list_store(store, store_lease_s(store))
    lines = [f"{'shard':<56} {'status':<10} {'segments':>8} {'rows':>9} {'bytes':>13}"]
    lines += [f"{s['shard']:<56} {s['status']:<10} {s['segments']:>8} {s['rows']:>9} {s['bytes']:>13}" for s in shards]
    lines.append(
        f"{len(shards)} shard(s), {sum(s['rows'] for s in shards)} trajectories, "
        f"{sum(s['bytes'] for s in shards)} bytes"
    )
    _emit(args, {"shards": shards}, lines)
    return 0


def run_stats(args: argparse.Namespace) -> int:
    import numpy as np

    from hpcrl.rl.store.reader import iter_segments

    bad: list[str] = []
    n = steps = tokens = size = 0
    by_domain: dict[str, list[float]] = {}
    versions: dict[int, int] = {}
    truncation: dict[str, int] = {}
    for state, name, cols in iter_segments(
        _store(args), on_error=lambda st, nm, why: bad.append(f"{st.name}/{nm}: {why}")
    ):
        t = cols.traj
        n += cols.rows
        steps += len(cols.steps)
        tokens += len(cols.tokens)
        size += (state.path / name).stat().st_size
        for dom, reward in zip(t["domain"], t["final_reward"]):
            by_domain.setdefault(dom.decode(), []).append(float(reward))
        for v, c in zip(*np.unique(cols.steps["policy_version"], return_counts=True)):
            versions[int(v)] = versions.get(int(v), 0) + int(c)
        for code, c in zip(*np.unique(t["truncation"], return_counts=True)):
            key = cols.truncation_names[code]
            truncation[key] = truncation.get(key, 0) + int(c)
    domains = {
        d: {"count": len(r), "mean_reward": float(np.mean(r)), "min": float(np.min(r)), "max": float(np.max(r))}
        for d, r in sorted(by_domain.items())
    }
    spread = {
        "min": min(versions, default=None),
        "max": max(versions, default=None),
        "steps_by_version": {str(k): versions[k] for k in sorted(versions)},
    }
    data = {
        "trajectories": n,
        "steps": steps,
        "tokens": tokens,
        "bytes": size,
        "reward_by_domain": domains,
        "policy_versions": spread,
        "truncation": truncation,
        "unreadable_segments": bad,
    }
    lines = [f"trajectories {n}   steps {steps}   tokens {tokens}   bytes {size}"]
    lines += [f"  {d:<16} n={v['count']:<8} mean_reward={v['mean_reward']:.4f}" for d, v in domains.items()]
    lines.append(
        f"policy versions {spread['min']}..{spread['max']}: "
        + ", ".join(f"v{k}:{c}" for k, c in sorted(versions.items()))
    )
    lines.append("truncation " + ", ".join(f"{k}:{c}" for k, c in sorted(truncation.items())))
    lines += [f"unreadable {b}" for b in bad]
    _emit(args, data, lines)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from hpcrl.rl.store.verify import store_lease_s, verify_store

    store = _store(args)
    report = verify_store(store, store_lease_s(store), repair=args.repair)
    ok = all(r["ok"] for r in report)
    lines = [
        f"{'OK ' if r['ok'] else 'BAD'} {r['shard']} ({r['status']}, {r['segments']} segments, {r['rows']} rows)"
        + "".join(f"\n    {p}" for p in r["problems"])
        for r in report
    ]
    orphaned = sum(r["status"] == "orphaned" for r in report)
    lines.append(
        f"{'all' if ok else 'NOT all'} {len(report)} shard(s) verified"
        + (f"; {orphaned} orphaned (writer dead): `hpcrl traj verify --repair` finalizes them" if orphaned else "")
    )
    _emit(args, {"ok": ok, "shards": report}, lines)
    return 0 if ok else 1


def run_trace(args: argparse.Namespace) -> int:
    import time
    from dataclasses import asdict

    from hpcrl.jobs.cli.status import resolve_run_dir
    from hpcrl.rl.audit.trace import TraceError, trace

    run_dir = resolve_run_dir(args.path, args.config)
    try:
        events, stored = trace(run_dir, args.id)
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps({"events": [asdict(e) for e in events], "stored": [asdict(c) for c in stored]}, indent=1))
        return 0
    t0 = next((e.time for e in events if e.time), 0.0)
    head = ", ".join(f"{c.id} ({c.domain} task {c.task})" for c in stored) or "not in the store"
    print(f"episode {events[0].episode}: {head}")
    for e in events:
        when = f"{time.strftime('%H:%M:%S', time.localtime(e.time))} +{e.time - t0:8.3f}s" if e.time else " " * 19
        print(f"  {when}  {e.detail}")
    return 0


def _find(store: Path, ident: str) -> list:
    """The stored trajectories `ident` names (an episode number or run/generator/episode).
    Segments whose manifest entry gives an episode range without it are not opened, so the
    cost follows what matches, not the size of the store."""
    from hpcrl.rl.audit.trace import TraceError, id_matches, parse_ident
    from hpcrl.rl.store.layout import list_shards
    from hpcrl.rl.store.reader import segments_of
    from hpcrl.rl.store.segment_read import SegmentError, load_segment, read_segment

    try:
        episode, suffix = parse_ident(ident)
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    out = []
    for state in list_shards(store):
        for seg in segments_of(state):
            e = seg.expect
            if e is not None and e.min_episode >= 0 and not e.min_episode <= episode <= e.max_episode:
                continue
            path = state.path / seg.name
            try:  # the id column first: only segments holding a match are read whole
                ids = read_segment(path, seg.expect, fields=("traj",)).ids()
                rows = [i for i, tid in enumerate(ids) if id_matches(tid, episode, suffix)]
                if rows:
                    cols, _ = load_segment(path, seg.expect)
                    out += [cols.trajectory(i) for i in rows]
            except SegmentError:
                continue  # damaged or being written: `hpcrl traj verify` reports it
    return out


def _decoder(store: Path):
    """The run's tokenizer's decode (its config.resolved.yaml beside the store), or None."""
    try:
        from hpcrl.core.config import load_config

        cfg = load_config(str(store.parent / "config.resolved.yaml"), [])
        # Only now: the tokenizer's import (transformers, torch) costs more than the lookup.
        from hpcrl.rl.model.policy import load_tokenizer

        tok = load_tokenizer(cfg.policy)
        return lambda ids: tok.decode([int(i) for i in ids])
    except Exception:  # no run config, no tokenizer files here: token counts only
        return None


def run_show(args: argparse.Namespace) -> int:
    store = _store(args)
    found = _find(store, args.id)
    if not found:
        raise UsageError(f"{args.id}: no such trajectory in {store}; `hpcrl traj export` lists the stored ids")
    decode = _decoder(store)
    data, lines = [], []
    for t in found:
        steps = []
        head = f"{t.id}  {t.domain} task {t.task}: reward {t.final_reward:g}, ended by {t.truncation}"
        lines.append(head + (f"\n  fault: {t.fault}" if t.fault else ""))
        for k, s in enumerate(t.steps):
            sb = s.sandbox
            step = {
                "policy_version": s.policy_version,
                "reward": s.reward,
                "tokens": {
                    "prompt": len(s.prompt_tokens),
                    "action": len(s.action_tokens),
                    "observation": len(s.observation_tokens),
                },
                "sandbox": {
                    "command": sb.command,
                    "status": sb.status,
                    "exit_code": sb.exit_code,
                    "tests_passed": sb.tests_passed,
                    "tests_total": sb.tests_total,
                    "duration_s": sb.duration_s,
                    "resumes": sb.resumes,
                },
                # what the action was drawn with (its log-probabilities are that distribution's)
                "sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k},
            }
            if decode is not None:
                step["text"] = {k2: decode(getattr(s, f"{k2}_tokens")) for k2 in ("prompt", "action", "observation")}
            steps.append(step)
            n = step["tokens"]
            lines.append(
                f"  step {k + 1}  policy v{s.policy_version}  reward {s.reward:g}  "
                f"tokens {n['prompt']}+{n['action']}+{n['observation']}"
                + ("" if s.plain else f"  sampled at temperature {s.temperature:g}, top_p {s.top_p:g}, top_k {s.top_k}")
            )
            if sb.status != "none" or sb.command:
                tests = f", tests {sb.tests_passed}/{sb.tests_total}" if sb.tests_total else ""
                again = f", resumed {sb.resumes}x after a sandbox fault" if sb.resumes else ""
                lines.append(
                    f"    sandbox: {sb.command or '(command not recorded)'} -> {sb.status}, exit {sb.exit_code}"
                    f"{tests}, {sb.duration_s:.2f} s{again}"
                )
            for part, text in (step.get("text") or {}).items():
                if text:
                    lines.append(f"    {part}: " + text.replace("\n", "\n      "))
        data.append(
            {
                **{k: getattr(t, k) for k in ("id", "domain", "task", "final_reward", "truncation", "fault")},
                "steps": steps,
            }
        )
    _emit(args, data if len(data) > 1 else data[0], lines)
    return 0


def run_export(args: argparse.Namespace) -> int:
    from hpcrl.rl.store.reader import iter_segments

    store = _store(args)
    bad: list[str] = []
    out = sys.stdout if args.output == "-" else open(args.output, "w")
    n = 0
    try:
        for _, _, cols in iter_segments(store, on_error=lambda st, nm, why: bad.append(f"{st.name}/{nm}: {why}")):
            for i in range(cols.rows):
                out.write(json.dumps(cols.trajectory(i, trusted=True).to_dict(), separators=(",", ":")) + "\n")
                n += 1
    finally:
        if out is not sys.stdout:
            out.close()
    summary = {"exported": n, "output": args.output, "skipped_segments": bad}
    print(
        json.dumps(summary)
        if args.json
        else f"exported {n} trajectories to {args.output}" + "".join(f"\nskipped {b}" for b in bad),
        file=sys.stderr,
    )
    return 1 if bad else 0


def run_synth(args: argparse.Namespace) -> int:
    import dataclasses

    import numpy as np

    from hpcrl.core.config import StoreConfig
    from hpcrl.core.schema import from_dict
    from hpcrl.rl.record.synth import DEFAULT_SHAPE, TINY_SHAPE, synth_trajectory
    from hpcrl.rl.store.layout import StoreError
    from hpcrl.rl.store.reader import resolve_store
    from hpcrl.rl.store.writer import ShardWriter

    if args.count < 1:
        raise UsageError(f"--count must be >= 1 (got {args.count})")
    if args.first_episode < 0:
        raise UsageError(f"--first-episode must be >= 0 (got {args.first_episode})")
    overrides = {
        k: v
        for k, v in (
            ("flush_every", args.flush_every),
            ("flush_interval_s", args.flush_interval),
            ("shard_max_rows", args.shard_max_rows),
            ("compression", args.compression),
        )
        if v is not None
    }
    cfg = from_dict(StoreConfig, {**dataclasses.asdict(StoreConfig()), **overrides}, "store")
    rng = np.random.default_rng(args.seed)
    shape = TINY_SHAPE if args.tiny else DEFAULT_SHAPE
    try:
        # Synthetic episode numbers never repeat, so the dedup index (one read of every
        # segment the writer name ever wrote) would only slow down fault drills.
        writer = ShardWriter(resolve_store(args.path), args.writer, cfg, dedup=False)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    with writer:
        for i in range(args.count):
            traj = synth_trajectory(rng, "synth", args.writer, args.first_episode + i, shape)
            flushed = writer.append(traj) or writer.poll()
            if flushed:
                print(f"acked {flushed.total_rows}", flush=True)
        flushed = writer.close()
        if flushed:
            print(f"acked {flushed.total_rows}", flush=True)
    return 0
