"""experiments.gpu_cells: what it reads from its workers' logs and how it sizes the clients' epochs."""

import json

import pytest

from experiments import gpu_cells

CLASSIFIER_LOG = """training client p0 (classifier, vgg9) for tableiv-mnist.mixed.p0
client p0: local epoch 1/2  loss 0.9000  train acc 0.7000  (2.5s, ETA 00:02)
client p0: local epoch 2/2  loss 0.4000  train acc 0.9000  (4.1s, ETA 00:00)
"""
CVAE_LOG = """client p8: CVAE epoch 1/2  -ELBO 708.22 (recon 628.41, KL 79.82)  (0.9s, ETA 00:01)
client p8: CVAE epoch 2/2  -ELBO 219.16 (recon 216.53, KL 2.63)  (1.7s, ETA 00:00)
"""
SERVER_LOG = """distill: epoch 3/20  kd 0.0500 (200 steps)  test acc 0.8012  [30s, ETA 02:50]
distill: epoch 4/20  kd 0.0400 (200 steps)  test acc 0.8250  [40s, ETA 02:40]
distill: epoch 5/20  kd 0.0300 (200 steps)  [50s, ETA 02:30]
"""


def test_probe_epoch_is_the_second_epochs_time(tmp_path):
    # the first epoch pays for warm-up: 4.1 - 2.5 = 1.6 s, 1.7 - 0.9 = 0.8 s
    (tmp_path / "c.log").write_text(CLASSIFIER_LOG)
    (tmp_path / "d.log").write_text(CVAE_LOG)
    assert abs(gpu_cells.epoch_seconds(tmp_path / "c.log") - 1.6) < 1e-9
    assert abs(gpu_cells.epoch_seconds(tmp_path / "d.log") - 0.8) < 1e-9


def test_probe_without_two_epochs_gives_none(tmp_path):
    (tmp_path / "c.log").write_text(CLASSIFIER_LOG.splitlines()[1])
    assert gpu_cells.epoch_seconds(tmp_path / "c.log") is None


def test_stopped_server_reports_its_last_evaluated_epoch(tmp_path):
    # epoch 5 printed no test accuracy: the last one printed is epoch 4's
    (tmp_path / "s.log").write_text(SERVER_LOG)
    assert gpu_cells.last_test_accuracy(tmp_path / "s.log") == {"epoch": 4, "epochs": 20, "accuracy": 0.825}
    assert gpu_cells.last_test_accuracy(tmp_path / "missing.log") is None


def test_paper_epoch_caps():
    # the paper preset's E = 200; MNIST CVAE epochs from FedMHO Table III (30), CIFAR-10 40
    cells = gpu_cells.fleets()
    mixed, _ = cells["tableiv-mnist"]["fleets"]["mixed"]
    hetero, jobs = cells["hetero-cifar10"]["fleets"]["fleet"]
    assert gpu_cells.paper_epochs(mixed) == (200, 30)
    assert gpu_cells.paper_epochs(hetero) == (200, 40)
    assert [arch for _, _, arch in jobs] == ["googlenet", "resnet18", "cnn2", "cnn3-bn", "lenet"]


def _summary(accuracy: float) -> dict:
    client = {"local_accuracy": 0.9, "arch": "vgg9", "received_bytes": 100, "raw_bytes": 90}
    result = {"method": "fedavg", "dataset": "mnist", "partition": "niid-bench", "alpha": 0.5, "num_clients": 5,
              "seed": 0, "preset": "paper", "global": {"accuracy_final": accuracy}, "clients": [client] * 5,
              "timings": {"local_sum": 10.0, "local_max": 2.0, "server_fuse": 3.0, "evaluation": 1.0},
              "provenance": {"git": {"commit": "abcdef0123456789", "dirty": False}}}
    return {"preset": "paper", "device": "a test GPU", "cpus": 16, "torch": "2", "commit": "abcdef0", "elapsed_s": 5.0,
            "argv": ["run"], "client_epochs": {"tableiv-mnist.mixed": {"local.epochs": 40, "cvae.epochs": 20,
                                                                        "paper": [200, 30]}},
            "cells": {"tableiv-mnist": {"fedavg": {"result": result, "accuracy_final": accuracy}}}}


@pytest.fixture
def results(tmp_path, monkeypatch):
    """The records folder `record` writes to, here a temporary one."""
    from benchmarks import records

    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path / "results")
    return tmp_path / "results"


