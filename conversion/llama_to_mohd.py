#!/usr/bin/env python
"""Convert a dense LLaMA checkpoint (safetensors folder or GGUF file) into a MoHD model folder.

Same as `hf-mohd convert mohd`; the work is done by `hf_mohd.conversion.llama_to_mohd` (docs/design.md section 6).
Example:

    python conversion/llama_to_mohd.py path/to/llama out/mohd-50 --preset compression_50 --verify
"""

import argparse
import sys

from hf_mohd.commands.convert import add_mohd_arguments


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = add_mohd_arguments(parser).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
