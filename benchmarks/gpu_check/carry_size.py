"""What a call of the device tool would carry to the GPU machine, and whether it fits.

The tool sends the working tree (tracked files and untracked ones git does not ignore) plus
the ignored paths named in ``carry`` (the wheels in ``.whl``), 64 MiB in all.

    python -m benchmarks.gpu_check.carry_size [--carry .whl]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

LIMIT_BYTES = 64 << 20
ROOT = Path(__file__).resolve().parents[2]


def carried_bytes(carry: list[str], root: Path = ROOT) -> int:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    files = {root / name.decode() for name in listed if name}
    for path in carry:
        where = root / path
        files.update(p for p in where.rglob("*") if p.is_file()) if where.is_dir() else files.add(where)
    return sum(f.stat().st_size for f in files if f.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--carry", nargs="*", default=[".whl"])
    args = ap.parse_args(argv)
    size = carried_bytes(args.carry)
    print(f"carried: {size / 2**20:.1f} MiB of {LIMIT_BYTES / 2**20:.0f} MiB")
    return 0 if size <= LIMIT_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())
