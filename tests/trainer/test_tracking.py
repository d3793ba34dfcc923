"""Tracker backends (console, JSONL, TensorBoard, W&B offline, SwanLab offline) and verl's metric helpers."""

import datetime
import json
import struct
import sys
import time

import numpy as np
import pytest
import torch

from trainer.tracking import (
    SUMMARY_FILE,
    Tracker,
    backend_run,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    format_console_line,
    format_metric,
    memory_metrics,
    mfu,
    peak_flops_per_gpu,
    progress_metrics,
    timed,
    timer,
    training_flops,
)


def make_tracker(tmp_path, backends, **kwargs):
    defaults = {
        "project": "proj",
        "experiment": "exp",
        "run_dir": tmp_path / "run",
        "config": {"lr": 1e-6},
        "total_steps": 10,
    }
    return Tracker(backends, **{**defaults, **kwargs})


# ---------------------------------------------------------------------------------------- console, jsonl


def test_console_line_is_verls_format_with_significant_digits():
    line = format_console_line(
        {"critic/score/mean": 0.5, "perf/total_num_tokens": 120, "actor/pg_loss": -0.01234}, 3
    )
    assert line == "step:3 - critic/score/mean:0.5 - perf/total_num_tokens:120 - actor/pg_loss:-0.01234"


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (2e-5, "2e-05"),  # a learning rate: verl's 3 decimals printed 0.000
        (1.23456e-7, "1.235e-07"),
        (0.123456, "0.1235"),
        (3.0, "3"),  # counts stay whole
        (1536.25, "1536"),  # 4 significant digits
        (123456.7, "123457"),  # tokens/s: no exponent
        (-0.5, "-0.5"),
        (float("nan"), "nan"),
    ],
)
def test_metric_values_keep_their_significant_digits(value, shown):
    assert format_metric(value) == shown


def test_console_prints_lines_and_a_progress_bar_with_eta(tmp_path, capsys):
    tracker = make_tracker(tmp_path, ["console"], total_steps=4)
    tracker.log({"critic/score/mean": 0.25}, step=1)
    time.sleep(0.05)
    tracker.log({"critic/score/mean": 0.75, "actor/entropy": torch.tensor(1.5)}, step=2)
    tracker.close()
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "step:1 - critic/score/mean:0.25",
        "step:2 - critic/score/mean:0.75 - actor/entropy:1.5",
    ]
    assert "Training Progress" in err and "2/4" in err
    assert "<" in err.split("2/4")[-1]  # tqdm's [elapsed<remaining] ETA


def test_jsonl_metrics_and_generations_append_across_resume(tmp_path):
    with make_tracker(tmp_path, []) as tracker:  # jsonl is on even with no backend named
        with pytest.warns(UserWarning, match="'note' is not a number"):
            tracker.log(
                {"critic/score/mean": np.float32(0.5), "perf/total_num_tokens": 42, "note": "hi"}, step=1
            )
        tracker.log_generations(
            [{"input": "1+1?", "output": "2", "score": 1.0}, {"input": "2+2?", "output": "5", "score": 0.0}],
            step=1,
        )
        run_id = tracker.run_id
    with make_tracker(tmp_path, [], run_id=run_id, start_step=1) as resumed:
        resumed.log({"critic/score/mean": 0.75}, step=2)
        assert resumed.run_id == run_id
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["critic/score/mean"]) for r in lines] == [(1, 0.5), (2, 0.75)]
    assert lines[0]["perf/total_num_tokens"] == 42 and "note" not in lines[0]
    generations = [
        json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()
    ]
    assert generations == [
        {"step": 1, "input": "1+1?", "output": "2", "score": 1.0},
        {"step": 1, "input": "2+2?", "output": "5", "score": 0.0},
    ]
    assert len(run_id) == 21 and run_id.isalnum()


