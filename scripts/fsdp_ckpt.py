#!/usr/bin/env python
"""Run ``fsdp-ckpt`` from a source checkout without installing it: ``python scripts/fsdp_ckpt.py inspect CKPT``.

The tool itself is :mod:`checkpoint.tool.cli` (installed as the ``fsdp-ckpt`` console script).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from checkpoint.tool.cli import main  # noqa: E402  (needs the path above)

if __name__ == "__main__":
    sys.exit(main())
