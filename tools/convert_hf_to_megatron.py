#!/usr/bin/env python
"""Same as `megatron-rl convert hf-to-megatron` (see megatron_rl/commands/convert.py)."""

import sys

from megatron_rl.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-megatron", *sys.argv[1:]]))
