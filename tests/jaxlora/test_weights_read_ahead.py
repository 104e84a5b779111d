"""`jaxlora.weights.hf.ReadAhead`: tensors read by threads ahead of the one asked for, in order, with
skipped names dropped, errors raised where the tensor is asked for, and the read-ahead bounded."""

import threading

import numpy as np
import pytest

import jaxlora.weights.hf as hf
from jaxlora.weights.errors import WeightsError


def test_reads_in_any_thread_come_back_in_the_order_asked_with_skips(monkeypatch):
    monkeypatch.setattr(hf, "READ_AHEAD", 3)
    names = [f"t{i:02d}" for i in range(20)]
    started, lock = [], threading.Lock()
    gate = threading.Event()

    def read(name):
        with lock:
            started.append(name)
        gate.wait(timeout=10)
        return np.full((2,), int(name[1:]))

    with hf.ReadAhead(names, read, to_device=lambda t: t * 10) as reader:
        gate.set()
        asked = names[::3]  # every third name: the others are skipped
        got = [int(reader(name)[0]) for name in asked]
        assert got == [10 * int(name[1:]) for name in asked]
        # never more than READ_AHEAD names past the one asked for were started
        assert len(started) <= int(asked[-1][1:]) + 1 + hf.READ_AHEAD
    assert reader._pending == {}


def test_a_read_error_is_raised_when_its_tensor_is_asked_for():
    def read(name):
        if name == "bad":
            raise WeightsError("model.safetensors: cannot read tensor bad")
        return np.zeros(1)

    with hf.ReadAhead(["a", "bad", "c"], read) as reader:
        assert reader("a").shape == (1,)
        with pytest.raises(WeightsError, match="cannot read tensor bad"):
            reader("bad")
        assert reader("c").shape == (1,)
        assert reader("not listed").shape == (1,)  # a name outside the list is read directly
