"""One error convention for the whole command line: every command, given each kind of bad input that applies to it,
prints exactly one line `error: <path or field>: <what was expected>` on stderr, no traceback, and exits with the
status of that kind (`hf_mohd.commands.EXIT_STATUS`); `--debug` / `HF_MOHD_DEBUG=1` add the traceback.

The commands run in this process (`hf_mohd.cli.main`) on tiny model folders built once for the module; each case
reads a copy that is damaged one way (truncated or garbage weights, a config field out of range, another model type).
"""

import json
import shutil
import socket

import pytest
import torch
from test_nemotron_h_interop import latent_moe_model
from test_reliability import MOHD_BASES, _edit_json, _truncate, llama_folder  # noqa: F401  (llama_folder: a fixture)

from hf_mohd import MoHDConfig, MoHDForCausalLM
from hf_mohd.cli import main
from hf_mohd.commands import EXIT_STATUS


USAGE, MISSING, WRONG_TYPE, DAMAGED, CONFIG, HUB, EXISTS = (
    EXIT_STATUS[kind] for kind in ("usage", "missing", "wrong_type", "damaged", "config", "hub", "exists")
)


def _garbage(path):
    path.write_bytes(b"this is not a safetensors file\n" * 64)


def _closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def paths(tmp_path_factory, llama_folder):  # noqa: F811
    """{name: path} of the inputs every case refers to as `{name}`: the intact folders (llama, mohd, latent,
    nemotron), their damaged copies (`<base>_trunc`, `<base>_garbage`, config edits), text, JSON and YAML files."""
    from hf_mohd.interop import export_to_nemotron_h
    from hf_mohd.training.data import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("cli-errors")
    found = {"root": root, "llama": llama_folder}
    torch.manual_seed(0)
    MoHDForCausalLM(MoHDConfig(**MOHD_BASES["mohd_gqa"])).save_pretrained(root / "mohd")
    found["mohd"] = root / "mohd"
    latent = latent_moe_model(per_layer_config=None, vocab_size=104)  # every layer MoE: Nemotron-H and llama.cpp
    latent.save_pretrained(root / "latent")
    found["latent"] = root / "latent"
    export_to_nemotron_h(latent, root / "nemotron")
    found["nemotron"] = root / "nemotron"

    def variant(base, name, damage):
        shutil.copytree(found[base], root / name)
        damage(root / name)
        found[name] = root / name

    for base in ("llama", "mohd", "latent", "nemotron"):
        variant(base, f"{base}_trunc", lambda d: _truncate(d / "model.safetensors"))
        variant(base, f"{base}_garbage", lambda d: _garbage(d / "model.safetensors"))
    variant("llama", "llama_badfield", lambda d: _edit_json(d / "config.json", hidden_size="32"))
    variant("mohd", "mohd_badfield", lambda d: _edit_json(d / "config.json", hidden_size=60, num_sub_dims=16))
    variant("latent", "latent_k9", lambda d: _edit_json(d / "config.json", num_experts_per_tok=9))
    variant("latent", "latent_rope", lambda d: _edit_json(d / "config.json", position_embedding_type="rope"))
    blocks = json.loads((found["nemotron"] / "config.json").read_text())["layers_block_type"]
    mamba = ["linear_attention" if i == 2 else block for i, block in enumerate(blocks)]
    variant("nemotron", "nemotron_mamba", lambda d: _edit_json(d / "config.json", layers_block_type=mamba))

    tokenizer = train_bpe_tokenizer(["a river city", "the old king sang"] * 8, 280)
    variant("llama", "llama_tok", tokenizer.save_pretrained)
    (root / "empty_dir").mkdir()
    (root / "existing").mkdir()
    (root / "existing" / "keep.txt").write_text("x")
    (root / "existing.gguf").write_bytes(b"GGUF")
    found.update(empty_dir=root / "empty_dir", existing=root / "existing", existing_gguf=root / "existing.gguf")
    files = {
        "text": "a river city\n\nthe old king sang\n",
        "blank.txt": " \n\n \n",
        "latin1.txt": "caf\xe9".encode("latin-1"),
        "bad.json": "{",
        "list.json": "[1, 2, 3]",
        "number.json": "3",
        "ids.json": json.dumps([list(range(3, 40)), list(range(50, 90))]),
        "standard.json": json.dumps(
            {
                "vocab_size": 1000,
                "hidden_size": 512,
                "intermediate_size": 1024,
                "num_hidden_layers": 6,
                "num_attention_heads": 8,
                "moe_intermediate_size": 128,
                "num_experts": 16,
                "num_experts_per_tok": 4,
                "moe_shared_expert_intermediate_size": 256,
                "mlp_gated": True,
            }
        ),
        "profile.json": json.dumps({"intrinsic_dimension": [3.0, 4.0, 11.0, 13.0, 14.0, 12.0, 9.0]}),
        "corpus.txt": "a river city\n\nthe old king sang\n" * 20,
        "empty.yaml": "",
        "notyaml.yaml": "max_steps: [1,\n",
    }
    for name, content in files.items():
        path = root / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        found[name.split(".")[0] if name != "text" else "text"] = path
    found["badfield_yaml"] = root / "badfield.yaml"
    found["badfield_yaml"].write_text(f"max_steps: ten\ndata: {{path: {root / 'corpus.txt'}}}\n")

    def train_yaml(name, **model):
        values = {"output_dir": str(root / f"run-{name}"), "data": {"path": str(root / "corpus.txt")}, "model": model}
        (root / f"{name}.yaml").write_text(json.dumps(values))  # JSON is YAML
        found[f"{name}_yaml"] = root / f"{name}.yaml"

    train_yaml("init_missing", init_from=str(root / "no-such-model"))
    train_yaml("init_file", init_from=str(root / "text"))
    train_yaml("init_nocfg", init_from=str(root / "empty_dir"))
    train_yaml("init_trunc", init_from=str(root / "mohd_trunc"))
    train_yaml("init_garbage", init_from=str(root / "mohd_garbage"))
    train_yaml("init_badfield", init_from=str(root / "mohd_badfield"))
    found["nodata_yaml"] = root / "nodata.yaml"
    found["nodata_yaml"].write_text(
        json.dumps(
            {
                "output_dir": str(root / "run-nodata"),
                "data": {"path": str(root / "no-corpus.txt")},
                "model": {"architecture": {"model_type": "mohd", "hidden_size": 32, "num_hidden_layers": 1}},
            }
        )
    )
    return {name: str(path) for name, path in found.items()}


