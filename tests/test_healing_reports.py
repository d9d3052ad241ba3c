"""The healing runners' reports (`experiments.smollm2.heal_carved`, `experiments.smollm2.ladder`): arms measured in an
earlier work folder are kept, new ones added."""

import json

import pytest
from test_reliability import MOHD_BASES

from experiments.smollm2 import heal_carved
from hf_mohd import MoHDConfig


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


def ladder_work(tmp_path):
    """A ladder work folder with heal's and the ladder's training-free records (dense 25 on Wikipedia; 20 and 40
    on two held-out sources)."""
    from experiments.smollm2 import heal

    work = tmp_path / "work"
    work.mkdir()
    students = {name: 100.0 for name in heal.STUDENTS.values()}
    write(work / "prepare.json", {"perplexity": {"teacher": 25.0, **students}, "held_out_tokens": 4096})
    write(work / "ladder_prepare.json", {"mohd75u": {"perplexity": 200.0, "perplexity_full_activation": 25.0}})
    write(work / "ladder_oracle.json", {"mohd75u": {"perplexity_oracle": 150.0}})
    write(
        work / "ladder_sources.json",
        {
            "teacher": {"wikipedia": 20.0, "kjv": 40.0},
            "mohd75ub": {
                "target": {"wikipedia": 80.0, "kjv": 80.0},
                "full_activation": {"wikipedia": 20.0, "kjv": 40.0},
            },
            "mohd50ub": {
                "target": {"wikipedia": 200.0, "kjv": 800.0},
                "full_activation": {"wikipedia": 20.0, "kjv": 40.0},
            },
        },
    )
    return work


def healed(work, name, target, full, **extra):
    write(
        work / f"ladder_{name}.json",
        {
            "perplexity": {"target": target, "full_activation": full},
            "train_cpu_seconds_this_process": 3.0,
            "machine": {"load_average": [2.0, 2.0, 2.0]},
            **extra,
        },
    )


def test_ladder_report_keeps_earlier_arms_and_adds_new_ones(tmp_path):
    """`experiments.smollm2.ladder.report` likewise: a 256k arm healed here (on the multi-source text, measured per
    source) joins the 64k arms recorded earlier (one Wikipedia number each)."""
    from experiments.smollm2 import ladder

    work = ladder_work(tmp_path)
    healed(work, "unit_nested_budgets_256k", {"wikipedia": 40.0, "kjv": 160.0}, {"wikipedia": 21.0, "kjv": 42.0})
    output = tmp_path / "ladder.json"
    earlier_arm = {"student": "mohd75u", "budget_tokens": 65536, "ratio_to_dense": {"target": 3.2}}
    earlier_student = {"from": "mohd50u", "perplexity": 430.0}
    earlier_oracle = {"perplexity": 99.0, "perplexity_oracle": 90.0}
    write(
        output,
        {"arms": {"unit_64k": earlier_arm}, "students": {"mohd50ub": earlier_student, "mohd75": earlier_oracle}},
    )

    result = ladder.report(work, output)

    assert result["arms"]["unit_64k"] == earlier_arm
    assert result["students"]["mohd50ub"] == earlier_student  # kept; mohd75 is measured here and replaced
    # measured here: its numbers replace the recorded ones, the oracle number it did not measure stays
    assert result["students"]["mohd75"] == {"perplexity": 100.0, "ratio_to_dense": 4.0, "perplexity_oracle": 90.0}
    assert result["students"]["mohd75u"] == {
        "perplexity": 200.0,
        "perplexity_full_activation": 25.0,
        "ratio_to_dense": 8.0,
        "perplexity_oracle": 150.0,
        "ratio_to_dense_oracle": 6.0,
    }
    added = result["arms"]["unit_nested_budgets_256k"]
    assert added["student"] == "mohd75ub" and added["budget_tokens"] == 256 * 1024 and added["nested_full_activation"]
    assert added["ratio_to_dense"] == {
        "target": {"wikipedia": 2.0, "kjv": 4.0},
        "full_activation": {"wikipedia": 1.05, "kjv": 1.05},
    }
    assert added["geometric_mean_ratio_to_dense"]["target"] == pytest.approx(8**0.5)  # sqrt(2 x 4)
    assert result["students_per_source"]["mohd50ub"]["ratio_to_dense"]["target"] == {"wikipedia": 10.0, "kjv": 20.0}
    assert "unit_64k" not in result["missing"] and "unit_256k" in result["missing"]
    assert result["best_256k_recipe"] is None and result["curve"]["75%"]["points"] == []  # the ladder is unfinished


