"""``fsdp-ckpt``: inspect, verify, reshard, export, import and diff checkpoints; gc unfinished saves.

Installed as the console script ``fsdp-ckpt``; also ``python -m checkpoint.tool.cli``.
Works in one process without ``torchrun``. Every command streams tensor by
tensor, so memory stays near the largest tensor, never the whole checkpoint.

Exit codes: 0 success; 1 the command ran and found a problem (``verify``
problems, ``diff`` differences); 2 it could not run (bad arguments, missing
path, not a checkpoint, corrupt file, bad rule). Every non-zero exit ends with
one line ``fsdp-ckpt: error: <what>; <how to fix>`` on stderr; ``--debug``
shows the traceback instead.

This module is the tool's front: the argument parser, :func:`main` and the
error / exit-code handling. The commands live beside it, one module per
concern: ``cli_inspect`` (inspect, verify), ``cli_diff`` (diff),
``cli_convert`` (export, import, reshard); ``cli_source`` opens their input,
``cli_report`` holds :class:`CliError`, sizes and the progress bar, and
``cli_parallel`` the ``torchrun`` mode.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from checkpoint.atomic import output_path
from checkpoint.manifest import NotACheckpointError
from checkpoint.tool.cli_convert import cmd_export, cmd_import, cmd_reshard
from checkpoint.tool.cli_diff import cmd_diff
from checkpoint.tool.cli_gc import cmd_gc
from checkpoint.tool.cli_inspect import cmd_inspect, cmd_verify
from checkpoint.tool.cli_parallel import SOLO, PeerFailed, join_group, leave_group
from checkpoint.tool.cli_report import EXIT_CANNOT_RUN, PROG, CliError, process_rank

__all__ = ["CliError", "build_parser", "main"]


# --------------------------------------------------------------------------- argument parsing


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal, as Hugging Face reads it); ``"512MiB"`` -> binary."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    size = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive size")
    return size


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other failure."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message}; see `{self.prog} --help`")


def _add_rule_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("key transforms (split/merge match stored names; renames run last)")
    g.add_argument(
        "--rename",
        nargs=2,
        action="append",
        metavar=("REGEX", "REPLACEMENT"),
        help="re.sub on each parameter name (model weights and their optimizer state alike)",
    )
    g.add_argument(
        "--split",
        nargs=3,
        action="append",
        metavar=("FUSED", "DIM", "PARTS"),
        help="split FUSED (name, '*' = any text) along DIM into comma-separated PARTS, "
        "each optionally NAME:SIZE (default: equal sizes)",
    )
    g.add_argument(
        "--merge",
        nargs=3,
        action="append",
        metavar=("FUSED", "DIM", "PARTS"),
        help="the inverse of --split with the same arguments",
    )
    g.add_argument(
        "--stack",
        nargs=3,
        action="append",
        metavar=("STACKED", "DIM", "PARTS"),
        help="stack per-index tensors along a new dim 0: PARTS are names with '#' for the index "
        "(0, 1, ...); several parts of one index are first concatenated along DIM "
        "(MoE experts.#.gate_proj.weight,experts.#.up_proj.weight -> experts.gate_up_proj)",
    )
    g.add_argument(
        "--unstack",
        nargs=3,
        action="append",
        metavar=("STACKED", "DIM", "PARTS"),
        help="the inverse of --stack with the same arguments",
    )
    g.add_argument(
        "--reshape",
        nargs=2,
        action="append",
        metavar=("NAME", "SHAPE"),
        help="reshape NAME ('*' = any text) to SHAPE, comma-separated (e.g. 8,64,32)",
    )
    g.add_argument(
        "--rules",
        metavar="JSON",
        help='rules file: {"rename": [[regex, repl]], "split": [{"fused", "dim", "parts", "sizes"}], "merge": [...], '
        '"stack": [{"fused", "dim", "parts"}], "unstack": [...], "reshape": [[name, [sizes]]]}',
    )


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="log milestones (INFO) to stderr")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")


_EXAMPLES = {
    "inspect": """examples:
  fsdp-ckpt inspect ckpt/step_500
  fsdp-ckpt inspect ckpt/step_500 --json | jq '.totals'""",
    "verify": """examples:
  fsdp-ckpt verify ckpt/step_500            # exit 0: complete; exit 1: problems listed
  fsdp-ckpt verify ckpt/step_500 --no-checksums""",
    "reshard": """examples:
  fsdp-ckpt reshard ckpt/step_500 ckpt/step_500_w64 --world-size 64
  fsdp-ckpt reshard a b --world-size 8 --rename '^decoder\\.' 'model.'""",
    "export": """examples:
  fsdp-ckpt export ckpt/step_500 hf/ --format safetensors --model-only --max-shard-size 5GB
  fsdp-ckpt export ckpt/step_500 hf/ --format safetensors --model-only --dtype bf16 \\
      --split 'layers.*.mlp.linear_fc1.weight' 0 'layers.*.mlp.gate_proj.weight,layers.*.mlp.up_proj.weight'
  fsdp-ckpt export ckpt/step_500 full.pt --format torch""",
    "import": """examples:
  fsdp-ckpt import hf/ ckpt/init --world-size 8            # HF directory (index json) -> fsdp_dtensor
  fsdp-ckpt import model.safetensors ckpt/init
  fsdp-ckpt import weights.pt ckpt/init \\
      --merge 'layers.*.mlp.linear_fc1.weight' 0 'layers.*.mlp.gate_proj.weight,layers.*.mlp.up_proj.weight'""",
    "diff": """examples:
  fsdp-ckpt diff ckpt/a ckpt/b                 # exact; exit 1 on any difference
  fsdp-ckpt diff ckpt/a ckpt/b --atol 1e-6 --rtol 1e-5""",
    "gc": """examples:
  fsdp-ckpt gc s3://bucket/run/step_500      # a save in progress (its lease, or its lock) is left alone
  fsdp-ckpt gc ckpt/step_500
  fsdp-ckpt gc s3://bucket/run/step_500 --force   # also leftovers whose lease looks held (no save runs)""",
}


