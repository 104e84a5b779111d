"""bench/jit_cache.py: a cache folder packed into size-bounded parts comes back byte for byte."""

import os

from bench.jit_cache import pack, unpack


def test_pack_splits_into_bounded_parts_and_unpack_restores_every_file(tmp_path):
    cache = tmp_path / "cache"
    (cache / "sub").mkdir(parents=True)
    files = {"a-entry": os.urandom(50_000), "sub/b-entry": os.urandom(30_000), "c": b""}
    for name, data in files.items():
        (cache / name).write_bytes(data)
    parts = pack(str(cache), str(tmp_path / "out" / "jit"), part_bytes=20_000)
    assert len(parts) >= 4 and all(os.path.getsize(p) <= 20_000 for p in parts)
    restored = tmp_path / "restored"
    assert unpack(str(tmp_path / "out" / "jit"), str(restored)) == len(files)
    for name, data in files.items():
        assert (restored / name).read_bytes() == data
