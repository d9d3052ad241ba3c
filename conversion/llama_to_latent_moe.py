#!/usr/bin/env python
"""Upcycle a dense LLaMA checkpoint (safetensors folder or GGUF file) into a LatentMoE model folder.

The dense FFN becomes the shared expert and `fc2_latent_proj` starts at zero, so the converted model computes the
source logits before any training. Same as `hf-mohd convert latent-moe`; the work is done by
`hf_mohd.conversion.llama_to_latent_moe` (docs/design.md section 6). Example:

    python conversion/llama_to_latent_moe.py path/to/llama out/latent-moe --num-experts 8 --num-experts-per-tok 2
"""

import argparse
import sys

from hf_mohd.commands.convert import add_latent_moe_arguments


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = add_latent_moe_arguments(parser).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
