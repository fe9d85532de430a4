"""The Llama shapes the benchmarks compare at, in one place: the random checkpoints of
make_random_checkpoint.py (read by cuda_step_bench), the transformers baseline
(bench/hf_step_baseline.py) and the gpt-fast baseline (gpt_fast_bench.py) all build their
models from these, so the three tables describe the same networks. No torch import here.
"""

VOCAB = 128256
ROPE_THETA = 500000.0
ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}

SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         tie_word_embeddings=False, rope_scaling=dict(ROPE, factor=8.0)),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         tie_word_embeddings=True, rope_scaling=dict(ROPE, factor=32.0)),
    # 80 layers (141 GB): benchmarks write it cut to fewer layers (make_random_checkpoint.py
    # --layers) and report per layer.
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                          tie_word_embeddings=False, rope_scaling=dict(ROPE, factor=8.0)),
}

# A toy shape for smoke tests on a CPU; never a benchmark figure.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
            rope_scaling=dict(ROPE, factor=8.0))
TINY_VOCAB = 512


def shape(name):
    """The shape's fields and vocabulary size; 'tiny' is the smoke-test shape."""
    if name == "tiny":
        return TINY, TINY_VOCAB
    return SHAPES[name], VOCAB


def hf_config(name):
    """config.json contents (the Hugging Face layout) for a shape, as the checkpoints carry it."""
    s, vocab = shape(name)
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab,
                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=ROPE_THETA,
                attention_bias=False, mlp_bias=False, hidden_act="silu", bos_token_id=128000,
                eos_token_id=128001, torch_dtype="bfloat16", **s)


def gpt_fast_args(name):
    """Keyword arguments of gpt-fast's model.ModelArgs for a shape (its 'llama-3.1-8b' entry has
    the same fields). gpt-fast derives head_dim as dim // n_head, which matches both shapes, and
    has no tied-embedding option: the caller ties output to tok_embeddings itself."""
    s, vocab = shape(name)
    assert s["hidden_size"] // s["num_attention_heads"] == s["head_dim"], name
    rope = {k: v for k, v in s["rope_scaling"].items() if k != "rope_type"}
    return dict(block_size=131072, vocab_size=vocab, n_layer=s["num_hidden_layers"],
                n_head=s["num_attention_heads"], n_local_heads=s["num_key_value_heads"],
                dim=s["hidden_size"], intermediate_size=s["intermediate_size"],
                rope_base=ROPE_THETA, norm_eps=1e-5, rope_scaling=rope)