def test_ladder_curve_starts_from_the_best_256k_recipe(tmp_path):
    """The curve's recipe is the 256k arm of lowest geometric-mean perplexity over the sources, moved to the 50%
    student of the same kind; the report orders each activation's points by tokens from the training-free student."""
    from experiments.smollm2 import ladder

    work = ladder_work(tmp_path)
    with pytest.raises(SystemExit, match="unit_256k"):
        ladder.resolve(work, "curve50_256k")
    full = {"wikipedia": 20.0, "kjv": 40.0}
    # geometric means of the perplexity: 60, sqrt(30 x 120) = 60, 40 (the best), sqrt(50 x 112.5) = 75, 80, 90
    for name, target in zip(
        ladder.LADDER_256K,
        [(60.0, 60.0), (30.0, 120.0), (40.0, 40.0), (50.0, 112.5), (80.0, 80.0), (90.0, 90.0)],
        strict=True,
    ):
        healed(work, name, dict(zip(("wikipedia", "kjv"), target, strict=True)), full)
    assert ladder.LADDER_256K[2] == "unit_nested_budgets_256k"
    arm, recipe = ladder.resolve(work, "curve50_256k")
    assert recipe == "unit_nested_budgets_256k"
    assert arm == ladder.ARMS[recipe]._replace(student="mohd50ub")
    arm, _ = ladder.resolve(work, "curve75_2m")
    assert arm.student == "mohd75ub" and arm.budget == 2048 * 1024 and arm.nested and arm.corpus
    healed(work, "curve50_256k", {"wikipedia": 60.0, "kjv": 120.0}, full, recipe=recipe, student="mohd50ub")
    # the best arm's healed folder: its config is what the model card renders
    MoHDConfig(**MOHD_BASES["mohd_gqa"]).save_pretrained(work / "runs" / f"ladder_{recipe}" / "final")
    parts = {part: {"wikipedia": 40.0, "kjv": 40.0} for part in ladder.BREAKDOWN}
    parts["attention"] = {"wikipedia": 80.0, "kjv": 160.0}  # ratios 4 and 4
    write(work / f"ladder_breakdown_{recipe}.json", {"arm": recipe, "perplexity": parts})
    allocation = {"budgets": {"0.ffn": 2}, "error": "residual", "tokens": 4096}
    write(
        work / "ladder_budgets.json",
        {
            "mohd75ub": {
                "from": "mohd75u",
                "allocation": allocation,
                "perplexity": 140.0,
                "active_parameters": 10,
                "uniform_active_parameters": 10,
            }
        },
    )

    result = ladder.report(work, tmp_path / "ladder.json")

    assert result["best_256k_recipe"] == recipe
    points75 = result["curve"]["75%"]["points"]
    assert [(p["tokens"], p["arm"]) for p in points75] == [(0, "mohd75ub"), (256 * 1024, recipe)]
    # ratios 40 / 20 = 2 and 40 / 40 = 1 to the dense model: geometric mean sqrt(2)
    assert points75[1]["geometric_mean_ratio_to_dense"]["target"] == pytest.approx(2**0.5)
    points50 = result["curve"]["50%"]["points"]
    assert [(p["tokens"], p["arm"]) for p in points50] == [(0, "mohd50ub"), (256 * 1024, "curve50_256k")]
    assert points50[1]["ratio_to_dense"]["target"] == {"wikipedia": 3.0, "kjv": 3.0}
    assert result["arms"]["curve50_256k"]["recipe"] == recipe
    assert {"curve75_1m", "curve75_2m", "curve50_1m"} <= set(result["missing"])
    # the final models' lm-eval: dense, the largest healed 75% point (the ladder's best) and 50% point
    assert {f"lm-eval {n} (500 docs)" for n in ("dense", recipe, "curve50_256k")} <= set(result["missing"])
    # the plot and the final 75% model's card (the best 256k arm until a longer 75% point is healed)
    assert (tmp_path / "ladder.png").stat().st_size > 0
    card = (tmp_path / "smollm2_mohd75_ladder_model_card.md").read_text(encoding="utf-8")
    assert "| healed 262,144 tokens | 40.0 (2.00x) | 40.0 (1.00x) |" in card
    assert "| converted, training-free | 80.0 (4.00x) | 80.0 (2.00x) |" in card
    assert "| healed, every block active | 20.0 (1.00x) | 40.0 (1.00x) |" in card
    assert "nested: the loss at the target k plus the loss with every block active" in card
    # the student's allocation: its calibration tokens and its error measure, in the conversion's words
    assert "allocated greedily on 4,096 calibration tokens from each sublayer's residual-stream error" in card
    assert "Partial: " in card and "curve75_1m" in card
    # where the loss remains: per part the geometric mean of the ratios to dense (40 / 20, 40 / 40: sqrt(2))
    assert "is attention 4.00x, FFN 1.41x, first third of the layers 1.41x" in card
    assert "(as healed: 1.41x)" in card


