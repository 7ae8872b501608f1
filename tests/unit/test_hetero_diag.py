"""benchmarks.hetero_diag: each record's server setting is what it changed against the fleet file, and the report
puts the student beside its teacher and the fleet's best client."""

from benchmarks import hetero_diag, records

FLEET = {"dataset": "mnist", "num-clients": 5, "client-models": "lenet,cnn2", "server-model": "resnet8",
         "preset": "cpu"}


def _record(overrides: dict, student: float, teacher: float, seconds: float, at: str) -> dict:
    return {"table": "hetero_diag", "method": "fedhydra", "dataset": "fmnist", "cell": "0.5", "seed": 100,
            "overrides": overrides, "accuracy_final": student, "ensemble_accuracy": teacher,
            "client_accuracy": [0.5, 0.8125], "client_archs": ["lenet", "cnn2"],
            "wall_s": {"server_total": seconds}, "code_version": "abc1234", "recorded_at": at}


def test_the_setting_is_what_a_record_changed_against_the_fleet():
    run = {"method": "fedhydra", "seed": 100, "threads": 1, "server-threads": 1, "client-models": "lenet,cnn2"}
    assert hetero_diag.setting_of({"overrides": {**run, "server-model": "resnet8"}}, FLEET) == "– (the fleet file's)"
    assert hetero_diag.setting_of({"overrides": {**run, "server-model": "vgg9-small", "fedhydra.lambda-bn": 0}},
                                  FLEET) == "fedhydra.lambda-bn=0, server-model=vgg9-small"


def test_report_rows_latest_per_setting_with_the_gap_to_the_teacher(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    base = {"server-model": "resnet8", "threads": 1}
    for record in (_record(base, 0.70, 0.875, 600.4, "2026-01-01T00:00:00"),
                   _record(base, 0.75, 0.875, 500.0, "2026-01-02T00:00:00"),  # the same row again: the latest wins
                   _record({**base, "server-model": "cnn3-bn"}, 0.8, 0.875, 900.0, "2026-01-03T00:00:00")):
        records.append_record(record)
    text = hetero_diag.render(FLEET, out=tmp_path / "diag.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| fmnist")]
    assert rows == [
        "| fmnist | 0.5 | 100 | – (the fleet file's) | 75.00 | 87.50 | cnn2 81.25 | -12.50 | 500 | abc1234 |",
        "| fmnist | 0.5 | 100 | server-model=cnn3-bn | 80.00 | 87.50 | cnn2 81.25 | -7.50 | 900 | abc1234 |"]


def test_each_replay_is_told_the_fleet_files_server_settings(monkeypatch, tmp_path):
    replayed = []
    monkeypatch.setattr(hetero_diag, "train_clients", lambda *args, **kwargs: tmp_path)
    monkeypatch.setattr(hetero_diag, "replay_methods",
                        lambda table, up, methods, by, ds, cell, seed, preset, client, server, force:
                        replayed.append((client, server)))
    report = tmp_path / "diag.md"
    report.write_text("report\n")
    monkeypatch.setattr(hetero_diag, "render", lambda fleet: report)
    assert hetero_diag.main(["--settings", "", "fedhydra.lambda-bn=0", "server-model='cnn3-bn'"]) == 0
    fleet = hetero_diag.parse_sets([str(hetero_diag.CONF)])
    clients = {"client-models": fleet["client-models"]}
    # the file's server model reaches the replay unless the setting replaces it; client settings stay client-side
    assert replayed == [
        (clients, {"server-model": fleet["server-model"], "threads": 1, "server-threads": 1, "fedhydra.lambda-bn": 0}),
        (clients, {"server-model": "cnn3-bn", "threads": 1, "server-threads": 1})]