def _record(folder, summary: dict) -> None:
    """One `record` of a call's folder holding this summary."""
    folder.mkdir(exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    gpu_cells.record(folder)


def test_recording_a_folder_twice_adds_its_runs_once(tmp_path, results):
    _record(tmp_path / "out", _summary(0.6577))
    _record(tmp_path / "out", _summary(0.6577))
    lines = (results / "gpu_cells.jsonl").read_text().splitlines()
    assert [(r["method"], r["code_version"], r["accuracy_final"]) for r in map(json.loads, lines)] == [
        ("fedavg", "abcdef0", 0.6577)]
    assert "| fedavg | 65.77 |" in (results / "gpu_cells.md").read_text()
    # another run of the same cell (another accuracy) is a record of its own
    _record(tmp_path / "out", _summary(0.7))
    assert len((results / "gpu_cells.jsonl").read_text().splitlines()) == 2


def test_recording_another_cell_keeps_the_first_cells_section(tmp_path, results):
    _record(tmp_path / "out", _summary(0.6577))
    # a later call ran the CIFAR-10 cell only, its Co-Boosting stopped at the deadline
    other = {**_summary(0.5), "argv": ["run", "--cells", "hetero-cifar10"],
             "client_epochs": {"hetero-cifar10.fleet": {"local.epochs": 20, "cvae.epochs": 1, "paper": [200, 40]}},
             "cells": {"hetero-cifar10": {"coboosting": {
                 "exit": None, "last_logged": {"epoch": 7, "epochs": 10, "accuracy": 0.3396}}}}}
    _record(tmp_path / "out", other)
    sections = gpu_cells.report_sections((results / "gpu_cells.md").read_text())
    assert list(sections) == ["hetero-cifar10", "tableiv-mnist"]
    assert "| fedavg | 65.77 |" in sections["tableiv-mnist"]
    assert "--cells hetero-cifar10" in sections["hetero-cifar10"] and "--cells" not in sections["tableiv-mnist"]
    assert "| coboosting | stopped at the deadline, last logged epoch 7/10: 33.96 |" in sections["hetero-cifar10"]
    assert "fleet: local 20 [200]; server distillation epochs 10 [200]" in sections["hetero-cifar10"]
    assert "mixed: local 40 [200], CVAE 20 [30]" in sections["tableiv-mnist"]  # a fleet with decoders


def test_record_names_the_calls_distillation_epochs(tmp_path, results):
    # a call run with --distill-epochs 8: the report and the record say 8, not the cell's default 20
    _record(tmp_path / "out", {**_summary(0.6577), "server_epochs": {"tableiv-mnist": 8}})
    record = json.loads((results / "gpu_cells.jsonl").read_text())
    assert record["overrides"]["distill.epochs"] == 8
    assert "server distillation epochs 8 [200]" in (results / "gpu_cells.md").read_text()
    # a summary from before the option: the default it ran
    _record(tmp_path / "old", _summary(0.7))
    assert "server distillation epochs 20 [200]" in (results / "gpu_cells.md").read_text()


def test_the_alpha_0_1_cell_is_recorded_as_its_own_cell(tmp_path, results):
    cells = gpu_cells.fleets()
    names = ("tableiv-mnist", "hetero-cifar10", "hetero-cifar10-alpha0_1")
    assert [cells[c]["alpha"] for c in names] == [0.5, 0.5, 0.1]
    flat, _ = cells["hetero-cifar10-alpha0_1"]["fleets"]["fleet"]
    assert flat["alpha"] == 0.1
    result = {**_summary(0.3)["cells"]["tableiv-mnist"]["fedavg"]["result"], "method": "dense", "dataset": "cifar10",
              "alpha": 0.1}
    summary = {**_summary(0.3), "client_epochs": {"hetero-cifar10-alpha0_1.fleet": {
        "local.epochs": 20, "cvae.epochs": 1, "paper": [200, 40]}},
        "cells": {"hetero-cifar10-alpha0_1": {"dense": {"result": result, "accuracy_final": 0.3}}}}
    _record(tmp_path / "out", summary)
    record = json.loads((results / "gpu_cells.jsonl").read_text())
    assert (record["gpu_cell"], record["cell"], record["method"]) == ("hetero-cifar10-alpha0_1", "0.1", "dense")
    section = gpu_cells.report_sections((results / "gpu_cells.md").read_text())["hetero-cifar10-alpha0_1"]
    assert "Seed 0, NIID-Bench 0.1," in section and "fleet: local 20 [200]; server distillation epochs 10" in section


@pytest.mark.parametrize("epochs", [["--distill-epochs", "0"], ["--client-epochs", "5", "0"],
                                    ["--client-epochs", "-2", "1"]])
def test_epochs_below_one_are_refused_before_anything_runs(tmp_path, capsys, epochs):
    with pytest.raises(SystemExit):
        gpu_cells.main(["run", "--out", str(tmp_path / "out"), *epochs])
    bad = next(value for value in epochs[1:] if int(value) < 1)
    assert f"'{bad}': expected an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_what_is_said_of_clients_sharing_a_gpu_is_what_the_cited_records_hold():
    """launch.client_gpu_share, docs/gpu.md and this module's docstring say how 25 and 10 client processes fared on
    one H100, citing two records: the figures they give are those records'."""
    import re

    from launcher.launch import client_gpu_share
    from oneshot_fl.config import PROJECT_ROOT

    results = PROJECT_ROOT / "benchmarks" / "results"
    exits = json.loads((results / "gpu_cells_attempt1.json").read_text())["clients"]["exit"]
    behind = f"{sum(code is None for code in exits.values())} of the {len(exits)} were still training"
    section = (results / "gpu_cells.md").read_text().split("## tableiv-mnist")[1]
    assert "lent NVIDIA H100" in section
    seconds = re.search(r"one call, (\d+) s\)", section).group(1)
    local, cvae = re.search(r"mixed: local (\d+) \[\d+\], CVAE (\d+) \[", section).groups()
    _, jobs = gpu_cells.fleets()["tableiv-mnist"]["fleets"]["mixed"]
    classifiers = sum(role == "classifier" for _, role, _ in jobs)
    texts = {"client_gpu_share": client_gpu_share.__doc__, "experiments.gpu_cells": gpu_cells.__doc__,
             "docs/gpu.md": (PROJECT_ROOT / "docs" / "gpu.md").read_text()}
    for name, text in texts.items():
        flat = " ".join(text.split())
        assert "gpu_cells_attempt1.json" in flat and "gpu_cells.md" in flat, name
        assert behind in flat, name
    for name in ("client_gpu_share", "docs/gpu.md"):
        flat = " ".join(texts[name].split())
        assert (f"{len(jobs)} such processes ({classifiers} VGG-9 classifiers at {local} epochs, "
                f"{len(jobs) - classifiers} CVAEs at {cvae}) all finished within one {seconds} s call") in flat, name
