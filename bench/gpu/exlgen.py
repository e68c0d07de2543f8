"""ExLlamaV3's own generator on an EXL3 pack: decode speed at batch 1 and 8, the bar the plugin's serving is held to.

Random token ids as prompts (64 tokens), a fixed number of new tokens (stop conditions off), the time from the
first generated token of the batch to the last: tokens after the first per second and ms per step.

    TORCH_EXTENSIONS_DIR=... python3 bench/gpu/exlgen.py PACK [--batch 1,8] [--tokens 128]   (prints one JSON line)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("pack")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    a = ap.parse_args()
    from exllamav3 import Cache, Config, Generator, Job, Model, Tokenizer
    from exllamav3.version import __version__

    t0 = time.time()
    config = Config.from_directory(a.pack)
    model = Model.from_config(config)
    batches = [int(b) for b in a.batch.split(",")]
    cache = Cache(model, max_num_tokens=max(batches) * (a.prompt + a.tokens + 256))
    model.load()
    tokenizer = Tokenizer.from_config(config)
    gen = Generator(model=model, cache=cache, tokenizer=tokenizer, max_batch_size=max(batches))
    out = {"exllamav3": __version__, "pack": a.pack, "load_s": round(time.time() - t0, 1), "runs": []}
    g = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    for b in batches:
        for warm in (True, False):
            jobs = [Job(input_ids=torch.randint(100, vocab - 100, (1, a.prompt), generator=g),
                        max_new_tokens=a.tokens, stop_conditions=[]) for _ in range(b)]
            for j in jobs:
                gen.enqueue(j)
            first = last = None
            tokens = 0
            while gen.num_remaining_jobs():
                results = gen.iterate()
                now = time.perf_counter()
                n = sum(len(r.get("token_ids", torch.empty(0)).flatten()) if isinstance(r.get("token_ids"),
                                                                                       torch.Tensor) else 0
                        for r in results if r.get("stage") == "streaming")
                if n:
                    first = first or now
                    last = now
                    tokens += n
            torch.cuda.synchronize()
        steps = a.tokens - 1
        secs = (last - first) if first and last else None
        out["runs"].append({"batch": b, "tokens": tokens, "decode_s": secs,
                            "ms_per_step": 1000 * secs / steps if secs else None,
                            "tok_s": (tokens - b) / secs if secs else None})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
