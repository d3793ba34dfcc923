"""bench/trace_summary.py: where a profiled step's GPU waits, and which host thread ran what meanwhile."""

import gzip
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("trace_summary", ROOT / "bench" / "trace_summary.py")
trace_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_summary)


def test_gpu_gaps_name_the_host_work_inside_them(tmp_path):
    us = 1000.0
    events = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "rollout-engine"}},
        {"ph": "X", "cat": "kernel", "name": "decode", "ts": 0.0, "dur": 10 * us, "pid": 0, "tid": 0},
        # 20 ms without a kernel, 12 of it covered by the engine thread's range and its op
        {"ph": "X", "cat": "user_annotation", "name": "engine.finish", "ts": 12 * us, "dur": 12 * us,
         "pid": 1, "tid": 7},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 14 * us, "dur": 3 * us, "pid": 1, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "forward", "ts": 30 * us, "dur": 1 * us, "pid": 0, "tid": 0},
        {"ph": "X", "cat": "kernel", "name": "forward", "ts": 32 * us, "dur": 1 * us, "pid": 0, "tid": 0},
    ]  # fmt: skip
    path = tmp_path / "rank0.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    (gap,) = trace_summary.gpu_gaps(path, min_ms=5)  # the 1 ms between the forwards is not listed
    assert gap["at_ms"] == 10 and gap["idle_ms"] == 20 and gap["host_ms"] == 12
    assert gap["overlapping"] == [
        ("rollout-engine", "engine.finish", 12.0),
        ("rollout-engine", "aten::copy_", 3.0),
    ]
    assert trace_summary.gpu_gaps(path, min_ms=25) == []
