"""Client archives known by their content (benchmarks.archives): the uploads' fingerprint is the tensors, not the node
ids or the folder; the fleet store serves an archive again only at the code version that trained it and only while
it holds what it held; in a release run only the release commit's records and archives count."""

import json

import pytest
import torch

from benchmarks import archives, records


def _archive(path, node_ids=(7, 8), weights=(0.0, 1.0), order=None, dtype=torch.float32, metrics=None):
    path.mkdir(parents=True, exist_ok=True)
    entries = []
    for partition, (node, w) in enumerate(zip(node_ids, weights)):
        name = f"node-{node}.pt"
        torch.save({"conv.weight": torch.full((2, 3), w, dtype=dtype), "bn.num_batches_tracked": torch.tensor(5)},
                   path / name)
        entries.append({"file": name, "node_id": node, "partition_id": partition, "role": "classifier",
                        "arch": "cnn2", "label_counts": [3, partition], "num_examples": 3 + partition,
                        "metrics": metrics or {"train-seconds": 1.5 * node}, "received_bytes": 100 + node,
                        "raw_bytes": 96, "extra": None})
    if order:
        entries = [entries[i] for i in order]
    (path / "manifest.json").write_text(json.dumps({"format": 1, "context": {"run_config": {}}, "uploads": entries}))
    return path


def test_the_fingerprint_is_the_uploads_content_not_node_ids_files_timings_or_the_folder(tmp_path):
    first = archives.uploads_fp(_archive(tmp_path / "a"))
    assert len(first) == 16
    # another training of the same clients: other node ids and file names, timings, wire sizes, folder, entry order
    again = _archive(tmp_path / "elsewhere" / "b", node_ids=(3, 4), order=(1, 0), metrics={"train-seconds": 9.0})
    assert archives.uploads_fp(again) == first
    # one weight, the label counts, a dtype: other uploads
    assert archives.uploads_fp(_archive(tmp_path / "c", weights=(0.0, 1.0 + 2 ** -20))) != first
    assert archives.uploads_fp(_archive(tmp_path / "d", dtype=torch.float16)) != first
    changed = _archive(tmp_path / "e")
    manifest = json.loads((changed / "manifest.json").read_text())
    manifest["uploads"][0]["label_counts"] = [2, 1]
    (changed / "manifest.json").write_text(json.dumps(manifest))
    assert archives.uploads_fp(changed) != first
    bare = tmp_path / "f"
    bare.mkdir()
    (bare / "manifest.json").write_text(json.dumps({"context": {"run_config": {}}, "uploads": [{"node_id": 1}]}))
    with pytest.raises(ValueError, match="names no tensor file"):
        archives.uploads_fp(bare)


def test_the_store_serves_an_archive_at_its_code_version_while_it_holds_what_it_held(tmp_path):
    runs = tmp_path / "runs"
    archive = _archive(runs / "paper_table" / "fmnist-0.5-s0" / "uploads")
    settings = {"method": "fedavg", "dataset": "fmnist", "cell": "0.5", "seed": 0, "num-clients": 5, "preset": "cpu"}
    assert archives.fleet_key(settings, "abc1234") == archives.fleet_key(dict(reversed(settings.items())), "abc1234")
    assert archives.fleet_key(settings, "abc1234") != archives.fleet_key(settings, "def5678")
    assert archives.remember(runs, settings, archive, "abc1234-dirty") is None  # no one could say which code
    assert archives.recall(runs, settings, "abc1234-dirty") is None
    assert archives.remember(runs, settings, archive, "abc1234") == archives.uploads_fp(archive)
    assert archives.recall(runs, settings, "abc1234") == archive.resolve()
    assert archives.trained_at(archive, "abc1234") and not archives.trained_at(archive, "def5678")
    assert archives.recall(runs, settings, "def5678") is None  # other code: train again
    assert archives.recall(runs, {**settings, "seed": 1}, "abc1234") is None
    torch.save({"conv.weight": torch.zeros(2, 3), "bn.num_batches_tracked": torch.tensor(6)}, archive / "node-7.pt")
    assert archives.recall(runs, settings, "abc1234") is None  # changed since it was stored
    assert not archives.trained_at(archive, "abc1234")


def test_in_a_release_run_only_records_of_the_release_commit_count(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    monkeypatch.delenv(records.RELEASE_ENV, raising=False)
    records.append_record({"table": "t", "method": "dense", "seed": 0, "code_version": "old1234"})
    assert records.has_record("t", {"method": "dense", "seed": 0})
    monkeypatch.setenv(records.RELEASE_ENV, "new5678")
    assert not records.has_record("t", {"method": "dense", "seed": 0})
    records.append_record({"table": "t", "method": "dense", "seed": 0, "code_version": "new5678"})
    assert records.has_record("t", {"method": "dense", "seed": 0})


def test_a_release_run_trains_kept_clients_of_other_code_again_and_serves_a_fleet_stored_at_its_commit(
        tmp_path, monkeypatch):
    from benchmarks import fleets

    monkeypatch.setattr(fleets, "BENCH_DIR", tmp_path)
    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path / "results")
    trained = []

    class Run:
        ok = True

        def __init__(self, overrides):
            self.overrides = overrides

        def result(self):
            return {"method": "fedavg", "code_version": "rel1234", "clients": [], "global": {"accuracy_final": 0.5},
                    "timings": {"local_sum": 1.0, "server_fuse": 1.0}, "dataset": "mnist", "partition": "niid-bench",
                    "alpha": 0.5, "num_clients": 2, "seed": 0, "preset": "cpu"}

    def fake_simulation(overrides, stream=True):
        trained.append(overrides["run-name"])
        _archive(tmp_path / "runs" / overrides["output-dir"].split("/runs/")[1] / overrides["run-name"] / "uploads")
        return Run(overrides)

    monkeypatch.setattr(fleets, "run_simulation", fake_simulation)
    kept = _archive(tmp_path / "runs" / "paper_table" / "mnist-0.5-s0" / "uploads")  # trained by older code
    (kept.parent / "client_sets.json").write_text("{}")
    monkeypatch.delenv(records.RELEASE_ENV, raising=False)
    assert fleets.train_clients("paper_table", "mnist", "0.5", 0, 2, "cpu", {}, False) == kept and trained == []
    monkeypatch.setenv(records.RELEASE_ENV, "rel1234")
    assert fleets.train_clients("paper_table", "mnist", "0.5", 0, 2, "cpu", {}, False) == kept
    assert trained == ["mnist-0.5-s0"]  # not the release commit's: trained again
    record, = records.load_records("paper_table")
    assert record["uploads_fp"] == archives.uploads_fp(kept) and record["code_version"] == "rel1234"
    # resumed: the archive is the release commit's now, and another table asking for the same fleet is served it
    assert fleets.train_clients("paper_table", "mnist", "0.5", 0, 2, "cpu", {}, False) == kept
    assert fleets.train_clients("clients-k2", "mnist", "0.5", 0, 2, "cpu", {}, False) == kept.resolve()
    assert trained == ["mnist-0.5-s0"]
    # other client settings are another fleet
    assert fleets.train_clients("clients-k2", "mnist", "0.5", 0, 2, "cpu", {"local.epochs": 3}, False) != kept
    assert trained == ["mnist-0.5-s0", "mnist-0.5-s0"]