def test_ladder_curve_recipe_counts_recorded_arms_and_a_chosen_recipe(tmp_path):
    """On a new work folder the curve's recipe counts the arms the committed report records; with the ladder
    unfinished a curve point heals with a chosen recipe, which the report leaves out of the curve until that recipe
    is the best."""
    from experiments.smollm2 import ladder

    work = ladder_work(tmp_path)
    output = tmp_path / "ladder.json"
    full = {"wikipedia": 20.0, "kjv": 40.0}
    targets = dict(zip(ladder.LADDER_256K, [(60.0, 60.0), (30.0, 120.0), (40.0, 40.0), (50.0, 112.5)], strict=False))
    # four arms recorded by an earlier work folder (geometric means 60, 60, 40, 75), the last two not healed anywhere
    recorded = {
        name: {
            "perplexity": {"target": {"wikipedia": wikipedia, "kjv": kjv}, "full_activation": full},
            "ratio_to_dense": {
                "target": {"wikipedia": wikipedia / 20, "kjv": kjv / 40},
                "full_activation": {"wikipedia": 1.0, "kjv": 1.0},
            },
        }
        for name, (wikipedia, kjv) in targets.items()
    }
    write(output, {"arms": recorded})
    *others, last = ladder.LADDER_256K[4:]
    with pytest.raises(SystemExit, match=f"heal these first: {', '.join([*others, last])} .*--recipe"):
        ladder.resolve(work, "curve50_256k", output)
    with pytest.raises(SystemExit, match="expected an arm of the 256k ladder"):
        ladder.resolve(work, "curve50_256k", output, "curve75_1m")
    arm, recipe = ladder.resolve(work, "curve50_256k", output, "unit_nested_budgets_256k")
    assert recipe == "unit_nested_budgets_256k" and arm.student == "mohd50ub" and arm.budget == 256 * 1024
    healed(work, "curve50_256k", {"wikipedia": 60.0, "kjv": 120.0}, full, recipe=recipe, student="mohd50ub")

    # the ladder unfinished: the point is measured but not on the curve
    result = ladder.report(work, output)
    assert result["arms"]["curve50_256k"]["recipe"] == recipe
    assert [p["arm"] for p in result["curve"]["50%"]["points"]] == []
    assert "curve50_256k (healed with unit_nested_budgets_256k; the 256k ladder is unfinished)" in result["missing"]

    # the unhealed arms healed here, the last one better (geometric mean 30): the point's recipe is not the best one
    for name in others:
        healed(work, name, {"wikipedia": 80.0, "kjv": 80.0}, full)
    healed(work, last, {"wikipedia": 30.0, "kjv": 30.0}, full)
    assert ladder.best_recipe(work, output) == last
    with pytest.raises(SystemExit, match=f"names {last} as the best recipe"):
        ladder.resolve(work, "curve50_1m", output, recipe)
    result = ladder.report(work, output)
    # the curve's 50% student is now the best arm's (its 0-token point only where `sources` measured it)
    assert result["best_256k_recipe"] == last
    assert result["curve"]["50%"]["student"] == ladder.ARMS[last].student.replace("75", "50", 1)
    assert "curve50_256k" not in [p["arm"] for p in result["curve"]["50%"]["points"]]
    assert f"curve50_256k (healed with {recipe}; the best recipe is {last})" in result["missing"]

    # the last arm worse (geometric mean 80): the chosen recipe is the best and the point joins the curve
    healed(work, last, {"wikipedia": 80.0, "kjv": 80.0}, full)
    assert ladder.best_recipe(work, output) == recipe
    result = ladder.report(work, output)
    assert [(p["tokens"], p["arm"]) for p in result["curve"]["50%"]["points"]] == [
        (0, "mohd50ub"),
        (256 * 1024, "curve50_256k"),
    ]
    assert not any(entry.startswith("curve50_256k") for entry in result["missing"])


