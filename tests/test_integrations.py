"""The tools users already have, on both families: `transformers.Trainer` fine-tuning on real text (aux loss in the
loss), `pipeline("text-generation")`, and lm-evaluation-harness's own CLI on a saved folder (offline, local task).

Real text: the Wikipedia sample that the `gensim` wheel ships (`gensim/test/test_data/enwiki-latest-pages-articles1
.xml-...-shortened.bz2`, CC BY-SA), read and cleaned by `hf_mohd.corpora` (docs/design.md section 8).
"""

import glob
import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM, MoHDConfig, MoHDForCausalLM
from hf_mohd.model_card import render_model_card
from hf_mohd.training.data import pack, train_bpe_tokenizer


SEQ_LEN = 64


def wiki_articles(count: int) -> list[str]:
    """The first `count` articles of gensim's Wikipedia sample, as plain text (`hf_mohd.corpora`)."""
    if importlib.util.find_spec("gensim") is None:
        pytest.skip("gensim (the `demo` extra) carries the real text sample")
    from hf_mohd.corpora import wikipedia_articles

    return [article.text for article in wikipedia_articles()[:count]]


@pytest.fixture(scope="module")
def corpus():
    """Tokenizer trained on 3 articles; training blocks from the first two, held-out blocks from the third."""
    articles = wiki_articles(3)
    tokenizer = train_bpe_tokenizer(articles[:2], vocab_size=512)
    return tokenizer, pack(articles[:2], tokenizer, SEQ_LEN), pack(articles[2:], tokenizer, SEQ_LEN)[:8]


def build(family: str, tokenizer, **kw):
    torch.manual_seed(0)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **kw,
    )
    if family == "mohd":
        return MoHDForCausalLM(MoHDConfig(**common))
    config = LatentMoEConfig(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_latent_size=32, **common
    )
    return LatentMoEForCausalLM(config)


def router_weights(model) -> list[torch.Tensor]:
    return [
        p.detach().clone() for n, p in model.named_parameters() if n.endswith(("router.weight", "mlp.gate.weight"))
    ]


@pytest.mark.parametrize("family", ["mohd", "latent_moe"])
def test_trainer_fine_tunes_with_the_aux_loss(tmp_path, corpus, family):
    from transformers import Trainer, TrainingArguments, default_data_collator

    tokenizer, train_blocks, eval_blocks = corpus
    model = build(family, tokenizer, output_router_logits=True, router_aux_loss_coef=0.05)

    # The loss Trainer optimises is the LM loss plus coef * aux loss (router load balance).
    batch = train_blocks[:4]
    out = model(input_ids=batch, labels=batch)
    lm_loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())
    assert out.aux_loss is not None and out.aux_loss > 0
    torch.testing.assert_close(out.loss, lm_loss + 0.05 * out.aux_loss, rtol=1e-5, atol=1e-5)

    train = [{"input_ids": b, "labels": b} for b in train_blocks[:80]]
    held_out = [{"input_ids": b, "labels": b} for b in eval_blocks]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=10,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        learning_rate=1e-2,
        warmup_steps=2,
        logging_steps=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=train, eval_dataset=held_out, data_collator=default_data_collator
    )
    routers_before = router_weights(model)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert after < before - 0.5, f"held-out loss {before:.3f} -> {after:.3f}"
    assert logged[-1] < logged[0], logged
    assert all(not torch.equal(a, b) for a, b in zip(routers_before, router_weights(model), strict=True))


@pytest.mark.parametrize("family", ["mohd", "latent_moe"])
def test_text_generation_pipeline_from_a_saved_folder(tmp_path, corpus, family):
    from transformers import pipeline

    tokenizer = corpus[0]
    model = build(family, tokenizer).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompt = "Anarchism is a political philosophy"
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    text = generator(prompt, max_new_tokens=8, do_sample=False, return_full_text=True)[0]["generated_text"]

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert expected.shape[1] > ids.shape[1]
    assert text == tokenizer.decode(expected[0], skip_special_tokens=True)


