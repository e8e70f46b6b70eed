"""``fsdp-ckpt``: the command-line tool over the checkpoint format library.

inspect / verify / diff / export / import / reshard (:mod:`checkpoint.tool.cli`), with
the streaming reader, transform rules and tensor-major writers only the tool uses.
The library (``checkpoint/*.py`` outside this package) never imports from here.
"""
