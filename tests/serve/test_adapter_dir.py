"""`jaxlora-serve --adapter-dir` over the tiny random model: adapters served by folder name on first
request; bad input fails only the requests that name it (a corrupt or mismatched adapter: 400 with
the reason, also when found corrupt on a later read from disk; an unknown name or a folder that is
not an adapter: 404; a name escaping the directory: 400) while the server keeps serving; /metrics
reports the tiers; a host bound smaller than one adapter is a start-up error."""

import json
import os
import shutil

import httpx
import jax
import pytest

from jaxlora.lora.adapter import random_adapter
from jaxlora.lora.adapter_config import LoraConfig
from jaxlora.lora.peft_io import WEIGHTS_FILE, save_peft_adapter
from jaxlora.weights import load_config
from serve.cli import build_app, build_parser
from tests.serve.adapter_dirs import SERVER_OPTIONS, adapter_name, write_adapter
from tests.serve.conftest import LiveServer


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, tiny_model_dir):
    """task-0000..0005, a truncated copy ("corrupt"), one made for another model ("mismatch"), bad
    JSON ("bad_json"), a folder without a config and a plain file."""
    root = str(tmp_path_factory.mktemp("adapter_dir"))
    base = load_config(tiny_model_dir)
    for index in range(6):
        write_adapter(root, base, index)
    shutil.copytree(os.path.join(root, adapter_name(0)), os.path.join(root, "corrupt"))
    weights = os.path.join(root, "corrupt", WEIGHTS_FILE)
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    other = load_config("default")  # SmolLM2's shapes
    save_peft_adapter(random_adapter("mismatch", other, LoraConfig(r=4, target_modules=("q_proj",))),
                      os.path.join(root, "mismatch"))
    os.makedirs(os.path.join(root, "bad_json"))
    with open(os.path.join(root, "bad_json", "adapter_config.json"), "w") as f:
        f.write("{not json")
    os.makedirs(os.path.join(root, "no_config"))
    with open(os.path.join(root, "notes.txt"), "w") as f:
        f.write("not an adapter")
    return root


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapter_dir):
    """A live server over `adapter_dir` whose host cache holds one adapter."""
    args = build_parser().parse_args(["--model", tiny_model_dir, "--adapter-dir", adapter_dir, "--max-cpu-adapters",
                                      "1", "--compile-cache", "", "--served-model-name", "base"] + SERVER_OPTIONS)
    with LiveServer(build_app(args), None) as live:
        live.wait_ready()
        yield live


def _complete(server, model, stream=False):
    return httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "Once upon a time",
                                                            "max_tokens": 4, "temperature": 0, "stream": stream},
                      timeout=120)


def test_directory_adapters_and_bad_ones_fail_only_their_requests(server):
    good = _complete(server, adapter_name(0))
    assert good.status_code == 200, good.text
    base = _complete(server, "base")
    for name, reason in (("corrupt", "truncated or corrupt"), ("mismatch", "expected (4, 64)"),
                         ("bad_json", "not valid JSON"), ("../task-0000", "not an adapter folder name")):
        for stream in (False, True):
            response = _complete(server, name, stream)
            assert response.status_code == 400 and reason in response.json()["error"]["message"], response.text
    for name in ("no_config", "notes.txt", "task-9999"):
        response = _complete(server, name)
        assert response.status_code == 404 and "does not exist" in response.text
    assert _complete(server, adapter_name(0)).json()["choices"] == good.json()["choices"]  # still serving
    assert _complete(server, adapter_name(1)).json()["choices"] != good.json()["choices"]
    assert base.status_code == 200