TASK_YAML = """\
task: hf_mohd_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

DOCS = [
    {"context": "Anarchism is a political", "choices": [" philosophy", " river", " number"], "label": 0},
    {"context": "The state is undesirable, unnecessary, and", "choices": [" harmful", " blue"], "label": 0},
    {"context": "Autism is a", "choices": [" disorder", " mountain", " song"], "label": 0},
    {"context": "The term anarchism is a compound", "choices": [" word", " engine"], "label": 0},
]


def loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context), split as lm-eval's HFLM does: encode the whole, drop the context tokens."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    n_context = len(tokenizer(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logprobs = model(torch.tensor([whole])).logits.float().log_softmax(-1)[0]
    return sum(logprobs[i - 1, whole[i]].item() for i in range(n_context, len(whole)))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mohd", "latent_moe"])
def test_lm_eval_cli_evaluates_a_saved_folder_offline(tmp_path, corpus, family):
    tokenizer = corpus[0]
    model = build(family, tokenizer).eval()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "data.json").write_text(json.dumps(DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny.yaml").write_text(TASK_YAML.format(data=tmp_path / "data.json"))

    cli = os.path.join(os.path.dirname(sys.executable), "lm-eval")
    command = [cli, "run"] if os.path.exists(cli) else [os.path.join(os.path.dirname(sys.executable), "lm_eval")]
    proc = subprocess.run(
        command
        + ["--model", "hf", "--model_args", f"pretrained={tmp_path / 'model'},trust_remote_code=True,dtype=float32"]
        + ["--tasks", "hf_mohd_tiny_choice", "--include_path", str(tmp_path / "tasks"), "--device", "cpu"]
        + ["--batch_size", "4", "--output_path", str(tmp_path / "out"), "--log_samples"],
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, textwrap.shorten(proc.stderr[-4000:], 4000)
    (results_file,) = glob.glob(str(tmp_path / "out" / "*" / "results_*.json"))
    (samples_file,) = glob.glob(str(tmp_path / "out" / "*" / "samples_*.jsonl"))
    results = json.loads(open(results_file).read())
    samples = [json.loads(line) for line in open(samples_file)]

    # Each logged log-likelihood is the model's own log p(choice | context): the CLI ran this model.
    correct = 0
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        doc = DOCS[sample["doc_id"]]
        ours = [loglikelihood(model, tokenizer, doc["context"], choice) for choice in doc["choices"]]
        theirs = [float(resp[0]) for resp in sample["filtered_resps"]]
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(ours, theirs, strict=True)), (ours, theirs)
        correct += int(max(range(len(ours)), key=ours.__getitem__) == doc["label"])
    acc = results["results"]["hf_mohd_tiny_choice"]["acc,none"]
    assert acc == correct / len(DOCS)

    # The CLI's results file goes straight into the model card's model-index.
    card = render_model_card(model, eval_results=results, repo_id=f"tester/{family}-tiny")
    (entry,) = card.data.eval_results
    assert (entry.dataset_name, entry.metric_type, entry.metric_value) == ("hf_mohd_tiny_choice", "acc", acc)


def test_python_dash_m_runs_the_cli(tmp_path):
    """`python -m hf_mohd` is the `hf-mohd` command: same output for a real sub-command, same exit status."""
    import subprocess
    import sys

    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4).save_pretrained(
        tmp_path
    )
    command = ["accounting", str(tmp_path / "config.json"), "--preset", "compression_50"]
    as_module = subprocess.run([sys.executable, "-m", "hf_mohd", *command], capture_output=True, text=True, check=True)
    as_script = subprocess.run(
        [sys.executable, "-c", "import sys; from hf_mohd.cli import main; sys.exit(main(sys.argv[1:]))", *command],
        capture_output=True,
        text=True,
        check=True,
    )
    assert as_module.stdout == as_script.stdout and as_module.stdout.strip()
    assert "compression_50" in as_module.stdout or "activated" in as_module.stdout.lower()
    assert subprocess.run([sys.executable, "-m", "hf_mohd"], capture_output=True).returncode == 2  # no sub-command
    import hf_mohd

    version = subprocess.run([sys.executable, "-m", "hf_mohd", "--version"], capture_output=True, text=True)
    assert (version.returncode, version.stdout.strip()) == (0, f"hf-mohd {hf_mohd.__version__}")


def test_repository_cites_only_what_it_ships():
    """Code and docs cite papers and the repository's own files (docs/design.md), never a design file, a workspace
    folder or an issue tracker outside the repository, which a reader of a clone or of a Hub checkpoint cannot open."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    outside = re.compile("DESIGN" + r" section|\.\./" + "shared|[Ii]ssue" + r" [0-9]+")
    folders = ("hf_mohd", "conversion", "tests", "bench", "experiments", "configs", "model_cards", "scripts", "docs")
    files = [root / "README.md", *(p for f in folders for p in (root / f).rglob("*") if p.is_file())]
    hits = []
    for path in files:
        if path.suffix not in {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt"}:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if outside.search(line):
                hits.append(f"{path.relative_to(root)}:{number}: {line.strip()[:100]}")
    assert (root / "docs" / "design.md").is_file()
    assert not hits, "\n".join(hits)
