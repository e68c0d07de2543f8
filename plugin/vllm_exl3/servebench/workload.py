"""The workload: prompt categories shipped as data files (`categories/*.toml`), each with a fixed output length,
and the sampling settings every request of a run shares (temperature 0, a seed, ignore_eos)."""

from __future__ import annotations

import random
import sys
from dataclasses import asdict, dataclass, field
from importlib import resources

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CATEGORY_DIR = "categories"
# The order of the report's rows: the prior art's eight categories.
CATEGORY_ORDER = ("coding", "prose", "reasoning", "summary", "format", "json", "html", "narrative")
# The prefill phase's prompts are token ids drawn from this range: ids every tokenizer the bench meets has (real
# vocabularies are far larger) and past the special tokens at the start; random, so no two prompts share a prefix
# (prefix caching would skip the prefill being measured).
PREFILL_ID_RANGE = (100, 1000)
# Output tokens per prefill request: a few, so the time is the prompt's.
PREFILL_OUTPUT_TOKENS = 8
PREFILL_CATEGORY = "prefill-{}"


class WorkloadError(ValueError):
    """A category file or a workload option that cannot be used (the message names which and why)."""


@dataclass(frozen=True)
class Category:
    name: str
    description: str
    max_tokens: int
    prompts: tuple[str, ...]


@dataclass(frozen=True)
class Prompt:
    """One request of the workload: which category, which prompt of it, the text and the output length."""

    category: str
    index: int
    text: str
    max_tokens: int
    token_ids: list[int] | None = None  # a prefill prompt: sent as token ids to /v1/completions, `text` unused


@dataclass
class Workload:
    """Everything that must be equal on both sides of a head-to-head run (stored in the raw JSON)."""

    categories: list[str]
    prompts_per_category: int
    max_tokens: int | None  # None: each category's own length
    concurrency: list[int]
    api: str  # "chat" or "completions"
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    warmup: int = 2
    prompts: list[Prompt] = field(default_factory=list)
    fill: int = 1  # each concurrency phase sends at least fill x concurrency requests (the prompts repeated)
    prefill_lengths: list[int] = field(default_factory=list)  # prompt lengths (tokens) of the prefill phase
    prefill_prompts: list[Prompt] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    def phase_prompts(self, concurrency: int) -> list[Prompt]:
        """The requests of one concurrency phase: every prompt once, repeated in order until there are at least
        `fill` x `concurrency` of them, so the level stays busy instead of draining after the first wave."""
        n = max(len(self.prompts), self.fill * concurrency)
        return [self.prompts[i % len(self.prompts)] for i in range(n)]

    def prefill_phase(self, length: int) -> list[Prompt]:
        return [p for p in self.prefill_prompts if p.category == PREFILL_CATEGORY.format(length)]

    def prefill_warmup(self, length: int) -> Prompt:
        """The prompt sent, not measured, before the prefill phase of `length` tokens: the first prompt of a new
        length pays one-time costs (a GEMM tuned or compiled for the new shape: one H200 run's first 2048-token
        prefill took 965 ms, the next two 47 ms). Its own ids, so the measured prompts find no prefix cached."""
        rng = random.Random(f"{self.seed}:{length}:warm-up")
        return Prompt(PREFILL_CATEGORY.format(length), -1, "", PREFILL_OUTPUT_TOKENS,
                      [rng.randrange(*PREFILL_ID_RANGE) for _ in range(length)])


def prefill_prompts(lengths: list[int], requests: int, seed: int) -> list[Prompt]:
    """`requests` prompts of each length, token ids drawn from PREFILL_ID_RANGE (deterministic in the seed)."""
    out = []
    for n in lengths:
        for i in range(requests):
            rng = random.Random(f"{seed}:{n}:{i}")
            out.append(Prompt(PREFILL_CATEGORY.format(n), i, "", PREFILL_OUTPUT_TOKENS,
                              [rng.randrange(*PREFILL_ID_RANGE) for _ in range(n)]))
    return out


def _check_category(name: str, raw: dict) -> Category:
    where = f"servebench/{CATEGORY_DIR}/{name}.toml"
    max_tokens, prompts = raw.get("max_tokens"), raw.get("prompts")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise WorkloadError(f"{where}: max_tokens must be a positive integer, found {max_tokens!r}")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise WorkloadError(f"{where}: prompts must be a non-empty list of non-empty strings")
    return Category(name, str(raw.get("description", "")), max_tokens, tuple(prompts))


def load_categories() -> dict[str, Category]:
    """Every category file shipped with the package, in the report's order (unknown names after, sorted)."""
    folder = resources.files(__package__) / CATEGORY_DIR
    found = {}
    for entry in folder.iterdir():
        if entry.name.endswith(".toml"):
            name = entry.name[: -len(".toml")]
            try:
                found[name] = _check_category(name, tomllib.loads(entry.read_text(encoding="utf-8")))
            except tomllib.TOMLDecodeError as e:
                raise WorkloadError(f"servebench/{CATEGORY_DIR}/{entry.name}: not valid TOML: {e}") from e
    order = [n for n in CATEGORY_ORDER if n in found] + sorted(set(found) - set(CATEGORY_ORDER))
    return {n: found[n] for n in order}


def build_workload(categories: list[str] | None, prompts_per_category: int | None, max_tokens: int | None,
                   concurrency: list[int], api: str, seed: int = 0, ignore_eos: bool = True,
                   warmup: int = 2, fill: int = 1, prefill_lengths: list[int] | None = None,
                   prefill_requests: int = 3) -> Workload:
    """The prompts of a run: the first `prompts_per_category` prompts of each chosen category (all when None),
    each with its category's output length unless `max_tokens` overrides it; and the prefill phase's prompts,
    `prefill_requests` of each length in `prefill_lengths`."""
    known = load_categories()
    chosen = categories or list(known)
    unknown = [c for c in chosen if c not in known]
    if unknown:
        raise WorkloadError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                            f"the shipped ones are {', '.join(known)}")
    if prompts_per_category is not None and prompts_per_category < 1:
        raise WorkloadError(f"--prompts must be at least 1, found {prompts_per_category}")
    if max_tokens is not None and max_tokens < 2:
        raise WorkloadError(f"--max-tokens must be at least 2 (decode speed needs tokens after the first), "
                            f"found {max_tokens}")
    if warmup < 0:
        raise WorkloadError(f"--warmup must be 0 or more, found {warmup}")
    if fill < 1:
        raise WorkloadError(f"--fill must be at least 1, found {fill}")
    prefill_lengths = sorted(set(prefill_lengths or []))
    if any(n < 1 for n in prefill_lengths) or (prefill_lengths and prefill_requests < 1):
        raise WorkloadError(f"--prefill lengths and --prefill-requests must be positive, found {prefill_lengths} "
                            f"and {prefill_requests}")
    prompts = []
    for name in chosen:
        cat = known[name]
        for i, text in enumerate(cat.prompts[:prompts_per_category]):
            prompts.append(Prompt(name, i, text, max_tokens or cat.max_tokens))
    return Workload(chosen, prompts_per_category or max(len(known[c].prompts) for c in chosen), max_tokens,
                    concurrency, api, seed, 0.0, ignore_eos, warmup, prompts, fill, prefill_lengths,
                    prefill_prompts(prefill_lengths, prefill_requests, seed))
