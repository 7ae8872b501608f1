"""experiments.hetero_diag: each record's server setting is what it changed against the fleet file, and the report
puts the student beside its teacher and the fleet's best client."""

from benchmarks import fleets, records
from experiments import hetero_diag

FLEET = {"dataset": "mnist", "num-clients": 5, "client-models": "lenet,cnn2", "server-model": "resnet8",
         "preset": "cpu"}


def _record(overrides: dict, student: float, teacher: float, seconds: float, at: str,
            method: str = "fedhydra") -> dict:
    return {"table": "hetero_diag", "method": method, "dataset": "fmnist", "cell": "0.5", "seed": 100,
            "overrides": overrides, "accuracy_final": student, "ensemble_accuracy": teacher,
            "client_accuracy": [0.5, 0.8125], "client_archs": ["lenet", "cnn2"],
            "wall_s": {"server_total": seconds}, "code_version": "abc1234", "recorded_at": at}


def test_the_setting_is_what_a_record_changed_against_the_fleet():
    run = {"method": "fedhydra", "seed": 100, "threads": 1, "server-threads": 1, "client-models": "lenet,cnn2"}
    assert hetero_diag.setting_of({"method": "fedhydra", "overrides": {**run, "server-model": "resnet8"}},
                                  FLEET) == "– (the fleet file's)"
    assert hetero_diag.setting_of({"method": "fedhydra", "overrides": {**run, "server-model": "vgg9-small",
                                                                      "fedhydra.lambda-bn": 0}},
                                  FLEET) == "fedhydra.lambda-bn=0, server-model=vgg9-small"
    # a row made before the file set a key ran at the default: it shows that value; another method's knob is not
    # a FedDF row's setting
    fleet = {**FLEET, "fedhydra.lambda-bn": 0.03}
    assert hetero_diag.setting_of({"method": "fedhydra", "overrides": {**run, "server-model": "resnet8"}},
                                  fleet) == "fedhydra.lambda-bn=1.0"
    assert hetero_diag.setting_of({"method": "fedhydra", "overrides": {**run, "server-model": "resnet8",
                                                                      "fedhydra.lambda-bn": 0.03}},
                                  fleet) == "– (the fleet file's)"
    assert hetero_diag.setting_of({"method": "feddf", "overrides": {**run, "method": "feddf",
                                                                   "server-model": "resnet8"}},
                                  fleet) == "– (the fleet file's)"


