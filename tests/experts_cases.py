"""Random DiffusionGemma expert blocks and routed tokens, for the batch-invariance tests of the
fast mode's grouped experts (tests/unit on CPU, tests/gpu on a device)."""

import torch


def experts_case(hidden, inter, experts, top_k, seed=0):
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaTextExperts

    cfg = DiffusionGemmaTextConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                                   top_k_experts=top_k, hidden_activation="gelu_pytorch_tanh")
    cfg._experts_implementation = "grouped_mm"  # what the loaded model runs
    module = DiffusionGemmaTextExperts(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=g) * hidden ** -0.5)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=g) * inter ** -0.5)
    return module


def routed_tokens(n, hidden, experts, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g)
    w, idx = torch.topk(torch.softmax(torch.randn(n, experts, generator=g), -1), top_k, dim=-1)
    return x, idx, w / w.sum(-1, keepdim=True)
