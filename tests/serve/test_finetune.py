"""Fine-tuning inside the server (serve.finetune) with the official `openai` client: a job trains
while other clients stream completions, its adapter answers its demo task, equals what
`jaxlora-train` trains offline from the job's own jobs.yaml, and a job interrupted by a server
restart resumes to the same adapter; bad uploads and bad jobs are refused with 400."""

import concurrent.futures
import os
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from safetensors.numpy import load_file

from tests.serve.conftest import LiveServer
from train.demo_tasks import is_correct, make_examples, write_jsonl

BASE = "SmolLM2-135M-Instruct"
TASK = "last_word"

JOB = dict(model=BASE, hyperparameters={"n_epochs": 1, "batch_size": 8, "learning_rate_multiplier": 2.0}, seed=3,
           extra_body={"lora": {"r": 8, "alpha": 16}})
ENGINE = dict(page_size=8, num_pages=32, max_model_len=32, max_num_seqs=8, token_budget=16, prefill_chunk=16,
              max_lora_rank=8)
MAX_FILE = 32 * 1024
PROMPTS = ["The capital of France is", "Water boils at", "Once upon a time"]


def _server(smollm2, data_dir, adapter_dir, checkpoint_every=2, api_key=None):
    from serve.app import ServerSettings, create_app
    from serve.engine import Engine, EngineConfig
    from serve.finetune import FinetuneSettings
    from serve.finetune_jobs import TrainingSettings
    from serve.protocol import Limits

    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(adapter_dir=str(adapter_dir), **ENGINE))
    finetune = FinetuneSettings(str(data_dir), MAX_FILE, training=TrainingSettings(capacity=192,
                                                                                  checkpoint_every=checkpoint_every))
    settings = ServerSettings(BASE, limits=Limits(max_tokens=16), finetune=finetune, api_key=api_key)
    app = create_app(engine, tokenizer, settings)
    engine.start()  # already running: the app skips the warm-up (programs compile when first used)
    return LiveServer(app, engine)


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _training_file(tmp_path):
    path = tmp_path / f"{TASK}.jsonl"
    write_jsonl(str(path), make_examples(TASK, 48, seed=0))
    return path


def _wait(client, job_id, until=("succeeded", "failed", "cancelled"), timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in until:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {job.status}")


def _greedy(client, model, prompt, stream=False):
    response = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stream=stream)
    if stream:
        return "".join(chunk.choices[0].text for chunk in response)
    return response.choices[0].text


