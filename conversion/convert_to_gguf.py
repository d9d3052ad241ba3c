# Copyright 2026 The hf-mohd Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Export a LatentMoE model folder as one GGUF file for llama.cpp (and Ollama, LM Studio, llama-cpp-python), with its
tokenizer embedded.

    python conversion/convert_to_gguf.py LATENT_MOE_DIR model.gguf --outtype f16

The path is LatentMoE -> transformers' Nemotron-H (equal logits, plus one leading Mamba-2 block whose output is zero,
which llama.cpp's hybrid memory needs) -> llama.cpp's own `convert_hf_to_gguf.py` (architecture `nemotron_h_moe`).
Besides the Nemotron-H choices (see `convert_latent_moe_to_nemotron_h.py`) llama.cpp needs every layer MoE, relu2
and a vocabulary size that is a multiple of 8; a carved model (unit gates over gated experts) has no GGUF form. MoHD
has none either (llama.cpp has no sub-dimension routing). The options are those of `hf-mohd export gguf`
(`hf_mohd.commands.export.add_gguf_arguments`); the work is `hf_mohd.interop.export_to_gguf`. The sanity generation
runs the GGUF in llama.cpp when llama-cpp-python is installed; `--push_to_hub REPO_ID` uploads the file.
"""

from hf_mohd.commands.export import add_gguf_arguments
from hf_mohd.conversion.scripts import add_script_arguments, finish, script_parser
from hf_mohd.interop import export_to_gguf


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    add_script_arguments(add_gguf_arguments(parser))
    args = parser.parse_args(argv)

    path = export_to_gguf(
        args.source,
        args.output,
        outtype=args.outtype,
        tokenizer=args.tokenizer,
        converter_dir=args.converter,
        overwrite=args.overwrite,
    )
    print(f"GGUF ({args.outtype}) written to {path}")
    finish(path, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
