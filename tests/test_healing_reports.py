"""The healing runners' reports (`experiments.smollm2.heal_carved`, `experiments.smollm2.ladder`): arms measured in an
earlier work folder are kept, new ones added."""

import json

from experiments.smollm2 import heal_carved


def write(path, value):
    path.write_text(json.dumps(value), encoding="utf-8")


def test_report_keeps_earlier_arms_and_adds_new_ones(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    dense = {"wikipedia": 20.0, "kjv": 40.0}
    write(work / "prepare.json", {"dense": dense})
    # a new arm measured in this work folder
    new = {"wikipedia": 30.0, "kjv": 50.0}
    write(
        work / "carved75_1m.json",
        {
            "perplexity": {"target": new, "every_expert_active": dense},
            "train_cpu_seconds_this_process": 12.5,
            "resumed": True,
            "machine": {"load_average": [1.0, 1.0, 1.0]},
        },
    )
    # the committed result of an earlier work folder: one arm this folder does not hold, and a stale lm-eval row
    output = tmp_path / "result.json"
    earlier_arm = {"carving": "carved75", "budget_tokens": 262144, "ratio_to_dense": {"target": {"wikipedia": 1.29}}}
    earlier_row = {"documents": 500, "tasks": {}, "mean_accuracy_points": 45.1}
    write(output, {"arms": {"carved75_256k": earlier_arm}, "lm_eval": {"dense (500 docs)": earlier_row}})

    result = heal_carved.report(work, output)

    assert result["arms"]["carved75_256k"] == earlier_arm  # kept as recorded
    added = result["arms"]["carved75_1m"]
    assert added["budget_tokens"] == 1024 * 1024
    assert added["ratio_to_dense"]["target"] == {"wikipedia": 1.5, "kjv": 1.25}
    assert added["ratio_to_dense"]["every_expert_active"] == {"wikipedia": 1.0, "kjv": 1.0}
    assert result["lm_eval"]["dense (500 docs)"] == earlier_row
    # neither the kept arm nor the kept lm-eval row is missing; arms never measured anywhere are
    assert "carved75_256k" not in result["missing"] and "lm-eval dense (500 docs)" not in result["missing"]
    assert {"carved75_128k", "carved50_1m", "lm-eval carved75_1m (500 docs)"} <= set(result["missing"])
    assert not result["complete"]
    assert json.loads(output.read_text(encoding="utf-8"))["arms"]["carved75_1m"] == added


def test_ladder_report_keeps_earlier_arms_and_adds_new_ones(tmp_path):
    """`experiments.smollm2.ladder.report` likewise: a 256k arm healed here joins the 64k arms recorded earlier."""
    from experiments.smollm2 import heal, ladder

    work = tmp_path / "work"
    work.mkdir()
    students = {name: 100.0 for name in heal.STUDENTS.values()}
    write(work / "prepare.json", {"perplexity": {"teacher": 25.0, **students}, "held_out_tokens": 4096})
    write(work / "ladder_prepare.json", {})
    write(
        work / "ladder_unit_nested_budgets_256k.json",
        {
            "perplexity": {"target": 50.0, "full_activation": 26.0},
            "train_cpu_seconds_this_process": 3.0,
            "machine": {"load_average": [2.0, 2.0, 2.0]},
        },
    )
    output = tmp_path / "ladder.json"
    earlier_arm = {"student": "mohd75u", "budget_tokens": 65536, "ratio_to_dense": {"target": 3.2}}
    write(output, {"arms": {"unit_64k": earlier_arm}})

    result = ladder.report(work, output)

    assert result["arms"]["unit_64k"] == earlier_arm
    added = result["arms"]["unit_nested_budgets_256k"]
    assert added["student"] == "mohd75ub" and added["budget_tokens"] == 256 * 1024 and added["nested_full_activation"]
    assert added["ratio_to_dense"] == {"target": 2.0, "full_activation": 1.04}
    assert "unit_64k" not in result["missing"] and "unit_256k" in result["missing"]