def test_report_rows_latest_per_setting_with_the_gap_to_the_teacher(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    base = {"server-model": "resnet8", "threads": 1}
    for record in (_record(base, 0.70, 0.875, 600.4, "2026-01-01T00:00:00"),
                   _record(base, 0.75, 0.875, 500.0, "2026-01-02T00:00:00"),  # the same row again: the latest wins
                   _record({**base, "server-model": "cnn3-bn"}, 0.8, 0.875, 900.0, "2026-01-03T00:00:00"),
                   # another method on the same uploads is its own row, after FedHydra's
                   _record(base, 0.625, 0.75, 400.0, "2026-01-04T00:00:00", method="feddf")):
        records.append_record(record)
    text = hetero_diag.render(lambda dataset: FLEET, out=tmp_path / "diag.md").read_text()
    # the fleet described from its own settings (the cpu preset's 30 distillation epochs: the file sets none)
    assert ("`benchmarks/conf/grey-hetero-cpu.toml` (lenet / cnn2 clients, server resnet8, 30 distillation epochs)"
            in text)
    rows = [line for line in text.splitlines() if line.startswith("| fmnist")]
    assert rows == [
        "| fmnist | 0.5 | 100 | fedhydra | – (the fleet file's) | 75.00 | 87.50 | cnn2 81.25 | -12.50 | 500 | abc1234 "
        "|",
        "| fmnist | 0.5 | 100 | fedhydra | server-model=cnn3-bn | 80.00 | 87.50 | cnn2 81.25 | -7.50 | 900 | abc1234 |",
        "| fmnist | 0.5 | 100 | feddf | – (the fleet file's) | 62.50 | 75.00 | cnn2 81.25 | -12.50 | 400 | abc1234 |"]


def test_each_replay_is_told_the_fleet_files_server_settings(monkeypatch, tmp_path):
    replayed = []
    monkeypatch.setattr(hetero_diag, "tuning_uploads", lambda *args: tmp_path)
    monkeypatch.setattr(hetero_diag, "replay_methods",
                        lambda table, up, methods, by, ds, cell, seed, preset, client, server, force, folder_tag="":
                        replayed.append((methods, client, server, folder_tag, by)))
    report = tmp_path / "diag.md"
    report.write_text("report\n")
    monkeypatch.setattr(hetero_diag, "render", lambda: report)
    assert hetero_diag.main(["--settings", "", "fedhydra.lambda-bn=0", "server-model='cnn3-bn'",
                             "--reference", "feddf"]) == 0
    fleet = fleets.parse_sets([str(fleets.GREY)])
    clients = {"client-models": fleet["client-models"]}
    file_server = {"server-model": fleet["server-model"], "threads": 1, "server-threads": 1}
    # the file's server model reaches the replay unless the setting replaces it; client settings stay client-side;
    # a reference method replays at the file's settings
    assert [r[:3] for r in replayed] == [
        (["fedhydra"], clients, {**file_server, "fedhydra.lambda-bn": 0}),
        (["fedhydra"], clients, {**file_server, "server-model": "cnn3-bn"}),
        (["feddf"], clients, file_server)]
    # each FedHydra setting replays into a run folder of its own (two diag processes side by side never share one)
    tags = [r[3] for r in replayed]
    assert tags[0] and tags[1] and tags[0] != tags[1] and tags[2] == ""
    # every replay names FedHydra as the method that trained the clients; its setting rows are replayed because the
    # training run's row is at the file's settings (plan_replays' trainer_recorded)
    assert {r[4] for r in replayed} == {"fedhydra"}


def test_a_baseline_gets_the_same_setting_rows_with_method(monkeypatch, tmp_path):
    replayed = []
    monkeypatch.setattr(hetero_diag, "tuning_uploads", lambda *args: tmp_path)
    monkeypatch.setattr(hetero_diag, "replay_methods",
                        lambda table, up, methods, by, ds, cell, seed, preset, client, server, force, folder_tag="":
                        replayed.append((methods, by, server)))
    report = tmp_path / "diag.md"
    report.write_text("report\n")
    monkeypatch.setattr(hetero_diag, "render", lambda: report)
    assert hetero_diag.main(["--method", "dense", "--settings", "", "dense.lambda-bn=0"]) == 0
    fleet = fleets.parse_sets([str(fleets.GREY)])
    file_server = {"server-model": fleet["server-model"], "threads": 1, "server-threads": 1}
    # DENSE at the file's settings is a replay too (only FedHydra's row comes from the training run), and neither
    # replay is planned as the training method's own row
    assert replayed == [(["dense"], "fedhydra", file_server),
                        (["dense"], "fedhydra", {**file_server, "dense.lambda-bn": 0})]


def test_cifar10_uses_its_own_fleet_file_and_an_unknown_dataset_is_refused(monkeypatch, tmp_path, capsys):
    trained = []
    monkeypatch.setattr(fleets, "train_clients",
                        lambda *args, **kwargs: trained.append((args[6], kwargs["server_sets"])) or tmp_path)
    monkeypatch.setattr(hetero_diag, "replay_methods", lambda *args, **kwargs: None)
    report = tmp_path / "diag.md"
    report.write_text("report\n")
    monkeypatch.setattr(hetero_diag, "render", lambda: report)
    assert hetero_diag.main(["--dataset", "cifar10", "--settings", ""]) == 0
    cifar = fleets.parse_sets([str(fleets.TUNING_FLEET_FILES["cifar10"])])
    client_side, server = trained[0]
    assert client_side["client-models"] == cifar["client-models"] == "googlenet,resnet18,cnn2,cnn3-bn,lenet"
    assert client_side["local.max-samples"] == cifar["local.max-samples"]
    # the file's server settings reach the training run as server settings, not as what its kept uploads are checked
    # against (a later change of them must still find the uploads)
    assert "distill.epochs" not in client_side and server["distill.epochs"] == cifar["distill.epochs"]
    assert server["fedhydra.lambda-bn"] == cifar["fedhydra.lambda-bn"] and server["server-threads"] == 1
    try:
        hetero_diag.main(["--dataset", "svhn"])
    except SystemExit as exc:
        assert exc.code == 2
    assert "there are tuning fleet files for mnist, fmnist, cifar10" in capsys.readouterr().err
