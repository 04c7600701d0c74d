"""Pure parsers for Slurm's parsable output. No I/O here: each function takes text, returns data.

The commands that produce the text live in `hpcrl.slurm.queries`; tests feed these functions
both captured text and live output of the dev cluster. Formats are those of Slurm 22.05+
(`scontrol -o`, `sacct -P`, `squeue -o` / `sinfo -o` with a `|` separator).
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

SEP = "|"


class SlurmParseError(ValueError):
    """Slurm printed something these parsers do not understand; carries the offending line."""


def parse_delimited(text: str, fields: list[str] | tuple[str, ...], sep: str = SEP) -> list[dict[str, str]]:
    """Rows of `squeue -h -o 'a|b|c'`, `sinfo -h -o ...` or `sacct -n -P -o ...` as dicts.

    The last field may itself contain the separator (put free text such as job names last).
    """
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(sep, len(fields) - 1)
        if len(parts) != len(fields):
            raise SlurmParseError(
                f"line {lineno}: expected {len(fields)} fields {list(fields)}, got {len(parts)}: {line!r}"
            )
        rows.append(dict(zip(fields, (p.strip() for p in parts))))
    return rows


def parse_scontrol_records(text: str) -> list[dict[str, str]]:
    """Records of `scontrol -o show job|node|partition` (one record per line, `Key=Value` pairs).

    Values may contain spaces (`Reason=Not responding [slurm@...]`, `OS=Linux 6.1 #1 SMP`) and
    `=` (`TRES=cpu=1,gres/gpu=2`): a token that does not start with `Key=` continues the
    previous value, and only the first `=` of a token splits key from value.
    """
    records = []
    key_re = re.compile(r"^([A-Za-z][A-Za-z0-9_:/().-]*)=(.*)$")
    for line in text.splitlines():
        line = line.strip()
        if not line or (line.startswith("No ") and "in the system" in line):
            continue
        rec: dict[str, str] = {}
        last = None
        for token in line.split(" "):
            m = key_re.match(token)
            if m and not (last and _continues(rec[last], token)):
                last = m.group(1)
                rec[last] = m.group(2)
            elif last is not None:
                rec[last] += " " + token
            elif token:
                raise SlurmParseError(f"scontrol record does not start with Key=Value: {line[:120]!r}")
        if rec:
            records.append({k: v.strip() for k, v in rec.items()})
    return records


def _continues(prev: str, token: str) -> bool:
    # An unbalanced bracket in the previous value (Reason=Not responding [slurm@2026-...])
    # means this token still belongs to it.
    return prev.count("[") > prev.count("]") or prev.count("(") > prev.count(")")


def expand_hostlist(expr: str) -> list[str]:
    """`n[1-3,7],gpu01` -> ['n1', 'n2', 'n3', 'n7', 'gpu01'] (zero padding kept, nested ranges per group)."""
    expr = expr.strip()
    if not expr or expr in ("(null)", "None"):
        return []
    hosts: list[str] = []
    depth, start = 0, 0
    items = []
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(expr[start:i])
            start = i + 1
    items.append(expr[start:])
    for item in items:
        hosts.extend(_expand_one(item))
    return hosts


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item] if item else []
    prefix, rest = item[: m.start()], item[m.end() :]
    out = []
    for part in m.group(1).split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            width = len(lo) if lo.startswith("0") else 0
            for n in range(int(lo), int(hi) + 1):
                out.extend(_expand_one(f"{prefix}{n:0{width}d}{rest}"))
        else:
            out.extend(_expand_one(f"{prefix}{part}{rest}"))
    return out


def expand_array_ids(job_id: str) -> list[str]:
    """sacct's row for a job array whose tasks have not started yet, `123_[0-3%2]`, as the task ids
    ['123_0', ..., '123_3'] (the `%2` throttle dropped); any other id as itself."""
    m = re.fullmatch(r"(\d+)_\[([^\]]*)\]", job_id.strip())
    if not m:
        return [job_id.strip()]
    base, spec = m.group(1), m.group(2).split("%", 1)[0]
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise SlurmParseError(f"not a job array id: {job_id!r}")
        out.extend(f"{base}_{n}" for n in range(int(lo), int(hi or lo) + 1))
    return out


def parse_duration_s(text: str) -> int | None:
    """Slurm durations (`[days-]hours:minutes:seconds`, `minutes:seconds`, `minutes`) to seconds.

    `UNLIMITED`, `INFINITE`, `N/A`, `NOT_SET`, `INVALID` and empty give None.
    """
    text = text.strip()
    if text.upper() in ("", "UNLIMITED", "INFINITE", "N/A", "NOT_SET", "INVALID", "NONE"):
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
        parts = [int(p) for p in text.split(":")]
        while len(parts) < 3:  # `1-2` is days-hours, `1-2:3` days-hours:minutes
            parts.append(0)
        h, m, s = parts
    else:
        parts = [int(float(p)) for p in text.split(":")]
        if len(parts) == 1:
            h, m, s = 0, parts[0], 0
        elif len(parts) == 2:
            h, (m, s) = 0, parts
        elif len(parts) == 3:
            h, m, s = parts
        else:
            raise SlurmParseError(f"not a Slurm duration: {text!r}")
    return ((days * 24 + h) * 60 + m) * 60 + s


def parse_timestamp(text: str) -> dt.datetime | None:
    """`2026-12-02T12:30:00` (local time, as Slurm prints it) to a naive datetime; N/A etc. to None."""
    text = text.strip()
    if text in ("", "N/A", "Unknown", "None", "(null)"):
        return None
    try:
        return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        raise SlurmParseError(f"not a Slurm timestamp: {text!r}") from None


def parse_tres(text: str) -> dict[str, str]:
    """`cpu=2,mem=4G,node=1,billing=2,gres/gpu=2` to {'cpu': '2', ..., 'gres/gpu': '2'}."""
    out = {}
    for item in text.split(","):
        if "=" in item:
            k, v = item.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def gpus_in_gres(text: str, name: str = "gpu") -> int:
    """Count GPUs in a GRES string: `gpu:4`, `gpu:a100:4(S:0-1)`, `gres:gpu:2`, `gres/gpu:2`, `(null)`;
    `name="shard"` counts GPU shards the same way (`gpu:4,shard:16`)."""
    total = 0
    for item in re.split(r",(?![^(]*\))", text or ""):
        item = re.sub(r"\(.*\)$", "", item.strip())
        item = re.sub(r"^gres[:/]", "", item)
        parts = item.split(":")
        if not parts or parts[0] != name:
            continue
        if len(parts) == 1:
            total += 1
        elif parts[-1].isdigit():
            total += int(parts[-1])
        else:
            total += 1  # `gpu:a100` means one GPU of that type
    return total


def gpus_in_tres(text: str, name: str = "gpu") -> int:
    """GPUs (or with `name="shard"`, GPU shards) in a TRES string: `cpu=2,gres/gpu=2,gres/shard=4`."""
    tres = parse_tres(text or "")
    return sum(int(v) for k, v in tres.items() if k == f"gres/{name}" and v.isdigit())


def gpu_share(shards: int, node_gpus: int, node_shards: int) -> float | None:
    """The part of one GPU that `shards` of a node's GRES shards are (its `node_shards` spread
    evenly over its `node_gpus`, as gres.conf's Count over the GPUs' device files): what a job
    holding them may use of the GPU's memory. None when the node has no shards or no GPUs."""
    if shards <= 0 or node_gpus <= 0 or node_shards <= 0:
        return None
    return min(1.0, shards * node_gpus / node_shards)


