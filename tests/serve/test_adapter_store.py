"""The adapter store alone (no model): directory names and paths, the host cache's LRU bounds in
bytes and adapters, what `want` protects and reads, failed reads, an adapter over the bound."""

import json
import os
import threading

import numpy as np
import pytest

from jaxlora.lora.adapter_config import AdapterError
from jaxlora.lora.peft_io import CONFIG_FILE, WEIGHTS_FILE
from jaxlora.lora.pool import PreparedAdapter
from serve.adapter_store import AdapterStore


def _folder(root, name, size=1000, config=True):
    """An adapter-looking folder whose weights file has `size` bytes (the store's estimate)."""
    path = os.path.join(root, name)
    os.makedirs(path)
    if config:
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump({"r": 4}, f)
    with open(os.path.join(path, WEIGHTS_FILE), "wb") as f:
        f.write(os.urandom(size))
    return path


class FakeReader:
    """read(path, name) -> a PreparedAdapter of the weights file's size; names in `bad` fail."""

    def __init__(self, bad=()):
        self.bad, self.reads = set(bad), []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, path, name):
        self.gate.wait(10)
        self.reads.append(name)
        if name in self.bad:
            raise AdapterError(f"{path}: cannot read safetensors (truncated or corrupt?)")
        size = os.path.getsize(os.path.join(path, WEIGHTS_FILE))
        return PreparedAdapter(name, {"q_proj": {"a": np.zeros(size, np.uint8)}}, ())


def _wait(store, names):
    for name in names:
        future = store.ensure(name)
        if future is not None:
            future.result(10)


def test_directory_names_paths_and_non_adapters(tmp_path):
    root = tmp_path / "adapters"
    root.mkdir()
    _folder(str(root), "good")
    _folder(str(root), "no_config", config=False)
    (root / "a_file").write_text("not an adapter")
    outside = _folder(str(tmp_path), "outside")
    os.symlink(outside, root / "escape")
    store = AdapterStore(FakeReader(), str(root))
    assert store.resolve("good").path == str(root / "good")
    assert store.resolve("good") is store.resolve("good")  # registered once
    for name in ("no_config", "a_file", "missing"):
        with pytest.raises(LookupError):
            store.resolve(name)
    for name in ("../outside", "good/../good", ".hidden", "", "a" * 200, "escape"):
        with pytest.raises(AdapterError):
            store.resolve(name)
    assert store.names() == ["good"] and store.disk_count() == 1
    with pytest.raises(LookupError):
        AdapterStore(FakeReader()).resolve("good")  # no directory: only registered names


@pytest.mark.parametrize("bound", [dict(max_bytes=3500), dict(max_adapters=3)])
def test_host_cache_is_lru_within_its_bound(tmp_path, bound):
    names = [f"ad{i}" for i in range(8)]
    for name in names:
        _folder(str(tmp_path), name, size=1000)
    store = AdapterStore(FakeReader(), str(tmp_path), **bound)
    uids = {name: store.resolve(name).uid for name in names}
    _wait(store, names[:3])
    assert [store.on_host(uids[n]) for n in names[:3]] == [True] * 3
    store.host(uids["ad0"])  # ad0 used: ad1 is now the least recently used
    store.want([])  # nothing protected
    _wait(store, ["ad3"])
    assert [store.on_host(uids[n]) for n in names[:4]] == [True, False, True, True]
    assert store.on_host_count() == 3 and store.cached_bytes() == 3000 and store.stats.host_evictions == 1


def test_want_protects_queued_adapters_and_reads_the_next_that_fit(tmp_path):
    names = [f"ad{i}" for i in range(6)]
    for name in names:
        _folder(str(tmp_path), name, size=1000)
    reader = FakeReader()
    store = AdapterStore(reader, str(tmp_path), max_bytes=3000, readers=1)  # reads in order
    uids = [store.resolve(name).uid for name in names]
    _wait(store, names[:2])
    store.want([uids[1], uids[0], uids[4], uids[5]])  # ad0, ad1 protected; ad4 read; ad5 does not fit
    _wait(store, [])
    store._reader.submit(lambda: None).result(10)  # the reader's queue is drained
    assert reader.reads == ["ad0", "ad1", "ad4"]
    assert all(store.on_host(uids[i]) for i in (0, 1, 4)) and not store.on_host(uids[5])
    _wait(store, ["ad2"])  # a handler's first read: evicts only what is not protected... all are
    assert all(store.on_host(uids[i]) for i in (0, 1, 4, 2))
    store.want([uids[5]])  # the queue moved on: ad5 is read, least recently used ones evicted
    store._reader.submit(lambda: None).result(10)
    assert store.on_host(uids[5]) and store.cached_bytes() <= 3000


def test_failed_read_marks_the_entry_and_the_next_lookup_reads_again(tmp_path):
    _folder(str(tmp_path), "broken")
    reader = FakeReader(bad={"broken"})
    store = AdapterStore(reader, str(tmp_path), max_bytes=10_000)
    entry = store.resolve("broken")
    with pytest.raises(AdapterError, match="corrupt"):
        store.ensure("broken").result(10)
    assert "corrupt" in store.error(entry.uid) and store.stats.disk_read_errors == 1
    again = store.resolve("broken")
    assert again.uid != entry.uid and entry.removed and store.error(again.uid) is None
    reader.bad.clear()  # fixed on disk: read fine now
    store.ensure("broken").result(10)
    assert store.on_host(again.uid)


def test_adapter_larger_than_the_bound_fails_with_the_reason(tmp_path):
    _folder(str(tmp_path), "big", size=5000)
    store = AdapterStore(FakeReader(), str(tmp_path), max_bytes=4000)
    uid = store.resolve("big").uid
    store.want([uid])
    assert "more than the host cache bound of 4000 bytes" in store.error(uid)
    with pytest.raises(ValueError, match="max_bytes"):
        AdapterStore(FakeReader(), max_bytes=0)
