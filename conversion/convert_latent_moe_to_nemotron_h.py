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
"""Export a LatentMoE model folder as a transformers Nemotron-H folder (`NemotronHForCausalLM`, which vLLM and SGLang
serve natively), with the same logits.

    python conversion/convert_latent_moe_to_nemotron_h.py LATENT_MOE_DIR OUTPUT_DIR

LatentMoE layer i (attention, then the FFN mixer) becomes the Nemotron-H blocks 2i (`full_attention`) and 2i + 1
(`moe` or `mlp`); the weights are renamed, not changed. The model must use the choices Nemotron-H can express: no
positional embedding, non-gated relu2 experts, sigmoid routing with weighted gates, a shared expert, one expert shape
for all MoE layers (a LatentMoE converted from LLaMA has RoPE and gated experts, so it is refused, naming each
field). The options are those of `hf-mohd export nemotron-h` (`hf_mohd.commands.export.add_nemotron_h_arguments`);
the work is `hf_mohd.interop.export_to_nemotron_h`. The written folder is loaded with `AutoModelForCausalLM`
(transformers' own Nemotron-H) for a greedy sanity generation, and uploaded as it is with `--push_to_hub REPO_ID`.
The way back is `convert_nemotron_h_to_latent_moe.py`.
"""

from hf_mohd.commands.export import add_nemotron_h_arguments
from hf_mohd.conversion.scripts import add_script_arguments, finish, script_parser
from hf_mohd.interop import export_to_nemotron_h


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    add_script_arguments(add_nemotron_h_arguments(parser))
    args = parser.parse_args(argv)

    path = export_to_nemotron_h(args.source, args.output, overwrite=args.overwrite)
    print(f"Nemotron-H model written to {path}")
    finish(path, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
