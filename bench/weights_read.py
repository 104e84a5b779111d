"""The weights' read of a HF checkpoint, three ways (issue 35's warm start): the raw floor (every
tensor's bytes read from the page cache by threads into numpy, `os.preadv`), the loader
(`jaxlora.weights.hf.load_hf_weights`: parallel reads into one buffer per weight, one transfer and
one transpose/cast program per weight on a GPU/TPU) and the safetensors library's reader through
`layout.stack_weights` (the loader before: `get_tensor` per tensor under the GIL, each tensor put on
the device, stacked there). The files are read once first (page cache), as a warm start finds them.

    PYTHONPATH=. python bench/weights_read.py --model DIR [--dtype bfloat16] [--repeat 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.weights import layout, parallel_read
from jaxlora.weights.hf import load_hf_weights, read_hf_config, safetensors_files
from jaxlora.weights.safetensors_file import read_chunk, read_header


def raw_floor(files: list[str], threads: int) -> tuple[int, float]:
    """(bytes, seconds) of reading every tensor into a new numpy buffer by `threads` threads."""
    refs = [ref for file in files for ref in read_header(file).values()]
    started = time.perf_counter()

    def one(ref):
        out = np.empty(ref.nbytes, np.uint8)
        for offset, view in ref.chunks(out.view(ref.dtype).reshape(ref.shape), parallel_read.CHUNK_BYTES):
            read_chunk(ref.file, offset, view, ref.name)

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, refs))
    return sum(ref.nbytes for ref in refs), time.perf_counter() - started


def library_load(directory: str, config, dtype) -> dict:
    """The loader before: the safetensors library's reader, one thread, through `stack_weights`."""
    from safetensors import safe_open

    handles = [safe_open(file, framework="numpy") for file in safetensors_files(directory)]
    owner = {name: handle for handle in handles for name in handle.keys()}
    return layout.stack_weights(config, sorted(owner), lambda name: owner[name].get_tensor(name), dtype, directory)


def timed(load) -> float:
    started = time.perf_counter()
    jax.block_until_ready(list(load().values()))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--skip-library", action="store_true", help="not the old reader (slow on 16 GB)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    files, config, dtype = safetensors_files(args.model), read_hf_config(args.model), jnp.dtype(args.dtype)
    raw_floor(files, parallel_read.READ_THREADS)  # into the page cache
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "dtype": args.dtype, "runs": []}
    for _ in range(args.repeat):
        nbytes, floor = raw_floor(files, parallel_read.READ_THREADS)
        run = {"bytes": nbytes, "raw_floor_s": floor,
               "loader_s": timed(lambda: load_hf_weights(args.model, config, dtype))}
        if not args.skip_library:
            run["library_s"] = timed(lambda: library_load(args.model, config, dtype))
        report["runs"].append(run)
        print(" ".join(f"{k} {v / 1e9:.2f} GB" if k == "bytes" else f"{k} {v:.2f} s ({nbytes / v / 1e9:.2f} GB/s)"
                       for k, v in run.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
