"""MoHD's prepacked oneDNN sublayers (`hf_mohd.interop.vllm_mohd_cpu`) against the masked strategy, run with the Python
of `.venv-vllm` by test_vllm.py (vLLM's CPU operators exist only there): prints a JSON object.

For both sublayers of a tiny MoHD layer (attention: q/k/v fused, o_proj; MLP: gate/up fused, down_proj) and M tokens
across the plans (per token, dense, sorted by block; `vllm_mohd_cpu.DENSE_TOKENS` per side), the sublayer's `project_in` and
`project_out` (activation scaling, group fusion) on a plan of the packed strategy and on the masked strategy's plan of
the same routes, in float32: {sublayer: {M: {"error", "scale", "onednn_calls", "distinct_blocks"}}}, with
"onednn_calls" the `_C::onednn_mm` calls of the packed sublayer and "distinct_blocks" the routed blocks the M tokens
picked; and {"freed": the element counts of the packed projections' weights}.
"""

import copy
import json

import torch

from hf_mohd import MoHDConfig, MoHDForCausalLM
from hf_mohd.interop.vllm_mohd_cpu import pack_sublayer


TOKENS = (1, 2, 3, 16, 32, 33, 128, 129, 200)


def main() -> None:
    torch.manual_seed(0)
    config = MoHDConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_sub_dims=16, num_shared_sub_dims=6, num_routed_sub_dims_per_tok=2,
        sparse_implementation="masked",
    )  # fmt: skip
    layer = MoHDForCausalLM(config).eval().model.layers[0]
    for param in layer.parameters():  # group fusion and routers away from their identity / uniform initialisation
        torch.nn.init.normal_(param, std=0.1)
    results, freed = {}, {}
    for name, projections in (("attention", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj"))):  # fmt: skip
        module = layer.self_attn if name == "attention" else layer.mlp
        packed = copy.deepcopy(module)
        *inputs, output = (getattr(packed, p) for p in projections)
        packed.sub_dims.strategy = pack_sublayer(packed.sub_dims, inputs, output)
        freed[name] = [getattr(packed, p).weight.numel() for p in projections]
        *reference_inputs, reference_output = (getattr(module, p) for p in projections)
        width = reference_output.weight.shape[1]
        results[name] = {}
        with torch.no_grad():
            for m in TOKENS:
                x, h = torch.randn(1, m, config.hidden_size), torch.randn(1, m, width)
                plan = module.sub_dims.route(x, (*reference_inputs, reference_output))
                want = [*module.sub_dims.project_in(x, plan, reference_inputs)]
                want.append(module.sub_dims.project_out(h, plan, reference_output))
                with torch.profiler.profile() as profile:
                    plan = packed.sub_dims.route(x, (*inputs, output))
                    got = [*packed.sub_dims.project_in(x, plan, inputs), packed.sub_dims.project_out(h, plan, output)]
                _, _, ids = module.sub_dims.router(x)
                results[name][m] = {
                    "error": max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)),
                    "scale": max(b.abs().max().item() for b in want),
                    "onednn_calls": sum(e.count for e in profile.key_averages() if e.key == "_C::onednn_mm"),
                    "distinct_blocks": len(set(ids.view(-1).tolist())),
                }
    print(json.dumps({"sublayers": results, "freed": freed}))


if __name__ == "__main__":
    main()
