"""A resumed run reuses the uploads its interrupted launch archived (strategies/archived.py): with a complete archive
of this run, its round sends no instruction and serves the archived uploads, and the run ends as the interrupted
one would have (same global model, the same clients, rejections and missing nodes in result.json); an archive that
is partial, another run's, or holds an upload failing its checks is not reused: the clients train, and the log
says why. A new run's folder is no resume: nothing is logged about one."""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.constant import ErrorCode

import strategies.fedhydra as fh
from oneshot_fl.config import from_run_config, merge_overrides
from oneshot_fl.engine.stratify import Stratification, normalise
from oneshot_fl.results import load_model
from strategies import build_strategy
from tests.strategies.test_fedavg import _reply
from tests.strategies.test_missing_nodes import _flower_error, _sent
from tests.strategies.test_resume import _uploads

CONFIG = {"method": "fedavg", "preset": "smoke", "num-clients": 3, "min-clients": 2}
REUSED = "resuming: the 2 uploads archived by the interrupted run are reused; no client trains again"


class _Grid:
    def __init__(self, nodes=()):
        self.nodes = list(nodes)
        self.asked = 0

    def get_node_ids(self):
        self.asked += 1
        return list(self.nodes)


@pytest.fixture
def flower_ids(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):  # what a ServerApp process has set when it builds messages
        monkeypatch.setattr(TaskIdentity, attr, 1)


def _strategy(run_dir, **over):
    return build_strategy(from_run_config(merge_overrides({**CONFIG, **over})), run_dir=run_dir)


def _uninterrupted(tmp_path):
    """A run whose round had nodes 11, 12 answer and node 13 die: its folder, uploads archived."""
    strategy = _strategy(tmp_path / "reference")
    _sent(strategy, [11, 12, 13])
    strategy.aggregate_train(1, [_reply(11), _reply(12, seed=1),
                                 _flower_error("msg-13", ErrorCode.NODE_UNAVAILABLE, "Error: Node Unavailable")])
    return tmp_path / "reference"


def _interrupted(tmp_path, reference):
    """What an interrupt after the uploads were archived leaves: the archive and the launch's bookkeeping."""
    folder = tmp_path / "resumed"
    shutil.copytree(reference / "uploads", folder / "uploads")
    (folder / "launch.json").write_text("{}")
    return folder


def _files(folder):
    return {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in sorted(folder.iterdir())}


