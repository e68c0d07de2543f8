"""What an EXL3 pack is: constants, errors, safetensors headers, records, the pack, its index and contract,
geometry, tensors, the pure-torch reference decoder, summary and dequant. The bottom layer: imports nothing above it,
and its header-only modules never import torch."""
