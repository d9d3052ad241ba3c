"""TRL's trainers (the pinned TRL 1.16.0) on both families, through `hf_mohd.training.trl.prepare_trl_trainer`:
`SFTTrainer` and `DPOTrainer`, full and LoRA (LatentMoE's 3-D experts through `target_parameters`), train with the
model's own load-balance loss (oracle: the model's own forward with labels on the same batch), or with router-bias
updates and no loss for sigmoid routing; the saved config is the one the model was built with, and the result reloads
with `AutoModelForCausalLM` and generates. Full tier: each case trains for a few steps."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_mohd import LatentMoEConfig, LatentMoEForCausalLM, MoHDConfig, MoHDForCausalLM
from hf_mohd.lora import lora_targets
from hf_mohd.training.data import train_bpe_tokenizer


trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow

TEXT = [
    "The river rises in the hills and flows north to the sea.",
    "Every token activates the shared sub-dimensions and the routed ones its router picks.",
    "Routed experts compute in a latent width smaller than the model width.",
]
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
CASES = {
    "mohd": lambda shape: MoHDForCausalLM(MoHDConfig(**shape, num_sub_dims=8, num_shared_sub_dims=2)),
    "latent_moe": lambda shape: LatentMoEForCausalLM(
        LatentMoEConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_latent_size=16)
    ),
    "latent_moe_sigmoid": lambda shape: LatentMoEForCausalLM(
        LatentMoEConfig(
            **shape,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            moe_latent_size=16,
            router_score_func="sigmoid",
        )
    ),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{case: a saved tiny model with its tokenizer}, routers spread (std 0.5) so that routing is uneven."""
    root = tmp_path_factory.mktemp("trl-models")
    tokenizer = train_bpe_tokenizer(TEXT * 4, vocab_size=300)
    shape = dict(
        SHAPE,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    result = {}
    for case, make in CASES.items():
        torch.manual_seed(0)
        model = make(shape)
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "router_name"):
                    module.weight.normal_(0, 0.5)
        folder = root / case
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        result[case] = folder
    return result


def common_args(output_dir) -> dict:
    return dict(
        output_dir=str(output_dir),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        model_init_kwargs={"trust_remote_code": True},
    )


def lora_config(folder):
    modules, parameters = lora_targets(AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).config)
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=modules, target_parameters=parameters or None)


def sft_trainer(folder, output_dir, peft_config=None):
    from hf_mohd.training.trl import prepare_trl_trainer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    args = trl.SFTConfig(**common_args(output_dir), max_length=24)
    dataset = datasets.Dataset.from_dict({"text": TEXT * 8})
    trainer = trl.SFTTrainer(
        model=str(folder), processing_class=tokenizer, train_dataset=dataset, args=args, peft_config=peft_config
    )
    return prepare_trl_trainer(trainer)


def dpo_trainer(folder, output_dir, peft_config=None):
    from hf_mohd.training.trl import prepare_trl_trainer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    args = trl.DPOConfig(**common_args(output_dir), max_length=32)
    dataset = datasets.Dataset.from_dict(
        {
            "prompt": ["The river rises in the", "Every token activates the", "Routed experts compute in a"] * 8,
            "chosen": [" hills.", " shared sub-dimensions.", " latent width."] * 8,
            "rejected": [" sea sea.", " river.", " hills hills."] * 8,
        }
    )
    trainer = trl.DPOTrainer(
        model=str(folder), processing_class=tokenizer, train_dataset=dataset, args=args, peft_config=peft_config
    )
    return prepare_trl_trainer(trainer)


def own_forward(model, **inputs):
    """The model's own causal-LM forward (the class's, not TRL's fused one bound on the instance)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(base).forward(base, **inputs)


@pytest.mark.parametrize("case", ["mohd", "latent_moe"])
def test_sft_fused_aux_loss_is_the_models_own(folders, tmp_path, case):
    """The aux loss TRL's fused forward returns on a training batch is the model's own `load_balancing_loss` (its
    forward with labels, the oracle), not Mixtral's formula (k times the pooled Switch loss), which differs."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    trainer = sft_trainer(folders[case], tmp_path / "run")
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model
    with torch.no_grad():
        fused = model(**batch, fused_lm_head=True, output_router_logits=True, use_cache=False)
        own = own_forward(model, **batch, output_router_logits=True, use_cache=False)
    assert own.aux_loss is not None and own.aux_loss > 0
    torch.testing.assert_close(fused.aux_loss, own.aux_loss, rtol=1e-5, atol=1e-6)
    config = model.config
    if case == "latent_moe":
        mixtral = load_balancing_loss_func(
            own.router_logits, config.num_experts, config.num_experts_per_tok, batch.get("attention_mask")
        )
        assert (mixtral - own.aux_loss).abs() > 0.1  # what TRL alone would add


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_trainer_trains_saves_the_users_config_and_reloads(folders, tmp_path, case, lora, kind):
    folder = folders[case]
    build = sft_trainer if kind == "sft" else dpo_trainer
    trainer = build(folder, tmp_path / "run", lora_config(folder) if lora else None)
    base = trainer.model.get_base_model() if lora else trainer.model
    before = {name: param.detach().clone() for name, param in trainer.model.named_parameters() if param.requires_grad}
    sigmoid = [module for module in base.modules() if getattr(module, "e_score_correction_bias", None) is not None]
    biases = [module.e_score_correction_bias.clone() for module in sigmoid]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(entry["loss"])) for entry in logs)
    if case == "latent_moe_sigmoid":
        assert all("aux_loss" not in entry for entry in logs)  # balanced by the bias, not a loss
        after = [module.e_score_correction_bias for module in sigmoid]
        assert biases and any(not torch.equal(a, b) for a, b in zip(after, biases, strict=True)), "no bias update"
    else:
        assert all(entry["aux_loss"] > 0 for entry in logs)
    moved = [name for name, param in trainer.model.named_parameters() if name in before]
    assert any(not torch.equal(before[name], trainer.model.get_parameter(name)) for name in moved)
    if lora and case.startswith("latent_moe"):
        assert any(".experts." in name and "lora" in name for name in moved), "LoRA did not reach the 3-D experts"

    out = tmp_path / "saved"
    trainer.save_model(str(out))
    if not lora:
        saved, original = (json.loads((path / "config.json").read_text()) for path in (out, folder))
        changed = {key for key in saved.keys() | original.keys() if saved.get(key) != original.get(key)}
        # output_router_logits and router_aux_loss_coef stay as built; `use_cache` is transformers' Trainer's for every
        # model (`TrainingArguments.use_cache`, False unless asked)
        assert changed <= {"dtype", "transformers_version", "use_cache"}, changed
    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert reloaded.config.output_router_logits is False
    ids = torch.tensor([[reloaded.config.bos_token_id, 5, 6, 7]])
    tokens = reloaded.generate(ids, max_new_tokens=4, do_sample=False)
    assert tokens.shape == (1, 8)
    if lora:  # the adapter reloads on its base: the reloaded model is the trained one
        trained = trainer.model.eval()
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, own_forward(trained, input_ids=ids).logits)
