"""`jaxlora-compress`: compress a collection of PEFT LoRA adapters (Compress-then-Serve), add
adapters to a compressed collection, or show one. See `jaxlora.compress`."""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sys

from jaxlora.compress import store
from jaxlora.compress.collection import METHODS, Source, add, compress, recompress, source_parameter_count
from jaxlora.lora.adapter_config import AdapterError
from jaxlora.lora.peft_io import CONFIG_FILE, WEIGHTS_FILE, load_peft_adapter
from jaxlora.weights import WeightsError, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxlora-compress", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("compress", help="compress adapters into a new collection")
    make.add_argument("adapters", nargs="+", metavar="ADAPTER",
                      help="a PEFT adapter directory, a directory of them, or a glob (quoted)")
    make.add_argument("--out", required=True, help="directory of the compressed collection")
    make.add_argument("--method", choices=METHODS, default="jd-full",
                      help="svd: each adapter at rank r; jd-full: shared orthonormal bases and an r x r core per "
                           "adapter; jd-diag: shared bases and a diagonal core (default jd-full)")
    make.add_argument("--rank", type=int, required=True, help="rank r of the compressed adapters / shared bases")
    make.add_argument("--clusters", type=int, default=1, help="k-means clusters, each with its own bases (JD)")
    _common(make)
    grow = commands.add_parser("add", help="add adapters to a collection: projected onto its bases, or recompressed")
    grow.add_argument("collection", help="a directory written by `jaxlora-compress compress`")
    grow.add_argument("adapters", nargs="+", metavar="ADAPTER", help="as for compress")
    grow.add_argument("--recompress", action="store_true",
                      help="compress everything again (reads the members' sources from the paths in the manifest "
                           "and checks their hashes) instead of projecting the new adapters onto the bases")
    grow.add_argument("--out", default=None, help="write here (default: replace the collection)")
    _common(grow)
    show = commands.add_parser("info", help="print a collection's manifest summary")
    show.add_argument("collection")
    show.add_argument("--json", action="store_true", help="the whole manifest")
    return parser


def _common(parser) -> None:
    parser.add_argument("--model", default="default", help="the base model: 'default', a HF directory or a .gguf")
    parser.add_argument("--iters", type=int, default=30, help="alternating iterations of the JD methods")
    parser.add_argument("--seed", type=int, default=0)


def adapter_dirs(specs: list[str]) -> list[str]:
    """PEFT adapter directories named by `specs` (each a directory with adapter_config.json, a
    directory of such directories, or a glob), in order, without repeats; AdapterError if one
    names nothing."""
    found = []
    for spec in specs:
        paths = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
        dirs = []
        for path in paths:
            if os.path.isfile(os.path.join(path, CONFIG_FILE)):
                dirs.append(path)
            elif os.path.isdir(path):
                dirs += sorted(os.path.join(path, d) for d in os.listdir(path)
                               if os.path.isfile(os.path.join(path, d, CONFIG_FILE)))
        if not dirs:
            raise AdapterError(f"{spec}: no PEFT adapter (a directory with {CONFIG_FILE}) found there")
        found += [d for d in dirs if d not in found]
    return found


def read_source(path: str, base) -> Source:
    """The adapter at `path` with its base model name (adapter_config.json's
    base_model_name_or_path) and the sha256 of its two files."""
    adapter = load_peft_adapter(path, base)
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(os.path.join(path, name), "rb") as f:
            digest.update(f.read())
    with open(os.path.join(path, CONFIG_FILE)) as f:
        base_model = str(json.load(f).get("base_model_name_or_path") or "")
    return Source(adapter, base_model, digest.hexdigest(), os.path.abspath(path))


def _progress(done: int, total: int) -> None:
    print(f"\r  layer {done}/{total}", end="\n" if done == total else "", file=sys.stderr, flush=True)


def _summary(collection, sources=None) -> str:
    lines = [f"{collection.method} rank {collection.rank}, {collection.num_clusters} cluster(s), "
             f"{len(collection.names)} adapters on {collection.base_model or '(unnamed base model)'}; "
             f"modules {', '.join(collection.modules)}; {collection.parameter_count():,} parameters"
             + (f" ({source_parameter_count(sources) / collection.parameter_count():.1f}x fewer than the "
                f"originals)" if sources else "")]
    for name, cluster in zip(collection.names, collection.cluster):
        errors = collection.errors[name]
        lines.append(f"  {name:<24} cluster {int(cluster):<3} relative error "
                     + " ".join(f"{m} {e:.3f}" for m, e in errors.items()))
    return "\n".join(lines)


def _run(args) -> None:
    if args.command == "info":
        collection = store.load(args.collection)
        print(json.dumps(store.manifest(collection), indent=1) if args.json else _summary(collection))
        return
    base = load_config(args.model)
    sources = [read_source(path, base) for path in adapter_dirs(args.adapters)]
    if args.command == "compress":
        collection = compress(sources, base, args.method, args.rank, args.clusters, iters=args.iters,
                              seed=args.seed, progress=_progress)
        store.save(collection, args.out)
        print(_summary(collection, sources))
        return
    collection = store.load(args.collection)
    if args.recompress:
        members = [read_source(record["path"], base) for record in collection.sources]
        collection = recompress(collection, members, sources, base, args.iters, args.seed)
    else:
        collection = add(collection, sources, base)
    store.save(collection, args.out or args.collection)
    print(_summary(collection))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _run(args)
    except (AdapterError, store.CollectionError, WeightsError, ValueError, OSError) as err:
        print(f"jaxlora-compress: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
