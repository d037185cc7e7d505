"""What `nowait bench soak` measures of the server and how it reads the trend.

- `read_process`: the server process's resident memory, open file descriptors and threads, from
  /proc (Linux; psutil is not a dependency and /proc holds all three).
- `data_bytes`: the server's data directory, split into its SQLite stores (batches, files, keys,
  with their WAL) and the rest (the audit log, which is append-only by design and so grows with
  every request): a store that does not reuse the space of deleted files shows in the first.
- `trend`: a least-squares line over the second half of the run. The first half holds warm-up
  (allocator pools, torch's caches, the first batch's pages), so growth is judged on the second:
  a series levels off when the line moves by at most 5% of its level there, or by less than a
  small absolute floor for series that are small counts (a queue of 0-3, a few threads).
- `tally`: every accepted batch line against the output and error files' lines: a line never
  answered is lost, one answered twice duplicated.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

LEVEL_TOLERANCE = 0.05
# Absolute floors under which a series' movement is noise, not growth (same units as the series).
FLOORS = {"rss_bytes": 4 * 2**20, "open_fds": 2, "threads": 2, "store_bytes": 256 * 2**10,
          "audit_bytes": 256 * 2**10, "queued": 2}
METRICS = tuple(FLOORS)


@dataclass(frozen=True)
class Sample:
    t_s: float
    rss_bytes: int
    open_fds: int
    threads: int
    store_bytes: int
    audit_bytes: int
    queued: int  # requests running or waiting in every engine, from /readyz

    def as_dict(self) -> dict:
        return asdict(self)


def read_process(pid: int) -> tuple[int, int, int]:
    """(resident bytes, open file descriptors, threads) of a live process."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()
    rss = int(fields["VmRSS"][0]) * 1024  # /proc says kB
    return rss, len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"][0])


def data_bytes(data_dir: Path) -> tuple[int, int]:
    """(bytes of the SQLite stores with their WAL and journal files, bytes of everything else)."""
    stores = other = 0
    for path in data_dir.rglob("*"):
        try:
            if not path.is_file():
                continue
            size = path.stat().st_size
        except FileNotFoundError:  # a WAL or journal checkpointed away meanwhile
            continue
        if ".sqlite" in path.name:
            stores += size
        else:
            other += size
    return stores, other


def queued(readyz: dict) -> int:
    return sum(int(e.get("running") or 0) + int(e.get("waiting") or 0) for e in (readyz.get("engines") or {}).values())


def _line(times: list[float], values: list[float]) -> tuple[float, float]:
    """(slope per second, intercept) of the least-squares line; flat for a single point."""
    n = len(times)
    mean_t, mean_v = sum(times) / n, sum(values) / n
    spread = sum((t - mean_t) ** 2 for t in times)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values, strict=True)) / spread if spread else 0.0
    return slope, mean_v - slope * mean_t


def trend(samples: list[Sample], metric: str, floor: float | None = None) -> dict:
    """The series' first, middle and last values, its slope per hour over the second half, the
    growth that slope makes over that half (absolute and in %), and whether it levels off
    (`floor`: the absolute movement that is noise, FLOORS' by default)."""
    values = [getattr(s, metric) for s in samples]
    times = [s.t_s for s in samples]
    middle = times[-1] / 2
    half = [i for i, t in enumerate(times) if t >= middle]
    if len(half) < 2:
        half = list(range(max(0, len(samples) - 2), len(samples)))
    slope, intercept = _line([times[i] for i in half], [values[i] for i in half])
    start, end = times[half[0]], times[half[-1]]
    level = slope * start + intercept
    growth = slope * (end - start)
    return {"first": values[0], "middle": values[half[0]], "last": values[-1],
            "per_hour": round(slope * 3600, 3), "second_half_growth": round(growth, 3),
            "second_half_growth_pct": round(100 * growth / level, 3) if level > 0 else 0.0,
            "levels_off": growth <= max(LEVEL_TOLERANCE * abs(level), FLOORS[metric] if floor is None else floor)}


def tally(accepted: dict[str, list[str]], answered: dict[str, list[str]]) -> tuple[int, int]:
    """(lines lost, lines duplicated): per batch, each accepted custom_id against the custom_ids
    of its output and error files (every accepted line is in exactly one of them, once)."""
    lost = duplicated = 0
    for batch_id, custom_ids in accepted.items():
        seen = Counter(answered.get(batch_id, []))
        for custom_id in custom_ids:
            count = seen.pop(custom_id, 0)
            lost += count == 0
            duplicated += max(0, count - 1)
        duplicated += sum(seen.values())  # answers to lines never sent count as extra answers
    return lost, duplicated
