"""wait_for_model: a service started beside the job that writes its model waits for it, bounded."""

import threading
import time

import pytest

from shared.models.loading import wait_for_model


def test_the_wait_ends_when_the_model_is_written_and_reports_while_it_lasts(tmp_path):
    model = tmp_path / "tiny"

    def deliver():
        time.sleep(0.6)
        model.mkdir()
        (model / "model.safetensors").write_bytes(b"x")
        (model / "config.json").write_text("{}")  # last, as deliver() writes it

    writer = threading.Thread(target=deliver)
    writer.start()
    waited: list[int] = []
    started = time.monotonic()
    wait_for_model(model, 30, waited.append, every=0.2)
    writer.join()
    assert 0.6 <= time.monotonic() - started < 30
    assert waited and waited == sorted(waited) and waited[-1] <= 1  # told while it waited, in seconds
    calls = []
    wait_for_model(model, 0.01, calls.append)  # there: no wait, nothing told
    assert calls == []


def test_the_wait_is_bounded(tmp_path):
    (tmp_path / "half").mkdir()  # a directory without config.json is not yet a model
    started = time.monotonic()
    with pytest.raises(FileNotFoundError, match=r"half: no model \(config.json\) within 0.5 s"):
        wait_for_model(tmp_path / "half", 0.5)
    assert time.monotonic() - started >= 0.5
