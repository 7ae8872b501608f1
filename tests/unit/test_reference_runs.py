"""benchmarks/reference_runs: the patches, the data layouts and the output parsers of the reference-code harness
(no reference repository needed: their texts are stood in for by the lines the patches expect)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from torch import nn

from benchmarks import reference_runs as rr
from oneshot_fl.data.datasets import Split, read_idx
from oneshot_fl.models.registry import build


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_dense_client_models_have_the_reference_parameter_counts():
    # DENSE's CNNMnist: conv 1->16 k5 (416) + BN (32) + conv 16->32 k5 (12,832) + BN (64) + FC 1568->10 (15,690);
    # CNNCifar: conv 3->128 k3 (3,584) + 2 x conv 128->128 k3 (147,584) + FC 2048->10 (20,490), no BN
    assert _params(build("cnn2", (1, 28, 28), 10)) == 416 + 32 + 12_832 + 64 + 15_690 == 29_034
    assert _params(build("cnn3", (3, 32, 32), 10)) == 3_584 + 2 * 147_584 + 20_490 == 319_242
    assert rr.DENSE_MODEL == {"mnist": ("mnist_cnn", "cnn2"), "cifar10": ("cnn", "cnn3")}


def test_fedmho_quarter_width_patch_builds_exactly_our_vgg9_small():
    # their VGG9 body, patched, inside a stand-in of their class: same state-dict keys and shapes as vgg9-small
    source = ("class Patched(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
              "        input_channel = 1\n        self.output_size = 10\n        self.features = nn.Sequential(\n"
              + rr.VGG9_QUARTER)
    namespace = {"nn": nn}
    exec(source, namespace)  # noqa: S102 - the harness's own patch text
    theirs = {k: tuple(v.shape) for k, v in namespace["Patched"]().state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in build("vgg9-small", (1, 28, 28), 10).state_dict().items()}
    assert theirs == ours
    assert theirs["features.0.weight"] == (16, 1, 3, 3) and theirs["classifier.6.weight"] == (10, 1024)
    full = "class Full(nn.Module):\n" + source.split("\n", 1)[1].replace(rr.VGG9_QUARTER, rr.VGG9_FULL)
    exec(full, namespace)  # noqa: S102
    assert _params(namespace["Full"]()) == _params(build("vgg9", (1, 28, 28), 10))


def test_apply_patches_changes_exactly_one_place_and_names_its_line(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\ny = 2\nz = 3\n")
    applied = rr.apply_patches(tmp_path, [rr.Patch("a.py", "y = 2\n", "y = 20\n", "why")])
    assert (tmp_path / "a.py").read_text() == "x = 1\ny = 20\nz = 3\n"
    assert applied == [{"file": "a.py", "line": 2, "old": "y = 2", "new": "y = 20", "why": "why"}]
    (tmp_path / "b.py").write_text("y = 2\ny = 2\n")
    with pytest.raises(RuntimeError, match="matches 2 places"):
        rr.apply_patches(tmp_path, [rr.Patch("b.py", "y = 2\n", "y = 3\n", "why")])
    with pytest.raises(RuntimeError, match="matches 0 places"):
        rr.apply_patches(tmp_path, [rr.Patch("a.py", "w = 9\n", "w = 3\n", "why")])


def test_every_reference_patch_is_one_line_of_theirs_or_a_named_block():
    for impl, patches in rr.PATCHES.items():
        assert patches, impl
        for patch in patches:
            assert patch.old != patch.new and patch.why and patch.old.endswith("\n"), (impl, patch.file)


def test_mnist_export_is_the_idx_layout_torchvision_reads(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    splits = {s: Split(rng.integers(0, 256, (n, 28, 28, 1), dtype=np.uint8), rng.integers(0, 10, n))
              for s, n in (("train", 7), ("test", 3))}
    monkeypatch.setattr("oneshot_fl.data.datasets.load_split", lambda dataset, split, *a: splits[split])
    rr.export_dataset("mnist", tmp_path, tmp_path / "out")
    raw = tmp_path / "out" / "MNIST" / "raw"
    assert np.array_equal(read_idx(raw / "train-images-idx3-ubyte"), splits["train"].images[..., 0])
    assert np.array_equal(read_idx(raw / "t10k-labels-idx1-ubyte"), splits["test"].labels)
    from torchvision.datasets import MNIST

    data = MNIST(str(tmp_path / "out"), train=True)
    assert data.data.shape == (7, 28, 28) and data.targets.tolist() == splits["train"].labels.tolist()


def test_cifar_export_is_the_pickle_layout_torchvision_reads(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    splits = {"train": Split(rng.integers(0, 256, (50_000, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, 50_000)),
              "test": Split(rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, 4))}
    monkeypatch.setattr("oneshot_fl.data.datasets.load_split", lambda dataset, split, *a: splits[split])
    rr.export_dataset("cifar10", tmp_path, tmp_path / "out")
    from torchvision.datasets import CIFAR10

    monkeypatch.setattr(CIFAR10, "train_list", [[n, None] for n, _ in CIFAR10.train_list])  # as the launcher does
    monkeypatch.setattr(CIFAR10, "test_list", [[n, None] for n, _ in CIFAR10.test_list])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": None})
    train, test = CIFAR10(str(tmp_path / "out"), train=True), CIFAR10(str(tmp_path / "out"), train=False)
    assert np.array_equal(train.data, splits["train"].images)  # index k is our image k
    assert train.targets == splits["train"].labels.tolist() and np.array_equal(test.data, splits["test"].images)


DENSE_PRETRAIN = """Data statistics: {0: {0: 5}}
client 0

 Test_set: Average loss: 2.0000, Accuracy: 40.5000

 Test_set: Average loss: 1.0000, Accuracy: 61.2500