_AddCommand = Callable[[str, str], argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Inspect, verify, reshard, export, import and diff fsdp_dtensor / DCP checkpoints, "
        "streaming one tensor at a time.",
        epilog="run `fsdp-ckpt <command> --help` for the options and examples of each command",
    )
    sub = parser.add_subparsers(
        dest="command", metavar="{inspect,verify,reshard,export,import,diff,gc}", parser_class=_Parser
    )
    sub.required = True

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=_EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_common(p)
        return p

    _add_inspect_and_verify(add)
    _add_reshard_and_import(add)
    _add_export(add)
    _add_diff(add)
    p = add("gc", "remove what killed or failed saves left at a checkpoint path (never the committed checkpoint)")
    p.add_argument("ckpt")
    p.add_argument(
        "--force",
        action="store_true",
        help="also remove save directories and commit claims whose lease looks held (a save on another host "
        "killed less than the lease time ago); only while no save to that path runs",
    )
    p.set_defaults(func=cmd_gc)
    return parser


def _add_inspect_and_verify(add: _AddCommand) -> None:
    p = add("inspect", "keys with dtype, global shape, chunk count and bytes; totals; format, world size, commit")
    p.add_argument("ckpt")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = add("verify", "check coverage, files against the manifest, and that every chunk reads")
    p.add_argument("ckpt")
    p.add_argument("--no-checksums", action="store_true", help="check file sizes only (faster)")
    p.set_defaults(func=cmd_verify)


