"""The release command (benchmarks.release) on tiny fake inputs, nothing trained: what it plans (every table the issue
names, with its seeds, cells and methods), what counts as done (a record of this commit only), the estimate from the
tables' own records, the refusal of a dirty tree, two processes at a time, the provenance lines, the archive of
superseded records and the CHANGELOG's commit."""

import json
from datetime import date

import pytest

from benchmarks import release, release_plan
from benchmarks.release_plan import Job, Step

COMMIT = "abc1234"


def _rec(label, dataset, cell, seed, version=COMMIT, k=5, server=60.0, total=300.0, **extra):
    method = {"fedhydra-paper": "fedhydra", "fedlmd": "fedavg"}.get(label, label)
    return {"table": "t", "method": method, **({"label": label} if label != method else {}), "dataset": dataset,
            "cell": cell, "partition": "niid-bench", "alpha": 0.5, "seed": seed, "num_clients": k,
            "code_version": version, "overrides": {"threads": 1}, "wall_s": {"server_total": server, "total": total},
            "machine": {"cpus": 2, "cpu": "test CPU", "processor": "x86_64", "gpu": None}, "preset": "cpu",
            "accuracy_final": 0.5, "recorded_at": "2026-01-01T00:00:00", **extra}


def _step(name="s", table="t", cores=2, after=(), labels=("fedavg", "dense"), seeds=(0, 1)):
    jobs = tuple(release_plan.fleet_jobs(table, ("mnist",), ("0.5",), seeds, 5, labels, "fedavg", {"threads": 1}))
    return Step(name, table, "benchmarks.paper_table", ("--seeds", "0"), jobs, cores=cores, after=after)


def test_the_release_plans_every_table_the_issue_names():
    steps = {s.name: s for s in release_plan.release_steps()}

    def cells(*names, kind=None):
        return {(j.table, j.label, j.dataset, j.cell, j.seed, j.num_clients) for n in names for j in steps[n].jobs
                if kind is None or j.kind == kind}

    paper = cells("paper-grey", "paper-cifar10")
    assert {(d, c) for _, _, d, c, _, _ in paper} == {(d, c) for d in ("mnist", "fmnist")
                                                     for c in ("0.5", "0.3", "0.1", "0.01", "2c/c")} | {
        ("cifar10", "0.5"), ("cifar10", "0.1")}  # the 12 cells
    assert len(paper) == 12 * 6 * 3 and {label for _, label, *_ in paper} == set(release_plan.PAPER_METHODS)
    assert set(release_plan.PAPER_METHODS) == {"fedavg", "dense", "feddf", "coboosting", "fedhydra-paper", "fedhydra"}
    cifar = steps["paper-cifar10"]  # the cpu preset's budget, named in the command and required of the records
    assert {"local.epochs=10", "distill.epochs=30", "distill.generator-steps=20", "distill.kd-steps=50"} <= set(
        cifar.args)
    assert all({("local.epochs", 10), ("distill.epochs", 30), ("distill.kd-steps", 50)} <= set(j.sets)
               for j in cifar.jobs)
    assert {k for *_, k in cells("clients")} == {5, 10, 20, 50, 100}
    fedmho = cells("fedmho-mnist", "fedmho-fmnist")
    assert {label for _, label, *_ in fedmho} == {"fedmho", "fedmho-md", "fedmho-sd", "fedcvae", "fedavg", "dense",
                                                  "fedhydra"}
    assert {(d, c) for _, _, d, c, _, _ in fedmho} == {(d, c) for d in ("mnist", "fmnist") for c in ("0.5", "0.1")}
    assert {(t, d, c) for t, _, d, c, _, _ in cells("hetero-grey", "hetero-cifar10")} == {
        ("hetero_grey", d, c) for d in ("mnist", "fmnist") for c in ("0.5", "0.1")} | {
        ("hetero_cifar10", "cifar10", c) for c in ("0.5", "0.1")}
    rounds = [j for n in ("multiround-0.1", "multiround-2cc") for j in steps[n].jobs]
    assert {j.cell for j in rounds} == {"0.1", "2c/c"} and all(dict(j.match)["round"] >= 20 for j in rounds)
    assert {j.label for j in rounds} == {"fedavg", "fedlmd", "fedlmd-tf"} and {j.seed for j in rounds} == {0, 1, 2}
    assert "local.epochs=5" in steps["multiround-0.1"].args  # FedLMD's local epochs per round
    assert {j.table for j in steps["dp"].jobs} == {f"dp-eps{e}{m}" for e in (1, 3, 8, 0) for m in ("", "-mixed")}
    assert len(steps["robustness"].jobs) == 2 * 2 * 3 * 5 * 4
    assert {j.seed for s in steps.values() for j in s.jobs if not s.name.startswith("clients")} == {0, 1, 2}
    # one torch thread per process, two processes at a time: fleet tables with --cores 2, one-process steps at 1 core
    assert all("threads=1" in s.args for s in steps.values())
    assert {s.cores for s in steps.values()} == {1, 2}
    assert all("--cores" in s.args for s in steps.values() if s.cores == 2 and s.name != "robustness")


