"""Issue 13 at the strategy level (fake replies, no Flower processes): hostile clients cost only
themselves, the good uploads are archived before fusion, run folders are never overwritten, and
results stay valid JSON."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord

from oneshot_fl.config import ConfigError
from oneshot_fl.engine.distill import Checkpoint
from oneshot_fl.results import NONFINITE_KEY, write_json
from oneshot_fl.errors import RunFolderTaken
from strategies.context import FuseResult
from tests.strategies.test_fedavg import _reply, _strategy


def _strict_json(path):
    """json.loads that refuses NaN / Infinity, as any strict JSON reader does."""
    def refuse(name):
        raise ValueError(f"invalid JSON constant {name}")
    return json.loads(path.read_text(), parse_constant=refuse)


def _hostile_string_partition(node):
    reply = _reply(node)
    reply.content.config_records["meta"]["partition-id"] = "abc"
    return reply


def _hostile_uint64_counts(node):
    reply = _reply(node)
    counts = np.array([np.iinfo(np.uint64).max, 2] + [0] * 8, dtype=np.uint64)
    reply.content.array_records["label-counts"]["counts"] = Array(counts)
    return reply


def _hostile_arch(node):
    return _reply(node, arch="vgg9")


def test_two_good_and_three_hostile_clients_complete_the_round_on_the_good_ones(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, **{"num-clients": 5, "min-clients": 2})
    strategy._sent = [1, 2, 3, 4, 5]
    replies = [_reply(1), _hostile_string_partition(2), _reply(3, seed=1), _hostile_uint64_counts(4), _hostile_arch(5)]
    strategy.aggregate_train(1, replies)
    run = tmp_path / "run"
    result = _strict_json(run / "result.json")
    assert [c["node_id"] for c in result["clients"]] == [1, 3]
    reasons = {r["node_id"]: r["reason"] for r in result["rejected"]}
    assert set(reasons) == {2, 4, 5}
    assert "partition-id 'abc' is not an integer" in reasons[2]
    assert "int64 range" in reasons[4]
    assert "'vgg9' was not assigned to partition 4" in reasons[5]
    manifest = json.loads((run / "uploads" / "manifest.json").read_text())
    assert [e["node_id"] for e in manifest["uploads"]] == [1, 3]
    assert sorted(p.name for p in (run / "uploads").glob("node-*.pt")) == ["node-1.pt", "node-3.pt"]


def test_a_fusion_failure_after_the_quorum_keeps_the_uploads_archive(tmp_path, mnist_dir, log_text):
    strategy = _strategy(tmp_path, **{"num-clients": 2})
    strategy._sent = [1, 2]

    def broken_fuse(uploads, ctx):
        raise RuntimeError("out of memory in fusion")

    strategy.fuse = broken_fuse
    with pytest.raises(RuntimeError, match="out of memory in fusion") as err:
        strategy.aggregate_train(1, [_reply(1), _reply(2, seed=1)])
    archive = tmp_path / "run" / "uploads"
    manifest = json.loads((archive / "manifest.json").read_text())
    assert [e["node_id"] for e in manifest["uploads"]] == [1, 2]
    assert any(str(archive) in note for note in err.value.__notes__)
    assert "fusion failed after the quorum" in log_text.text
    assert not (tmp_path / "run" / "result.json").exists()


def test_a_duplicate_partition_id_rejects_the_second_claim(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, **{"num-clients": 3, "min-clients": 2})
    strategy._sent = [1, 2, 3]
    strategy.aggregate_train(1, [_reply(1), _reply(2, seed=1), _reply(3, seed=2, partition=0)])
    result = _strict_json(tmp_path / "run" / "result.json")
    assert [c["partition_id"] for c in result["clients"]] == [0, 1]
    assert result["rejected"] == [{"node_id": 3, "reason": "partition-id 0 already uploaded by node 1"}]


def test_a_reply_from_a_node_that_was_not_instructed_is_rejected(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, **{"num-clients": 2})
    strategy._sent = [1, 2]
    strategy.aggregate_train(1, [_reply(1), _reply(2, seed=1), _reply(9, partition=1)])
    result = _strict_json(tmp_path / "run" / "result.json")
    assert result["rejected"] == [{"node_id": 9, "reason": "reply from a node that was not sent an instruction"}]


class _Grid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def test_more_nodes_than_num_clients_only_num_clients_are_instructed(tmp_path, mnist_dir, monkeypatch, log_text):
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):  # what a ServerApp process has set when it builds messages
        monkeypatch.setattr(TaskIdentity, attr, 1)
    strategy = _strategy(tmp_path, **{"num-clients": 3})
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord({"seed": 0}), _Grid([17, 5, 9, 6, 30])))
    assert sorted(m.metadata.dst_node_id for m in messages) == [5, 6, 9]
    assert strategy._sent == [5, 6, 9]
    assert "not instructing nodes [17, 30]" in log_text.text


# --- run folders -------------------------------------------------------------------------------

def test_a_finished_run_folder_is_never_reused(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, **{"num-clients": 2})
    strategy._sent = [1, 2]
    strategy.aggregate_train(1, [_reply(1), _reply(2, seed=1)])
    before = (tmp_path / "run" / "result.json").read_bytes()
    with pytest.raises(RunFolderTaken, match="already holds a finished run") as err:
        _strategy(tmp_path, **{"num-clients": 2})
    assert isinstance(err.value, ConfigError)
    assert (tmp_path / "run" / "result.json").read_bytes() == before


def test_a_run_name_that_exists_is_refused_through_the_output_dir_too(tmp_path, mnist_dir, monkeypatch):
    from oneshot_fl.config import from_run_config, merge_overrides
    from strategies import build_strategy

    flat = merge_overrides({"method": "fedavg", "preset": "smoke", "run-name": "taken", "output-dir": str(tmp_path)})
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "result.json").write_text("{}")
    with pytest.raises(ConfigError, match="taken"):
        build_strategy(from_run_config(flat))


def test_an_unfinished_folder_with_a_checkpoint_is_a_resume_and_allowed(tmp_path, mnist_dir):
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    Checkpoint(checkpoints / "distill.pt", "abc").save({"epoch": 2})
    strategy = _strategy(tmp_path, **{"num-clients": 2})
    assert strategy.ctx.run_dir == tmp_path / "run"


def test_a_run_that_fails_before_any_work_leaves_no_folder(tmp_path, mnist_dir):
    from oneshot_fl.errors import QuorumError

    strategy = _strategy(tmp_path, **{"num-clients": 3})
    strategy._sent = [1, 2, 3]
    with pytest.raises(QuorumError):
        strategy.aggregate_train(1, [_reply(1)])
    assert not (tmp_path / "run").exists()


def test_a_stale_archive_of_an_earlier_attempt_is_replaced(tmp_path, mnist_dir):
    stale = tmp_path / "run" / "uploads"
    stale.mkdir(parents=True)
    (stale / "manifest.json").write_text(json.dumps({"format": 1, "context": {}, "uploads": []}))
    (stale / "node-77.pt").write_bytes(b"old")
    strategy = _strategy(tmp_path, **{"num-clients": 2})
    strategy._sent = [1, 2]
    strategy.aggregate_train(1, [_reply(1), _reply(2, seed=1)])
    manifest = json.loads((stale / "manifest.json").read_text())
    assert [e["node_id"] for e in manifest["uploads"]] == [1, 2]
    assert sorted(p.name for p in stale.glob("node-*.pt")) == ["node-1.pt", "node-2.pt"]


# --- valid JSON whatever the numbers --------------------------------------------------------------

def test_non_finite_values_never_make_invalid_json(tmp_path):
    path = tmp_path / "r.json"
    write_json(path, {"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": np.float32("-inf")},
                      "e": torch.tensor([0.5, float("nan")]), "ok": 2.5})
    data = _strict_json(path)
    assert data["a"] is None and data["b"] == [1.0, None] and data["c"]["d"] is None
    assert data["e"] == [0.5, None] and data["ok"] == 2.5
    assert data[NONFINITE_KEY] == {"a": "nan", "b[1]": "inf", "c.d": "-inf", "e[1]": "nan"}
    write_json(path, [float("nan")])  # not a dict: null, and the warning is logged
    assert _strict_json(path) == [None]


def test_a_method_reporting_non_finite_metrics_still_writes_valid_json(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, **{"num-clients": 2})
    strategy._sent = [1, 2]
    fuse = strategy.fuse

    def fuse_with_bad_metrics(uploads, ctx):
        result = fuse(uploads, ctx)
        return FuseResult(result.model, result.arch, {"ensemble_accuracy": math.nan, "gap": math.inf},
                          [{"epoch": 1, "accuracy": None, "kd_loss": math.nan}])

    strategy.fuse = fuse_with_bad_metrics
    strategy.aggregate_train(1, [_reply(1), _reply(2, seed=1)])
    result = _strict_json(tmp_path / "run" / "result.json")
    assert result["global"]["ensemble_accuracy"] is None and result["history"][0]["kd_loss"] is None
    assert set(result[NONFINITE_KEY]) == {"global.ensemble_accuracy", "global.gap", "history[0].kd_loss"}


# --- checkpoints -----------------------------------------------------------------------------

class _Payload:
    """A pickle payload: unpickling it would create the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_carrying_a_pickle_payload_is_refused_without_running_it(tmp_path, log_text):
    marker = tmp_path / "pwned"
    path = tmp_path / "checkpoints" / "distill.pt"
    path.parent.mkdir()
    torch.save({"fingerprint": "f", "epoch": 1, "student": _Payload(marker)}, path)
    assert not marker.exists()
    assert Checkpoint(path, "f").load() is None
    assert not marker.exists()
    assert "cannot be loaded safely" in log_text.text