def test_ladder_breakdown_sets_one_part_to_full_activation(tmp_path, monkeypatch):
    """`ladder.breakdown`: each part of the network at k = N_r and every other sublayer at its own k (per-layer
    budgets kept) gives the perplexity of a model whose config asks for exactly that; the parts are the sublayer
    kinds and the thirds of the layers."""
    import torch
    import transformers

    from experiments.smollm2 import ladder
    from hf_mohd import MoHDForCausalLM
    from hf_mohd.evaluation.perplexity import perplexity

    layers = range(30)
    third = {part: [i for i in layers if ladder.BREAKDOWN[part](i, "ffn", 30)] for part in list(ladder.BREAKDOWN)[2:]}
    assert third == {
        "first third of the layers": list(range(10)),
        "middle third of the layers": list(range(10, 20)),
        "last third of the layers": list(range(20, 30)),
    }
    # three layers, k = 2 of N_r = 5 routed blocks, layer 1's attention at its own k = 1
    own = {(i, s): 2 for i in range(3) for s in ("attention", "ffn")}
    own[(1, "attention")] = 1
    base = dict(
        MOHD_BASES["mohd_gqa"], num_hidden_layers=3, per_layer_config={1: {"attention_routed_sub_dims_per_tok": 1}}
    )
    torch.manual_seed(0)
    work = ladder_work(tmp_path)
    final = work / "runs" / "ladder_curve50_256k" / "final"
    MoHDForCausalLM(MoHDConfig(**base)).save_pretrained(final)
    vocab = base["vocab_size"]
    windows = {"a": torch.randint(vocab, (4, 16)), "b": torch.randint(vocab, (4, 16))}
    monkeypatch.setattr(ladder, "source_windows", lambda corpus, tokenizer: windows)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: None)

    ladder.breakdown(work, "curve50_256k", tmp_path / "corpus")

    found = json.loads((work / "ladder_breakdown_curve50_256k.json").read_text(encoding="utf-8"))
    assert list(found["perplexity"]) == list(ladder.BREAKDOWN)
    state = MoHDForCausalLM.from_pretrained(final).state_dict()
    for part, member in ladder.BREAKDOWN.items():
        per_layer = {
            i: {f"{s}_routed_sub_dims_per_tok": 5 if member(i, s, 3) else own[(i, s)] for s in ("attention", "ffn")}
            for i in range(3)
        }
        oracle = MoHDForCausalLM(MoHDConfig(**{**base, "per_layer_config": per_layer})).eval()
        oracle.load_state_dict(state)
        for source, ids in windows.items():
            assert found["perplexity"][part][source] == pytest.approx(perplexity(oracle, ids, 4), rel=1e-5), part
    # the parts differ from one another (a part left at its own k would repeat another's number)
    assert len({round(ppl["a"], 6) for ppl in found["perplexity"].values()}) == len(ladder.BREAKDOWN)


