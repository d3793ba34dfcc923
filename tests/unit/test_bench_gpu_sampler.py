"""bench/scaling.py's GpuSampler: the clocks of a case's GPUs from nvidia-smi's loop, or nothing without it.

This machine has no GPU: a stand-in nvidia-smi on PATH prints what the real one prints for
`--query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -l 1` (one line a GPU a
sample), first a cool, fast card, then the same card hot and clocked down."""

import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
spec = importlib.util.spec_from_file_location("bench_scaling", ROOT / "bench" / "scaling.py")
scaling = sys.modules["bench_scaling"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(scaling)

STAND_IN = """#!/bin/sh
for i in 1 2 3 4; do echo "1980, 300.12, 41"; echo "1980, 310.00, 43"; done
for i in 1 2 3 4 5 6; do echo "1755, 699.50, 67"; echo "1740, 700.00, 69"; sleep 0.05; done
sleep 30
"""


def test_the_later_half_of_the_samples_gives_the_clock_power_and_hottest_reading(tmp_path, monkeypatch):
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text(STAND_IN)
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    sampler = scaling.GpuSampler(tmp_path / "gpu.csv")
    deadline = time.monotonic() + 10
    while (tmp_path / "gpu.csv").read_text().count("\n") < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    telemetry = sampler.stop()  # the stand-in is still sleeping: stop ends it
    assert sampler.process.poll() is not None
    # 20 lines; the later 10 are all hot ones (the cool 8 and the first 2 hot ones are the earlier half)
    assert telemetry == {"gpu/sm_clock_mhz": 1747.5, "gpu/power_w": 699.75, "gpu/temperature_c_max": 69.0}


def test_without_nvidia_smi_nothing_is_sampled(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert scaling.GpuSampler(tmp_path / "gpu.csv").stop() == {}