def test_a_checkpoint_of_the_saved_kinds_loads_under_the_safe_loader(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.rand(4, 3)).sum().backward()
    optimizer.step()
    state = {"epoch": 3, "student": model.state_dict(), "optimizer": optimizer.state_dict(),
             "rng": torch.Generator().manual_seed(1).get_state(), "history": [{"epoch": 1, "accuracy": None,
                                                                               "kd_loss": 0.5}],
             "pool": {"images": [torch.rand(2, 3)], "labels": [torch.tensor([0, 1])], "logits": [torch.rand(2, 2)]},
             "synthesizer": {}, "early_stop": None}
    checkpoint = Checkpoint(tmp_path / "c.pt", "f")
    checkpoint.save(state)
    loaded = checkpoint.load(tuple(state))
    assert loaded["epoch"] == 3 and torch.equal(loaded["rng"], state["rng"])
    assert Checkpoint(tmp_path / "c.pt", "other").load() is None  # another configuration
    assert checkpoint.load(("epoch", "missing-key")) is None  # lacks what the resume needs


# --- replay: an archive is input too; expected failures are one line ------------------------------

def _archive_of_two(tmp_path):
    strategy = _strategy(tmp_path, **{"num-clients": 3, "min-clients": 2})
    strategy._sent = [1, 2, 3]
    strategy.aggregate_train(1, [_reply(1), _reply(2, seed=1)])
    return tmp_path / "run" / "uploads"


