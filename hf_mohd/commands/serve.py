"""`hf-mohd serve`: transformers' OpenAI-compatible server (`transformers serve`) for MoHD and LatentMoE folders.

`transformers serve FOLDER --trust-remote-code` (transformers 5.25) loads a model with
`getattr(transformers, config.architectures[0])`, ignoring `auto_map`, so a saved folder of either family fails with
"module transformers has no attribute MoHDForCausalLM". This command runs the same server (every option of
`transformers serve`, passed through) after making both causal LMs attributes of the `transformers` module in each
of the server's processes (its model and API processes are spawned: they unpickle `RoutedModelLoader`, which
registers them again before loading). The folder stays a standard remote-code checkpoint: nothing in it changes.
"""

import argparse

from . import add_command, check_model_folder, looks_local


ARCHITECTURES = ("MoHDForCausalLM", "LatentMoEForCausalLM")


def register_with_transformers() -> None:
    """Makes `transformers.MoHDForCausalLM` and `transformers.LatentMoEForCausalLM` the hf-mohd classes (and registers
    the model types with the Auto classes, by importing `hf_mohd`), as transformers' server resolves
    `config.architectures[0]` on the `transformers` module. Idempotent."""
    import sys

    import transformers

    import hf_mohd

    # the server's module may hold an earlier `transformers` module object than sys.modules does now (transformers
    # replaces its lazy module once fully imported): both get the classes
    server = sys.modules.get("transformers.cli.serving.model_manager")
    modules = {id(module): module for module in (transformers, getattr(server, "transformers", None)) if module}
    for module in modules.values():
        for name in ARCHITECTURES:
            if getattr(module, name, None) is not getattr(hf_mohd, name):
                setattr(module, name, getattr(hf_mohd, name))


def routed_model_loader():
    """transformers' `ModelLoader` (the class its server loads models with, in a spawned process), registering the
    hf-mohd classes first (`register_with_transformers`) in whichever process loads."""
    from transformers.cli.serving.model_manager import ModelLoader

    class RoutedModelLoader(ModelLoader):
        def load_model_and_processor(self, *args, **kwargs):
            register_with_transformers()
            return super().load_model_and_processor(*args, **kwargs)

        def load_config(self, *args, **kwargs):
            register_with_transformers()
            return super().load_config(*args, **kwargs)

    # picklable by name: the spawned processes import this module and find the class here
    RoutedModelLoader.__module__ = __name__
    RoutedModelLoader.__qualname__ = "RoutedModelLoader"
    globals()["RoutedModelLoader"] = RoutedModelLoader
    return RoutedModelLoader


def register(subparsers) -> None:
    # no options of its own ("+" marks none): every argument, --help included, is `transformers serve`'s
    parser = add_command(subparsers, "serve", run, add_help=False, prefix_chars="+")
    parser.add_argument(
        "serve_args",
        nargs=argparse.REMAINDER,
        help="The arguments of `transformers serve` (`hf-mohd serve --help` lists them): a model folder or Hub id, "
        "--continuous-batching, --host, --port, --trust-remote-code, ...",
    )


def run(args) -> int:
    """Serve a MoHD or LatentMoE model with transformers' OpenAI-compatible server (`transformers serve`).

    Takes every argument of `transformers serve` (for example `hf-mohd serve FOLDER --host 127.0.0.1 --port 8000
    --continuous-batching`) and serves chat completions, completions and responses as it does for Llama, with the
    hf-mohd classes registered where transformers' server looks for them (it ignores `auto_map`). When to use it and
    when vLLM: docs/serving.md ("transformers serve").

    Raises:
        CommandError: a local model folder among the arguments that is missing, not a folder, without config.json,
            with a config field its class refuses, or with damaged weights (`check_model_folder`).
    """
    # a local model folder is checked before the server starts (it loads models lazily, on the first request): a
    # missing, damaged or misconfigured folder is refused now, by name, with the exit status of docs/bad-input.md
    for argument in args.serve_args:
        if not argument.startswith("-") and looks_local(argument):
            check_model_folder(argument)

    from transformers.cli import serve as serve_module
    from transformers.cli.serving import model_manager
    from transformers.cli.transformers import app

    register_with_transformers()
    model_manager.ModelLoader = routed_model_loader()
    serve_module.ModelLoader = model_manager.ModelLoader  # if imported by name at module level
    app(["serve", *args.serve_args], prog_name="hf-mohd", standalone_mode=False)
    return 0


def __getattr__(name):
    """`hf_mohd.commands.serve.RoutedModelLoader`, built on first use (importing transformers' server is slow, and
    every `hf-mohd` command imports this module): the name the spawned processes unpickle the loader by."""
    if name == "RoutedModelLoader":
        return routed_model_loader()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