_MEM_UNITS_MB = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def parse_mem_mb(text: str) -> float | None:
    """A Slurm memory size in MB: `4G` 4096, `256M` 256, `388532K` 379.4, `2.50G` 2560, `1000`
    (M where no unit is given); None when empty or unreadable."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)", (text or "").strip())
    return None if m is None else float(m.group(1)) * _MEM_UNITS_MB[m.group(2) or "M"]


def mem_mb_in_tres(text: str) -> int:
    """Memory of a TRES string in whole MB (`mem=4G` 4096); 0 without one."""
    return round(parse_mem_mb(parse_tres(text or "").get("mem", "")) or 0)


def peak_rss_by_job(text: str) -> dict[str, float]:
    """`sacct -n -P -o JobID,MaxRSS` output to {job id: the largest MaxRSS of its steps, MB}
    (pure); a job none of whose steps has one (never ran, or not sampled yet) is absent."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        jid, _, rss = line.partition("|")
        mb = parse_mem_mb(rss)
        if jid and mb is not None:
            job = jid.split(".", 1)[0]
            out[job] = max(out.get(job, 0.0), mb)
    return out


_TEST_ONLY_RE = re.compile(
    r"Job (?P<job>\d+) to start at (?P<start>\S+) using (?P<cpus>\d+) processors on nodes? (?P<nodes>\S+)"
    r"(?: in partition (?P<partition>\S+))?"
)