def _adapter(directory):
    return load_file(os.path.join(directory, "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    """A live server with fine-tuning: (server, client, data dir, adapter dir, a scratch dir)."""
    root = tmp_path_factory.mktemp("finetune")
    data_dir, adapter_dir = root / "data", root / "adapters"
    adapter_dir.mkdir()
    with _server(smollm2, data_dir, adapter_dir) as live:
        live.wait_ready()
        yield dict(server=live, client=_client(live), data_dir=data_dir, adapter_dir=adapter_dir, root=root)


@pytest.fixture(scope="module")
def trained(server):
    """One job trained while another client streamed completions of the base model."""
    client = server["client"]
    alone = [_greedy(client, BASE, p) for p in PROMPTS]
    with open(_training_file(server["root"]), "rb") as f:
        file = client.files.create(file=f, purpose="fine-tune")
    job = client.fine_tuning.jobs.create(training_file=file.id, **JOB)
    during, stop = [], threading.Event()

    def stream():
        while not stop.is_set():
            during.append([_greedy(client, BASE, p, stream=True) for p in PROMPTS])

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream)
        finished = _wait(client, job.id)
        stop.set()
        streaming.result()
    events = client.fine_tuning.jobs.list_events(job.id, limit=100).data
    answers = {e["prompt"]: (e["completion"], _greedy(client, finished.fine_tuned_model, e["prompt"]))
               for e in make_examples(TASK, 12, seed=1)}
    metrics = httpx.get(server["server"].url + "/metrics").text
    return dict(server, job=finished, events=events, alone=alone, during=during, eval=answers, metrics=metrics,
                listed=client.fine_tuning.jobs.list().data, train_steps=server["server"].engine.stats.train_steps)


def test_job_trains_while_serving_and_its_adapter_answers(trained):
    job = trained["job"]
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model.startswith(f"ft-{BASE}-") and job.trained_tokens > 0
    assert job.hyperparameters.n_epochs == 1 and job.hyperparameters.batch_size == 8
    assert [j.id for j in trained["listed"]] == [job.id]
    messages = [e.message for e in trained["events"]]
    assert messages[-1].startswith("Created fine-tuning job") and "successfully completed" in messages[0]
    assert sum(e.type == "metrics" for e in trained["events"]) == 6  # 48 records / batch 8
    assert trained["train_steps"] >= 6 and len(trained["during"]) >= 2
    assert f"jaxlora_train_steps {float(trained['train_steps'])}" in trained["metrics"]
    assert all(answers == trained["alone"] for answers in trained["during"])  # serving unchanged by training
    correct = [is_correct(answer, expected) for expected, answer in trained["eval"].values()]
    assert all(correct), trained["eval"]


def test_job_equals_offline_training(trained, tmp_path):
    """The server wrote the job's jaxlora-train file; training offline from it gives the same adapter,
    bit for bit (the same packed programs on the same weights, data order and seed). (A full-suite
    run once differed by 5e-3 here: an earlier test had left the shared model's weights off by
    float rounding, which tests/conftest.py's `_shared_model_unchanged` now catches.)"""
    from train.cli import main

    job = trained["job"]
    jobs_yaml = trained["data_dir"] / "jobs" / job.id / "jobs.yaml"
    assert main([str(jobs_yaml), f"output_dir={tmp_path}"]) == 0
    served = _adapter(trained["adapter_dir"] / job.fine_tuned_model)
    offline = _adapter(tmp_path / job.fine_tuned_model)
    assert served.keys() == offline.keys() and served
    for key in served:
        np.testing.assert_array_equal(served[key], offline[key], err_msg=key)


def test_restart_resumes_a_job_to_the_same_adapter(smollm2, trained, tmp_path):
    data_dir, adapter_dir = tmp_path / "data", tmp_path / "adapters"
    adapter_dir.mkdir()
    with _server(smollm2, data_dir, adapter_dir) as server:
        server.wait_ready()
        client = _client(server)
        with open(_training_file(tmp_path), "rb") as f:
            file = client.files.create(file=f, purpose="fine-tune")
        job = client.fine_tuning.jobs.create(training_file=file.id, **JOB)
        deadline = time.time() + 300
        while server.engine.stats.train_steps < 3 and time.time() < deadline:  # past the checkpoint at 2
            time.sleep(0.05)
        server.engine.training = None  # no further step: the server stops mid-job
    with _server(smollm2, data_dir, adapter_dir) as server:
        server.wait_ready()
        client = _client(server)
        finished = _wait(client, job.id)
        events = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data]
    assert finished.status == "succeeded", finished.error
    resumed = [m for m in events if m.startswith("Fine-tuning job resumed at step")]
    assert resumed and resumed[0].split()[-1] in ("2/6", "4/6"), events  # from a checkpoint (every 2), mid-job
    reference = _adapter(trained["adapter_dir"] / trained["job"].fine_tuned_model)
    result = _adapter(adapter_dir / finished.fine_tuned_model)
    for key in reference:
        np.testing.assert_array_equal(result[key], reference[key], err_msg=key)


def _upload(client, content: bytes, name="data.jsonl", purpose="fine-tune"):
    return client.files.create(file=(name, content), purpose=purpose)


BAD_UPLOADS = {
    b"hello world\n": "not valid JSON",
    b'{"question": "a", "answer": "b"}\n': "expected 'text'",
    b'{"prompt": "a", "completion": "b", "weight": 2}\n': "unknown field(s) 'weight'",
    b'{"text": "ok"}\n["a list"]\n': "data.jsonl:2: expected a JSON object",
    b'{"messages": [{"role": "user", "content": "hi"}]}\n': "no assistant turn",
    b"\xff\xfe\n": "not UTF-8",
    b"\n\n": "empty",
    b'{"text": "x"}\n' * (MAX_FILE // 14 + 1): "more than this server's limit",
}


def test_bad_uploads_are_refused_and_leave_nothing(server):
    client, data_dir = server["client"], server["data_dir"]
    before = [f.id for f in client.files.list().data]
    stored = sorted(os.listdir(data_dir / "files"))
    for content, reason in BAD_UPLOADS.items():
        with pytest.raises(openai.BadRequestError, match=reason.replace("(", r"\(").replace(")", r"\)")):
            _upload(client, content)
    with pytest.raises(openai.BadRequestError, match="purpose must be 'fine-tune'"):
        _upload(client, b'{"text": "x"}\n', purpose="assistants")
    with pytest.raises(openai.APIStatusError, match="exceeds") as err:  # far past the bound: the body is refused
        _upload(client, b'{"text": "x"}\n' * (MAX_FILE // 2))
    assert err.value.status_code == 413
    assert [f.id for f in client.files.list().data] == before
    assert sorted(os.listdir(data_dir / "files")) == stored


def test_bad_jobs_are_refused(server):
    client = server["client"]
    file = _upload(client, open(_training_file(server["root"]), "rb").read())
    jobs = [j.id for j in client.fine_tuning.jobs.list().data]
    bad = {
        "this server fine-tunes its base model": dict(model="gpt-4o-mini"),
        "no such file": dict(training_file="file-nope"),
        "n_epochs must be in": dict(hyperparameters={"n_epochs": 0}),
        "batch_size must be in": dict(hyperparameters={"batch_size": 49}),
        "learning_rate_multiplier must be in": dict(hyperparameters={"learning_rate_multiplier": -1.0}),
        "n_epochs": dict(hyperparameters={"n_epochs": "3"}),
        "lora.r must be in": dict(extra_body={"lora": {"r": 64}}),
        "lora.dropout must be in": dict(extra_body={"lora": {"dropout": 1.0}}),
        "not: qkv": dict(extra_body={"lora": {"targets": ["qkv"]}}),
        "unsupported field": dict(extra_body={"epochs": 3}),
        "method.type": dict(method={"type": "dpo"}),
        "validation_file is not supported": dict(validation_file=file.id),
        "suffix": dict(suffix="has space"),
    }
    for reason, change in bad.items():
        with pytest.raises(openai.BadRequestError, match=reason):
            client.fine_tuning.jobs.create(**{"training_file": file.id, **JOB, **change})
    assert [j.id for j in client.fine_tuning.jobs.list().data] == jobs
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-nope")


def test_cancel(server):
    client = server["client"]
    file = _upload(client, open(_training_file(server["root"]), "rb").read())
    job = client.fine_tuning.jobs.create(training_file=file.id, **JOB)
    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and client.fine_tuning.jobs.retrieve(job.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="already cancelled"):
        client.fine_tuning.jobs.cancel(job.id)
    assert client.fine_tuning.jobs.list_events(job.id).data[0].message == "Fine-tuning job cancelled"


@pytest.mark.parametrize("extra, reason", [
    ([], "--data-dir needs --adapter-dir"),
    (["--adapter-dir", "{tmp}", "--replicas", "2"], "one engine on one device"),
    (["--adapter-dir", "{tmp}", "--inference-mode", "merged"], "one engine on one device"),
    (["--adapter-dir", "{tmp}", "--finetune-capacity", "0"], "--finetune-capacity must be >= 1"),
])
def test_cli_refuses_fine_tuning_it_cannot_run(tmp_path, extra, reason):
    """Checked before the model loads."""
    from serve.cli import build_app, build_parser

    argv = ["--data-dir", str(tmp_path / "data")] + [a.format(tmp=tmp_path) for a in extra]
    with pytest.raises(SystemExit, match=reason):
        build_app(build_parser().parse_args(argv))


def test_a_job_that_cannot_train_fails_with_the_reason(server):
    """A prompt longer than a microbatch leaves no token to learn from once truncated: the job
    fails (the server goes on serving) and says why."""
    client = server["client"]
    record = b'{"prompt": "' + b"word " * 400 + b'", "completion": " end"}\n'
    file = _upload(client, record * 8)
    job = client.fine_tuning.jobs.create(training_file=file.id, **JOB)
    failed = _wait(client, job.id)
    assert failed.status == "failed" and "no token to learn from" in failed.error.message
    assert client.fine_tuning.jobs.list_events(job.id).data[0].level == "error"
    assert _greedy(client, BASE, PROMPTS[0])


class _Source:
    """A training source that counts the microbatches the engine runs."""

    def __init__(self):
        self.ran = 0

    def next_item(self):
        from jaxlora.scheduler.core import TRAIN, WorkItem

        return WorkItem(TRAIN, "job", 10)

    def run_next(self):
        self.ran += 1


def test_engine_trains_only_when_the_policy_lets_it(smollm2):
    """Serving first: no microbatch while a request waits or runs (train_below=0), one between
    serving steps while at most train_below requests run."""
    from jaxlora.sampling import SamplingParams
    from jaxlora.scheduler.core import CoSchedulePolicy
    from serve.engine import Engine, EngineConfig

    model, tokenizer = smollm2
    engine = Engine(model, tokenizer.eos_token_ids, EngineConfig(**ENGINE))
    engine.training = source = _Source()
    events = []
    engine.submit("a", tokenizer.encode("Hello"), None, SamplingParams(4), events.append)
    assert not engine.train_step() and source.ran == 0  # a request waits
    engine.step()
    assert engine.serving_load().running == 1 and not engine.train_step()
    engine.co_policy = CoSchedulePolicy(train_below=1)
    assert engine.train_step() and source.ran == 1  # one running request: training may go between steps
    engine.co_policy = CoSchedulePolicy()
    while not events or events[-1].finish_reason is None:
        engine.step()
        assert not engine.train_step() or not engine.serving_load().busy
    engine.step()
    assert not engine.serving_load().busy and engine.train_step()  # idle: training takes the step
    assert engine.stats.train_steps == source.ran >= 2 and engine.stats.train_tokens == 10 * source.ran


def test_fine_tuning_routes_need_the_api_key(smollm2, tmp_path):
    (tmp_path / "adapters").mkdir()
    with _server(smollm2, tmp_path / "data", tmp_path / "adapters", api_key="sesame") as server:
        anonymous = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        for call in (anonymous.files.list, anonymous.fine_tuning.jobs.list,
                     lambda: _upload(anonymous, b'{"text": "x"}\n')):
            with pytest.raises(openai.AuthenticationError):
                call()
        keyed = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0)
        assert _upload(keyed, b'{"text": "x"}\n').records == 1
        assert [f.id for f in keyed.files.list().data] and keyed.fine_tuning.jobs.list().data == []