# (case id, argv, exit status, what the error line must name); `{name}` is `paths[name]`, `{out}` a fresh path.
CASES = [
    # train (a YAML/JSON config; `model.init_from` is a field of it)
    ("train-missing-config", ["train", "{root}/none.yaml"], MISSING, "{root}/none.yaml"),
    ("train-empty-config", ["train", "{empty}"], DAMAGED, "{empty}"),
    ("train-config-not-yaml", ["train", "{notyaml}"], DAMAGED, "{notyaml}"),
    ("train-bad-field", ["train", "{badfield_yaml}"], CONFIG, "max_steps"),
    ("train-bad-set", ["train", "{init_missing_yaml}", "--set", "max_steps"], USAGE, "--set"),
    ("train-init-from-missing", ["train", "{init_missing_yaml}"], MISSING, "{root}/no-such-model"),
    ("train-init-from-file", ["train", "{init_file_yaml}"], WRONG_TYPE, "{text}"),
    ("train-init-from-no-config", ["train", "{init_nocfg_yaml}"], WRONG_TYPE, "{empty_dir}"),
    ("train-init-from-truncated", ["train", "{init_trunc_yaml}"], DAMAGED, "{mohd_trunc}/model.safetensors"),
    ("train-init-from-garbage", ["train", "{init_garbage_yaml}"], DAMAGED, "{mohd_garbage}/model.safetensors"),
    ("train-init-from-bad-field", ["train", "{init_badfield_yaml}"], CONFIG, "{mohd_badfield}/config.json"),
    ("train-data-missing", ["train", "{nodata_yaml}"], MISSING, "data.path"),
    # eval
    ("eval-missing", ["eval", "{root}/no-such-model", "--tasks", "arc_easy"], MISSING, "{root}/no-such-model"),
    ("eval-file", ["eval", "{text}"], WRONG_TYPE, "{text}"),
    ("eval-no-tokenizer", ["eval", "{mohd}", "--tasks", "arc_easy"], WRONG_TYPE, "{mohd}"),
    ("eval-truncated", ["eval", "{mohd_trunc}"], DAMAGED, "{mohd_trunc}/model.safetensors"),
    ("eval-garbage", ["eval", "{mohd_garbage}"], DAMAGED, "{mohd_garbage}/model.safetensors"),
    ("eval-bad-field", ["eval", "{mohd_badfield}"], CONFIG, "{mohd_badfield}/config.json"),
    ("eval-unknown-task", ["eval", "{mohd}", "--tasks", "arc_e"], USAGE, "--tasks"),
    # hf-mohd serve checks a local folder before transformers' server starts (it loads models on the first request)
    ("serve-missing", ["serve", "{root}/no-such-model", "--port", "1"], MISSING, "{root}/no-such-model"),
    ("serve-file", ["serve", "{text}"], WRONG_TYPE, "{text}"),
    ("serve-truncated", ["serve", "{mohd_trunc}"], DAMAGED, "{mohd_trunc}/model.safetensors"),
    ("serve-bad-field", ["serve", "{mohd_badfield}"], CONFIG, "{mohd_badfield}/config.json"),
]
# accounting, and its deprecated alias latent-accounting: one function, the same statuses
for command in ("accounting", "latent-accounting"):
    CASES += [
        (f"{command}-missing", [command, "{root}/nothing"], MISSING, "{root}/nothing"),
        (f"{command}-no-config", [command, "{empty_dir}"], WRONG_TYPE, "{empty_dir}"),
        (f"{command}-not-json", [command, "{bad}"], DAMAGED, "{bad}"),
        (f"{command}-not-an-object", [command, "{list}"], DAMAGED, "{list}"),
        (f"{command}-bad-field", [command, "{llama_badfield}"], CONFIG, "{llama_badfield}"),
        (f"{command}-invalid-mohd-field", [command, "{mohd_badfield}"], CONFIG, "{mohd_badfield}"),
        (f"{command}-preset-wrong-type", [command, "{mohd}", "--preset", "compression_50"], WRONG_TYPE, "{mohd}"),
        (
            f"{command}-preset-no-model-type",
            [command, "{standard}", "--preset", "compression_50"],
            WRONG_TYPE,
            "{standard}",
        ),
        (f"{command}-unknown-preset", [command, "{llama}", "--preset", "compresion_50"], USAGE, "preset"),
        (f"{command}-json-and-table", [command, "{llama}", "--json", "--table"], USAGE, "--table"),
    ]