def test_unknown_backend_and_missing_extra_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"'mlflowz'.*console"):
        make_tracker(tmp_path, ["console", "mlflowz"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the extra were not installed
    with pytest.raises(ImportError, match=r"'wandb'.*pip install 'rl-jobgroup\[loggers\]'"):
        make_tracker(tmp_path, ["wandb"])


# ---------------------------------------------------------------------------------- optional backends


def test_tensorboard_event_files_are_readable(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is an optional extra (rl-jobgroup[loggers])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with make_tracker(tmp_path, ["tensorboard"]) as tracker:
        for step, score in ((1, 0.1), (2, 0.4), (3, 0.9)):
            tracker.log({"critic/score/mean": score, "timing_s/gen": 2.0 * step}, step=step)
        tracker.log_generations([{"input": "q", "output": "a", "score": 1.0}], step=3)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    scores = events.Scalars("critic/score/mean")
    assert [(e.step, round(e.value, 6)) for e in scores] == [(1, 0.1), (2, 0.4), (3, 0.9)]
    assert [e.value for e in events.Scalars("timing_s/gen")] == [2.0, 4.0, 6.0]
    assert "val/generations/text_summary" in events.Tags()["tensors"]


def read_leveldb_log(path, ident: bytes):
    """Records of a W&B / SwanLab transaction log (LevelDB log format: 32 KiB blocks, 7-byte record
    headers).
    """
    data = path.read_bytes()
    assert data[:4] == ident
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk completes a record
            records.append(pending)
            pending = b""
    return records


def offline_run_start(folder) -> float:
    """The start time (epoch seconds) W&B wrote into an offline run folder's name, to the second."""
    stamp = folder.name.split("-")[2]  # offline-run-YYYYmmdd_HHMMSS-<id>, local time
    return datetime.datetime.strptime(stamp, "%Y%m%d_%H%M%S").timestamp()


def wait_for_the_clock_to_pass(moment: float) -> None:
    """Return once time.time() >= moment: a condition on the clock, whatever the machine's speed."""
    while time.time() < moment:
        time.sleep(max(0.0, moment - time.time()))


def test_wandb_offline_run_holds_the_metrics_and_resumes_the_same_id(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is an optional extra (rl-jobgroup[loggers])")

    import wandb
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with make_tracker(tmp_path, ["wandb"]) as tracker:
        tracker.log({"critic/score/mean": 0.25, "actor/pg_loss": -1.5}, step=1)
        tracker.log({"critic/score/mean": 0.5}, step=2)
        tracker.log_generations([{"input": "1+1?", "output": "2", "score": 1.0}], step=2)
        run_id = tracker.run_id
    # run.finish() only tells wandb-core the run is over; wandb-core closes (flushes) the run's log file
    # after finish() has returned. teardown() waits for wandb-core to exit, so the files are complete.
    # (Reading them right after finish() lost the last records whenever wandb-core lagged: a loaded box.)
    wandb.teardown()
    (first,) = (tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}")
    # W&B names an offline run's folder by the second it started: a resumed session within that second
    # would reuse the first one's folder and clobber its log, which no real resume (a restart) does.
    wait_for_the_clock_to_pass(offline_run_start(first) + 1)
    with make_tracker(tmp_path, ["wandb"], run_id=run_id, start_step=2) as resumed:
        resumed.log({"critic/score/mean": 0.75}, step=3)
    wandb.teardown()
    runs = sorted((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2 and runs[0] == first  # both sessions wrote under the same run id
    history = {}
    for run in runs:
        for raw in read_leveldb_log(run / f"run-{run_id}.wandb", b":W&B"):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                history[record.history.step.num] = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items
                }
    assert history[1]["critic/score/mean"] == 0.25 and history[1]["actor/pg_loss"] == -1.5
    assert history[2]["critic/score/mean"] == 0.5 and history[3]["critic/score/mean"] == 0.75
    table_file = runs[0] / "files" / history[2]["val/generations/path"]  # the validation samples table
    assert json.loads(table_file.read_text())["data"] == [[2, "1+1?", "2", 1.0]]


def test_user_run_ids_and_resume_modes_win(tmp_path, monkeypatch):
    for var in ("WANDB_RUN_ID", "WANDB_RESUME", "SWANLAB_RUN_ID", "SWANLAB_RESUME"):
        monkeypatch.delenv(var, raising=False)
    assert backend_run("wandb", "ours") == ("ours", "allow")  # nothing set: our id, reopened on resume
    monkeypatch.setenv("WANDB_RUN_ID", "theirs")
    monkeypatch.setenv("WANDB_RESUME", "must")
    monkeypatch.setenv("SWANLAB_RESUME", "never")
    assert backend_run("wandb", "ours") == ("theirs", "must")
    assert backend_run("swanlab", "ours") == ("ours", "never")  # each backend reads its own variables
    monkeypatch.setenv("SWANLAB_RUN_ID", "swan")
    assert backend_run("swanlab", "ours") == ("swan", "never")
    # the tracker's own id (stored in checkpoints) is the user's only for a backend that is logged to
    with make_tracker(tmp_path, ["jsonl"]) as plain:
        assert plain.run_id not in ("theirs", "swan")


def test_wandb_run_uses_the_users_run_id(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is an optional extra (rl-jobgroup[loggers])")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_RUN_ID", "userrun123")
    monkeypatch.setenv("WANDB_RESUME", "allow")
    config = {"actor_rollout_ref": {"rollout": {"name": "vllm", "engine": "hf"}}}
    with make_tracker(tmp_path, ["wandb"], config=config) as tracker:
        tracker.log({"critic/score/mean": 0.25}, step=1)
    assert tracker.run_id == "userrun123"  # stored in checkpoints, so a resume reopens the same run
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*-userrun123"))
    summary = json.loads((tmp_path / "run" / SUMMARY_FILE).read_text())
    assert summary == {"rollout_engine": "hf", "rollout_engine_requested": "vllm"}


def test_swanlab_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("swanlab", reason="swanlab is an optional extra (rl-jobgroup[loggers])")
    try:
        from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    except ImportError:
        pytest.skip("this swanlab version has no readable offline record format")
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    with make_tracker(tmp_path, ["swanlab"]) as tracker:
        tracker.log({"critic/score/mean": 0.25}, step=1)
        tracker.log({"critic/score/mean": 0.5}, step=2)
        tracker.log_generations([{"input": "1+1?", "output": "2", "score": 1.0}], step=2)
        run_id = tracker.run_id
    files = list((tmp_path / "run" / "swanlog").glob(f"run-*-{run_id}/run-{run_id}.swanlab"))
    assert len(files) == 1
    scalars, media = {}, {}
    for raw in read_leveldb_log(files[0], b":SWL"):
        record = Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "scalar" and record.scalar.key == "critic/score/mean":
            scalars[record.scalar.step] = record.scalar.value.number
        if record.WhichOneof("record_type") == "media":
            media[(record.media.key, record.media.step)] = [
                item.filename for item in record.media.value.items
            ]
    assert scalars == {1: 0.25, 2: 0.5}
    (text_file,) = media[("val/generations", 2)]  # the validation samples
    assert "1+1?" in next(files[0].parent.glob(f"media/**/{text_file}")).read_text()


# ------------------------------------------------------------------------------------------ metrics


def test_compute_data_metrics_against_hand_computed_numbers():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    advantages = torch.tensor(
        [[1.0, 1.0, 1.0, 9.0], [-2.0, -2.0, 9.0, 9.0], [0.5, 0.5, 0.5, 0.5]]
    )  # 9 = padding
    metrics = compute_data_metrics(
        scores=torch.tensor([1.0, 0.0, 0.5]),
        token_rewards=torch.tensor([[0.0, 0.0, 0.9, 0.0], [0.0, -0.1, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5]]),
        advantages=advantages,
        returns=2 * advantages,
        values=advantages,
        response_mask=mask,
        response_lengths=torch.tensor([3, 2, 4]),
        prompt_lengths=torch.tensor([5, 8, 8]),
        max_response_length=4,
        max_prompt_length=8,
    )
    expected = {
        "critic/score/mean": 0.5,
        "critic/score/max": 1.0,
        "critic/score/min": 0.0,
        "critic/rewards/mean": (0.9 - 0.1 + 0.5) / 3,
        "critic/rewards/max": 0.9,
        "critic/rewards/min": -0.1,
        # valid advantages: 1,1,1, -2,-2, .5,.5,.5,.5 -> sum 1, 9 tokens
        "critic/advantages/mean": 1 / 9,
        "critic/advantages/max": 1.0,
        "critic/advantages/min": -2.0,
        "critic/returns/mean": 2 / 9,
        "critic/returns/max": 2.0,
        "critic/returns/min": -4.0,
        "critic/values/mean": 1 / 9,
        "critic/values/max": 1.0,
        "critic/values/min": -2.0,
        # returns - values = advantages, var(returns) = 4 var(advantages): 1 - 1/4
        "critic/vf_explained_var": 0.75,
        "response_length/mean": 3.0,
        "response_length/max": 4.0,
        "response_length/min": 2.0,
        "response_length/clip_ratio": 1 / 3,
        "prompt_length/mean": 7.0,
        "prompt_length/max": 8.0,
        "prompt_length/min": 5.0,
        "prompt_length/clip_ratio": 2 / 3,
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-5), key

    grpo = compute_data_metrics(
        scores=[1.0, 0.0],
        advantages=torch.tensor([[0.7, 0.7], [-0.7, 0.0]]),
        response_mask=torch.tensor([[1, 1], [1, 0]]),
        response_lengths=[2, 1],
        prompt_lengths=[3, 3],
        max_response_length=2,
        max_prompt_length=4,
    )
    assert grpo["critic/rewards/mean"] == 0.5  # no KL in reward: rewards = scores
    assert grpo["critic/returns/mean"] == pytest.approx(
        0.7 / 3
    )  # returns default to advantages (0.7+0.7-0.7)/3
    assert "critic/values/mean" not in grpo and grpo["prompt_length/clip_ratio"] == 0.0


def test_timing_throughput_and_mfu_helpers():
    timing = compute_timing_metrics(
        {"gen": 2.0, "update_actor": 3.0, "reward": 0.5, "step": 6.0},
        num_prompt_tokens=1000,
        num_response_tokens=3000,
    )
    assert timing == pytest.approx(
        {
            "timing_s/gen": 2.0,
            "timing_s/update_actor": 3.0,
            "timing_s/reward": 0.5,
            "timing_s/step": 6.0,
            "timing_per_token_ms/gen": 2000 / 3000,  # generation: per response token
            "timing_per_token_ms/update_actor": 3000 / 4000,  # passes over whole sequences: per token
        }
    )
    assert compute_throughput_metrics(8000, 4.0, 2) == {
        "perf/total_num_tokens": 8000,
        "perf/time_per_step": 4.0,
        "perf/throughput": 1000.0,
    }
    # 6 * 100 params * 5 tokens + 12 * 2 layers * 4 dim * (2^2 + 3^2)
    assert training_flops(num_params=100, seq_lens=[2, 3], num_layers=2, attention_dim=4) == 3000 + 1248
    # a shared prompt token skips the weights (6 * 100), not the attention
    shared = training_flops(num_params=100, seq_lens=[2, 3], num_layers=2, attention_dim=4, shared_tokens=1)
    assert shared == 2400 + 1248
    assert mfu(989e12 * 3.0, 3.0, n_gpus=2, peak_flops_per_gpu=989e12) == pytest.approx(0.5)
    assert mfu(1e12, 1.0, n_gpus=1, peak_flops_per_gpu=None) is None
    assert peak_flops_per_gpu("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_per_gpu("NVIDIA H200") == 989e12
    assert peak_flops_per_gpu("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_per_gpu("Some Future Accelerator") is None


def test_timer_adds_up_and_times_failed_stages():
    timings = {}
    for _ in range(2):
        with timer("gen", timings):
            time.sleep(0.05)
    with pytest.raises(KeyError), timer("reward", timings):
        raise KeyError("failed stages are timed too")
    assert 0.1 <= timings["gen"] < 2.0 and timings["reward"] < 1.0


def test_verl_progress_memory_and_save_timing_metrics():
    assert progress_metrics(12, 3) == {"training/global_step": 12, "training/epoch": 3}
    memory = memory_metrics()
    assert set(memory) == {"perf/cpu_memory_used_gb"}  # the GPU peaks come from the ranks
    assert 0 < memory["perf/cpu_memory_used_gb"] < 1e4  # GiB, not bytes
    calls = []
    timing = timed("save_checkpoint", calls.append, "step-3")
    assert calls == ["step-3"] and list(timing) == ["timing_s/save_checkpoint"]
    assert timing["timing_s/save_checkpoint"] >= 0


@pytest.mark.gpu
def test_gpu_peak_flops_and_peak_memory():
    from trainer.parallel.ranks import peak_memory

    block = torch.ones(1024, 1024, device="cuda")  # 4 MiB
    memory = peak_memory(block.device)
    assert memory["perf/max_memory_reserved_gb"] >= memory["perf/max_memory_allocated_gb"] >= 4 / 1024
    name = torch.cuda.get_device_name()
    if "H100" in name or "H200" in name:
        assert peak_flops_per_gpu(name) in (989e12, 756e12)
    del block


def test_a_profiled_step_that_raises_is_written_and_its_error_propagates(tmp_path):
    from trainer.profiling import profiled

    with profiled(str(tmp_path), 3, [5]):  # not a profiled step: nothing written
        torch.ones(4).sum()
    assert not (tmp_path / "profile").exists()
    with pytest.raises(ValueError, match="the step failed"), profiled(str(tmp_path), 5, [5]):
        torch.ones(64, 64) @ torch.ones(64, 64)
        raise ValueError("the step failed")
    assert "aten::mm" in (tmp_path / "profile" / "step_5.txt").read_text()
    assert (tmp_path / "profile" / "step_5.json").exists()


def test_a_profiled_step_records_the_work_of_a_thread_that_was_running_before_it(tmp_path):
    # a rank generates on its engine's thread, started long before the profiled step: its ops and
    # ranges belong in the trace (torch's default profiles the thread that starts it only)
    import json
    import queue
    import threading

    from trainer.profiling import profiled

    jobs: queue.Queue = queue.Queue()

    def engine():
        while (job := jobs.get()) is not None:
            job()

    worker = threading.Thread(target=engine)
    worker.start()
    try:
        done = threading.Event()

        def job():
            with torch.profiler.record_function("engine.job"):
                torch.ones(32, 32) @ torch.ones(32, 32)
            done.set()

        with profiled(str(tmp_path), 1, [1]):
            jobs.put(job)
            assert done.wait(30)
    finally:
        jobs.put(None)
        worker.join()
    events = json.loads((tmp_path / "profile" / "step_1.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events if e.get("tid") == worker.native_id}
    assert {"engine.job", "aten::mm"} <= names
