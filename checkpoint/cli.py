"""``python -m checkpoint.cli``: the documented module entry point of the ``fsdp-ckpt`` tool.

The tool lives in :mod:`checkpoint.tool` (the format library never imports it);
this module only forwards to it, and nothing in the library imports this module.
"""

from __future__ import annotations

from checkpoint.tool.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