def test_adapter_found_corrupt_on_a_later_read_fails_its_requests(server, adapter_dir):
    """task-0002 is read fine, evicted from the host (bound: one adapter) and from the device slots,
    then corrupted on disk: the engine's next read fails the request naming it (400), not others."""
    name = adapter_name(2)
    assert _complete(server, name).status_code == 200
    for index in (0, 1, 3, 4, 5):  # 4 device slots: task-0002's is evicted too
        assert _complete(server, adapter_name(index)).status_code == 200
    weights = os.path.join(adapter_dir, name, WEIGHTS_FILE)
    saved = open(weights, "rb").read()
    try:
        with open(weights, "wb") as f:
            f.write(saved[: len(saved) // 3])
        response = _complete(server, name)
        assert response.status_code == 400 and "corrupt" in response.text, response.text
        assert _complete(server, adapter_name(3)).status_code == 200
    finally:
        with open(weights, "wb") as f:
            f.write(saved)
    assert _complete(server, name).status_code == 200  # fixed on disk: read again


def test_metrics_report_the_adapter_tiers(server):
    """Its own traffic (it holds alone and after the tests above): four adapters read from disk
    and placed on the device, three bad folders read and refused, task-0003 last on the host."""
    for index in (0, 1, 2, 3):
        assert _complete(server, adapter_name(index)).status_code == 200
    for name in ("corrupt", "mismatch", "bad_json"):
        assert _complete(server, name).status_code == 400
    text = httpx.get(server.url + "/metrics").text
    metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert metrics["jaxlora_adapters_on_disk"] == 9  # folders with an adapter_config.json
    assert metrics["jaxlora_adapters_on_host"] == 1
    assert 0 < metrics["jaxlora_adapter_host_bytes"]
    assert metrics['jaxlora_adapter_loads{tier="disk"}'] >= 4 and metrics['jaxlora_adapter_loads{tier="device"}'] >= 4
    assert metrics['jaxlora_adapter_load_seconds_sum{tier="disk"}'] > 0
    assert metrics["jaxlora_adapter_read_errors"] >= 3
    assert metrics['jaxlora_adapter_rows{kind="total"}'] == 0  # no device rows without unified paging


def test_host_bound_smaller_than_one_adapter_is_a_startup_error(tiny_model_dir, adapter_dir):
    args = build_parser().parse_args(["--model", tiny_model_dir, "--adapter-dir", adapter_dir,
                                      "--max-cpu-adapter-memory", "64K"] + SERVER_OPTIONS)
    with pytest.raises(SystemExit, match="smaller than one adapter"):
        build_app(args)
    path = os.path.join(adapter_dir, adapter_name(0))
    args = build_parser().parse_args(["--model", tiny_model_dir, "--adapter", f"a={path}",
                                      "--max-cpu-adapter-memory", "1K"] + SERVER_OPTIONS)
    with pytest.raises(SystemExit, match="a needs"):
        build_app(args)
    with pytest.raises(SystemExit, match="expects bytes"):
        build_app(build_parser().parse_args(["--max-cpu-adapter-memory", "lots"]))
    assert json.load(open(os.path.join(path, "adapter_config.json")))["r"] == 4


def test_request_waits_for_its_adapter_read_without_holding_others(tiny_model_dir, adapter_dir):
    """The engine in this thread: while task-0004 is still being read (the reader is held), a request
    for task-0005 queued behind it is admitted and finishes; task-0004's then runs with its weights."""
    import threading
    import time

    from jaxlora.sampling import SamplingParams
    from jaxlora.weights import load_model
    from serve.engine import Engine

    model, tokenizer = load_model(tiny_model_dir)
    config = _engine_config(adapter_dir)
    engine = Engine(model, tokenizer.eos_token_ids, config)
    release, read = threading.Event(), engine.adapters._read

    def held_read(path, name):
        if name == adapter_name(4):
            release.wait(60)
        return read(path, name)

    engine.adapters._read = held_read
    events = {0: [], 1: []}
    prompt = tokenizer.encode("Once upon a time")
    for i, name in enumerate((adapter_name(4), adapter_name(5))):
        engine.submit(i, prompt, name, SamplingParams(4), events[i].append)
    deadline = time.monotonic() + 120
    while not (events[1] and events[1][-1].finish_reason) and time.monotonic() < deadline:
        if not engine.step():
            time.sleep(0.01)  # task-0005's read is on its way
    assert events[1][-1].finish_reason == "length" and not events[0]
    assert [seq.seq_id for seq in engine.scheduler.waiting] == [0]
    release.set()
    engine.run_until_idle()
    assert events[0][-1].finish_reason == "length"
    alone = Engine(model, tokenizer.eos_token_ids, config)
    again = []
    alone.submit(0, prompt, adapter_name(4), SamplingParams(4), again.append)
    alone.run_until_idle()
    assert [e.token for e in events[0]] == [e.token for e in again]
    assert engine.adapters.stats.disk_reads == 2 and engine.snapshot()["adapters_on_host"] == 2


def test_engine_waiting_only_for_reads_sleeps_and_wakes_when_a_read_ends(tiny_model_dir, adapter_dir, monkeypatch):
    """The engine's own thread: while the only request waits for its adapter's read (held), the
    engine is `stalled` and waits instead of stepping in a loop (a spinning engine thread holds the
    GIL the reader threads need); the read's end wakes it (with the longest wait made 60 s here, the
    request still finishes at once), with the same tokens as an engine that read it beforehand."""
    import threading
    import time

    import serve.engine as engine_module
    from jaxlora.sampling import SamplingParams
    from jaxlora.weights import load_model
    from serve.engine import Engine

    model, tokenizer = load_model(tiny_model_dir)
    engine = Engine(model, tokenizer.eos_token_ids, _engine_config(adapter_dir))
    release, read, schedule = threading.Event(), engine.adapters._read, engine.scheduler.schedule
    plans = []
    engine.adapters._read = lambda path, name: (release.wait(60), read(path, name))[1]
    engine.scheduler.schedule = lambda: (plans.append(1), schedule())[1]
    monkeypatch.setattr(engine_module, "STALLED_WAIT_S", 60.0)
    done, events = threading.Event(), []
    prompt = tokenizer.encode("Once upon a time")
    engine.start()
    try:
        engine.submit(0, prompt, adapter_name(3), SamplingParams(4),
                      lambda event: (events.append(event), event.finish_reason and done.set()))
        time.sleep(0.5)
        assert engine.stalled and not events and len(plans) <= 3, len(plans)  # no spinning
        release.set()
        assert done.wait(30) and events[-1].finish_reason == "length"
    finally:
        engine.stop()
    alone = Engine(model, tokenizer.eos_token_ids, _engine_config(adapter_dir))
    again = []
    alone.submit(0, prompt, adapter_name(3), SamplingParams(4), again.append)
    alone.run_until_idle()
    assert [e.token for e in events] == [e.token for e in again]


def _engine_config(adapter_dir, **changes):
    from serve.engine import EngineConfig

    return EngineConfig(**{**dict(max_adapters_on_device=2, page_size=8, num_pages=32, max_model_len=64,
                                  max_num_seqs=4, token_budget=32, prefill_chunk=16, max_lora_rank=32,
                                  adapter_dir=adapter_dir, max_host_adapter_bytes=4 << 20), **changes})


@pytest.mark.parametrize("unified", [False, True])
def test_adapter_evicted_from_the_host_after_admission_is_still_copied(tiny_model_dir, adapter_dir, unified):
    """A reader thread may evict an adapter from the host cache right after the scheduler found it
    ready: the engine keeps the copy it found for that step, and the request gets its own answer."""
    from jaxlora.sampling import SamplingParams
    from jaxlora.weights import load_model
    from serve.engine import Engine

    model, tokenizer = load_model(tiny_model_dir)
    prompt = tokenizer.encode("Once upon a time")
    answers = []
    for racing in (False, True):
        engine = Engine(model, tokenizer.eos_token_ids, _engine_config(adapter_dir, unified_paging=unified,
                                                                       num_pages=128))
        ready = engine._adapter_ready

        def ready_then_evicted(uid):
            found = ready(uid)
            if racing and found:
                engine.adapters._evict(uid)
            return found

        engine.scheduler.is_ready = ready_then_evicted
        engine.adapters.ensure(adapter_name(3)).result(60)
        events = []
        engine.submit(0, prompt, adapter_name(3), SamplingParams(4), events.append)
        engine.run_until_idle()
        assert events[-1].finish_reason == "length" and not engine.adapters.on_host(
            engine.adapters.resolve(adapter_name(3)).uid) == racing
        answers.append([e.token for e in events])
    assert answers[0] == answers[1]


def test_unified_paging_refuses_an_adapter_larger_than_the_page_pool(tiny_model_dir, adapter_dir):
    """task-0003 (rank 32 on every projection) takes 64 pages of 4 KiB; with 32 pages in all, its
    request ends with the reason instead of waiting forever, and a smaller adapter's still runs."""
    from jaxlora.sampling import SamplingParams
    from jaxlora.weights import load_model
    from serve.engine import Engine

    model, tokenizer = load_model(tiny_model_dir)
    engine = Engine(model, tokenizer.eos_token_ids, _engine_config(adapter_dir, unified_paging=True))
    events = {0: [], 1: []}
    for i, index in enumerate((3, 0)):  # rank 32, rank 4
        engine.submit(i, tokenizer.encode("Once upon a time"), adapter_name(index), SamplingParams(4), events[i].append)
    engine.run_until_idle()
    assert events[0][-1].finish_reason == "adapter_error" and "exceed the device page pool" in events[0][-1].error
    assert events[1][-1].finish_reason == "length"


def test_warmup_reserves_pinned_host_memory_for_directory_reads(tiny_model_dir, adapter_dir, monkeypatch):
    """An engine that reads adapters from a directory into pinned host copies grows the pinned host
    memory once at warmup by its host bound (`Residency.reserve_host`: the device pool's bytes when
    unbounded, at most HOST_RESERVE_CAP); without pinned copies or without a directory it reserves
    nothing; its answers are those of an engine without the reserve."""
    from jaxlora.lora.pool import AdapterPool
    from jaxlora.sampling import SamplingParams
    from jaxlora.weights import load_model
    from serve.engine import Engine
    from serve.residency import Residency

    model, tokenizer = load_model(tiny_model_dir)
    asked = []
    reserve = AdapterPool.reserve_host
    monkeypatch.setattr(AdapterPool, "reserve_host", lambda pool, nbytes: (asked.append(nbytes), reserve(pool, nbytes))[1])
    prompt, answers = tokenizer.encode("Once upon a time"), []
    for changes, expected in (({"pinned_host_adapters": True}, [4 << 20]), ({}, [])):
        asked.clear()
        engine = Engine(model, tokenizer.eos_token_ids, _engine_config(adapter_dir, **changes))
        engine.warmup(background=False)
        assert asked == expected
        events = []
        engine.submit(0, prompt, adapter_name(3), SamplingParams(4), events.append)
        engine.run_until_idle()
        answers.append([e.token for e in events])
    assert answers[0] == answers[1] and events[-1].finish_reason == "length"
    asked.clear()
    unbounded = Engine(model, tokenizer.eos_token_ids,
                       _engine_config(adapter_dir, pinned_host_adapters=True, max_host_adapter_bytes=None))
    pool_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(unbounded.pool.arrays))
    assert unbounded.residency.reserve_host() == min(pool_bytes, Residency.HOST_RESERVE_CAP) and asked == [pool_bytes]
    no_dir = Engine(model, tokenizer.eos_token_ids, _engine_config(None, pinned_host_adapters=True))
    assert no_dir.residency.reserve_host() == 0