def test_ladder_report_breakdown_share_of_the_gap(tmp_path):
    """The report's breakdown: per part the ratio to dense per source, its geometric mean and the share of the log
    gap to dense that the part at full activation closes (hand-computed)."""
    from experiments.smollm2 import ladder

    work = ladder_work(tmp_path)
    full = {"wikipedia": 20.0, "kjv": 40.0}
    healed(work, "curve50_256k", {"wikipedia": 80.0, "kjv": 80.0}, full, recipe="unit_nested_256k", student="mohd50u")
    parts = {part: {"wikipedia": 80.0, "kjv": 80.0} for part in ladder.BREAKDOWN}
    parts["ffn"] = {"wikipedia": 40.0, "kjv": 40.0}
    write(work / "ladder_breakdown_curve50_256k.json", {"arm": "curve50_256k", "perplexity": parts})

    result = ladder.report(work, tmp_path / "ladder.json")

    row = result["breakdown"]["curve50_256k"]
    # as healed: ratios 4 and 2, geometric mean sqrt(8); FFN at full activation: ratios 2 and 1, sqrt(2)
    assert row["at_own_k"] == pytest.approx(8**0.5)
    ffn = row["parts"]["ffn"]
    assert ffn["ratio_to_dense"] == {"wikipedia": 2.0, "kjv": 1.0}
    assert ffn["geometric_mean_ratio_to_dense"] == pytest.approx(2**0.5)
    # log(sqrt(8) / sqrt(2)) / log(sqrt(8)) = log 2 / (1.5 log 2)
    assert ffn["share_of_log_gap_closed"] == pytest.approx(2 / 3)
    assert row["parts"]["attention"]["share_of_log_gap_closed"] == pytest.approx(0.0)