def _add_reshard_and_import(add: _AddCommand) -> None:
    for name, verb in (
        ("reshard", "rewrite a checkpoint for --world-size ranks (no model code needed)"),
        ("import", "safetensors file / HF directory / torch file -> fsdp_dtensor checkpoint"),
    ):
        p = add(name, verb)
        p.add_argument("src")
        p.add_argument("dst")
        p.add_argument(
            "--world-size",
            type=int,
            default=1 if name == "import" else None,
            required=name == "reshard",
            help="ranks to lay the checkpoint out for",
        )
        p.add_argument(
            "--max-chunk-size",
            type=parse_size,
            default=parse_size("64MiB"),
            help="largest stored chunk (default 64MiB, as checkpoint.save; at least one element), "
            "so later reshards read small pieces",
        )
        p.add_argument("--force", action="store_true", help="write into an existing non-empty output")
        if name == "import":
            p.add_argument(
                "--key-prefix",
                default=None,
                help="prefix for imported names (default 'model.'; '' keeps names as they are)",
            )
        _add_rule_args(p)
        p.set_defaults(func=cmd_reshard if name == "reshard" else cmd_import, parallel=True)


def _add_export(add: _AddCommand) -> None:
    p = add("export", "checkpoint -> HF-style sharded safetensors or one torch file")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--format", required=True, choices=("safetensors", "torch"))
    p.add_argument("--model-only", action="store_true", help="model weights only, named by fqn (no 'model.' prefix)")
    p.add_argument("--dtype", help="cast floating model weights, e.g. bf16 (optimizer state keeps its dtype)")
    p.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=parse_size("5GB"),
        help="safetensors shard limit (default 5GB; a larger tensor gets its own shard)",
    )
    p.add_argument("--force", action="store_true", help="write into an existing non-empty output")
    p.add_argument(
        "--keep-tied",
        action="store_true",
        help="also write the second name of a tied weight (default: once, as save_pretrained does)",
    )
    _add_rule_args(p)
    p.set_defaults(func=cmd_export, parallel=True)


def _add_diff(add: _AddCommand) -> None:
    p = add("diff", "key-by-key comparison; exit 1 on any difference")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0)
    p.add_argument("--rtol", type=float, default=0.0)
    p.set_defaults(func=cmd_diff)


def _error_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) if str(exc) else type(exc).__name__
    if isinstance(exc, KeyError):
        text = text.strip("\"'")
    if ";" in text and not isinstance(exc, (RuntimeError, AssertionError)):
        return text
    if isinstance(exc, (CliError, ValueError, TypeError, NotACheckpointError, KeyError)):
        return f"{text}; check the arguments (see `{PROG} --help`)"
    if isinstance(exc, FileNotFoundError):
        return f"{text}; check the path"
    if isinstance(exc, OSError):
        return f"{text}; check the path, permissions and free space"
    return f"unexpected {type(exc).__name__}: {text}; rerun with --debug and report the traceback"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fsdp-ckpt``; returns the exit code (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    group = SOLO
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(
            level=logging.INFO if args.verbose and process_rank() == 0 else logging.WARNING,
            format=f"{PROG}: %(message)s" if not debug else "%(asctime)s %(name)s %(levelname)s: %(message)s",
        )
        if getattr(args, "dst", None) is not None:
            args.dst = str(output_path(args.dst))  # normalised once: `sub/..` is the directory it names
        args.group = group = join_group()  # SOLO unless run under torchrun
        if group.rank != 0 and not getattr(args, "parallel", False):
            return 0  # commands that do not split their work run on process 0 only
        code = args.func(args)
        sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at interpreter exit
        return code
    except SystemExit:
        raise  # --help
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted; outputs may be incomplete, delete them and rerun", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`fsdp-ckpt inspect ... | head`): not our failure, so no
        # error line; point stdout at /dev/null so the interpreter's final flush is quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except BaseException as exc:
        if debug:
            raise
        code = exc.exit_code if isinstance(exc, CliError) else EXIT_CANNOT_RUN
        sys.stdout.flush()
        if group.rank == 0 or not isinstance(exc, PeerFailed):  # a peer's failure is reported once, by process 0
            print(f"{PROG}: error: {_error_line(exc)}", file=sys.stderr)
        return code
    finally:
        leave_group(group)


if __name__ == "__main__":
    sys.exit(main())
