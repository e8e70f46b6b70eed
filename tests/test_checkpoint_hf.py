"""Hugging Face checkpoints of real ``transformers`` models (built from tiny configs, nothing downloaded).

Tied weights: ``save_pretrained`` writes a tied weight once; ``fsdp-ckpt import``
of it loads strictly, and ``export`` writes it once too (``--keep-tied``: twice).
"""

import pytest
import torch
from safetensors import safe_open

import checkpoint
from checkpoint.tool.cli import main as fsdp_ckpt

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _gpt2(seed: int):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16)
    return transformers.GPT2LMHeadModel(config).eval()


def _stored_names(directory) -> set[str]:
    names = set()
    for f in directory.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            names |= set(st.keys())
    return names


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(10).reshape(1, 10)).logits


def test_a_tied_gpt2_save_pretrained_imports_and_loads_strictly(tmp_path):
    hf = _gpt2(0)
    hf.save_pretrained(tmp_path / "hf")
    assert "lm_head.weight" not in _stored_names(tmp_path / "hf")
    assert fsdp_ckpt(["import", str(tmp_path / "hf"), str(tmp_path / "c"), "-q"]) == 0
    model = _gpt2(1)
    checkpoint.load(tmp_path / "c", model=model)  # strict: lm_head.weight comes through its twin
    assert torch.equal(_logits(model), _logits(hf))


@pytest.mark.parametrize("keep_tied", [False, True])
def test_export_writes_a_tied_weight_once_unless_asked_and_from_pretrained_matches(tmp_path, keep_tied):
    model = _gpt2(0)
    checkpoint.save(tmp_path / "c", model=model)
    args = ["export", str(tmp_path / "c"), str(tmp_path / "hf"), "--format", "safetensors", "--model-only", "-q"]
    assert fsdp_ckpt(args + (["--keep-tied"] if keep_tied else [])) == 0
    names = _stored_names(tmp_path / "hf")
    assert "transformer.wte.weight" in names and ("lm_head.weight" in names) == keep_tied
    model.config.save_pretrained(tmp_path / "hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(_logits(loaded), _logits(model))


EXPERTS = "model.layers.*.mlp.experts"
STACK_RULES = [
    (f"{EXPERTS}.gate_up_proj", "0", f"{EXPERTS}.#.gate_proj.weight,{EXPERTS}.#.up_proj.weight"),
    (f"{EXPERTS}.down_proj", "0", f"{EXPERTS}.#.down_proj.weight"),
]


def _rule_args(flag: str) -> list[str]:
    return [arg for rule in STACK_RULES for arg in (flag, *rule)]


def _qwen3_moe(seed: int):
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        num_hidden_layers=2,
        hidden_size=8,
        intermediate_size=12,
        moe_intermediate_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=32,
        num_experts=3,
        num_experts_per_tok=2,
        max_position_embeddings=16,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return transformers.Qwen3MoeForCausalLM(config).eval()


def test_a_per_expert_moe_checkpoint_imports_into_the_fused_experts_and_exports_back_per_expert(tmp_path):
    hf = _qwen3_moe(0)
    assert tuple(hf.model.layers[0].mlp.experts.gate_up_proj.shape) == (3, 16, 8)  # fused, 3-D
    hf.save_pretrained(tmp_path / "hf")
    per_expert = _stored_names(tmp_path / "hf")
    assert "model.layers.0.mlp.experts.2.up_proj.weight" in per_expert

    assert fsdp_ckpt(["import", str(tmp_path / "hf"), str(tmp_path / "c"), "-q", *_rule_args("--stack")]) == 0
    model = _qwen3_moe(1)
    checkpoint.load(tmp_path / "c", model=model)  # strict
    assert torch.equal(_logits(model), _logits(hf))

    checkpoint.save(tmp_path / "saved", model=model)
    args = ["export", str(tmp_path / "saved"), str(tmp_path / "out"), "--format", "safetensors", "--model-only", "-q"]
    assert fsdp_ckpt(args + _rule_args("--unstack")) == 0
    assert _stored_names(tmp_path / "out") == per_expert
    hf.config.save_pretrained(tmp_path / "out")
    loaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert torch.equal(_logits(loaded), _logits(hf))


def _gpt2_untied(seed: int):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16, tie_word_embeddings=False
    )
    return transformers.GPT2LMHeadModel(config).eval()


def test_an_untied_checkpoint_is_refused_by_a_tied_model_strictly_and_keeps_the_first_name_otherwise(tmp_path):
    untied = _gpt2_untied(0)
    checkpoint.save(tmp_path / "c", model=untied)
    tied = _gpt2(1)
    with pytest.raises(
        ValueError, match=r"model\.lm_head\.weight: differs from model\.transformer\.wte\.weight.*untied"
    ):
        checkpoint.load(tmp_path / "c", model=tied)
    result = checkpoint.load(tmp_path / "c", model=tied, strict=False)
    assert torch.equal(tied.transformer.wte.weight, untied.transformer.wte.weight)  # not overwritten by lm_head
    assert [m.split(":")[0] for m in result.mismatched_keys] == ["model.lm_head.weight"]


def test_a_checkpoint_storing_a_tied_weight_under_its_second_name_only_loads_strictly(tmp_path):
    from safetensors.torch import save_file

    hf = _gpt2(0)
    weights = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "transformer.wte.weight"}
    (tmp_path / "hf").mkdir()
    save_file(weights, tmp_path / "hf" / "model.safetensors")
    assert fsdp_ckpt(["import", str(tmp_path / "hf"), str(tmp_path / "c"), "-q"]) == 0
    model = _gpt2(1)
    checkpoint.load(tmp_path / "c", model=model)
    assert torch.equal(_logits(model), _logits(hf))


@pytest.mark.parametrize("stale", ["model.safetensors", "sharded", "pytorch_model.bin"])
def test_export_force_over_a_hugging_face_folder_replaces_its_weight_files_and_keeps_the_rest(tmp_path, cli, stale):
    hf = tmp_path / "hf"
    old = _gpt2(0)
    if stale == "pytorch_model.bin":
        old.config.save_pretrained(hf)
        torch.save(old.state_dict(), hf / "pytorch_model.bin")
    else:  # one model.safetensors, or model-0000k-of-0000n.safetensors + index
        old.save_pretrained(hf, **({"max_shard_size": "2KB"} if stale == "sharded" else {}))
    (hf / "tokenizer.json").write_text('{"version": "1.0"}')
    stale_files = sorted(p.name for p in hf.iterdir() if p.name.startswith(("model", "pytorch_model")))
    assert stale_files  # save_pretrained wrote the weights this test expects to be replaced
    new = _gpt2(1)
    checkpoint.save(tmp_path / "c", model=new)
    result = cli("export", tmp_path / "c", hf, "--format", "safetensors", "--model-only", "--force")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(hf).eval()
    assert torch.equal(_logits(loaded), _logits(new))  # what was exported, not the old weights nor a mix
    weights = sorted(p.name for p in hf.iterdir() if p.name.startswith(("model", "pytorch_model")))
    assert weights == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert (hf / "tokenizer.json").read_text() == '{"version": "1.0"}' and (hf / "config.json").is_file()
    assert f"replacing its earlier weight files ({', '.join(stale_files)}" in result.stdout