for command, extra in (
    ("alpha-transform", ["--alpha", "4"]),
    ("propose-shape", ["--config"]),
):

    def argv(config, command=command, extra=extra):
        return [command, *extra, config] if extra == ["--config"] else [command, config, *extra]

    CASES += [
        (f"{command}-missing", argv("{root}/nothing.json"), MISSING, "{root}/nothing.json"),
        (f"{command}-no-config", argv("{empty_dir}"), WRONG_TYPE, "{empty_dir}"),
        (f"{command}-not-json", argv("{bad}"), DAMAGED, "{bad}"),
        (f"{command}-not-an-object", argv("{list}"), DAMAGED, "{list}"),
    ]
CASES += [
    ("alpha-transform-bad-field", ["alpha-transform", "{standard}", "--alpha", "3"], CONFIG, "{standard}"),
    ("propose-shape-impossible", ["propose-shape", "--product", "7", "--multiple", "64"], USAGE, "no (l, m)"),
    # allocate
    (
        "allocate-missing-config",
        ["allocate", "{root}/u.json", "--profile", "{profile}", "--output-dir", "{out}"],
        MISSING,
        "{root}/u.json",
    ),
    (
        "allocate-missing-profile",
        ["allocate", "{standard}", "--profile", "{root}/p.json", "--output-dir", "{out}"],
        MISSING,
        "{root}/p.json",
    ),
    (
        "allocate-profile-not-json",
        ["allocate", "{standard}", "--profile", "{bad}", "--output-dir", "{out}"],
        DAMAGED,
        "{bad}",
    ),
    (
        "allocate-profile-not-ids",
        ["allocate", "{standard}", "--profile", "{number}", "--output-dir", "{out}"],
        DAMAGED,
        "{number}",
    ),
    (
        "allocate-bad-field",
        ["allocate", "{standard}", "--profile", "{profile}", "--output-dir", "{out}"],
        CONFIG,
        "{standard}",
    ),
    # intrinsic-dim
    ("intrinsic-dim-missing", ["intrinsic-dim", "{root}/none", "--input-ids", "{ids}"], MISSING, "{root}/none"),
    ("intrinsic-dim-file", ["intrinsic-dim", "{text}", "--input-ids", "{ids}"], WRONG_TYPE, "{text}"),
    (
        "intrinsic-dim-truncated",
        ["intrinsic-dim", "{llama_trunc}", "--input-ids", "{ids}"],
        DAMAGED,
        "{llama_trunc}/model.safetensors",
    ),
    (
        "intrinsic-dim-garbage",
        ["intrinsic-dim", "{llama_garbage}", "--input-ids", "{ids}"],
        DAMAGED,
        "{llama_garbage}/model.safetensors",
    ),
    (
        "intrinsic-dim-bad-field",
        ["intrinsic-dim", "{llama_badfield}", "--input-ids", "{ids}"],
        CONFIG,
        "{llama_badfield}/config.json",
    ),
    (
        "intrinsic-dim-text-missing",
        ["intrinsic-dim", "{llama_tok}", "--text-file", "{root}/t.txt"],
        MISSING,
        "{root}/t.txt",
    ),
    ("intrinsic-dim-text-empty", ["intrinsic-dim", "{llama_tok}", "--text-file", "{blank}"], DAMAGED, "{blank}"),
    ("intrinsic-dim-text-not-utf8", ["intrinsic-dim", "{llama_tok}", "--text-file", "{latin1}"], DAMAGED, "{latin1}"),
    ("intrinsic-dim-no-tokenizer", ["intrinsic-dim", "{llama}", "--text-file", "{text}"], WRONG_TYPE, "{llama}"),
    (
        "intrinsic-dim-ids-missing",
        ["intrinsic-dim", "{llama}", "--input-ids", "{root}/i.json"],
        MISSING,
        "{root}/i.json",
    ),
    ("intrinsic-dim-ids-not-json", ["intrinsic-dim", "{llama}", "--input-ids", "{bad}"], DAMAGED, "{bad}"),
    ("intrinsic-dim-ids-not-lists", ["intrinsic-dim", "{llama}", "--input-ids", "{list}"], DAMAGED, "{list}"),
    # publish (the Hub: a closed port on 127.0.0.1)
    ("publish-missing", ["publish", "{root}/none", "me/x", "--endpoint", "{hub}"], MISSING, "{root}/none"),
    ("publish-wrong-type", ["publish", "{llama}", "me/x", "--endpoint", "{hub}"], WRONG_TYPE, "{llama}/config.json"),
    (
        "publish-truncated",
        ["publish", "{mohd_trunc}", "me/x", "--endpoint", "{hub}"],
        DAMAGED,
        "{mohd_trunc}/model.safetensors",
    ),
    (
        "publish-garbage",
        ["publish", "{latent_garbage}", "me/x", "--endpoint", "{hub}"],
        DAMAGED,
        "{latent_garbage}/model.safetensors",
    ),
    (
        "publish-bad-field",
        ["publish", "{mohd_badfield}", "me/x", "--endpoint", "{hub}"],
        CONFIG,
        "{mohd_badfield}/config.json",
    ),
    (
        "publish-eval-results-missing",
        ["publish", "{mohd}", "me/x", "--eval-results", "{root}/r.json"],
        MISSING,
        "{root}/r.json",
    ),
    ("publish-eval-results-not-json", ["publish", "{mohd}", "me/x", "--eval-results", "{bad}"], DAMAGED, "{bad}"),
    ("publish-training-not-json", ["publish", "{mohd}", "me/x", "--training", "{{lr"], USAGE, "--training"),
    ("publish-hub-unreachable", ["publish", "{mohd}", "me/x", "--endpoint", "{hub}"], HUB, "{hub}"),
    # demo
    ("demo-unknown-model", ["demo", "--output-dir", "{out}", "--models", "gpt"], USAGE, "--models"),
    ("demo-negative-threads", ["demo", "--output-dir", "{out}", "--threads", "-2"], USAGE, "--threads"),
    # argparse's own usage errors, in the same one-line form
    ("usage-missing-argument", ["eval"], USAGE, "model"),
    ("usage-bad-choice", ["convert", "mohd", "{llama}", "{out}", "--dtype", "float8"], USAGE, "--dtype"),
    ("usage-unknown-command", ["no-such-command"], USAGE, "no-such-command"),
]
# export nemotron-h / gguf, and their deprecated aliases nemotron-h export / gguf (the same statuses); nemotron-h import
for export, gguf in (
    (["export", "nemotron-h"], ["export", "gguf"]),
    (["nemotron-h", "export"], ["nemotron-h", "gguf"]),
):
    name, gguf_name = "-".join(export), "-".join(gguf)
    CASES += [
        (f"{name}-missing", [*export, "{root}/none", "{out}"], MISSING, "{root}/none"),
        (f"{name}-wrong-type", [*export, "{llama}", "{out}"], WRONG_TYPE, "{llama}/config.json"),
        (f"{name}-truncated", [*export, "{latent_trunc}", "{out}"], DAMAGED, "{latent_trunc}/model.safetensors"),
        (f"{name}-garbage", [*export, "{latent_garbage}", "{out}"], DAMAGED, "{latent_garbage}/model.safetensors"),
        (f"{name}-bad-field", [*export, "{latent_k9}", "{out}"], CONFIG, "{latent_k9}/config.json"),
        (f"{name}-unsupported-field", [*export, "{latent_rope}", "{out}"], CONFIG, "{latent_rope}/config.json"),
        (f"{name}-output-exists", [*export, "{latent}", "{existing}"], EXISTS, "{existing}"),
        (f"{gguf_name}-missing", [*gguf, "{root}/none", "{out}.gguf"], MISSING, "{root}/none"),
        (f"{gguf_name}-wrong-type", [*gguf, "{mohd}", "{out}.gguf"], WRONG_TYPE, "{mohd}/config.json"),
        (
            f"{gguf_name}-truncated",
            [*gguf, "{latent_trunc}", "{out}.gguf"],
            DAMAGED,
            "{latent_trunc}/model.safetensors",
        ),
        (
            f"{gguf_name}-garbage",
            [*gguf, "{latent_garbage}", "{out}.gguf"],
            DAMAGED,
            "{latent_garbage}/model.safetensors",
        ),
        (f"{gguf_name}-bad-field", [*gguf, "{latent_k9}", "{out}.gguf"], CONFIG, "{latent_k9}/config.json"),
        (
            f"{gguf_name}-unsupported-field",
            [*gguf, "{latent_rope}", "{out}.gguf"],
            CONFIG,
            "{latent_rope}/config.json",
        ),
        (
            f"{gguf_name}-no-converter",
            [*gguf, "{latent}", "{out}.gguf", "--converter", "{root}/none"],
            MISSING,
            "{root}/none",
        ),
        (f"{gguf_name}-output-exists", [*gguf, "{latent}", "{existing_gguf}"], EXISTS, "{existing_gguf}"),
    ]
