"""The base package imports no sibling: a user's own ``checkpoint.py`` / ``optim.py`` cannot break it."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_SHADOW = 'raise ImportError("the user\'s own {name}.py was imported instead of the package")\n'


def test_offload_fsdp_imports_from_a_directory_holding_checkpoint_py_and_optim_py(tmp_path):
    for name in ("checkpoint", "optim"):
        (tmp_path / f"{name}.py").write_text(_SHADOW.format(name=name))
    # The script's own directory comes first on sys.path, as for a user's train.py beside its checkpoint.py.
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(1, {str(REPO)!r})\n"
        "from offload_fsdp import HybridDeviceOptimizer\n"
        "from offload_fsdp.grad import get_grad\n"
        "from offload_fsdp.precision import PrecisionPolicy\n"
        "from offload_fsdp.shard_spec import ShardSpec\n"
        "import torch\n"
        "p = torch.nn.Parameter(torch.ones(4))\n"
        "opt = HybridDeviceOptimizer(torch.optim.AdamW([p], lr=0.1), offload_fraction=1)\n"
        "p.grad = torch.ones(4)\n"
        "opt.step()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('checkpoint', 'optim')))\n"
    )
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"offload_fsdp imported a sibling package: {out.stdout}"


def test_sibling_packages_import_the_base_downward_only():
    # checkpoint and optim may import offload_fsdp; offload_fsdp imports neither (checked above),
    # and checkpoint does not import optim nor optim checkpoint.
    for package, forbidden in (("checkpoint", "optim"), ("optim", "checkpoint")):
        pattern = re.compile(rf"^\s*(from|import) {forbidden}\b", re.MULTILINE)
        for path in (REPO / package).rglob("*.py"):
            assert not pattern.search(path.read_text()), (
                f"{path.relative_to(REPO)} imports {forbidden}: siblings meet only through offload_fsdp"
            )


def test_the_checkpoint_library_never_imports_its_fsdp_ckpt_tool():
    # The format library (checkpoint/*.py) is what training code imports; the tool (checkpoint/tool/)
    # builds on it, never the other way round, so the library stays usable without the tool's modules.
    # Indented (function-level) imports count too: the pattern allows leading whitespace.
    pattern = re.compile(r"^\s*(from|import) checkpoint\.tool\b|^\s*from checkpoint import tool\b", re.MULTILINE)
    # checkpoint/cli.py is the documented `python -m checkpoint.cli` entry point: it forwards to the tool,
    # and no library module may import it (checked below with the library's own imports).
    library = sorted(p for p in (REPO / "checkpoint").glob("*.py") if p.name != "cli.py")
    assert len(library) > 10, "found no library modules: did checkpoint/ move?"
    entry = re.compile(r"^\s*(from|import) checkpoint\.cli\b|^\s*from checkpoint import cli\b", re.MULTILINE)
    for path in library:
        assert not entry.search(path.read_text()), f"{path.relative_to(REPO)} imports the checkpoint.cli entry point"
        assert not pattern.search(path.read_text()), (
            f"{path.relative_to(REPO)} imports checkpoint.tool: move the piece it needs into the library"
        )


def test_importing_checkpoint_loads_only_the_base_leaf_modules_not_the_optimizer():
    code = "import sys, checkpoint; print('offload_fsdp.optimizer' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "import checkpoint loaded HybridDeviceOptimizer's module"


def test_the_documented_module_entry_point_python_m_checkpoint_cli_runs_the_tool():
    out = subprocess.run(
        [sys.executable, "-m", "checkpoint.cli", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "usage: fsdp-ckpt" in out.stdout


def test_the_optimizer_names_no_copy_engine_class_only_the_copy_engine_protocol():
    # Transfer sits behind CopyEngine: offload_fsdp/transfer.py picks the engine, and the optimizer
    # calls protocol members only, so a new engine never adds an isinstance branch to the optimizer.
    source = (REPO / "offload_fsdp" / "optimizer.py").read_text()
    for name in ("RingCopyEngine", "StreamCopyEngine", "SyncCopyEngine"):
        assert not re.search(rf"\b{name}\b", source), f"offload_fsdp/optimizer.py names {name}"


def test_only_the_engines_modules_and_the_one_chooser_name_a_copy_engine_class():
    # The composed objects (placement, schedule, host update, AMP, layout, ...) use the protocol too.
    allowed = {"copy_engine.py", "transfer_ring.py", "transfer.py"}
    for path in sorted((REPO / "offload_fsdp").glob("*.py")):
        if path.name in allowed:
            continue
        source = path.read_text()
        for name in ("RingCopyEngine", "StreamCopyEngine", "SyncCopyEngine"):
            assert not re.search(rf"\b{name}\b", source), f"offload_fsdp/{path.name} names {name}"