def test_a_complete_archive_of_this_run_is_served_without_instructions_and_ends_like_the_uninterrupted_run(
        tmp_path, mnist_dir, log_text):
    reference = _uninterrupted(tmp_path)
    folder = _interrupted(tmp_path, reference)
    archived = _files(folder / "uploads")
    strategy = _strategy(folder)
    grid = _Grid([21, 22, 23])
    assert list(strategy.configure_train(1, ArrayRecord(), ConfigRecord({"seed": 0}), grid)) == []
    assert grid.asked == 0  # no wait for SuperNodes either
    assert REUSED in log_text.text
    assert "sending the round-1 training instruction" not in log_text.text
    arrays, metrics = strategy.aggregate_train(1, [])  # Flower's round of no messages: no replies
    assert dict(metrics)["accepted-uploads"] == 2
    assert strategy.central_evaluate(1, arrays)["accuracy"] == strategy.evaluation.accuracy

    expected = json.loads((reference / "result.json").read_text())
    resumed = json.loads((folder / "result.json").read_text())
    for key in ("clients", "rejected", "missing", "missing_nodes"):
        assert resumed[key] == expected[key], key
    assert resumed["missing_nodes"] == [13] and "Node Unavailable" in resumed["missing"][0]["reason"]
    assert resumed["global"]["accuracy"] == expected["global"]["accuracy"]
    model_a, _ = load_model(reference / "global_model.pt")
    model_b, _ = load_model(folder / "global_model.pt")
    for (key, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(a, b), key
    assert _files(folder / "uploads") == archived  # served where it lies: not written again


def _no_manifest(folder):
    (folder / "uploads" / "manifest.json").unlink()


def _another_seed(folder):
    path = folder / "uploads" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["context"]["run_config"]["seed"] = 1
    path.write_text(json.dumps(manifest))


def _damaged(folder):
    (folder / "uploads" / "node-12.pt").write_bytes(bytes(range(100)))


def _missing_file(folder):
    (folder / "uploads" / "node-11.pt").unlink()


def _foreign_partition(folder):  # an entry claiming a partition this run does not have
    path = folder / "uploads" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["uploads"][1]["partition_id"] = 7
    path.write_text(json.dumps(manifest))


def _unreadable_manifest(folder):
    (folder / "uploads" / "manifest.json").write_text("{not json")


def _no_archive(folder):
    shutil.rmtree(folder / "uploads")
    (folder / "checkpoints").mkdir()


@pytest.mark.parametrize("spoil, why", [
    (_no_manifest, "holds upload files but no manifest.json (written last): the earlier launch stopped while "
                   "archiving its uploads"),
    (_another_seed, "is not this run's (run config: seed: 1 in the folder, 0 now)"),
    (_damaged, "archived uploads fail their checks (node 12: archive file 'node-12.pt' is damaged: torch cannot "
               "read it as a tensor file (UnpicklingError))"),
    (_missing_file, "archived uploads fail their checks (node 11: archive file 'node-11.pt' is missing)"),
    (_foreign_partition, "archived uploads fail their checks (node 12: partition-id 7 out of range [0, 3))"),
    (_unreadable_manifest, "its uploads archive cannot be read: "),
    (_no_archive, "the earlier launch archived no uploads (it stopped before its clients' uploads arrived)"),
])
def test_an_archive_that_is_not_complete_or_not_this_runs_is_not_reused_and_the_log_says_why(
        tmp_path, mnist_dir, log_text, flower_ids, spoil, why):
    folder = _interrupted(tmp_path, _uninterrupted(tmp_path))
    spoil(folder)
    strategy = _strategy(folder)
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord({"seed": 0}), _Grid([21, 22, 23])))
    assert sorted(m.metadata.dst_node_id for m in messages) == [21, 22, 23]  # the clients train again
    line = next(line for line in log_text.text.splitlines() if "resuming:" in line)
    assert "resuming: the clients train again: " in line and why in line, line
    assert REUSED not in log_text.text
    # the new uploads are served and archived in place of the unusable archive
    strategy.aggregate_train(1, [_reply(21, partition=0), _reply(22, seed=1, partition=1)])
    manifest = json.loads((folder / "uploads" / "manifest.json").read_text())
    assert [entry["node_id"] for entry in manifest["uploads"]] == [21, 22]
    assert manifest["context"]["run_config"]["seed"] == 0


def test_a_new_runs_folder_is_no_resume_and_nothing_is_said_about_one(tmp_path, mnist_dir, log_text, flower_ids):
    folder = tmp_path / "new"
    folder.mkdir()
    (folder / "launch.json").write_text("{}")  # what a launcher writes before the ServerApp starts
    (folder / "run.lock").write_text("{}")
    strategy = _strategy(folder)
    assert len(list(strategy.configure_train(1, ArrayRecord(), ConfigRecord({"seed": 0}), _Grid([1, 2, 3])))) == 3
    assert "resuming" not in log_text.text


def test_a_multi_round_run_trains_its_clients_whatever_its_folder_holds(tmp_path, mnist_dir, log_text, flower_ids):
    folder = _interrupted(tmp_path, _uninterrupted(tmp_path))
    strategy = _strategy(folder, rounds=2)
    assert len(list(strategy.configure_train(1, ArrayRecord(), ConfigRecord({"seed": 0}), _Grid([1, 2, 3])))) == 3
    assert "resuming" not in log_text.text


# --- the stratification: computed once per run, loaded by a resumed one ------------------------------------------

def _fixed_stratification(samples: bool = True) -> Stratification:
    u = torch.tensor([[0.9, 0.2], [0.1, 0.8], [0.3, 0.6]])  # (c, m)
    u_r, u_c = normalise(u)
    return Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.arange(12.0).view(2, 3, 2), seconds=1.5,
                          score="prob-auc", samples=torch.rand(2, 3, 2, 1, 4, 4) if samples else None,
                          steps_run=torch.tensor([[3, 5, 2], [4, 4, 1]]))


def _hydra(run_dir, fingerprint: str | None = "f1"):
    hydra = fh.FedHydra.__new__(fh.FedHydra)  # the stage alone: no test set, no run folder set-up
    hydra.uploads_fingerprint = fingerprint
    return hydra, SimpleNamespace(run_dir=run_dir)


def _computed(value, calls: list):
    def compute():
        calls.append(1)
        return value
    return compute