def test_a_job_is_done_only_by_a_record_of_this_commit_at_the_release_settings():
    job = Job("replay", "t", "fedhydra-paper", "mnist", "0.5", 0, 5, (("variant", "flip"),), (("threads", 1),))
    record = _rec("fedhydra-paper", "mnist", "0.5", 0, variant="flip")
    assert job.recorded_by(record)
    assert not job.recorded_by({**record, "variant": "minus"})
    assert not job.recorded_by({**record, "label": None})  # the method's own row, not its paper variant
    assert not job.recorded_by({**record, "overrides": {"threads": 2}})
    assert not job.recorded_by({**record, "seed": 1}) and not job.recorded_by({**record, "num_clients": 10})
    step = Step("s", "t", "benchmarks.robustness", (), (job,))
    assert [len(p.done) for p in release_plan.plan([step], COMMIT, lambda table: [record])] == [1]
    older = {**record, "code_version": "0ld0000"}
    assert [len(p.todo) for p in release_plan.plan([step], COMMIT, lambda table: [older])] == [1]


def test_the_estimate_is_the_median_of_the_tables_records_of_that_cell_else_other_cells_else_none():
    records = [_rec("dense", "mnist", "0.5", s, version="0ld0000", server=t) for s, t in ((0, 60.0), (1, 120.0),
                                                                                           (2, 600.0))]
    records += [_rec("dense", "mnist", "0.1", 0, version="0ld0000", server=30.0),
                _rec("fedavg", "mnist", "0.1", 0, version="0ld0000", total=200.0)]
    step = _step(labels=("fedavg", "dense", "feddf"), seeds=(0,))
    p, = release_plan.plan([step], COMMIT, lambda table: records)
    by_label = {job.label: e for job, e in p.todo}
    assert (by_label["dense"].seconds, by_label["dense"].source) == (120.0, "this cell")  # median of 60, 120, 600
    assert (by_label["fedavg"].seconds, by_label["fedavg"].source) == (200.0, "other cells")  # a training run: total
    assert (by_label["feddf"].seconds, by_label["feddf"].source) == (None, "none")
    text = release_plan.plan_text([p], COMMIT, cores=2)
    assert "3 to run, 0.1 h of job time (1 estimated from other cells or tables)" in text  # 120 + 200 s
    assert "replay feddf: t mnist 0.5 seed 0 K=5: no estimate" in text
    assert "No estimate (no record of that method, dataset and clients to go by): s: 1 jobs, not in the total." in text
    # a job that names its budget is estimated from records at that budget only (a knob a record does not set is at
    # the preset): the 10-epoch record stands for it, the 3-epoch one does not
    budget = Job("replay", "t", "dense", "cifar10", "0.5", 0, 5, (), (("distill.epochs", 30), ("threads", 1)))
    cut = [_rec("dense", "cifar10", "0.5", 0, version="0ld0000", server=60.0, overrides={"distill.epochs": 10}),
           _rec("dense", "cifar10", "0.5", 1, version="0ld0000", server=900.0, overrides={"threads": 2})]
    assert release_plan.estimate(budget, cut).seconds == 900.0
    assert release_plan.estimate(budget, cut[:1], {"curve": cut[1:]}).source == "curve's dense, this cell"
    # a multi-round job: one round's time from the fallback table, as FedAvg for a FedLMD variant, times its rounds
    rounds = Job("simulation", "m", "fedlmd", "mnist", "0.1", 0, 5, (("round", 20),))
    guess = release_plan.estimate(rounds, [], {"paper_table": records})
    assert (guess.seconds, guess.source) == (20 * 200.0, "paper_table's fedavg, this cell per round")


