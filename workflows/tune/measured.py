"""`planner tune --objective measured`: each trial's tree decoded on validation prompts.

Guessers: PPD uses trained prompt tokens when `prompt_tokens_dir` is given (for sources whose
ensemble size E matches theirs); otherwise (and for medusa/sequoia, which have no trained heads
here) the oracle guesser puts the model's own token at distance d at rank r with the acceptance
file's probability a_d[r], with real prompt-token inputs for PPD so that every forward pass has
its planned size. The oracle's continuation is plain decoding's output (same temperature and
seed); at temperature > 0 the sampled outputs diverge from it, so there the oracle measures
cost more than acceptance.
"""
from __future__ import annotations

from planner.cost import default_guessing
from planner.tree import PPD, Tree
from workflows.tune.search import Config, Source


class MeasuredEvaluator:
    """Decodes validation prompts with each trial's tree; tokens per second over all prompts."""

    def __init__(self, model_spec: str, prompts: list[str], *, max_new_tokens: int = 64, device: str | None = None,
                 dtype: str | None = None, temperature: float = 0.0, prompt_tokens_dir: str | None = None,
                 seed: int = 0, max_prompt_tokens_len: int = 256, top_k: int = 0, top_p: float = 1.0):
        from decoder import generate
        from decoder.engines.registry import EngineRequest, open_engine
        from decoder.guesser import PlainGuesser

        # the default engine (hf): trials' trees and PPD's prompt-token inputs need its trees and embeddings
        self.engine = open_engine(None, EngineRequest(model=model_spec, device=device, dtype=dtype))
        self.temperature, self.max_new_tokens, self.seed = temperature, max_new_tokens, seed
        self.warp = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self.prompt_tokens_dir = prompt_tokens_dir
        self._trained = None  # PromptTokens loaded from prompt_tokens_dir on first use
        self.vocab = self.engine.vocab_size
        self.input_ids = _encode(self.engine, prompts, self.vocab, max_prompt_tokens_len)
        self._plain = [generate(self.engine, x, None, PlainGuesser(), max_new_tokens, seed=seed, phase_times=False,
                                **self.warp) for x in self.input_ids]  # the same loop the trials run
        self.plain_tokens_per_s = _rate(self._plain)

    def guesser(self, tree: Tree, src: Source, prompt_ids, plain_tokens):
        import torch

        from decoder import OracleGuesser, PromptTokens

        if tree.method == PPD and self.prompt_tokens_dir:
            if self._trained is None:
                self._trained = PromptTokens.load(self.prompt_tokens_dir, self.engine)
            if self._trained.ensemble == src.ept:  # another E: no trained set for it, use the oracle
                return self._trained
        K = src.accept.num_ranks
        depth = tree.prompt_tokens_max if tree.method == PPD else max(1, tree.depth)
        pt = None
        if default_guessing(tree.method, src.accept, ensemble=src.ept).prompt_tokens:
            # the forward pass carries the prompt-token inputs the planner costed
            pt = PromptTokens.random(self.engine, depth, ensemble=src.ept, seed=self.seed, top_k=K)
        seq = torch.cat([prompt_ids.cpu(), plain_tokens.cpu()])
        return OracleGuesser(seq, self.vocab, depth, top_k=K, accuracy=src.accept.rows(depth), seed=self.seed,
                             prompt_tokens=pt)

    def __call__(self, tree: Tree, cfg: Config, src: Source) -> dict:
        from decoder import generate

        kw = {} if cfg.typical_eps is None else {"eps": cfg.typical_eps, "delta": cfg.typical_delta}
        outs = [generate(self.engine, x, plan=tree, guesser=self.guesser(tree, src, x, plain.tokens),
                         max_new_tokens=self.max_new_tokens, verify_rule=cfg.verify, seed=self.seed,
                         phase_times=False, **self.warp, **kw)
                for x, plain in zip(self.input_ids, self._plain)]
        tokens = sum(o.tokens.numel() for o in outs)
        steps = sum(o.steps for o in outs)
        rate = _rate(outs)
        return {"tokens_per_s": rate, "tokens_per_step": tokens / max(1, steps),
                "speedup": rate / self.plain_tokens_per_s if self.plain_tokens_per_s else None,
                "plain_tokens_per_s": self.plain_tokens_per_s}


def _encode(engine, prompts: list[str], vocab: int, max_len: int) -> list:
    import torch

    tok = engine.tokenizer
    if tok is not None:
        ids = [tok(p, return_tensors="pt").input_ids[0][:max_len] for p in prompts]
    else:  # random-weight preset without a tokenizer: bytes folded into the vocabulary
        ids = [torch.tensor([b % vocab for b in p.encode()][:max_len]) for p in prompts]
    return [x.to(engine.device) for x in ids]


def _rate(outs) -> float:
    tokens = sum(o.tokens.numel() for o in outs)
    seconds = sum(o.stats.total_s for o in outs)
    return tokens / seconds if seconds > 0 else 0.0
