"""Carries jax's persistent compilation cache between fresh GPU machines.

A fresh H200 spends two 10-minute calls compiling the serving engine's step programs (8B shape,
hybrid backend); the cache those calls fill (`bench/serve.py --compile-cache`, ~70 MB) makes the
next machine skip them, if it travels: what comes back from the machine is at most 8 files of
16 MiB, and what goes to it at most 64 MiB in all. So:

    # on the machine, after `bench/serve.py --compile-only ...`:
    python3 bench/jit_cache.py pack /tmp/jaxlora_serve_jit_cache $OUT/jitcache
    # here: copy the parts into the ignored folder .jitcache/ and name it in `carry`; there:
    python3 bench/jit_cache.py unpack .jitcache/jitcache /tmp/jaxlora_serve_jit_cache

The cache is keyed by the programs, the jax version and the device, so it only helps a machine
of the same kind and jax version running the same code.
"""

from __future__ import annotations

import argparse
import glob
import io
import lzma
import os
import tarfile

PART_BYTES = 15 * 2**20


def pack(cache_dir: str, prefix: str, part_bytes: int = PART_BYTES) -> list[str]:
    """Writes `cache_dir` as an xz tar split into `prefix.partNN` files of <= part_bytes; their paths."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(cache_dir, arcname=".")
    data = lzma.compress(buffer.getvalue(), preset=6)
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    paths = []
    for index, start in enumerate(range(0, max(len(data), 1), part_bytes)):
        path = f"{prefix}.part{index:02d}"
        with open(path, "wb") as part:
            part.write(data[start:start + part_bytes])
        paths.append(path)
    return paths


def unpack(prefix: str, cache_dir: str) -> int:
    """Restores the parts `prefix.partNN` into `cache_dir`; the number of files restored."""
    parts = sorted(glob.glob(glob.escape(prefix) + ".part[0-9][0-9]"))
    if not parts:
        raise FileNotFoundError(f"no {prefix}.partNN files")
    data = b"".join(open(path, "rb").read() for path in parts)
    os.makedirs(cache_dir, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data)), mode="r") as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        tar.extractall(cache_dir, members=members, filter="data")
    return len(members)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    packer = commands.add_parser("pack", help="cache folder -> PREFIX.partNN")
    packer.add_argument("cache_dir")
    packer.add_argument("prefix")
    unpacker = commands.add_parser("unpack", help="PREFIX.partNN -> cache folder")
    unpacker.add_argument("prefix")
    unpacker.add_argument("cache_dir")
    args = parser.parse_args(argv)
    if args.command == "pack":
        paths = pack(args.cache_dir, args.prefix)
        print(f"{len(paths)} parts, {sum(os.path.getsize(p) for p in paths) / 2**20:.1f} MiB: {paths}")
    else:
        print(f"{unpack(args.prefix, args.cache_dir)} cache files restored into {args.cache_dir}")


if __name__ == "__main__":
    main()
