"""Parameter and FLOP accounting of MoHD (and plain LLaMA) configs, without building the model.

Counts follow docs/design.md section 3 ("Presets", accounting paragraph): total and activated parameters, forward FLOPs
per token at a given context length (2 FLOPs per multiply-add; matmuls plus attention scores QK^T and AV), with the
word-token embedding and the LM head reported separately (they grow with the total width in MoHD expansion).
"""

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Accounting:
    """Sizes of one config. Parameters are counts; FLOPs are per token for one forward pass.

    `total_params` counts every stored parameter once (a tied LM head is not counted twice); `activated_params`
    counts the decoder parameters a token reads (embedding and LM head excluded, given separately).
    """

    total_params: int
    decoder_params: int
    activated_decoder_params: int
    embedding_params: int
    lm_head_params: int
    router_params: int
    fusion_params: int
    decoder_flops_per_token: int
    lm_head_flops_per_token: int
    context_length: int

    @property
    def activated_params(self) -> int:
        """Activated decoder parameters plus the LM head (the usual 'activated parameters' of MoE papers)."""
        return self.activated_decoder_params + self.lm_head_params

    def decode_weight_bytes_per_token(self, bytes_per_param: int = 4) -> int:
        """Bytes of weights one batch-1 decoding step reads: the activated decoder parameters plus the LM head.

        This is the memory-bound cost of decoding; the embedding row and the key/value cache are left out
        (one row, and a few MB at short contexts). 4 bytes per parameter is fp32.
        """
        return (self.activated_decoder_params + self.lm_head_params) * bytes_per_param

    def as_dict(self) -> dict:
        return {**asdict(self), "activated_params": self.activated_params}


def mohd_accounting(config, context_length: int = 2048) -> Accounting:
    """Accounting of a `MoHDConfig` or a LLaMA-style config (then every block counts as shared).

    Args:
        config: `MoHDConfig`, `LlamaConfig`, or any config with LLaMA fields.
        context_length: number of keys each query attends to, for the attention-score FLOPs.

    Returns:
        An `Accounting`. For a MoHD sparsified sublayer, a token reads the n_a / N fraction of the columns of
        Q/K/V/gate/up and of the rows of o_proj/down (plus all of the router, N_r x D, and the fusion, N x N).
    """
    d = config.hidden_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    inter, layers, vocab = config.intermediate_size, config.num_hidden_layers, config.vocab_size
    n = getattr(config, "num_sub_dims", 1)
    n_shared = getattr(config, "num_shared_sub_dims", n)
    n_routed = n - n_shared
    n_active = n_shared + getattr(config, "num_routed_sub_dims_per_tok", 0)
    sparse = set(getattr(config, "sparse_modules", ())) if n_routed > 0 else set()
    fusion = getattr(config, "group_fusion", "none") == "mix"
    attn_bias, mlp_bias = bool(getattr(config, "attention_bias", False)), bool(getattr(config, "mlp_bias", False))

    qkv_out = (heads + 2 * kv_heads) * head_dim
    # (weights read on the input side, on the output side, biases of each side) per sublayer
    sublayers = {
        "attention": (d * qkv_out, heads * head_dim * d, qkv_out * attn_bias, d * attn_bias),
        "ffn": (2 * d * inter, inter * d, 2 * inter * mlp_bias, d * mlp_bias),
    }
    total = active = routers = fusions = flops = 0
    for name, (w_in, w_out, b_in, b_out) in sublayers.items():
        total += w_in + w_out + b_in + b_out
        if name in sparse:
            frac = n_active / n
            active_w = int(w_in * frac) + int(w_out * frac)
            active += active_w + b_in + int(b_out * frac)
            routers += n_routed * d
            fusions += n * n * fusion
            flops += 2 * (active_w + n_routed * d + n * d * fusion)
        else:
            active += w_in + w_out + b_in + b_out
            flops += 2 * (w_in + w_out)
    norms = 2 * d
    per_layer_total = total + routers + fusions + norms
    decoder = layers * per_layer_total + d
    activated = layers * (active + routers + fusions + norms) + d
    attention_flops = 4 * heads * head_dim * context_length
    embedding = vocab * d
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return Accounting(
        total_params=decoder + embedding + (0 if tied else embedding),
        decoder_params=decoder,
        activated_decoder_params=activated,
        embedding_params=embedding,
        lm_head_params=embedding,
        router_params=layers * routers,
        fusion_params=layers * fusions,
        decoder_flops_per_token=layers * (flops + attention_flops),
        lm_head_flops_per_token=2 * embedding,
        context_length=context_length,
    )
