"""Where a trained batch's time went, from a run directory's own records: per learner step, when
its trajectories were generated, when the store made the last of them durable, and when the
step that trained them was reported.

    .venv/bin/python bench/timeline.py RUN_DIR [--last 60]

For each of the last `--last` steps (their trajectories read from the HDF5 segments, the step
from learner/trained.jsonl and metrics.jsonl), the medians of:

* batch span: first start to last finish of the batch's episodes (generation);
* flush lag: last finish to the flush of the segment that holds it (the store writer);
* report lag: that flush to the learner's report of the step (reader refresh, waiting for the
  rest of the batch, the step itself);
* the learner's own step_s and wait_s.

A flush lag near the step time means the batch's tail waited in the writer's buffer for
company (store.flush_every) or for store.flush_interval_s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from hpcrl.rl.store.segment_read import SegmentError, load_segment


def segment_times(run: Path) -> dict[str, tuple[float, float, float]]:
    """trajectory id -> (started_at, finished_at, flushed_at of its segment)."""
    out = {}
    for f in sorted((run / "trajectories").glob("*/seg-*.h5")):
        try:
            cols, info = load_segment(f, fields=("traj",))
        except SegmentError:
            continue  # being written, or damaged: not this tool's business
        t = cols.traj
        for tid, s, e in zip(cols.ids(), t["started_at"], t["finished_at"]):
            out[tid] = (float(s), float(e), info.flushed_at)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--last", type=int, default=60, help="steps to summarise (default 60)")
    args = ap.parse_args(argv)
    run = args.run_dir
    times = segment_times(run)
    audit = [json.loads(line) for line in open(run / "learner" / "trained.jsonl") if '"trained"' in line]
    metrics = {}
    for line in open(run / "metrics.jsonl"):
        m = json.loads(line)
        metrics[m["step"]] = m
    rows = []
    for a in audit[-args.last :]:
        m, ids = metrics.get(a["step"]), a["trained"]
        if m is None or not ids or not all(i in times for i in ids):
            continue
        start = min(times[i][0] for i in ids)
        finish = max(times[i][1] for i in ids)
        flushed = max(times[i][2] for i in ids)
        rows.append((finish - start, flushed - finish, m["time"] - flushed, m["step_s"], m["wait_s"]))
    if not rows:
        print(f"{run}: no step whose trajectories are all in the store", file=sys.stderr)
        return 1
    names = ("batch span (generation)", "flush lag (store)", "report lag (learner)", "learner step_s", "learner wait_s")
    print(f"{run}: medians over {len(rows)} steps")
    for k, name in enumerate(names):
        print(f"  {name:26s} {statistics.median(r[k] for r in rows):7.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
