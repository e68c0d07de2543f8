"""gpt-oss (gpt-oss-20b, gpt-oss-120b): every layer routes, attention with biases and per-head sinks (alternating
sliding and full layers: the same tensors), a router with a bias, experts with a clamped SwiGLU (`swiglu_limit`).

ExLlamaV3 writes each expert's fused, interleaved gate_up as two linears (`experts.<e>.gate_proj` from the even
columns, `up_proj` from the odd ones) and `down_proj`; it keeps the experts' biases of MXFP4 sources (as those
linears' `.bias`) but drops them from bf16 sources (it looks for `gate_up_proj.bias`, the sources hold
`gate_up_proj_bias`), and serves a pack without them as zero: so does the plugin."""

from __future__ import annotations

from ..architectures import Architecture, linear, plain
from ..family import COMMON, TOP_K, Family, Key
from .common import GATED, HEAD, NORMS, attention

GPT_OSS = Architecture(
    HEAD, NORMS + attention(True, True) + (plain("self_attn", "sinks"),), (),
    sparse_mlp=(linear("mlp.router", bias=True),), expert=GATED, experts_keys=("num_local_experts", "num_experts"),
    expert_may_bias=True)

FAMILY = Family(
    "gpt-oss", {"GptOssForCausalLM": GPT_OSS},
    COMMON + (TOP_K, Key("num_local_experts", least=1, required=True, reads="vLLM's GptOss"),
              Key("sliding_window", least=1, required=True, reads="vLLM's GptOss attention"),
              Key("swiglu_limit", kinds=(float,), choices=(7.0,),
                  reads="vLLM's GptOss, whose experts clamp at 7.0 whatever the config says"),
              Key("swiglu_alpha", kinds=(float,), choices=(1.702,),
                  reads="vLLM's GptOss, whose experts scale the sigmoid by 1.702 whatever the config says"),
              Key("rms_norm_eps", kinds=(float,), choices=(1e-5,),
                  reads="vLLM's GptOss, which builds its RMSNorms with 1e-5 whatever the config says")),
    implements=frozenset({"swiglu_limit", "swiglu_alpha"}),
    examples=("gpt-oss-120b", "gpt-oss-20b"),
    notes=("experts run a clamped SwiGLU (swiglu_limit, alpha 1.702, up + 1); packs converted from bf16 sources hold "
           "no expert biases (ExLlamaV3 1.6.5 drops them): served as zero, as ExLlamaV3 serves them",
           "on Hopper vLLM serves it in bf16 only (FlashAttention 3 takes attention sinks in bf16)"))
