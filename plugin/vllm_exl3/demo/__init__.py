"""The bundled tiny EXL3 pack (see PROVENANCE.md) and a ChatML template for it (its tokenizer has none)."""

from pathlib import Path

PACK = Path(__file__).parent / "qwen3moe-tiny-exl3"
CHAT_TEMPLATE = Path(__file__).parent / "chatml.jinja"
