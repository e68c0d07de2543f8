"""An unquantized LM head stored with ExLlamaV3's padding (head_bits 16, docs/format.md §5.2).

The converter keeps the head at the padded input width ([vocab, ceil_to(hidden, 128)], zero pad columns);
vLLM's head is [vocab, hidden]. Everything is vLLM's unquantized embedding method except that the loader
drops the pad columns (after checking they are zero: non-zero pad columns would mean a different layout).
"""

from __future__ import annotations

from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from ..format.errors import Exl3FormatError


class PaddedHeadMethod(UnquantizedEmbeddingMethod):
    def __init__(self, hidden: int, stored_width: int):
        super().__init__()
        self.hidden, self.stored_width = hidden, stored_width

    def create_weights(self, layer, *args, **extra_weight_attrs):
        vllm_loader = extra_weight_attrs["weight_loader"]

        def load_unpadded(param, loaded_weight, *rest):
            if loaded_weight.shape[-1] != self.stored_width:
                raise Exl3FormatError(None, "lm_head.weight", f"{self.stored_width} input columns",
                                      str(list(loaded_weight.shape)))
            if loaded_weight[:, self.hidden:].abs().sum() != 0:
                raise Exl3FormatError(None, "lm_head.weight", f"zero padding in columns {self.hidden}..",
                                      "non-zero values")
            return vllm_loader(param, loaded_weight[:, : self.hidden].contiguous(), *rest)

        extra_weight_attrs["weight_loader"] = load_unpadded
        super().create_weights(layer, *args, **extra_weight_attrs)