@dataclass(frozen=True)
class TestOnlyEstimate:
    """What `sbatch --test-only` predicts for a would-be job."""

    __test__ = False  # not a pytest class

    job_id: int
    start: dt.datetime
    cpus: int
    nodes: tuple[str, ...]
    partition: str | None


def parse_test_only(stderr: str) -> TestOnlyEstimate:
    """Parse `sbatch: Job 12 to start at 2026-12-02T12:30:00 using 1 processors on nodes n1 in partition gpu`."""
    m = _TEST_ONLY_RE.search(stderr)
    if not m:
        raise SlurmParseError(f"sbatch --test-only gave no start estimate: {stderr.strip()[:300]!r}")
    start = parse_timestamp(m.group("start"))
    if start is None:
        raise SlurmParseError(f"sbatch --test-only gave no start time: {stderr.strip()[:300]!r}")
    return TestOnlyEstimate(
        job_id=int(m.group("job")),
        start=start,
        cpus=int(m.group("cpus")),
        nodes=tuple(expand_hostlist(m.group("nodes"))),
        partition=m.group("partition"),
    )


def parse_sbatch_job_id(stdout: str) -> str:
    """`sbatch --parsable` prints `123` or `123;cluster`; plain sbatch `Submitted batch job 123`."""
    text = stdout.strip()
    m = re.search(r"(?:Submitted batch job )?(\d+)(?:;\S+)?\s*$", text)
    if not m:
        raise SlurmParseError(f"no job id in sbatch output: {text[:200]!r}")
    return m.group(1)


def split_state(text: str) -> tuple[str, str | None]:
    """sacct's `CANCELLED by 0` -> ('CANCELLED', '0'); squeue's `RUNNING` -> ('RUNNING', None)."""
    text = text.strip()
    if " by " in text:
        state, by = text.split(" by ", 1)
        return state.strip().rstrip("+"), by.strip()
    return text.rstrip("+"), None


def parse_exit_code(text: str) -> tuple[int, int]:
    """sacct/scontrol `ExitCode=1:0` -> (exit status 1, signal 0)."""
    code, _, sig = text.strip().partition(":")
    try:
        return int(code or 0), int(sig or 0)
    except ValueError:
        raise SlurmParseError(f"not an exit code: {text!r}") from None


def parse_show_config(config_text: str) -> dict[str, str]:
    """`scontrol show config` as {key: value} (the text after the first " = "; later sections such as
    the plugins' own "Key = Value" lines are included, a key's first value wins)."""
    out: dict[str, str] = {}
    for line in config_text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out.setdefault(key.strip(), value.strip())
    return out


def parse_scheduler_parameters(config_text: str) -> dict[str, str]:
    """SchedulerParameters of `scontrol show config` as {name: value} ("bf_continue": "" for a flag)."""
    value = parse_show_config(config_text).get("SchedulerParameters")
    if value is None:
        return {}
    out = {}
    for item in value.split(","):
        name, _, val = item.partition("=")
        if name.strip() and name.strip() != "(null)":
            out[name.strip()] = val.strip()
    return out
