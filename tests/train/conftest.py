"""Fixtures for training tests: small datasets (the tiny model: tests/conftest.py)."""

import pytest

from train.demo_tasks import make_examples, write_jsonl


@pytest.fixture
def datasets(tmp_path):
    paths = {}
    for task, count in (("last_word", 24), ("repeat_twice", 20), ("count_words", 28)):
        paths[task] = str(tmp_path / f"{task}.jsonl")
        write_jsonl(paths[task], make_examples(task, count, seed=1))
    return paths