def test_ladder_curve_point_heals_anew_when_the_recipe_changes(tmp_path, monkeypatch):
    """A curve point healed with a recipe that is no longer the best: `train` moves its record, run folder, lm-eval
    and breakdown files to off_recipe/RECIPE/ (and unevaluated checkpoints of another recipe to
    off_recipe/unrecorded_from_STUDENT/, while checkpoints of its own recipe resume) before healing anew; the report
    tags the point's rows with their recipe and, once the point is healed anew, keeps the superseded rows under
    "off_recipe", even when the new lm-eval and breakdown are measured before the next report."""
    from experiments.smollm2 import heal, ladder
    from hf_mohd.training import train_config_from_dict

    work = ladder_work(tmp_path)
    output = tmp_path / "ladder.json"
    full = {"wikipedia": 20.0, "kjv": 40.0}
    *others, last = ladder.LADDER_256K
    old = "unit_nested_budgets_256k"
    for name in others:
        healed(work, name, {"wikipedia": 40.0, "kjv": 80.0} if name == old else {"wikipedia": 80.0, "kjv": 80.0}, full)
    healed(work, "curve50_256k", {"wikipedia": 60.0, "kjv": 120.0}, full, recipe=old, student="mohd50ub")
    (work / "runs" / "ladder_curve50_256k" / "final").mkdir(parents=True)

    def lm_eval_file(scores):
        per_doc = {"piqa": {"metric": "acc_norm", "scores": scores}}
        write(
            work / "lm_eval_curve50_256k_500.json",
            {"arm": "curve50_256k", "limit": 500, "cpu_seconds": 1.0, "per_doc": per_doc},
        )

    def breakdown_file(ppl):
        parts = {part: {"wikipedia": ppl, "kjv": 2 * ppl} for part in ladder.BREAKDOWN}
        write(work / "ladder_breakdown_curve50_256k.json", {"arm": "curve50_256k", "perplexity": parts})

    lm_eval_file([1, 0, 0, 1])
    breakdown_file(60.0)

    # the last arm not healed: the old recipe is the best, the point's rows carry it
    healed(work, last, {"wikipedia": 80.0, "kjv": 80.0}, full)
    result = ladder.report(work, output)
    assert result["best_256k_recipe"] == old
    assert result["lm_eval"]["curve50_256k (500 docs)"]["recipe"] == old
    assert result["breakdown"]["curve50_256k"]["recipe"] == old
    assert result["off_recipe"] == {}

    # the last arm turns out the best: the point stays under its name, off the curve, until healed anew
    healed(work, last, {"wikipedia": 30.0, "kjv": 30.0}, full)
    result = ladder.report(work, output)
    assert result["best_256k_recipe"] == last and result["arms"]["curve50_256k"]["recipe"] == old
    assert result["lm_eval"]["curve50_256k (500 docs)"]["recipe"] == old and result["off_recipe"] == {}

    new_student = ladder.ARMS[last].student.replace("75", "50", 1)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    started = []

    def run_healing(values):
        started.append(values)
        raise KeyboardInterrupt  # stop where training would begin

    monkeypatch.setattr(heal, "run_healing", run_healing)
    # nothing moves while the new student or the healing text is missing
    with pytest.raises(SystemExit, match=new_student):
        ladder.train_arm(work, "curve50_256k", corpus)
    for student in (new_student, ladder.ARMS[last].student):
        (work / student).mkdir()
        config = {"num_routed_sub_dims_per_tok": 2, "num_sub_dims": 12, "num_shared_sub_dims": 2}
        write(work / student / "config.json", config)
    with pytest.raises(SystemExit, match="healing.jsonl"):
        ladder.train_arm(work, "curve50_256k", corpus)
    assert (work / "ladder_curve50_256k.json").exists() and not (work / "off_recipe").exists()
    (corpus / "healing.jsonl").write_text('{"text": "a"}\n', encoding="utf-8")

    with pytest.raises(KeyboardInterrupt):
        ladder.train_arm(work, "curve50_256k", corpus)
    retired = work / "off_recipe" / old
    for relative in ("ladder_curve50_256k.json", "runs/ladder_curve50_256k/final", "lm_eval_curve50_256k_500.json"):
        assert (retired / relative).exists() and not (work / relative).exists(), relative
    assert (retired / "ladder_breakdown_curve50_256k.json").exists()
    assert started[-1]["model"]["init_from"] == str(work / new_student)

    # checkpoints of curve75_1m: its own recipe (the work folder reached by another path) resumes, another
    # recipe's (the old student, never evaluated) is retired
    with pytest.raises(KeyboardInterrupt):
        ladder.train_arm(work, "curve75_1m", corpus)
    run75 = work / "runs" / "ladder_curve75_1m"
    saved = train_config_from_dict(started[-1]).to_dict()
    saved["model"]["init_from"] = str(work.parent / ".." / work.parent.name / work.name / ladder.ARMS[last].student)
    (run75 / "checkpoints" / "step_0000016").mkdir(parents=True)
    write(run75 / "train_config.json", saved)
    with pytest.raises(KeyboardInterrupt):
        ladder.train_arm(work, "curve75_1m", corpus)
    assert run75.is_dir() and not (work / "off_recipe" / f"unrecorded_from_{ladder.ARMS[last].student}").exists()
    saved["model"]["init_from"] = str(work / "mohd75ub")
    write(run75 / "train_config.json", saved)
    with pytest.raises(KeyboardInterrupt):
        ladder.train_arm(work, "curve75_1m", corpus)
    assert (work / "off_recipe" / "unrecorded_from_mohd75ub" / "runs" / "ladder_curve75_1m" / "checkpoints").is_dir()
    assert not run75.exists() and started[-1]["model"]["init_from"] == str(work / ladder.ARMS[last].student)

    # healed anew, its lm-eval and a part of its breakdown measured before the next report: the old rows move
    # under "off_recipe", the new lm-eval row takes the name (the unfinished breakdown not yet)
    healed(work, "curve50_256k", {"wikipedia": 40.0, "kjv": 80.0}, full, recipe=last, student=new_student)
    lm_eval_file([1, 1, 1, 0])
    write(work / "ladder_breakdown_curve50_256k.json", {"arm": "curve50_256k", "perplexity": {"ffn": full}})
    result = ladder.report(work, output)
    assert result["arms"]["curve50_256k"]["recipe"] == last
    now = result["lm_eval"]["curve50_256k (500 docs)"]
    assert now["recipe"] == last and now["tasks"]["piqa"]["accuracy_points"] == 75.0
    assert "curve50_256k" not in result["breakdown"]
    superseded = result["off_recipe"]["curve50_256k"][old]
    assert superseded["arm"]["ratio_to_dense"]["target"] == {"wikipedia": 3.0, "kjv": 3.0}
    assert superseded["lm_eval"]["tasks"]["piqa"]["accuracy_points"] == 50.0
    assert superseded["breakdown"]["at_own_k"] == pytest.approx(3.0)
    # and they stay there in later reports, beside the finished new breakdown
    breakdown_file(40.0)
    later = ladder.report(work, output)
    assert later["off_recipe"] == result["off_recipe"]
    assert later["breakdown"]["curve50_256k"]["recipe"] == last
    assert later["breakdown"]["curve50_256k"]["at_own_k"] == pytest.approx(2.0)
    # the final 75% model's card (the best arm, from the output-KL student) names its allocation measure
    MoHDConfig(**MOHD_BASES["mohd_gqa"]).save_pretrained(work / "runs" / f"ladder_{last}" / "final")
    with pytest.raises(SystemExit, match="no allocation recorded"):
        ladder.report(work, output)
    allocation = {"budgets": {"0.ffn": 2}, "error": "output", "tokens": 4096}
    record = {"from": "mohd75u", "allocation": allocation, "perplexity": 120.0}
    write(
        work / "ladder_budgets.json", {"mohd75ubo": {**record, "active_parameters": 1, "uniform_active_parameters": 1}}
    )
    ladder.report(work, output)
    card = (tmp_path / "smollm2_mohd75_ladder_model_card.md").read_text(encoding="utf-8")
    assert "4,096 calibration tokens from the KL divergence of the model's next-token distribution" in card