client 1

 Test_set: Average loss: 1.5000, Accuracy: 55.0000

avg acc:

 Test_set: Average loss: 2.2000, Accuracy: 20.0000

ensemble acc:

 Test_set: Average loss: 0.9000, Accuracy: 70.0000
"""

DENSE_KD = """avg acc:

 Test_set: Average loss: 2.2000, Accuracy: 20.0000

ensemble acc:

 Test_set: Average loss: 0.9000, Accuracy: 70.0000

 Test_set: Average loss: 1.9000, Accuracy: 30.0000

best acc:30.0

 Test_set: Average loss: 1.8000, Accuracy: 25.5000

best acc:30.0
"""


def test_dense_parsers_read_clients_ensemble_and_epochs():
    pre = rr.parse_dense_pretrain(DENSE_PRETRAIN, 2)
    assert pre == {"clients": [61.25, 55.0], "fedavg": 20.0, "ensemble": 70.0}  # each client's last epoch
    kd = rr.parse_dense_kd(DENSE_KD)
    assert kd == {"fedavg": 20.0, "ensemble": 70.0, "epochs": [30.0, 25.5], "best": 30.0}
    with pytest.raises(RuntimeError, match="3 clients"):
        rr.parse_dense_pretrain(DENSE_PRETRAIN.replace("client 1", "client 1\nclient 2"), 3)
    with pytest.raises(RuntimeError, match="no distillation epoch"):
        rr.parse_dense_kd(DENSE_KD.split("best acc")[0].rsplit(" Test_set", 1)[0])


def test_fedmho_parser_takes_the_last_test_accuracy():
    w0 = "runtime: {'comm_round': 1, 'top1': 54.91} ({'split': 'test', 'type': 'fedag_test_loader_vgg9-0'})\n"
    text = w0 + "test accuracy: 12.500 %\n...\ntest accuracy: 91.230 %\n" + w0.replace("54.91", "91.23")
    assert rr.parse_fedmho(text) == {"final": 91.23, "w0": 54.91}  # w0: the averaged classifiers before fusion
    assert rr.parse_fedmho("test accuracy: 91.230 %\n")["w0"] is None
    with pytest.raises(RuntimeError, match="did not finish"):
        rr.parse_fedmho("Master received all local models.\n")


def test_evaluate_classifiers_scores_each_model_and_the_mean_logit_ensemble(monkeypatch):
    # two "classifiers" on 4 test images: one always right, one always class 0; ensemble = mean logits
    images = np.zeros((4, 28, 28, 1), dtype=np.uint8)
    labels = np.array([0, 1, 2, 1])
    monkeypatch.setattr("oneshot_fl.data.datasets.load_split", lambda *a: Split(images, labels))
    model = build("vgg9-small", (1, 28, 28), 10)
    right = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    wrong = {k: v.clone() for k, v in right.items()}
    right["classifier.6.bias"] = torch.zeros(10)  # all-zero images: the logits are the last bias
    # logits = last bias for every image: a constant prediction, so accuracy = share of that label
    right["classifier.6.bias"][1] = 3.0   # predicts 1: right on 2 of 4
    wrong["classifier.6.bias"][0] = 2.0   # predicts 0: right on 1 of 4
    accs, ensemble = rr.evaluate_classifiers([right, wrong], "vgg9-small", "mnist", None)
    assert accs == [0.5, 0.25]
    assert ensemble == 0.5  # mean bias: class 1 at 1.5 beats class 0 at 1.0


def test_side_by_side_pairs_ours_with_the_reference_on_one_cell():
    # clients without a test accuracy (FedMHO's decoder clients: None) are left out of the clients column
    base = {"dataset": "mnist", "seed": 0, "budget": "E5-T10", "partition_digest": "abc",
            "wall_s": {"server_total": 10.0, "local": 5.0}, "recorded_at": "2026-01-01T00:00:00"}
    records = [{**base, "method": "dense-ref", "client_accuracy": [0.5, 0.25], "ensemble_accuracy": 0.7,
                "accuracy_final": 0.6, "accuracy_best": 0.65, "fedavg_accuracy": 0.3},
               {**base, "method": "dense", "client_accuracy": [0.5, None], "ensemble_accuracy": 0.75,
                "accuracy_final": 0.7, "accuracy_best": 0.7}]
    lines = rr.side_by_side(records)
    assert lines[2] == "| mnist | 0 | E5-T10 | dense-ref | 50.0 / 25.0 | 70.00 | 30.00 | 60.00 | 65.00 | 10 | 5 | abc |"
    assert lines[3].startswith("| mnist | 0 | E5-T10 | dense | 50.0 | 75.00 | – | 70.00 | 70.00 |")


def test_reference_states_load_into_our_models_unchanged():
    # DENSE's CNNMnist names (layer1.0 conv, layer1.1 BN, layer2.*, fc) and CNNCifar's (conv1-3, fc1) -> ours
    for arch, shape in (("cnn2", (1, 28, 28)), ("cnn3", (3, 32, 32))):
        ours = build(arch, shape, 10).state_dict()
        names = (["layer1.0.", "layer1.1.", "layer2.0.", "layer2.1.", "fc."] if arch == "cnn2"
                 else ["conv1.", "conv2.", "conv3.", "fc1."])
        prefixes = sorted({k.rsplit(".", 1)[0] + "." for k in ours}, key=lambda p: list(ours).index(p + "weight")
                          if p + "weight" in ours else 0)
        theirs = {}
        for their, our in zip(names, prefixes):
            theirs.update({their + k[len(our):]: v + 1 for k, v in ours.items() if k.startswith(our)})
        mapped = rr.dense_state(theirs)
        assert mapped.keys() == ours.keys() and all(torch.equal(mapped[k], ours[k] + 1) for k in ours)
    with pytest.raises(KeyError, match="no name"):
        rr.dense_state({"head.weight": torch.zeros(1)})
    # FedMHO: a CVAE upload becomes its decoder (fc1, fc2); a VGG-9 keeps its keys
    cvae = {"encoder.MLP.L0.weight": torch.zeros(256, 794), "decoder.MLP.L0.weight": torch.ones(256, 12),
            "decoder.MLP.L0.bias": torch.ones(256), "decoder.MLP.L1.weight": torch.ones(784, 256),
            "decoder.MLP.L1.bias": torch.ones(784)}
    assert sorted(rr.fedmho_state(cvae)) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    vgg = build("vgg9-small", (1, 28, 28), 10).state_dict()
    assert rr.fedmho_state(vgg).keys() == vgg.keys()


def test_decomposition_splits_the_gap_along_the_replays():
    base = {"dataset": "mnist", "seed": 0, "budget": "E5-T10", "recorded_at": "2026-01-01T00:00:00"}
    on = "fedmho-md on fedmho-md-ref"
    finals = {"fedmho-md-ref": 0.88, "fedmho-md": 0.80, f"{on} uploads": 0.87,
              f"{on} uploads, random 80 % filter (their code's)": 0.885,
              f"{on} classifiers, our decoders": 0.85, f"{on} decoders, our classifiers": 0.82}
    records = [{**base, "method": label.split(" on ")[0] if " on " in label else label,
                **({"label": label} if " on " in label else {}), "accuracy_final": acc}
               for label, acc in finals.items()]
    line = rr.decomposition(records)[4]
    assert line == ("- mnist seed 0 E5-T10: fedmho-md-ref 88.00 - fedmho-md 80.00 = +8.00; server (their server minus "
                    "ours, on their uploads) +1.00; of which the filter (their random 80 % minus our nearest 80 %) "
                    "+1.50; uploads (ours on theirs minus ours on ours) +7.00; of which the classifier clients +5.00 "
                    "(with our decoders) / +5.00 (with theirs), the decoder clients +2.00 / +2.00.")
    assert rr.decomposition(records[:2]) == []  # no replay on their uploads: nothing to split


def test_replays_older_than_their_reference_run_are_left_out():
    base = {"dataset": "mnist", "seed": 0, "budget": "E5-T10", "accuracy_final": 0.5}
    on = {**base, "method": "fedmho-md", "label": "fedmho-md on fedmho-md-ref uploads"}
    old_ref = {**base, "method": "fedmho-md-ref", "recorded_at": "2026-01-01T00:00:00"}
    new_ref = {**old_ref, "recorded_at": "2026-01-03T00:00:00"}
    replay = {**on, "recorded_at": "2026-01-02T00:00:00"}
    assert ("fedmho-md on fedmho-md-ref uploads", "mnist", 0, "E5-T10") in rr.latest([old_ref, replay])
    assert ("fedmho-md on fedmho-md-ref uploads", "mnist", 0, "E5-T10") not in rr.latest([old_ref, replay, new_ref])


def test_our_dense_clients_augment_cifar10_as_the_reference_loader_does_and_mnist_not_at_all():
    # DENSE's CIFAR-10 training transform is RandomCrop(32, padding=4) + RandomHorizontalFlip; MNIST's ToTensor only
    from argparse import Namespace

    from oneshot_fl.config import from_run_config, merge_overrides

    def overrides(dataset):
        return rr.dense_overrides(Namespace(dataset=dataset, seed=0, num_clients=5, local_epochs=3, epochs=2, set=[]))

    cifar, mnist = overrides("cifar10"), overrides("mnist")
    assert cifar["local.augment"] == "crop-flip" and cifar["model"] == "cnn3"
    assert "local.augment" not in mnist and mnist["model"] == "cnn2"
    assert from_run_config(merge_overrides(cifar)).local.augment == "crop-flip"
    assert from_run_config(merge_overrides(mnist)).local.augment == "none"


def _cell(method, seed, budget, final, **extra):
    return {"method": method, "dataset": "mnist", "seed": seed, "budget": budget, "accuracy_final": final,
            "recorded_at": "2026-01-01T00:00:00", **extra}


def test_budget_order_reads_local_then_distillation_epochs():
    assert sorted(["E5-T30", "E15-T10", "E5-T10"], key=rr.budget_order) == ["E5-T10", "E5-T30", "E15-T10"]
    with pytest.raises(ValueError, match="E<local epochs>-T<epochs>"):
        rr.budget_order("5-10")


def test_budget_curves_list_both_implementations_per_budget_with_the_published_number():
    records = [_cell("dense-ref", 0, "E5-T30", 0.9, ensemble_accuracy=0.95, accuracy_best=0.91),
               _cell("dense", 0, "E5-T30", 0.875, ensemble_accuracy=0.94, accuracy_best=0.88),
               _cell("dense-ref", 0, "E5-T10", 0.8, ensemble_accuracy=0.95, accuracy_best=0.8),
               _cell("dense", 0, "E5-T10", 0.85, ensemble_accuracy=0.94, accuracy_best=0.86),
               _cell("dense", 100, "E5-T10", 0.85)]  # one budget only at seed 100: no curve
    lines = rr.budget_curves(records)
    rows = [line for line in lines if line.startswith("| dense |")]
    assert rows == [
        "| dense | mnist | 0 | E5-T10 | 95.00 | 80.00 (80.00) | 94.00 | 85.00 (86.00) | -5.00 | "
        "95.82 (DENSE Table 1, MNIST alpha 0.5, m 5) |",
        "| dense | mnist | 0 | E5-T30 | 95.00 | 90.00 (91.00) | 94.00 | 87.50 (88.00) | +2.50 | "
        "95.82 (DENSE Table 1, MNIST alpha 0.5, m 5) |"]
    assert rr.budget_curves(records[2:]) == []


def test_seed_noise_calls_a_difference_above_noise_only_where_its_mean_exceeds_its_spread():
    above = [_cell("fedmho-md-ref", 0, "E5-T10", 0.89), _cell("fedmho-md", 0, "E5-T10", 0.82),
             _cell("fedmho-md-ref", 100, "E5-T10", 0.895), _cell("fedmho-md", 100, "E5-T10", 0.865)]
    line = rr.seed_noise(above)[-2]
    assert line == ("- fedmho-md mnist E5-T10: theirs - ours +7.00 (seed 0) / +3.00 (seed 100), mean +5.00, spread "
                    "4.00: above the noise; each implementation's own seed-to-seed range: fedmho-md-ref 0.50, "
                    "fedmho-md 4.50.")
    wide = [*above[:3], _cell("fedmho-md", 100, "E5-T10", 0.885)]  # +7.00 / +1.00: mean 4.00 < spread 6.00
    assert rr.seed_noise(wide)[-2].endswith("mean +4.00, spread 6.00: within the noise; each implementation's own "
                                            "seed-to-seed range: fedmho-md-ref 0.50, fedmho-md 6.50.")
    mixed = [*above[:3], _cell("fedmho-md", 100, "E5-T10", 0.905)]  # +7.00 / -1.00: mean 3, spread 8
    assert "within the noise" in rr.seed_noise(mixed)[-2]
    assert rr.seed_noise(above[:2]) == []  # one seed: no noise to compare with


def test_reruns_compare_runs_of_one_commit_with_the_same_patches_and_commands():
    ref = {"commit": "237c5dd" + "0" * 33, "patches": [{"file": "a.py", "line": 1}],
           "commands": ["main.py --seed 0 --timestamp 111"]}
    first = _cell("dense-ref", 0, "E5-T10", 0.8288, reference=ref, client_accuracy=[0.9], ensemble_accuracy=0.88,
                  history=[0.5, 0.8288], code_version="aaa")
    again = {**first, "reference": {**ref, "commands": ["main.py --seed 0 --timestamp 222"]}, "code_version": "bbb",
             "recorded_at": "2026-01-02T00:00:00"}
    assert rr.reruns([first, again])[-2] == (
        "- dense-ref mnist seed 0 E5-T10, their commit 237c5dd, the same patches and commands: 2 runs (harness code "
        "aaa, bbb), final 82.88 / 82.88, ensemble 88.00 / 88.00: identical clients, ensemble and every epoch's "
        "accuracy.")
    drifted = {**again, "history": [0.51, 0.8288]}
    assert rr.reruns([first, drifted])[-2].endswith("they differ.")
    other_args = {**again, "reference": {**ref, "commands": ["main.py --seed 0 --lr_milestones 9"]}}
    assert rr.reruns([first, other_args]) == []  # another command line is another experiment, not a rerun


def test_reproduce_writes_each_rows_run_command_after_the_clones():
    dense = {"repo": "zj-jayzhang/DENSE", "commit": "d" * 40, "patches": []}
    fedmho = {"repo": "YXShi2000/FedMHO", "commit": "f" * 40, "patches": []}
    later = {"recorded_at": "2026-01-02T00:00:00"}  # a replay counts only after its reference run
    records = [_cell("dense", 0, "E5-T10", 0.86), _cell("dense-ref", 0, "E5-T10", 0.83, reference=dense),
               _cell("fedmho-md", 100, "E15-T10", 0.9, label="fedmho-md on fedmho-md-ref uploads, random 80 % filter "
                                                          "(their code's)", **later),
               _cell("fedmho-md", 100, "E15-T10", 0.9, label="fedmho-md on fedmho-md-ref classifiers, our decoders",
                     **later),
               _cell("fedmho-md-ref", 100, "E15-T10", 0.9, reference=fedmho)]
    lines = rr.reproduce(records)
    start = lines.index("```")
    assert lines[start + 1:start + 3] == [
        f"git clone https://github.com/YXShi2000/FedMHO FedMHO && git -C FedMHO checkout {'f' * 40}",
        f"git clone https://github.com/zj-jayzhang/DENSE DENSE && git -C DENSE checkout {'d' * 40}"]
    run = "python -m benchmarks.reference_runs run "
    assert lines[start + 4:] == [
        run + "dense-ref --repo DENSE --python venv/bin/python --dataset mnist --seed 0 --local-epochs 5 --epochs 10",
        run + "dense --dataset mnist --seed 0 --local-epochs 5 --epochs 10",
        run + "fedmho-md-ref --repo FedMHO --python venv/bin/python --seed 100 --local-epochs 15 --epochs 10",
        run + "fedmho-md-on-ref --seed 100 --local-epochs 15 --epochs 10 --ref-roles classifier",
        run + "fedmho-md-on-ref --seed 100 --local-epochs 15 --epochs 10 --random-filter",
        "```", "", "A replay (`X-on-ref`) reads the uploads of the reference run and of our run of its cell, so it "
        "comes after both.", ""]


def test_a_labelled_probe_is_a_row_of_its_own_with_the_command_that_reruns_it():
    cell = _cell("fedmho-md", 0, "E5-T10", 0.82, partition_digest="p")
    probe = _cell("fedmho-md", 0, "E5-T10", 0.87, partition_digest="p", recorded_at="2026-01-02T00:00:00",
                  label=rr.probe_label("fedmho-md", "independent init"), probe_sets=["local.init='independent'"])
    rows = rr.latest([cell, probe])
    assert rows[("fedmho-md", "mnist", 0, "E5-T10")]["accuracy_final"] == 0.82  # the cell's row stays
    assert rows[("fedmho-md (independent init)", "mnist", 0, "E5-T10")]["accuracy_final"] == 0.87
    table = "\n".join(rr.side_by_side([cell, probe]))
    assert "| fedmho-md (independent init) |" in table and "| 87.00 |" in table
    assert rr.run_command(probe, {}) == ("python -m benchmarks.reference_runs run fedmho-md --seed 0 --local-epochs 5 "
                                         "--epochs 10 --set \"local.init='independent'\" --label \"independent init\"")
    args = argparse.Namespace(label="independent init")
    assert rr.probe_suffix(args) == "-independent-init" and rr.probe_suffix(argparse.Namespace(label=None)) == ""


def test_a_reference_probe_at_another_seed_of_theirs_is_a_row_beside_theirs_with_its_command():
    ref = _cell("fedmho-md-ref", 0, "E5-T10", 0.89, partition_digest="p")
    probe = _cell("fedmho-md-ref", 0, "E5-T10", 0.85, partition_digest="p", recorded_at="2026-01-02T00:00:00",
                  label=rr.probe_label("fedmho-md-ref", "manual seed 1"), probe_ref_seed=1)
    ours = _cell("fedmho-md", 0, "E5-T10", 0.82, partition_digest="p")
    table = [line for line in rr.side_by_side([ref, probe, ours]) if line.startswith("| mnist")]
    assert [line.split(" | ")[3] for line in table] == ["fedmho-md-ref", "fedmho-md-ref (manual seed 1)", "fedmho-md"]
    assert rr.run_command(probe, {"fedmho-md-ref": "FedMHO"}) == (
        "python -m benchmarks.reference_runs run fedmho-md-ref --repo FedMHO --python venv/bin/python --seed 0 "
        "--local-epochs 5 --epochs 10 --ref-seed 1 --label \"manual seed 1\"")
    assert rr.their_seed(argparse.Namespace(seed=100, ref_seed=None)) == 100
    assert rr.their_seed(argparse.Namespace(seed=100, ref_seed=7)) == 7


@pytest.mark.parametrize("argv, message", [
    (["run", "fedmho-md", "--set", "local.init='independent'"], "give it --label NAME"),
    (["run", "dense-ref", "--repo", ".", "--ref-seed", "1"], "give it --label NAME"),
    (["run", "dense", "--ref-seed", "1", "--label", "x"], "--ref-seed retrains a reference run"),
    (["run", "dense-ref", "--repo", ".", "--label", "x"], "not of dense-ref"),
    (["run", "dense", "--set", "local.lr=0.1", "--label", "lr on clients"], "without ' on '"),
])
def test_a_probe_without_a_label_or_a_label_elsewhere_is_refused(argv, message, capsys):
    assert rr.main(argv) == 1
    assert message in capsys.readouterr().err


def test_chance_noise_sets_the_gap_of_the_means_against_each_sides_range_over_its_draws():
    def run(method, final, clients, **extra):
        return _cell(method, 0, "E5-T10", final, client_accuracy=clients, **extra)
    records = [
        run("fedmho-md-ref", 0.89, [0.50, 0.70, None]),
        run("fedmho-md-ref", 0.87, [0.40, 0.72, None], recorded_at="2026-01-02T00:00:00", probe_ref_seed=1,
            label=rr.probe_label("fedmho-md-ref", "manual seed 1")),
        run("fedmho-md", 0.82, [0.50, 0.55, None]),
        run("fedmho-md", 0.78, [0.51, 0.56, None], recorded_at="2026-01-02T00:00:00", probe_sets=["local.stream=1"],
            label=rr.probe_label("fedmho-md", "stream 1")),
        run("fedmho-md", 0.80, [0.49, 0.57, None], recorded_at="2026-01-02T00:00:00",
            probe_sets=["local.stream=2", "local.init-draw=2"], label=rr.probe_label("fedmho-md", "stream 2, init 2")),
        run("fedmho-md", 0.99, [0.9, 0.9, None], recorded_at="2026-01-03T00:00:00", probe_sets=["local.lr=0.1"],
            label=rr.probe_label("fedmho-md", "lr")),  # another setting, not another draw: left out
        run("fedmho-md", 0.98, [0.9, 0.9, None], recorded_at="2026-01-03T00:00:00",
            probe_sets=["local.init-draw=1", "local.lr=0.1"], label=rr.probe_label("fedmho-md", "init 1, lr")),
    ]
    lines = rr.chance_noise(records)
    # theirs 89, 87: mean 88.00, range 2.00; ours 82, 78, 80 (stream and init draws; the lr probes are other
    # settings): mean 80.00, range 4.00; gap +8.00 > 4.00
    assert lines[-2] == (
        "- fedmho-md mnist seed 0 E5-T10: fedmho-md-ref 89.00 / 87.00 (mean 88.00, range 2.00, 2 runs); fedmho-md "
        "82.00 / 78.00 / 80.00 (mean 80.00, range 4.00, 3 runs); theirs - ours +8.00, larger than either side's "
        "range. Clients (lowest-highest over the runs): fedmho-md-ref 40.0-50.0 / 70.0-72.0; fedmho-md 49.0-51.0 / "
        "55.0-57.0.")
    assert rr.chance_noise(records[:1] + records[2:3]) == []  # one run a side: nothing to set the gap against


TORCHRUN_STDERR = """[rank8]: Traceback (most recent call last):
[rank8]:   File "pcode/worker_lmf.py", line 374, in loss_fn_cvae
[rank8]: RuntimeError: all elements of input should be between 0 and 1
W1207 23:17:35.193000 22194 api.py:1028] Sending process 22206 closing signal SIGTERM
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def test_root_cause_is_the_first_exception_a_failed_run_names():
    # torch.distributed: the failing rank's exception, not the launcher's ChildFailedError that follows it
    assert rr.root_cause(TORCHRUN_STDERR) == "rank 8: RuntimeError: all elements of input should be between 0 and 1"
    assert rr.root_cause("Traceback ...\nValueError: bad shape\n") == "ValueError: bad shape"
    assert rr.root_cause("Killed\n\n") == "Killed" and rr.root_cause("") == "(no output on stderr)"


