"""bench/drift.py: a re-measurement held against bench/headline.json flags what moved more than 10%."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_drift", ROOT / "bench" / "drift.py")
drift = importlib.util.module_from_spec(spec)
spec.loader.exec_module(drift)


def write_scaling(folder: Path, step_s: float, throughput: float) -> None:
    (folder / "scaling").mkdir(parents=True, exist_ok=True)
    case = {"case": "0.5b x1", "status": "done", "timing_s/step": step_s, "perf/throughput": throughput}
    (folder / "scaling" / "results.json").write_text(
        json.dumps([case, {"case": "0.5b x4", "status": "failed"}])
    )


def test_a_step_15_percent_slower_is_flagged_and_a_5_percent_one_is_not(tmp_path, capsys):
    held = json.loads(drift.HEADLINE.read_text())["H100"]["scaling"]["figures"]["0.5b x1"]
    write_scaling(tmp_path / "slow", held["timing_s/step"] * 1.15, held["perf/throughput"] / 1.15)
    assert drift.main(["--results", str(tmp_path / "slow"), "--card", "H100"]) == 1
    lines = capsys.readouterr().out.splitlines()
    step = next(line for line in lines if "0.5b x1 timing_s/step" in line)
    assert "+15.0%" in step and "DRIFT (worse)" in step
    assert "not measured" in next(line for line in lines if "0.5b x4 timing_s/step" in line)  # it failed

    write_scaling(tmp_path / "ok", held["timing_s/step"] * 0.95, held["perf/throughput"] * 1.05)
    assert drift.main(["--results", str(tmp_path / "ok"), "--card", "H100"]) == 0
    assert "DRIFT" not in capsys.readouterr().out


def test_nothing_comparable_is_its_own_exit_status(tmp_path):
    assert drift.main(["--results", str(tmp_path), "--card", "H100"]) == 2
    assert drift.main(["--results", str(tmp_path)]) == 2  # no card named and none in the results
