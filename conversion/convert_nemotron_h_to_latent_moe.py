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
"""Import a transformers Nemotron-H folder whose blocks alternate attention and (MoE or MLP) as a LatentMoE model
folder (with `auto_map` and code), with the same logits.

    python conversion/convert_nemotron_h_to_latent_moe.py NEMOTRON_H_DIR OUTPUT_DIR [--dtype bfloat16]

Nemotron-H blocks 2i (`full_attention`) and 2i + 1 (`moe` or `mlp`) become LatentMoE layer i; the weights are renamed,
not changed. Checkpoints with Mamba-2 blocks, group-limited routing or sliding-window attention have no LatentMoE
counterpart and are refused (checked on config.json before any weight is read). The options are those of
`hf-mohd nemotron-h import` (`hf_mohd.commands.nemotron_h.add_import_arguments`); the work is
`hf_mohd.interop.import_from_nemotron_h`. The written folder is loaded with `AutoModelForCausalLM` for a greedy
sanity generation, and uploaded with `--push_to_hub REPO_ID`. The way there is `convert_latent_moe_to_nemotron_h.py`.
"""

import torch

from hf_mohd.commands.nemotron_h import add_import_arguments
from hf_mohd.conversion.scripts import add_script_arguments, finish, script_parser
from hf_mohd.interop import import_from_nemotron_h


def main(argv=None) -> int:
    parser = script_parser(__doc__)
    add_script_arguments(add_import_arguments(parser))
    args = parser.parse_args(argv)

    dtype = {"dtype": getattr(torch, args.dtype)} if args.dtype else {}
    import_from_nemotron_h(args.source, args.output, overwrite=args.overwrite, **dtype)
    print(f"LatentMoE model written to {args.output}")
    finish(args.output, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