def _same(a: Stratification, b: Stratification) -> None:
    for field in dataclasses.fields(Stratification):
        x, y = getattr(a, field.name), getattr(b, field.name)
        assert (torch.equal(x, y) and x.dtype == y.dtype) if isinstance(x, torch.Tensor) else x == y, field.name


@pytest.mark.parametrize("samples", [True, False])
def test_a_stage_is_saved_once_computed_and_loaded_by_the_next_fuse_of_the_same_fingerprint(tmp_path, log_text,
                                                                                             samples):
    value, calls = _fixed_stratification(samples), []
    hydra, ctx = _hydra(tmp_path)
    assert hydra.cached_stage("stratification", Stratification, ctx, _computed(value, calls)) is value
    assert calls == [1] and (tmp_path / "checkpoints" / "stratification.pt").is_file()
    again, ctx = _hydra(tmp_path)  # a resumed run: a new process, the same uploads and settings
    loaded = again.cached_stage("stratification", Stratification, ctx, _computed(None, calls))
    assert calls == [1]  # not computed again
    _same(loaded, value)
    assert (f"fedhydra: stratification reused from {tmp_path / 'checkpoints' / 'stratification.pt'} (saved by the "
            "interrupted run); not computed again") in log_text.text


def test_a_stage_of_another_fingerprint_or_a_damaged_file_is_computed_again(tmp_path, log_text):
    calls = []
    hydra, ctx = _hydra(tmp_path, "f1")
    hydra.cached_stage("stratification", Stratification, ctx, _computed(_fixed_stratification(), calls))
    other = _fixed_stratification()
    other.u = other.u * 2
    hydra, ctx = _hydra(tmp_path, "f2")  # other uploads or settings
    _same(hydra.cached_stage("stratification", Stratification, ctx, _computed(other, calls)), other)
    assert calls == [1, 1] and "belongs to another configuration" in log_text.text
    hydra, ctx = _hydra(tmp_path, "f2")
    _same(hydra.cached_stage("stratification", Stratification, ctx, _computed(None, calls)), other)  # f2's now
    (tmp_path / "checkpoints" / "stratification.pt").write_bytes(b"\x80garbage")
    hydra, ctx = _hydra(tmp_path, "f2")
    assert hydra.cached_stage("stratification", Stratification, ctx, _computed(other, calls)) is other
    assert calls == [1, 1, 1] and "cannot be loaded safely" in log_text.text


def test_a_stage_called_outside_a_fuse_is_not_cached(tmp_path):
    calls = []
    hydra, ctx = _hydra(tmp_path, fingerprint=None)
    for _ in range(2):
        hydra.cached_stage("stratification", Stratification, ctx, _computed(_fixed_stratification(), calls))
    assert calls == [1, 1] and not (tmp_path / "checkpoints").exists()


HYDRA = {"method": "fedhydra", "preset": "smoke", "num-clients": 3, "fedhydra.ms-steps": 1, "distill.epochs": 2,
         "distill.eval-every": 1, "distill.kd-steps": 2, "distill.generator-steps": 2, "save-uploads": False,
         "eval.test-samples": 200}


def test_fedhydra_on_a_saved_stratification_ends_bit_identical_without_running_ms(tmp_path, mnist_dir, monkeypatch,
                                                                                 log_text):
    def serve(run_dir):
        strategy = build_strategy(from_run_config(merge_overrides(HYDRA)), run_dir=run_dir)
        strategy.serve(_uploads())
        return strategy

    reference = serve(tmp_path / "reference")
    saved = tmp_path / "reference" / "checkpoints" / "stratification.pt"
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copy(saved, tmp_path / "resumed" / "checkpoints")  # what the interrupted run saved before distilling

    def no_ms(*args, **kwargs):
        raise AssertionError("MS ran again")
    monkeypatch.setattr(fh, "stratify_sequential", no_ms)
    monkeypatch.setattr(fh, "stratify", no_ms)
    resumed = serve(tmp_path / "resumed")
    assert "fedhydra: stratification reused from" in log_text.text
    assert resumed.evaluation.accuracy == reference.evaluation.accuracy
    for name in ("stratification.json",):
        assert (tmp_path / "resumed" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()
    model_a, _ = load_model(tmp_path / "reference" / "global_model.pt")
    model_b, _ = load_model(tmp_path / "resumed" / "global_model.pt")
    for (key, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert torch.equal(a, b), key
