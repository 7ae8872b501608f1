"""benchmarks.gpu_paper: the prediction and the budget against hand-computed values, and the whole call on the
CPU at a toy size (smoke preset, two LeNet clients, the workers in this process), its summary and its record."""

from __future__ import annotations

import json
import tarfile

import pytest

from benchmarks import gpu_paper
from benchmarks.gpu_paper import plan, predict
from launcher.launch import client_gpu_share

TIMES = {"local[a]": 0.01, "local[b]": 0.02, "generator": 0.1, "kd": 0.05, "evaluation": 1e-4, "teachers": 2e-4,
         "ms": 0.5, "checkpoint": 2.0}
SHARDS = {0: ("a", 250), 1: ("b", 128)}
COUNTS = {"local_batch": 128, "local_epochs": 200, "distill_epochs": 200, "generator_steps": 30, "kd_steps": 200,
          "eval_every": 1, "test_images": 10_000, "ms_steps": 30, "ms_batch": 16}


def test_predict_adds_the_clients_and_both_methods_by_hand():
    """E = 10, T = 5. Clients: a 2 steps/epoch x 0.01 s + b 1 step x 0.02 s, x 10 = 0.4 s. A distillation epoch:
    30 x 0.1 + 200 x 0.05 + 10,000 x 1e-4 = 14 s, so 70 s; teachers 10,000 x 2e-4 = 2 s; FedHydra's MS 30 x 0.5 =
    15 s; checkpoints once a minute: 2 of 2 s each."""
    out = predict(TIMES, SHARDS, COUNTS, local_epochs=10, distill_epochs=5)
    assert out["clients"] == pytest.approx(0.4)
    assert out["dense"] == pytest.approx(70 + 2 + 4)
    assert out["fedhydra"] == pytest.approx(70 + 2 + 15 + 4)
    assert out["total"] == pytest.approx(0.4 + 76 + 91)


def test_the_plan_keeps_the_whole_preset_where_it_fits_and_else_the_largest_factor_that_does():
    """Whole preset: clients 8 s; a method 2,800 s + teachers + 47 checkpoints (94 s): 2,896 / 2,911 s; 5,815 s.
    With 1,000 s: E = T = 33 (f in [0.165, 0.17)) gives 1.32 + (462 + 2 + 16) + (462 + 17 + 16) = 976.32 s, and 34
    epochs would need 1,004.36 s."""
    whole = plan(TIMES, SHARDS, COUNTS, available_s=6_000, margin=1.0)
    assert (whole.local_epochs, whole.distill_epochs, whole.whole_preset) == (200, 200, True)
    assert whole.predicted_s["total"] == pytest.approx(5_815)
    cut = plan(TIMES, SHARDS, COUNTS, available_s=1_000, margin=1.0)
    assert (cut.local_epochs, cut.distill_epochs, cut.whole_preset) == (33, 33, False)
    assert cut.predicted_s["total"] == pytest.approx(976.32)
    assert 33 / 200 <= cut.factor < 34 / 200
    assert predict(TIMES, SHARDS, COUNTS, 34, 34)["total"] > 1_000
    stretched = plan(TIMES, SHARDS, COUNTS, available_s=1_000, margin=1.15)  # the margin leaves less room
    assert stretched.distill_epochs < 33 and stretched.predicted_s["total"] <= 1_000
    floor = plan(TIMES, SHARDS, COUNTS, available_s=1.0, margin=1.0)  # nothing fits: one epoch each, said so
    assert (floor.local_epochs, floor.distill_epochs) == (1, 1) and floor.predicted_s["total"] > 1.0


def test_clients_share_the_gpus_so_that_every_concurrent_one_is_on_them():
    assert client_gpu_share(nodes=5, cpus_per_client=1, gpus=1, cores=16) == 0.2
    assert client_gpu_share(nodes=5, cpus_per_client=4, gpus=1, cores=16) == 0.25  # 4 run at once
    assert client_gpu_share(nodes=3, cpus_per_client=1, gpus=1, cores=16) == 0.33  # 3 x 0.33 <= 1 GPU
    assert client_gpu_share(nodes=1, cpus_per_client=1, gpus=2, cores=16) == 1.0  # one GPU at most
    assert client_gpu_share(nodes=4, cpus_per_client=1, gpus=2, cores=16) == 0.5
    assert client_gpu_share(nodes=500, cpus_per_client=1, gpus=1, cores=256) == 0.01  # Ray queues the rest
    assert client_gpu_share(nodes=5, cpus_per_client=1, gpus=0, cores=16) == 0.0


def test_the_cli_leaves_the_gpu_share_to_the_machine_unless_given(monkeypatch):
    from launcher import cli

    seen = []

    class Refused:
        ok, run_id, status, status_details, log_text = False, 0, "finished:failed", "stub", ""

    monkeypatch.setattr(cli, "run_simulation", lambda overrides, **kw: seen.append(kw) or Refused())
    cli.main(["run", "--quiet"])
    cli.main(["run", "--quiet", "--gpus-per-client", "0"])
    assert [kw["gpus_per_client"] for kw in seen] == [None, 0.0]


COST = {"stages": [{"name": n, "seconds": s} for n, s in {
    "local[lenet]": 1e-3, "generator": 1e-2, "kd": 1e-3, "evaluation": 1e-6, "teachers": 1e-6, "ms": 1e-2,
    "checkpoint": 0.1}.items()]}


def test_the_whole_call_at_a_toy_size_writes_a_summary_and_a_record(tmp_path, mnist_dir):
    """(mnist_dir: the data folder, which holds cifar10/ too.)"""
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps(COST))
    out = tmp_path / "out"
    toy = {"local.max-samples": 64, "eval.test-samples": 200, "distill.synth-batch": 8, "distill.epochs": 2,
           "distill.generator-steps": 2, "distill.kd-steps": 2, "distill.ngf": 8, "distill.nz": 16,
           "fedhydra.ms-steps": 2}
    server = {k: v for k, v in toy.items() if k.startswith(("distill.", "fedhydra."))}
    summary = gpu_paper.run(out, 3_600, tmp_path / "work", "lenet,lenet:lenet", "smoke", None, toy, server, cost,
                            inline=True)
    assert summary["stage_seconds"]["kd"] == 1e-3 and summary["shards"] == {"0": ["lenet", 64], "1": ["lenet", 64]}
    assert summary["plan"]["whole_preset"] and summary["plan"]["local_epochs"] == 1  # the smoke preset's
    assert summary["plan"]["distill_epochs"] == 2
    assert summary["clients"]["exit"] == {"0": 0, "1": 0}
    for method in ("dense", "fedhydra"):
        entry = summary["methods"][method]
        assert entry["exit"] == 0 and 0.0 <= entry["accuracy_final"] <= 1.0
        assert entry["result"]["config"]["distill.epochs"] == 2
        assert entry["fast_path"] == {"bf16": False, "device_data": False, "channels_last": False}  # a CPU
    assert json.loads((out / "summary.json").read_text())["plan"] == summary["plan"]
    with tarfile.open(out / "runs.tar.gz") as tar:
        names = tar.getnames()
    assert "runs/dense/result.json" in names and "logs/client-p0.log" in names
    results = tmp_path / "results"
    results.mkdir()
    report = gpu_paper.record(out, results_dir=results)
    text = report.read_text()
    assert "| dense |" in text and "| fedhydra |" in text and "local 1 and distillation 2" in text
    lines = (results / "gpu_paper.jsonl").read_text().splitlines()
    assert [json.loads(line)["method"] for line in lines] == ["dense", "fedhydra"]
