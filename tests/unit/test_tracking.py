"""TensorBoard scalars: what is written is read back; labels and non-finite values are skipped."""

import math

from shared.runtime.tracking import ScalarLog
from tests.helpers import read_scalars


def test_scalars_round_trip_and_skip_what_is_no_scalar(tmp_path):
    log = ScalarLog(tmp_path / "tb")
    log.add(1, {"reward_mean": 0.25, "tokens": 100, "recipe": "minirl+tis", "loss": math.nan, "flag": True})
    log.add(2, {"reward_mean": 0.5, "tokens": 120})
    log.close()
    scalars = read_scalars(tmp_path / "tb")
    assert scalars == {"reward_mean": [(1, 0.25), (2, 0.5)], "tokens": [(1, 100.0), (2, 120.0)]}
    event_file = next((tmp_path / "tb").glob("events.out.tfevents.*"))
    event_file.write_bytes(event_file.read_bytes()[:-7])  # a record cut short by a crash
    # a step is one event (one record): the cut takes its values together, the steps before stay whole
    assert read_scalars(tmp_path / "tb") == {"reward_mean": [(1, 0.25)], "tokens": [(1, 100.0)]}


def test_scalars_off_write_nothing(tmp_path, monkeypatch):
    off = tmp_path / "off"
    off.mkdir()
    monkeypatch.chdir(off)
    log = ScalarLog(None)
    log.add(1, {"x": 1.0})
    log.close()
    assert list(off.iterdir()) == [] and list(tmp_path.iterdir()) == [off]  # no event file anywhere it could go


def test_a_process_without_torch_writes_scalars_without_importing_it(tmp_path):
    """The orchestrator never computes: its scalars reach TensorBoard without torch loaded, and a
    later `import torch` in that process still works."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from shared.runtime.tracking import ScalarLog\n"
        f"log = ScalarLog(__import__('pathlib').Path({str(tmp_path / 'tb')!r}))\n"
        "log.add(3, {'eval_accuracy': 0.5})\n"
        "log.close()\n"
        "print('torch' in sys.modules)\n"
        "import torch\n"
        "print(torch.ones(2).sum().item())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "2.0"]
    assert read_scalars(tmp_path / "tb") == {"eval_accuracy": [(3, 0.5)]}
