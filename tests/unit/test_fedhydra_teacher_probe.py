"""experiments/fedhydra_teacher: the report section on expel's two signals, from hand-made records."""

from __future__ import annotations

import torch

from experiments import fedhydra_teacher as ft


def test_expel_section_lists_each_clients_signals_beside_the_fleets_median():
    signals = {"rejected_share": [0.93, 0.54, 0.57], "claim_recognition": [0.0, 0.187, 0.284],
               "expelled": [True, False, False]}
    records = {("grey-x-flip", "ms", "batch", True): {"expel_signals": signals},
               ("grey-x-flip", "ms", "fixed-ms", True): {"expel_signals": signals},
               ("grey-y", "ms", "batch", True): {}}  # a record from before the signals were kept: no row
    lines = ft.expel_section(records)
    assert lines[-1] == "| grey-x-flip | 0.187 | 0: 0.93 / 0.000 **out** · 1: 0.54 / 0.187 · 2: 0.57 / 0.284 |"
    assert sum(line.startswith("| grey-") for line in lines) == 1
    assert ">= 0.6" in lines[3] and "< 0.5 x" in lines[3]
    assert ft.expel_section({("grey-y", "ms", "batch", True): {}}) == []


def test_expel_signals_are_the_robust_recipes_check_on_the_whole_fleet():
    torch.manual_seed(0)
    m, c, s = 3, 2, 4
    logits = torch.randn(m, m, c, s, c)
    logits[0, :, :, :, :] = torch.tensor([4.0, -4.0])  # judge 0 calls every image class 0
    cache = {"u": torch.rand(c, m) + 0.1, "ms_logits": logits}
    sig = ft.expel_signals(cache)
    check = ft.weigh(cache["u"], ft.peer_probs(logits), ft.RECIPES["robust"]).check
    assert sig["rejected_share"] == check.rejected_share.tolist()
    assert sig["claim_recognition"] == check.claim_recognition.tolist()
    assert sig["expelled"] == check.expelled.tolist() and len(sig["expelled"]) == m


def test_a_fleet_record_expands_to_one_row_per_score_and_calibration_with_the_fleets_fields():
    record = {"fleet": "grey-x", "expel": True, "recall": [[1.0]], "code_version": "abc",
              "rows": [{"score": "ms", "calibration": "batch", "teacher_accuracy": 0.9},
                       {"score": "ms", "calibration": "fixed-ms", "teacher_accuracy": 0.8}]}
    rows = ft.score_rows(record)
    assert rows == [{"fleet": "grey-x", "expel": True, "recall": [[1.0]], "code_version": "abc", "score": "ms",
                     "calibration": "batch", "teacher_accuracy": 0.9},
                    {"fleet": "grey-x", "expel": True, "recall": [[1.0]], "code_version": "abc", "score": "ms",
                     "calibration": "fixed-ms", "teacher_accuracy": 0.8}]


def test_noise_lines_list_each_server_seed_and_the_spread_only_where_a_fleet_has_several():
    def rec(acc):
        return {"accuracy_final": acc}
    reseeded = {("grey-x", "running-ms", 100): rec(0.80), ("grey-x", "running-ms", 101): rec(0.83),
                ("grey-x", "running-ms", 102): rec(0.77), ("grey-y", "running-ms", 100): rec(0.5)}
    lines = ft.noise_lines(reseeded)
    # 80, 83, 77: range 6.00, sample std sqrt(((0)^2 + 3^2 + 3^2) / 2) = 3.00
    assert lines[-1] == ("- grey-x (running-ms): server seed 100: 80.00, server seed 101: 83.00, "
                         "server seed 102: 77.00; range 6.00, std 3.00")
    assert sum(line.startswith("- ") for line in lines) == 1
    assert ft.noise_lines({("grey-y", "running-ms", 100): rec(0.5)}) == []


def test_noise_lines_give_a_leave_one_out_gain_over_the_server_seeds_both_fleets_have():
    def rec(acc):
        return {"accuracy_final": acc}
    reseeded = {("grey-x", "running-ms", 100): rec(0.80), ("grey-x", "running-ms", 101): rec(0.82),
                ("grey-x", "running-ms", 102): rec(0.90),  # the minus fleet has no seed 102: left out of the mean
                ("grey-x-minus5", "running-ms", 100): rec(0.83), ("grey-x-minus5", "running-ms", 101): rec(0.84)}
    lines = ft.noise_lines(reseeded)
    # (83 + 84) / 2 = 83.50 against (80 + 82) / 2 = 81.00: +2.50
    assert lines[-1] == ("- grey-x-minus5 (running-ms): 83.50 against 81.00 with every client over server seeds "
                         "100, 101: +2.50")