def test_replay_failures_the_user_can_fix_are_one_line_and_non_zero(tmp_path, mnist_dir, capsys):
    from launcher.cli import main
    from oneshot_fl.errors import QuorumError

    uploads = _archive_of_two(tmp_path)
    out = tmp_path / "replayed"
    assert main(["replay", str(uploads), "-c", "min-clients=3", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("oneshot-fl: error: 2 valid uploads, 3 required")
    assert not out.exists()  # failed before any work: no empty run folder
    # into a finished run folder: refused up front, one line
    assert main(["replay", str(uploads), "--out", str(tmp_path / "run")]) == 1
    assert "already holds a finished run" in capsys.readouterr().err.strip().splitlines()[-1]
    # --debug: the traceback for whoever wants it, still exit 1
    assert main(["replay", str(uploads), "-c", "min-clients=3", "--out", str(out), "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and QuorumError.__name__ in err


def test_a_replay_never_writes_into_the_archive_it_reads(tmp_path, mnist_dir, capsys):
    """A run whose fusion failed leaves its uploads and no result.json; replaying into that folder would have
    re-archived only the uploads the method accepted over the source, and --out inside the archive mixed a
    run folder into it. Refused up front, the archive byte for byte as it was; a file as --out is one line."""
    from launcher.cli import main

    uploads = _archive_of_two(tmp_path)
    (tmp_path / "run" / "result.json").unlink()  # the run folder of a failed fusion
    before = {p.name: p.read_bytes() for p in uploads.iterdir()}
    for out in (tmp_path / "run", uploads, uploads / "inner"):
        assert main(["replay", str(uploads), "--out", str(out)]) == 1
        assert "would write into the uploads archive being replayed" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in uploads.iterdir()} == before
    (tmp_path / "a-file").write_text("x")
    assert main(["replay", str(uploads), "--out", str(tmp_path / "a-file")]) == 1
    assert capsys.readouterr().err.startswith("oneshot-fl: error: run folder ")
    assert (tmp_path / "a-file").read_text() == "x"
    # without an archive of its own the replay would not touch the archive, but the failed run's folder is that
    # run's: a replay is another config (here not even recorded), refused in one line, nothing changed
    assert main(["replay", str(uploads), "-c", "save-uploads=false", "--out", str(tmp_path / "run")]) == 1
    assert "holds an unfinished run whose config is not recorded" in capsys.readouterr().err
    assert not (tmp_path / "run" / "result.json").exists()
    assert {p.name: p.read_bytes() for p in uploads.iterdir()} == before


def test_a_run_folder_given_for_its_archive_is_pointed_to_its_uploads(tmp_path, mnist_dir, capsys):
    from launcher.cli import main

    uploads = _archive_of_two(tmp_path)
    assert main(["replay", str(uploads.parent), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"no uploads archive here (expected manifest.json + node-*.pt); the run folder's archive "
                        f"is {uploads}")
    assert main(["replay", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip().endswith("(expected manifest.json + node-*.pt)")  # no hint to give


def test_a_folder_of_someone_elses_files_is_no_run_folder(tmp_path, mnist_dir, capsys):
    """--out (or output-dir/run-name) naming a folder that holds files no run wrote (a user's documents) would
    mix the run's files into it and overwrite any of the same names: refused, the folder untouched. A folder
    a run left unfinished (only run files in it) is still a run folder: refused as an unfinished run whose config
    is not recorded (no launch.json), not as someone else's; an empty one takes the replay."""
    from launcher.cli import main

    uploads = _archive_of_two(tmp_path)
    mine = tmp_path / "documents"
    mine.mkdir()
    (mine / "accuracy.png").write_text("my own plot")
    (mine / "notes.txt").write_text("x")
    assert main(["replay", str(uploads), "-c", "method='fedavg' min-clients=2", "--out", str(mine)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds files that no run wrote (accuracy.png, notes.txt)" in err
    assert sorted(p.name for p in mine.iterdir()) == ["accuracy.png", "notes.txt"]
    assert (mine / "accuracy.png").read_text() == "my own plot"
    for name, entry in (("unfinished", "checkpoints"), ("rounds", "round-1")):
        folder = tmp_path / name
        (folder / entry).mkdir(parents=True)
        assert main(["replay", str(uploads), "-c", "method='fedavg' min-clients=2", "--out", str(folder)]) == 1
        assert "holds an unfinished run whose config is not recorded" in capsys.readouterr().err
        assert [p.name for p in folder.iterdir()] == [entry]
    (tmp_path / "empty").mkdir()
    assert main(["replay", str(uploads), "-c", "method='fedavg' min-clients=2", "--out", str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "result.json").exists()


def test_replay_rejects_a_tampered_archive_entry_and_goes_on(tmp_path, mnist_dir):
    from launcher.replay import replay

    uploads = _archive_of_two(tmp_path)
    manifest = json.loads((uploads / "manifest.json").read_text())
    manifest["uploads"][1]["partition_id"] = "abc"
    (uploads / "manifest.json").write_text(json.dumps(manifest))
    result = replay(uploads, ["min-clients=1"], run_dir=tmp_path / "replayed")
    assert [c["node_id"] for c in result["clients"]] == [1]
    assert result["rejected"][0]["node_id"] == 2 and "cannot be read" in result["rejected"][0]["reason"]
    manifest["uploads"][1]["partition_id"] = 0  # now a second claim on node 1's partition
    (uploads / "manifest.json").write_text(json.dumps(manifest))
    result = replay(uploads, ["min-clients=1"], run_dir=tmp_path / "replayed-again")
    assert result["rejected"] == [{"node_id": 2, "reason": "partition-id 0 already uploaded by node 1"}]


def test_a_damaged_upload_file_names_itself_and_the_ways_on_and_the_hint_works(tmp_path, mnist_dir, capsys):
    """One node-*.pt overwritten with 100 random bytes: one line naming the file, saying it is damaged and what
    works (min-clients = the intact uploads, or restoring the file), never torch's advice to load it with
    weights_only=False (which would run whatever the file holds, and cannot read random bytes anyway)."""
    import random

    from launcher.cli import main

    uploads = _archive_of_two(tmp_path)  # nodes 1 and 2 of num-clients=3, min-clients=2
    (uploads / "node-2.pt").write_bytes(random.Random(0).randbytes(100))
    assert main(["replay", str(uploads), "--out", str(tmp_path / "replayed")]) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last == (f"oneshot-fl: error: archive file 'node-2.pt' is damaged: torch cannot read it as a tensor file "
                    "(UnpicklingError): 1 intact upload, 2 required (min-clients=2, num-clients=3); replay the 1 "
                    f"intact upload with -c \"min-clients=1\", or restore node-2.pt from a copy of {uploads}")
    assert "weights_only" not in err
    assert "rejected archived upload of node 2: archive file 'node-2.pt' is damaged" in err
    assert not (tmp_path / "replayed").exists()
    assert main(["replay", str(uploads), "-c", "min-clients=1", "--out", str(tmp_path / "replayed")]) == 0
    result = json.loads((tmp_path / "replayed" / "result.json").read_text())
    assert [c["node_id"] for c in result["clients"]] == [1]
    assert result["rejected"] == [{"node_id": 2, "reason": "archive file 'node-2.pt' is damaged: torch cannot read "
                                                           "it as a tensor file (UnpicklingError)"}]
    (uploads / "node-1.pt").unlink()  # nothing intact: only the restore is left to say
    assert main(["replay", str(uploads), "-c", "min-clients=1", "--out", str(tmp_path / "again")]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("oneshot-fl: error: archive file 'node-1.pt' is missing; archive file 'node-2.pt' is "
                           "damaged") and "min-clients=0" not in last
    assert last.endswith(f"0 intact uploads, 1 required (min-clients=1, num-clients=3); restore node-1.pt, node-2.pt "
                         f"from a copy of {uploads}")


@pytest.mark.parametrize("damage, fragment", [
    (lambda m, text: text[: len(text) // 2], "is not valid JSON"),  # truncated
    (lambda m, text: "\xff\xfe", "is not valid JSON"),
    (lambda m, text: json.dumps([m]), "expected a JSON object, found list"),
    (lambda m, text: json.dumps({**m, "context": {}}), "no 'context' object with the run's 'run_config'"),
    (lambda m, text: json.dumps({**m, "uploads": {"1": m["uploads"][0]}}), "'uploads' must be a list"),
    (lambda m, text: json.dumps({**m, "uploads": [3, 4]}), "'uploads' must be a list of upload entries"),
    (lambda m, text: json.dumps({**m, "format": 2}), "archive format 2; this oneshot-fl reads format 1"),
])
def test_a_damaged_manifest_is_one_line_and_nothing_is_written(damage, fragment, tmp_path, mnist_dir, capsys):
    from launcher.cli import main

    uploads = _archive_of_two(tmp_path)
    path = uploads / "manifest.json"
    text = path.read_text()
    path.write_text(damage(json.loads(text), text))
    out = tmp_path / "replayed"
    assert main(["replay", str(uploads), "--out", str(out)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("oneshot-fl: error: ") and fragment in last and str(path) in last
    assert not out.exists()


def test_an_entry_without_its_byte_counts_or_role_is_that_uploads_rejection(tmp_path, mnist_dir):
    from launcher.replay import replay

    uploads = _archive_of_two(tmp_path)
    original = json.loads((uploads / "manifest.json").read_text())
    for node, field in ((2, "raw_bytes"), (1, "role")):
        manifest = json.loads(json.dumps(original))
        del manifest["uploads"][node - 1][field]
        (uploads / "manifest.json").write_text(json.dumps(manifest))
        result = replay(uploads, ["min-clients=1"], run_dir=tmp_path / f"replayed-{field}")
        assert [r["node_id"] for r in result["rejected"]] == [node], result["rejected"]
        assert f"cannot be read (KeyError: '{field}')" in result["rejected"][0]["reason"]
        assert [c["node_id"] for c in result["clients"]] == [3 - node]


def test_a_checkpoint_that_does_not_fit_the_run_leaves_everything_fresh(tmp_path, log_text):
    from oneshot_fl.engine.distill import DistillSettings, _resume

    student, synthesizer, pool = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2), torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    rng = torch.Generator().manual_seed(0)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    foreign = {"epoch": 2, "history": [], "student": torch.nn.Linear(3, 2).state_dict(),
               "optimizer": optimizer.state_dict(), "synthesizer": torch.nn.Linear(5, 5).state_dict(),  # wrong shape
               "pool": pool.state_dict(), "rng": rng.get_state()}
    assert not _resume(foreign, DistillSettings(epochs=4, lr=0.1), student, optimizer, synthesizer, pool, rng, None,
                       Checkpoint(tmp_path / "c.pt", "f"))
    assert all(torch.equal(student.state_dict()[k], v) for k, v in before.items())  # put back as it was
    assert "does not fit this run" in log_text.text
    assert not _resume({**foreign, "epoch": 9}, DistillSettings(epochs=4, lr=0.1), student, optimizer, synthesizer,
                       pool, rng, None, Checkpoint(tmp_path / "c.pt", "f"))
