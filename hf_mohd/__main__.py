"""`python -m hf_mohd ...` runs the `hf-mohd` command line (`hf_mohd.cli.main`), with its exit status."""

import sys

from hf_mohd.cli import main


if __name__ == "__main__":
    sys.exit(main())