CASES += [
    ("import-missing", ["nemotron-h", "import", "{root}/none", "{out}"], MISSING, "{root}/none"),
    ("import-wrong-type", ["nemotron-h", "import", "{latent}", "{out}"], WRONG_TYPE, "{latent}/config.json"),
    (
        "import-truncated",
        ["nemotron-h", "import", "{nemotron_trunc}", "{out}"],
        DAMAGED,
        "{nemotron_trunc}/model.safetensors",
    ),
    (
        "import-garbage",
        ["nemotron-h", "import", "{nemotron_garbage}", "{out}"],
        DAMAGED,
        "{nemotron_garbage}/model.safetensors",
    ),
    (
        "import-unsupported-field",
        ["nemotron-h", "import", "{nemotron_mamba}", "{out}"],
        CONFIG,
        "{nemotron_mamba}/config.json",
    ),
    ("import-output-exists", ["nemotron-h", "import", "{nemotron}", "{existing}"], EXISTS, "{existing}"),
]
for family in ("mohd", "latent-moe"):
    convert = ["convert", family]
    CASES += [
        (f"convert-{family}-missing", [*convert, "{root}/none", "{out}", "-q"], MISSING, "{root}/none"),
        (f"convert-{family}-wrong-type", [*convert, "{mohd}", "{out}", "-q"], WRONG_TYPE, "{mohd}/config.json"),
        (
            f"convert-{family}-truncated",
            [*convert, "{llama_trunc}", "{out}", "-q"],
            DAMAGED,
            "{llama_trunc}/model.safetensors",
        ),
        (
            f"convert-{family}-garbage",
            [*convert, "{llama_garbage}", "{out}", "-q"],
            DAMAGED,
            "{llama_garbage}/model.safetensors",
        ),
        (
            f"convert-{family}-bad-field",
            [*convert, "{llama_badfield}", "{out}", "-q"],
            CONFIG,
            "{llama_badfield}/config.json",
        ),
        (f"convert-{family}-output-exists", [*convert, "{llama}", "{existing}", "-q"], EXISTS, "{existing}"),
    ]