def test_a_dirty_tree_is_refused_in_one_line_and_the_plan_still_prints(monkeypatch, capsys):
    monkeypatch.setattr(release, "code_version", lambda: f"{COMMIT}-dirty")
    monkeypatch.setattr(release, "release_steps", lambda: [_step()])
    monkeypatch.setattr(release, "load_records", lambda table: [])
    monkeypatch.setattr(release, "run", lambda *a, **k: pytest.fail("a dirty tree must not run"))
    assert release.main([]) == 1
    captured = capsys.readouterr()
    assert captured.err == (f"benchmarks.release: error: the checkout has uncommitted changes ({COMMIT}-dirty): "
                            "commit them first, the release's records must name the code that made them\n")
    assert captured.out == ""  # nothing planned, nothing started
    assert release.main(["plan"]) == 0 and release.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "step s (t, 2 cores): 4 jobs, 0 done at this commit, 4 to run" in out and "`run` refuses this tree" in out
    monkeypatch.setattr(release, "code_version", lambda: "unknown")
    assert release.main([]) == 1 and "commit is unknown" in capsys.readouterr().err


def test_steps_run_two_cores_at_a_time_in_order_each_after_the_steps_it_needs():
    class Proc:
        def __init__(self, step, polls):
            self.step, self.left = step, polls

        def poll(self):
            self.left -= 1
            return None if self.left > 0 else (1 if self.step.name == "b" else 0)

    procs, seen = [], []
    durations = {"a": 3, "b": 2, "c": 4, "d": 1, "e": 1}

    def launch(step):
        live = [p for p in procs if p.left > 0]
        seen.append((step.name, sorted(p.step.name for p in live), sum(p.step.cores for p in live) + step.cores))
        procs.append(Proc(step, durations[step.name]))
        return procs[-1]

    steps = [_step("a", cores=2), _step("b", cores=1), _step("c", cores=1), _step("d", cores=2, after=("a",)),
             _step("e", cores=1, after=("x",))]  # x is not among these steps: not waited for
    codes = release.schedule(steps, 2, launch, poll_s=0)
    assert codes == {"a": 0, "b": 1, "c": 0, "d": 0, "e": 0}  # a failed step does not stop the others
    assert [name for name, _, _ in seen] == ["a", "b", "c", "d", "e"]
    assert all(cores <= 2 for _, _, cores in seen)
    assert seen[1][1] == [] and seen[2][1] == ["b"]  # b and c (one core each) side by side once a has ended
    assert seen[3][1] == []  # d (two cores) once b and c have ended
    assert release.schedule([_step("big", cores=4)], 2, lambda s: Proc(s, 1), poll_s=0) == {"big": 0}


def test_a_rerun_starts_only_the_steps_with_jobs_left_and_writes_a_table_s_provenance_when_it_is_done(
        monkeypatch, tmp_path, capsys):
    records = {"t": [_rec("fedavg", "mnist", "0.5", s) for s in (0, 1)] + [_rec("dense", "mnist", "0.5", s)
                                                                         for s in (0, 1)],
               "u": [_rec("fedavg", "mnist", "0.5", 0, version="0ld0000")]}
    steps = [_step("done", "t"), _step("left", "u")]
    monkeypatch.setattr(release, "load_records", lambda table: records.get(table, []))
    monkeypatch.setattr(release, "release_steps", lambda: steps)
    monkeypatch.setattr(release, "MANIFEST", tmp_path / "RELEASE.toml")
    monkeypatch.setattr(release, "CHANGELOG", tmp_path / "CHANGELOG.md")
    monkeypatch.setattr(release, "RENDER", ())
    launched = []

    class Ended:
        def poll(self):
            return 0

    assert release.run(steps, COMMIT, 2, launch=lambda s: launched.append(s.name) or Ended(), poll_s=0) == 0
    assert launched == ["left"]  # every job of "done" has its record at this commit
    manifest = release.read_manifest()
    assert list(manifest) == ["t"] and manifest["t"]["commit"] == COMMIT and manifest["t"]["records"] == ["t"]
    line = manifest["t"]["provenance"]
    assert line.startswith("Provenance (generated): records t.jsonl") and f"code {COMMIT} (4)" in line
    assert "0 of 4 records from a dirty tree" in line and "2 CPUs (test CPU)" in line
    assert "4 jobs of the release are left; run it again to resume" in capsys.readouterr().out
    # the second table's jobs land: its provenance joins the first's, the CHANGELOG gets the commit
    records["u"] = [_rec(m, "mnist", "0.5", s) for m in ("fedavg", "dense") for s in (0, 1)]
    (tmp_path / "CHANGELOG.md").write_text("# Changelog\n\n## 0.1.0 (unreleased)\n\nTables from commit: not yet\n")
    assert release.run(steps, COMMIT, 2, launch=lambda s: pytest.fail("nothing is left"), poll_s=0) == 0
    assert sorted(release.read_manifest()) == ["t", "u"]
    assert f"Tables from commit: {COMMIT}\n" in (tmp_path / "CHANGELOG.md").read_text()
    assert "Every table is done at abc1234" in capsys.readouterr().out


