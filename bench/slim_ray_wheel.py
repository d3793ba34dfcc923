"""Repack Ray's wheel without what the trainer never loads, so it travels to the GPU machine in one call.

    python bench/slim_ray_wheel.py ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl --out .whl/

Ray's wheel (~79 MB) is over the 64 MiB a device call may carry; a third of it is the Java worker jar
and the dashboard's source maps, which a Python-only cluster never opens. The repacked wheel keeps
every Python module and native binary (raylet, GCS server, _raylet.so), drops the listed files from
the archive and from its RECORD, and installs with plain `pip install --no-deps`.
"""

from __future__ import annotations

import argparse
import fnmatch
import zipfile
from pathlib import Path

DROP = (
    "ray/jars/*",  # the Java worker (ray_dist.jar, 32 MB compressed)
    "*.js.map",  # dashboard source maps
    "ray/rllib/*",  # RL library, unused by a trainer that only places actors
    "ray/serve/*",
    "ray/llm/*",
)


def dropped(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in DROP)


def slim(wheel: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    with (
        zipfile.ZipFile(wheel) as source,
        zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dest,
    ):
        for info in source.infolist():
            if dropped(info.filename):
                continue
            data = source.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not dropped(line.split(",", 1)[0])]
                data = ("\n".join(kept) + "\n").encode()
            dest.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--out", type=Path, default=Path(".whl"))
    args = parser.parse_args()
    target = slim(args.wheel, args.out)
    print(f"{target}: {args.wheel.stat().st_size / 2**20:.1f} MiB -> {target.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
