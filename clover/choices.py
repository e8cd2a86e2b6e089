"""Names (and a few defaults) that command-line options offer, in a module that imports nothing.

`clover --help` and argument errors must answer without importing torch, transformers or the model (seconds), so
the CLI builds its parsers from these; the modules that implement each name import them from here, the one source
of truth.
"""

# clover.model.quant: weight-only quantisation at load; fp32 / bf16: unquantised weights, through the kernel
QUANTIZATIONS = ("none", "fp32", "bf16", "int8", "int4")

# clover.engine.decoding: the built-in unmasking rules (its registry, RULES, is filled as the classes are defined;
# tests/cli/test_startup.py checks that it holds exactly these)
RULE_NAMES = ("threshold", "top_k_per_step", "no_adjacent_repeat", "product_threshold", "left_to_right", "sub_blocks",
              "exact")

# clover.conversion: --from name -> the module under clover.conversion whose open_source(src, name) reads it
SOURCE_FORMATS: dict[str, str] = {
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5": "qwen3_5",
    "qwen3_next": "qwen3_next",
    "llama": "llama",
    "qwen3": "qwen",
    "qwen3_moe": "qwen",
    "qwen2": "qwen",
    "gguf": "gguf",
    # released block-diffusion checkpoints (clover.conversion.families)
    "sdar": "released",
    "fast_dllm_v2": "released",
    "dllm_bd3lm": "released",
    "arclm": "released",
}

# clover.serving.draft_memories: whose answers draft whose (clover serve --draft-memory; the default: each API key
# its own), and how many answer tokens a drafting memory keeps (clover.engine.drafts.draft_memory)
DRAFT_MEMORY_MODES = ("per-key", "shared", "off")
DRAFT_MEMORY = "per-key"
DRAFT_MEMORY_TOKENS = 262_144

# clover.conversion.gguf_export: the GGUF weight formats it writes
GGUF_QUANTS = ("f32", "f16", "q8_0", "q4_0", "q4_k")

# clover.training.bfcl: the BFCL splits, and the categories the train / eval splits draw from
BFCL_SPLITS = ("train", "eval", "live_simple")
TRAIN_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")

# clover.training.data: token shards
OVERLONG_POLICIES = ("split", "truncate")
DEFAULT_MAX_LEN = 4096
DEFAULT_SHARD_TOKENS = 1 << 25  # 32 Mi tokens: 128 MiB of ids per shard
