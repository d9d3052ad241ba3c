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
"""Convert a dense LLaMA checkpoint (a safetensors folder or a GGUF file) into a LatentMoE model folder: upcycled
(default) or carved (`--carve`).

    python conversion/convert_llama_to_latent_moe.py LLAMA_DIR OUTPUT_DIR --num-experts 8 --verify
    python conversion/convert_llama_to_latent_moe.py LLAMA_DIR OUTPUT_DIR --carve --num-experts 8 \\
        --num-experts-per-tok 4 --verify

The options are those of `hf-mohd convert latent-moe` (the same parser,
`hf_mohd.commands.convert.add_latent_moe_arguments`); the work is `hf_mohd.conversion.convert_latent_moe` (upcycling:
each dense FFN of width I becomes the shared expert, N routed experts of width I / N start from its slices at latent
width l, and fc2_latent_proj is zero, so the model is the source until trained) or `convert_carved_latent_moe`
(carving: each FFN is split, weights unchanged, into a shared expert and N routed experts of equal width with unit
gates and fitted routers, the source again with every expert active). `--verify` checks that exact model against the
source's logits. The written folder is then loaded with `AutoModelForCausalLM` for a greedy sanity generation, and
uploaded with `--push_to_hub REPO_ID`.
"""

from hf_mohd.commands.convert import add_latent_moe_arguments, configure_logging, latent_moe_options
from hf_mohd.conversion.scripts import add_script_arguments, finish, script_parser


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    add_script_arguments(add_latent_moe_arguments(parser))
    args = parser.parse_args(argv)
    configure_logging(args.quiet)

    convert, options = latent_moe_options(args)  # convert_carved_latent_moe with --carve, else convert_latent_moe
    result = convert(args.source, args.output, **options)
    print(f"LatentMoE model ({'carved' if args.carve else 'upcycled'}) written to {result.path}")
    if result.max_logit_difference is not None:
        print(f"verify: max |logit difference| with every expert active = {result.max_logit_difference:.3g}")
    finish(result.path, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