def test_ladder_budgets_reuse_the_allocation_the_report_records(tmp_path, monkeypatch):
    """`ladder.budgets` with a report that records a budgeted student's allocation (same base student and error
    measure) applies it without measuring: the saved student has exactly the recorded k per sublayer; a student the
    report does not record is allocated as before; a recorded allocation whose active parameters differ from the
    student's stops the stage."""
    import torch
    import transformers

    from experiments.smollm2 import heal, ladder
    from hf_mohd import MoHDForCausalLM
    from hf_mohd.conversion.mohd import budgets as budgets_module

    class Tokenizer:
        def save_pretrained(self, folder):
            pass

    base = dict(MOHD_BASES["mohd_gqa"], routed_gate="unit")  # N_r = 5 routed blocks, k = 2
    work = tmp_path / "work"
    torch.manual_seed(0)
    for student in ("mohd75u", "mohd50u"):
        MoHDForCausalLM(MoHDConfig(**base)).save_pretrained(work / student)
    vocab = base["vocab_size"]
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: Tokenizer())
    monkeypatch.setattr(heal, "held_out_windows", lambda tokenizer: torch.randint(vocab, (4, 16)))
    monkeypatch.setattr(ladder, "calibration_ids", lambda work, tokenizer: torch.randint(vocab, (4, 16)))
    recorded = {"0.attention": 1, "0.ffn": 4, "1.attention": 3, "1.ffn": 1}
    # the active parameters of that allocation, from the config it gives
    per_layer = {0: {"attention_routed_sub_dims_per_tok": 1, "ffn_routed_sub_dims_per_tok": 4}}
    per_layer[1] = {"attention_routed_sub_dims_per_tok": 3, "ffn_routed_sub_dims_per_tok": 1}
    active = MoHDConfig(**base, per_layer_config=per_layer).num_active_parameters()
    students = {
        name: {"from": ladder.BUDGETED[name][0], "budgets": recorded, "allocation_error": "output"}
        | {"allocation_tokens": 4096, "active_parameters": active}
        for name in ("mohd75ubo", "mohd50ubo")
    }
    output = tmp_path / "report.json"
    write(output, {"students": students})
    measured = []
    allocate = budgets_module.allocate_routed_sub_dims

    def counting(model, calibration, k, error="residual", progress=None):
        measured.append(error)
        return allocate(model, calibration, k, error=error, progress=progress)

    monkeypatch.setattr(budgets_module, "allocate_routed_sub_dims", counting)

    ladder.budgets(work, output)

    assert measured == ["residual", "residual"]  # mohd75ub and mohd50ub; the two output-KL ones are reused
    found = json.loads((work / "ladder_budgets.json").read_text(encoding="utf-8"))
    for name in ("mohd75ubo", "mohd50ubo"):
        assert found[name]["allocation"]["budgets"] == recorded and found[name]["active_parameters"] == active
        assert found[name]["allocation_recorded_in"] == "report.json"
        saved = MoHDForCausalLM.from_pretrained(work / name).config.to_dict()["per_layer_config"]
        assert saved == {str(i): entries for i, entries in per_layer.items()}
    assert "allocation_recorded_in" not in found["mohd75ub"]
    # a record that does not fit the student (another parameter count) stops the stage instead of saving it
    (work / "ladder_budgets.json").unlink()
    write(output, {"students": {"mohd75ubo": {**students["mohd75ubo"], "active_parameters": active + 1}}})
    with pytest.raises(SystemExit, match="active parameters here against"):
        ladder.budgets(work, output)
