"""experiments/cifar_budget: one records file per local budget, and the report's rows from hand-made records."""

from __future__ import annotations

from experiments import cifar_budget as cb


def _record(method, local_epochs, distill_epochs, final, **extra):
    return {"method": method, "seed": 100, "cell": "0.5", "accuracy_final": final,
            "recorded_at": extra.pop("at", "2026-01-01T00:00:00"),
            "overrides": {"local.epochs": local_epochs, "local.augment": "none", "distill.epochs": distill_epochs},
            **extra}


def test_each_local_budget_has_its_own_table_and_keeps_the_release_server_settings():
    assert cb.table_of(6, "crop-flip") == "cifar10_budget-e6-crop-flip"
    assert cb.client_sets(6, "crop-flip") == {"local.epochs": 6, "local.augment": "crop-flip", "threads": 1}
    sets = cb.server_sets(20, {"distill.kd-steps": 40})
    assert sets["distill.epochs"] == 20 and sets["distill.kd-steps"] == 40
    assert sets["distill.generator-steps"] == cb.CIFAR10_SERVER["distill.generator-steps"]
    assert sets["server-threads"] == 1


def test_rows_pair_each_distillation_budget_with_its_fleets_clients():
    records = [
        _record("fedavg", 3, 10, 0.30, client_accuracy=[0.2, 0.4], wall_s={"local": 1200.0}),
        _record("dense", 3, 10, 0.35, ensemble_accuracy=0.45, wall_s={"server_total": 300.0}),
        _record("dense", 3, 10, 0.36, ensemble_accuracy=0.45, wall_s={"server_total": 310.0}, at="2026-01-02"),
        _record("fedhydra", 3, 20, 0.41, ensemble_accuracy=0.53, wall_s={"server_total": 900.0}),
        _record("fedavg", 6, 10, 0.33, client_accuracy=[0.5, 0.3], wall_s={"local": 2400.0}),
    ]
    rows = cb.rows(records)
    assert [(r["local_epochs"], r["distill_epochs"]) for r in rows] == [(3, 10), (3, 20)]
    first, second = rows
    assert first["clients"] == [0.2, 0.4] and first["client_s"] == 1200.0 and first["fedavg"] == 0.30
    assert (first["dense"], first["dense_s"], first["ensemble"]) == (0.36, 310.0, 0.45)  # the latest DENSE record
    assert first["fedhydra"] is None and second["fedhydra"] == 0.41 and second["dense"] is None
    assert second["fedhydra_teacher"] == 0.53 and second.get("ensemble") is None  # SA's, not the mean-logit one


def test_a_curve_on_a_reported_seed_is_refused(capsys):
    assert cb.main(["run", "--seed", "0"]) == 2
    assert "tuning seeds" in capsys.readouterr().err


def test_a_bad_setting_is_refused_before_any_fleet_trains(capsys, monkeypatch):
    monkeypatch.setattr(cb, "run_fleets", lambda *a, **k: (_ for _ in ()).throw(AssertionError("trained")))
    assert cb.main(["run", "--distill-epochs", "10", "--set", "distill.generator-steps=-2"]) == 2
    assert "distill.generator-steps" in capsys.readouterr().err


def test_two_server_budgets_at_the_same_epochs_are_two_rows():
    def replay(kd_steps, final):
        r = _record("fedhydra", 3, 10, final)
        r["overrides"].update({"distill.generator-steps": 10, "distill.kd-steps": kd_steps})
        return r
    rows = cb.rows([_record("fedavg", 3, 10, 0.30, client_accuracy=[0.3]), replay(50, 0.44), replay(20, 0.40)])
    assert [(r["distill_epochs"], r["generator_steps"], r["kd_steps"], r["fedhydra"]) for r in rows] == [
        (10, 10, 20, 0.40), (10, 10, 50, 0.44)]