def test_a_failed_reference_run_is_recorded_with_its_cause_and_listed_with_the_command_that_reruns_it(
        tmp_path, monkeypatch):
    from benchmarks import records

    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(rr, "RESULTS_DIR", tmp_path)

    def dies(args):
        raise rr.ReferenceFailed(["python", "-m", "torch.distributed.run", "main.py"], 1, 54.2, TORCHRUN_STDERR)

    monkeypatch.setattr(rr, "run_fedmho_ref", dies)
    (tmp_path / ".git").mkdir()  # a checkout, as far as the argument check looks
    argv = ["run", "fedmho-md-ref", "--repo", str(tmp_path), "--python", "python", "--seed", "0",
            "--local-epochs", "15", "--epochs", "10"]
    assert rr.main(argv) == 1
    failed, = records.load_records(rr.FAILURES)
    assert (failed["method"], failed["dataset"], failed["budget"], failed["returncode"]) == (
        "fedmho-md-ref", "mnist", "E15-T10", 1)
    assert failed["command"] == "python -m torch.distributed.run main.py"
    assert records.load_records(rr.TABLE) == []  # no accuracy record: no other section reads a failed run
    report = (tmp_path / "reference_runs.md").read_text()
    assert ("- fedmho-md-ref mnist seed 0 E15-T10 (harness " in report and
            "exit 1 after 54 s, `rank 8: RuntimeError: all elements of input should be between 0 and 1`; "
            "`python -m benchmarks.reference_runs run fedmho-md-ref --repo FedMHO --python venv/bin/python --seed 0 "
            "--local-epochs 15 --epochs 10`" in report)


