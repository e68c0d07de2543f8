"""EXL3 packs of the MoE families beyond Qwen3-MoE / GLM-4.5, made by ExLlamaV3's own converter from tiny random
models (arch_sources.py), each with ExLlamaV3's golden outputs (golden.py's `golden`).
On the GPU machine (run.sh does both):  python3 families.py make [fam,...]   then   python3 families.py pack a|b
(tars into $OUT, at most ~15 MB each). 'a' = fixture geometry, 'b' = another geometry (see arch_sources.py)."""
import json, os, subprocess, sys, tarfile, time, traceback

sys.path.insert(0, os.path.dirname(__file__))
import golden as G  # noqa: E402
import arch_sources as S  # noqa: E402

ARGS = {  # (fixture 'a', held-out 'b') converter arguments: bits and codebooks spread over the families
    "mixtral": (["-b", "4"], ["-b", "2.5", "-cb", "3inst"]),
    "minimaxm2": (["-b", "3", "-cb", "mcg"], ["-b", "5"]),
    "ernie45moe": (["-b", "4"], ["-b", "3", "-cb", "mcg"]),
    "qwen3next": (["-b", "4"], ["-b", "3", "-cb", "mcg"]),
    "qwen35moe": (["-b", "3.5"], ["-b", "4", "-cb", "mcg"]),
    "gptoss": (["-b", "4"], ["-b", "3"]),
    "glm4moelite": (["-b", "4", "-cb", "mcg"], ["-b", "2"]),
}
TEXTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
         "The history of the city begins in the early medieval period, when a small settlement grew around the river crossing."]
W = os.path.join(G.WORK, "arch")


def tag(args):
    b = args[args.index("-b") + 1]
    cb = args[args.index("-cb") + 1] if "-cb" in args else "mul1"
    return f"{cb}-b{b}"


def make(fams):
    tok = os.path.join(G.WORK, "tok")
    if not os.path.exists(os.path.join(tok, "tokenizer.json")):
        G.make_tokenizer(tok)
    status = {}
    for fam in fams:
        for v, args in zip("ab", ARGS[fam]):
            if v not in os.environ.get("VARIANTS", "ab"):
                continue
            name = f"{fam}-{v}"
            dst = os.path.join(W, v, f"{name}-exl3-{tag(args)}")
            if os.path.exists(os.path.join(dst, "golden", "meta.json")):
                status[name] = "done"; continue
            try:
                src = os.path.join(W, "src", name + "-bf16")
                if not os.path.exists(os.path.join(src, "config.json")):
                    t = time.time()
                    subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "arch_sources.py"),
                                    os.path.join(W, "src"), tok, fam], check=True, capture_output=True, text=True)
                    G.log("source", fam, "%.1fs" % (time.time() - t))
                G.convert(src, dst, args)
                G.golden(dst, TEXTS)
                status[name] = "ok"
            except BaseException as e:  # one family's failure must not stop the others
                status[name] = f"FAIL {type(e).__name__}: {str(e)[-300:]}"
                G.log(name, "FAILED"); G.log(traceback.format_exc()[-3000:])
            json.dump(status, open(os.path.join(G.OUT, f"status-{'-'.join(fams)[:40]}.json"), "w"), indent=1)
    G.log("status", json.dumps(status))


def pack(v, limit=15_000_000):
    root = os.path.join(W, v)
    dirs = sorted(os.path.join(root, d) for d in os.listdir(root) if os.path.exists(os.path.join(root, d, "golden", "meta.json")))
    n, cur, size = 0, [], 0
    def flush():
        nonlocal n, cur, size
        if cur:
            p = os.path.join(G.OUT, f"arch-{v}-{n}.tar.gz")
            with tarfile.open(p, "w:gz") as t:
                for d in cur:
                    t.add(d, arcname=os.path.basename(d),
                          filter=lambda ti: None if (v == "b" and "recon_inner" in ti.name) else ti)
            G.log("tar", p, os.path.getsize(p), [os.path.basename(d) for d in cur]); n += 1
        cur, size = [], 0
    for d in dirs:
        s = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs
                if not (v == "b" and "recon_inner" in f))
        if cur and size + s > limit * 1.6:  # gzip takes ~1/3 off random-ish trellis data at most
            flush()
        cur.append(d); size += s
    flush()


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make([f for f in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if f] or list(ARGS))
    else:
        pack(sys.argv[2])
