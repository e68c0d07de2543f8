"""The native MoE op's limits as Python sees them, mirrored from csrc/moe.h and csrc/moe_planner.h
(tests/kernels/test_moe_constants.py reads them from there). Torch-free: the appliance's memory plan sizes the op's workspace with them without
importing torch."""

from __future__ import annotations

MAX_LOCAL_EXPERTS = 1024  # csrc/moe.h kMoeMaxExperts: the routing kernel keeps one counter per local expert
MOE_CHUNK_TOKENS = 1024  # csrc/moe_planner.h kMoeChunkTokens: tokens per internal step; the workspace holds one step