def test_the_random_filter_replay_keeps_a_random_share_of_each_class_not_the_nearest():
    from oneshot_fl.engine.decoders import SyntheticSet, nearest_to_class_mean
    from strategies import strategy_class

    cls = rr.random_filter_class("fedmho-md")
    assert issubclass(cls, strategy_class("fedmho-md"))
    synth = object.__new__(cls.synthesizer_class)  # the filter reads only keep_ratio and seed
    synth.keep_ratio, synth.seed = 0.8, 3
    # class 0: 10 samples whose distance to the class mean grows with the index; class 1: 5 samples
    images = torch.cat([torch.arange(10.0), torch.zeros(5)]).view(15, 1, 1, 1)
    labels = torch.tensor([0] * 10 + [1] * 5)
    drawn = SyntheticSet(images, labels, torch.zeros(15, dtype=torch.long))
    kept, dropped = synth.filter(drawn)
    assert (kept.labels == 0).sum() == 8 and (kept.labels == 1).sum() == 4  # int(0.8 * n_c) per class
    assert len(kept) + len(dropped) == 15
    assert sorted(kept.images.flatten().tolist() + dropped.images.flatten().tolist()) == sorted(
        images.flatten().tolist())
    again, _ = synth.filter(drawn)
    assert torch.equal(again.images, kept.images)  # the seed decides the draw
    nearest = tuple(sorted(images.flatten()[nearest_to_class_mean(images, labels, 0.8)].tolist()))
    picks = set()
    for seed in range(5):  # other seeds keep other samples, and not only the nearest 80 % of each class
        synth.seed = seed
        picks.add(tuple(sorted(synth.filter(drawn)[0].images.flatten().tolist())))
    assert len(picks) > 1 and picks != {nearest}
