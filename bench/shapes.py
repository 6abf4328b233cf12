"""Public config shapes the benchmarks run at (random weights: speed ignores values)."""

SHAPES = {
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                        tie_word_embeddings=True, rope_theta=500000.0),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0),
}


def hf_config_dict(name: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5, **SHAPES[name]}