CASES += [
    (
        "convert-mohd-bad-options",
        ["convert", "mohd", "{llama}", "{out}", "--preset", "none", "-q"],
        USAGE,
        "num_sub_dims",
    ),
    (
        "convert-latent-moe-bad-options",
        ["convert", "latent-moe", "{llama}", "{out}", "--num-experts-per-tok", "9", "-q"],
        USAGE,
        "num_experts_per_tok",
    ),
    (
        "convert-mohd-calibration-missing",
        ["convert", "mohd", "{llama_tok}", "{out}", "--routers", "fitted", "--calibration-text", "{root}/c.txt", "-q"],
        MISSING,
        "{root}/c.txt",
    ),
    (
        "convert-mohd-calibration-empty",
        ["convert", "mohd", "{llama_tok}", "{out}", "--routers", "fitted", "--calibration-text", "{blank}", "-q"],
        DAMAGED,
        "{blank}",
    ),
]


def _run(argv, capsys):
    """`hf-mohd argv` in this process: (exit status, stdout, stderr)."""
    try:
        status = main(argv)
    except SystemExit as exit_:  # argparse's usage errors
        status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("argv, status, where", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gives_one_error_line_and_the_status_of_its_kind(
    paths, tmp_path, capsys, monkeypatch, argv, status, where
):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # publish reaches for the closed port
    values = {**paths, "out": str(tmp_path / "out"), "hub": f"http://127.0.0.1:{_closed_port()}"}
    argv = [arg.format(**values) for arg in argv]
    got, out, err = _run(argv, capsys)
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert where.format(**values) in lines[0], (where, lines[0])
    assert got == status, (argv, err)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.gguf").exists()


def test_every_command_has_cases():
    """A command added to `hf-mohd` without bad-input cases here fails this test."""
    from hf_mohd.cli import build_parser

    def leaves(parser, prefix=()):
        actions = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        if not actions:
            return [" ".join(prefix)]
        return [leaf for name, sub in actions[0].choices.items() for leaf in leaves(sub, (*prefix, name))]

    covered = {
        " ".join(argv[:2]) if argv[0] in ("convert", "export", "nemotron-h") else argv[0] for _, argv, *_ in CASES
    }
    assert set(leaves(build_parser())) <= covered


def test_kinds_have_distinct_statuses():
    assert len(set(EXIT_STATUS.values())) == len(EXIT_STATUS)
    assert EXIT_STATUS["usage"] == 2  # argparse's own


@pytest.mark.parametrize("how", ["--debug", "HF_MOHD_DEBUG=1"])
def test_debug_adds_the_traceback(paths, capsys, monkeypatch, how):
    argv = ["eval", paths["mohd_trunc"]]
    if how == "--debug":
        argv = ["--debug", *argv]
    else:
        monkeypatch.setenv("HF_MOHD_DEBUG", "1")
    status, _, err = _run(argv, capsys)
    assert status == DAMAGED
    assert "Traceback (most recent call last)" in err and "SafetensorError" in err
    assert err.splitlines()[-1].startswith(f"error: {paths['mohd_trunc']}/model.safetensors: not a complete")


# ------------------------------------------------------------------------------------------------------------------
# `convert latent-moe --carve --latent-size L` (carving's latent width, `hf_mohd.conversion.latent_moe.carve`): a width that is
# not in [1, hidden_size], --verify below full width, or the option without --carve is a bad option value, so a usage
# error (exit status 2), as the other carving options' (`ConversionError` kind "usage": settings that do not fit the
# source). Kept in their own list and test, after the shared ones, so that cases added above do not collide.
CARVE_LATENT_CASES = [
    (
        "convert-latent-moe-carve-latent-size-zero",
        ["convert", "latent-moe", "{llama}", "{out}", "--carve", "--latent-size", "0", "-q"],
        USAGE,
        "`latent_size` (--latent-size) must be a positive integer",
    ),
    (
        "convert-latent-moe-carve-latent-size-above-hidden",
        ["convert", "latent-moe", "{llama}", "{out}", "--carve", "--latent-size", "33", "-q"],
        USAGE,
        "`latent_size` (--latent-size) must be <= hidden_size = 32",
    ),
    (
        "convert-latent-moe-carve-latent-size-verify",
        ["convert", "latent-moe", "{llama}", "{out}", "--carve", "--latent-size", "16", "--verify", "-q"],
        USAGE,
        "`verify` (--verify)",
    ),
    (
        "convert-latent-moe-latent-size-without-carve",
        ["convert", "latent-moe", "{llama}", "{out}", "--latent-size", "16", "-q"],
        USAGE,
        "--latent-size",
    ),
]


@pytest.mark.parametrize(
    "argv, status, where", [c[1:] for c in CARVE_LATENT_CASES], ids=[c[0] for c in CARVE_LATENT_CASES]
)
def test_carve_latent_size_gives_one_error_line_and_the_status_of_its_kind(
    paths, tmp_path, capsys, monkeypatch, argv, status, where
):
    test_bad_input_gives_one_error_line_and_the_status_of_its_kind(
        paths, tmp_path, capsys, monkeypatch, argv, status, where
    )


@pytest.mark.parametrize(
    "old, new",
    [
        (["nemotron-h", "export"], "hf-mohd export nemotron-h"),
        (["nemotron-h", "gguf"], "hf-mohd export gguf"),
        (["latent-accounting"], "hf-mohd accounting --table"),
    ],
)
def test_old_command_names_are_deprecated_aliases(capsys, old, new):
    """The old names keep working for one release; their help says what replaces them."""
    with pytest.raises(SystemExit) as exit_info:
        main([*old, "--help"])
    assert exit_info.value.code == 0
    assert f"Deprecated alias of `{new}`" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main([*old[:-1], "--help"] if len(old) > 1 else ["--help"])
    assert f"Deprecated alias of `{new}`" in " ".join(capsys.readouterr().out.split())


def test_aliases_run_the_new_commands(paths, tmp_path, capsys):
    """`latent-accounting` prints what `accounting --table` prints, `nemotron-h export` writes what `export
    nemotron-h` writes; after a success the alias adds one note line on stderr naming the new command."""
    table, alias = (
        _run(["accounting", paths["latent"], "--table"], capsys),
        _run(["latent-accounting", paths["latent"]], capsys),
    )
    assert table[0] == alias[0] == 0 and alias[1] == table[1] and "total parameters" in table[1]
    status, out, err = _run(["latent-accounting", paths["standard"], "--json"], capsys)
    assert status == 0 and json.loads(out) == json.loads(_run(["accounting", paths["standard"]], capsys)[1])
    assert (
        err == "note: `hf-mohd latent-accounting` is a deprecated alias of `hf-mohd accounting --table`; use that.\n"
    )
    assert _run(["export", "nemotron-h", paths["latent"], str(tmp_path / "new")], capsys)[0] == 0
    status, _, err = _run(["nemotron-h", "export", paths["latent"], str(tmp_path / "old")], capsys)
    assert status == 0 and "deprecated alias of `hf-mohd export nemotron-h`" in err
    new, old = (json.loads((tmp_path / name / "config.json").read_text()) for name in ("new", "old"))
    assert new == old and sorted(p.name for p in (tmp_path / "new").iterdir()) == sorted(
        p.name for p in (tmp_path / "old").iterdir()
    )
