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
"""Convert a dense LLaMA checkpoint (a safetensors folder or a GGUF file) into a MoHD model folder.

    python conversion/convert_llama_to_mohd.py LLAMA_DIR OUTPUT_DIR --preset compression_50 --verify

The options are those of `hf-mohd convert mohd` (the same parser, `hf_mohd.commands.convert.add_mohd_arguments`);
the work is `hf_mohd.conversion.convert_mohd`. MoHD splits the hidden size D into N sub-dimensions of D / N channels:
with `--preset full` all N are shared and the model computes the source's logits (exact, which `--verify` checks on
2 x 32 random tokens); `compression_50` / `compression_75` keep N_s shared plus k routed sub-dimensions per token.
The written folder (safetensors, config.json with auto_map and code, the source tokenizer, model card) is then loaded
with `AutoModelForCausalLM` for a greedy sanity generation, and uploaded with `--push_to_hub REPO_ID`.
"""

from hf_mohd.commands.convert import add_mohd_arguments, configure_logging, mohd_options
from hf_mohd.conversion import convert_mohd
from hf_mohd.conversion.scripts import add_script_arguments, finish, script_parser


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    add_script_arguments(add_mohd_arguments(parser))
    args = parser.parse_args(argv)
    configure_logging(args.quiet)

    result = convert_mohd(args.source, args.output, **mohd_options(args))
    print(f"MoHD model written to {result.path}")
    if result.max_logit_difference is not None:
        print(f"verify: max |logit difference| at full activation = {result.max_logit_difference:.3g}")
    finish(result.path, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