def test_superseded_records_move_to_the_archive_only_when_asked_and_are_listed_first(tmp_path):
    lines = [json.dumps({"code_version": COMMIT, "seed": 0}), json.dumps({"code_version": "0ld0000", "seed": 0}),
             json.dumps({"code_version": f"{COMMIT}-dirty", "seed": 1}), '{"torn']
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "t.jsonl").write_text(json.dumps({"code_version": "older00"}) + "\n")
    listed = release.archive_superseded(["t", "absent"], COMMIT, move=False, results=tmp_path)
    assert listed == ["t.jsonl: 3 records of 3 other code versions would move to results/archive/t.jsonl, 1 kept"]
    assert (tmp_path / "t.jsonl").read_text() == "\n".join(lines) + "\n"  # nothing moved
    moved = release.archive_superseded(["t"], COMMIT, move=True, results=tmp_path)
    assert moved == ["t.jsonl: 3 records of 3 other code versions moved to results/archive/t.jsonl, 1 kept"]
    assert (tmp_path / "t.jsonl").read_text() == lines[0] + "\n"
    assert (tmp_path / "archive" / "t.jsonl").read_text().splitlines()[1:] == lines[1:]  # appended, as written
    assert release.archive_superseded(["t"], COMMIT, move=True, results=tmp_path) == []


def test_the_changelog_has_the_entry_the_release_command_fills(tmp_path):
    copy = tmp_path / "CHANGELOG.md"
    copy.write_text(release.CHANGELOG.read_text())
    assert len(release.COMMIT_LINE.findall(copy.read_text())) == 1 and release.UNRELEASED in copy.read_text()
    assert release.fill_changelog(COMMIT, copy, today=date(2027, 1, 2))
    text = copy.read_text()
    assert f"Tables from commit: {COMMIT}\n" in text and "## 0.1.0 (2027-01-02)" in text
    assert release.UNRELEASED not in text
    assert not release.fill_changelog(COMMIT, tmp_path / "missing.md")


def test_the_multi_round_table_shows_fedlmds_published_numbers_and_their_setup_beside_ours():
    from benchmarks.render import render_table

    records = [{**_rec(label, "mnist", cell, 0), "round": r, "num_rounds": 2, "accuracy_final": 0.5 + 0.1 * r,
                "table": "multiround_fedlmd"} for label in ("fedavg", "fedlmd") for cell in ("0.1", "2c/c")
               for r in (1, 2)]
    text = render_table("multiround_fedlmd", records)
    rows = [line for line in text.splitlines() if line.startswith("| mnist |")][:4]
    assert rows[1] == "| mnist | 0.1 | 5 | 2 | 70.00 ± 0.00 (1) | 70.00 ± 0.00 (1) | – (n < 2) | 85.19 | 88.61 |"
    assert rows[3].endswith("| 85.41 | 88.48 |")  # FedLMD Table 3a, two label-sorted shards per client
    assert "FedLMD paper columns: K = 100 clients, 10 per round, 200 rounds of E = 5 local epochs" in text
