"""Disk random-read benchmark: what the planner measures (llamaflash.planning.disk_probe), as a table + JSON.

Random reads of 4..256 KiB at queue depths 1..32 with direct I/O through llamaflash's FlashReader, on
a scratch file (evicted from the page cache) in the directory given (default ~/.cache/llamaflash),
each point for --seconds (<= 2 s). Rows: request size; columns: queue depth; cells: IOPS / MB/s.

Usage:  python bench/bench_disk.py [--dir DIR] [--engine auto|io_uring|pool|both] [--seconds 0.5]
                                   [--file-mb 512] [--sizes 4,16,32,64,256] [--depths 1,4,16,32]
Writes JSON to bench/results/disk-<time>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from llamaflash.planning.disk_probe import DEFAULT_DEPTHS, DEFAULT_FILE_MB, DEFAULT_SIZES_KIB, format_table, probe_disk  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default ~/.cache/llamaflash)")
    ap.add_argument("--engine", default="auto", choices=("auto", "io_uring", "pool", "both"))
    ap.add_argument("--seconds", type=float, default=0.5, help="seconds per point (at most 2)")
    ap.add_argument("--file-mb", type=int, default=DEFAULT_FILE_MB)
    ap.add_argument("--sizes", type=_ints, default=list(DEFAULT_SIZES_KIB), help="request sizes in KiB")
    ap.add_argument("--depths", type=_ints, default=list(DEFAULT_DEPTHS))
    ap.add_argument("--json", type=Path, default=None, help="output JSON (default bench/results/disk-<time>.json)")
    args = ap.parse_args(argv)

    engines = ("io_uring", "pool") if args.engine == "both" else (args.engine,)
    results = []
    for engine in engines:
        r = probe_disk(
            args.dir,
            sizes_kib=args.sizes,
            depths=args.depths,
            seconds=args.seconds,
            file_mb=args.file_mb,
            engine=engine,
        )
        results.append(r)
        mode = "direct" if r["direct"] else f"BUFFERED ({r['fallback_reason']})"
        print(
            f"\n{r['directory']} ({r['filesystem']}), engine {r['engine']}, {mode}, alignment {r['alignment']}, "
            f"{r['file_mb']} MB scratch file, {r['seconds_per_point']} s per point"
        )
        print(format_table(r))
        print(f"sequential (1 MiB reads, 8 in flight): {r.get('sequential_mb_s', 0):,.0f} MB/s")
    out = args.json or common.RESULTS_DIR / f"disk-{common.timestamp()}.json"
    common.write_json(out, {"machine": common.machine_info(), "results": results})
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
