"""vLLM's own step time against batch size and draft length K: the measuring half of
`planner profile --engine vllm` (profiler/vllm_profile.py is the other half).

Runs INSIDE vLLM's environment (decoder/engines/vllm/env.py) as a script, standard library and vLLM only:

    <vllm-venv>/bin/python steps_worker.py REQUEST.json OUT.jsonl

REQUEST {"model", "speculative" (bool), "draft_lengths", "batch_sizes", "prompt_length", "warmup_steps",
"repeats", "steps_per_repeat", "deadline" (a time.time() by which measuring stops), "seed",
"max_model_len", "temperature", "top_p", "top_k" (the decoding steps' sampling; greedy when absent)}. OUT gets one JSON object per line, flushed as it is known (vLLM's own log goes to
stdout and stderr, so results never do):

    {"event": "ready", "start_s", "vllm", "speculative_config"}
    {"event": "point", "draft_length", "batch_size", "step_s", "repeat_s", "steps", "full_steps",
     "other_steps", "context_mean", "wall_s", "drafts", "drafted"}
    {"event": "unmeasured", "draft_length", "batch_size", "reason"}
    {"event": "done"}

Two engines measure everything: vLLM plain (no speculative config: K = 0, the baseline a schedule's
K = 0 ranges are compared with) and one speculative engine for every K. That engine's proposer is
vLLM's `method: "custom_class"` hook with `MarkedDrafts` below: it drafts exactly the K that the
request's prompt carries in a marker token, up to the engine's `num_speculative_tokens` (the
largest K), so one engine start serves every K (an engine start costs 40-50 s on a 2-core CPU),
as a per-batch-size schedule (`num_speculative_tokens_per_batch_size`) runs several K in one engine.
Its drafts are a token the model never predicts, so verification rejects them and every sequence
gains one token per step: the step still scores 1 + K tokens per sequence (the forward, the logits
and the rejection sampler do not depend on what is accepted), and every K grows the context alike.
The scored length is checked from vLLM's own counters: drafted tokens per draft must be K and there
must be a draft per sequence per counted step.

Why not what seemed simpler: `rejection_sample_method: "synthetic"` (vLLM 0.32 accepts drafts at a
set rate, whatever the target says) is asserted away in the CPU build's rejection kernels
("Synthetic acceptance not supported with CPU sampling"); and ngram drafts that the model accepts
(prompts repeating a phrase) broke on one sequence or another in most steps at 4-16 sequences, so
too few steps had every sequence at 1 + K.

A step counts when every one of the b sequences gained a token in it, none finished, and the step
before counted too; then the time between the two steps' outputs (`llm_engine.step()` returning,
the offline engine with its multiprocess engine core, as the server runs it) is one engine step of
b sequences x (1 + K) scored tokens. The first `warmup_steps` counted steps of each point are
dropped (first use of a shape), the next `repeats` x `steps_per_repeat` are kept; a repeat's time is
its mean step, the point's the median of its repeats. The b sequences of a point start from distinct
random prompts of `prompt_length` tokens and the marker, the same ones at every K and batch size
(only the marker differs), so vLLM's prefix cache spares their prefill after the first point.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

KV_CACHE_GB = "2"  # VLLM_CPU_KVCACHE_SPACE, as the server runs: a small model's cache needs far less
MARK_ENV = "TREE_PLANNER_STEPS_MARK"  # "POSITION:BASE": the prompt token at POSITION is BASE + K
MARK_BASE = 1000
FIRST_TOKEN = 2000  # prompt tokens from here up: clear of a vocabulary's special tokens and of the markers
TAIL_STEPS = 4  # steps a point's sequences take past the counted ones: the first decode steps, the finish


class MarkedDrafts:
    """vLLM's custom_class proposer: K copies of the vocabulary's last token, K read from the marker."""

    def __init__(self, vllm_config):
        self.k_max = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_len = int(vllm_config.model_config.max_model_len)
        self.token = int(vllm_config.model_config.get_vocab_size()) - 1
        at, base = os.environ[MARK_ENV].split(":")
        self.at, self.base = int(at), int(base)

    def load_model(self, *args, **kwargs) -> None:
        pass  # nothing to load: the drafts are made up

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        out = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            k = int(token_ids_cpu[i, self.at]) - self.base if sampled and n > self.at else 0
            k = k if 0 <= k <= self.k_max else 0  # an unmarked prompt (the warm-up) drafts nothing
            out.append([self.token] * max(0, min(k, self.max_len - 1 - n)))
        return out


class Out:
    """The result file: one JSON object per line, flushed at once so the driver sees progress."""

    def __init__(self, path: str):
        self.path = path

    def emit(self, **obj) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")


def speculative_config(request: dict) -> dict | None:
    if not request["speculative"]:
        return None
    return {"method": "custom_class", "model": f"{Path(__file__).stem}.MarkedDrafts",
            "num_speculative_tokens": max(1, max(int(k) for k in request["draft_lengths"]))}


def prompts(request: dict, b: int, k: int, vocab: int) -> list[list[int]]:
    """b distinct prompts, the same at every K but for the marker at the end."""
    out = []
    for i in range(b):
        rng = random.Random(int(request["seed"]) * 100_003 + i)
        body = [rng.randrange(FIRST_TOKEN, max(FIRST_TOKEN + 1, min(vocab, 30_000)))
                for _ in range(int(request["prompt_length"]))]
        out.append(body + [MARK_BASE + k])
    return out


def spec_counts(llm) -> tuple[int, int]:
    """vLLM's counters of drafts (a sequence's draft in a step) and drafted tokens."""
    names = {"vllm:spec_decode_num_drafts": 0, "vllm:spec_decode_num_draft_tokens": 1}
    got = [0, 0]
    for m in llm.get_metrics():
        if m.name in names:
            got[names[m.name]] += int(getattr(m, "value", 0))
    return got[0], got[1]


def measure(llm, params, request: dict, k: int, b: int, vocab: int, serial: int) -> dict:
    """One batch of b sequences decoded to their end: the point's fields, or a reason."""
    engine = llm.llm_engine
    warm, reps, per = int(request["warmup_steps"]), int(request["repeats"]), int(request["steps_per_repeat"])
    plen = int(request["prompt_length"])
    ids = [f"s{serial}-k{k}-b{b}-{i}" for i in range(b)]
    drafts0, drafted0 = spec_counts(llm)
    for rid, p in zip(ids, prompts(request, b, k, vocab)):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    done = {rid: 0 for rid in ids}
    dts: list[float] = []
    contexts: list[float] = []
    steps = other = 0
    prev_full = aborted = False
    t0 = t_prev = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        t = time.perf_counter()
        steps += 1
        gains = {o.request_id: len(o.outputs[0].token_ids) for o in outs if o.outputs}
        full = (len(gains) == b and all(gains.get(r, 0) >= 1 and done[r] > 0 for r in ids)
                and not any(o.finished for o in outs))
        if full and prev_full:
            dts.append(t - t_prev)
            contexts.append(plen + 1 + statistics.fmean(done.values()))  # the marker, then the decoded
        elif any(done.values()):
            other += 1  # decoding, but not every sequence: the first decode step, the finish
        for r, g in gains.items():
            done[r] = done.get(r, 0) + g
        prev_full, t_prev = full, t
        if time.time() > float(request["deadline"]) and len(dts) >= warm + per:
            engine.abort_request(ids)
            aborted = True
            break
    wall = time.perf_counter() - t0
    drafts1, drafted1 = spec_counts(llm)
    kept = dts[warm:]
    n_rep = min(reps, len(kept) // per)
    if n_rep < 1:
        return {"reason": f"{len(dts)} of {steps} steps decoded all {b} sequences (needed {warm + per})"}
    repeat_s = [statistics.fmean(kept[i * per:(i + 1) * per]) for i in range(n_rep)]
    used = kept[:n_rep * per]
    return {"step_s": statistics.median(repeat_s), "repeat_s": repeat_s, "steps": len(used),
            "full_steps": len(dts), "other_steps": other,
            "context_mean": statistics.fmean(contexts[warm:warm + len(used)]), "wall_s": wall,
            "drafts": drafts1 - drafts0, "drafted": drafted1 - drafted0, "aborted": aborted}


def run(request: dict, out: Out) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    spec = speculative_config(request)
    plen = int(request["prompt_length"])
    os.environ[MARK_ENV] = f"{plen}:{MARK_BASE}"
    here = str(Path(__file__).resolve().parent)  # vLLM's worker processes import MarkedDrafts from here
    os.environ["PYTHONPATH"] = os.pathsep.join([here] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    t0 = time.perf_counter()
    llm = LLM(model=request["model"], dtype="float32", enforce_eager=True, max_model_len=int(request["max_model_len"]),
              seed=int(request["seed"]), speculative_config=spec, disable_log_stats=False)
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    out.emit(event="ready", start_s=time.perf_counter() - t0, vllm=vllm.__version__, speculative_config=spec)
    need = int(request["warmup_steps"]) + int(request["repeats"]) * int(request["steps_per_repeat"])
    # one token per step (the drafts are rejected): counted steps, then the first and last ones
    # sampled as the requests will be: verification's work depends on it. A draft (the vocabulary's last token)
    # outside top-p has probability 0 and is always rejected; without top-p, almost always
    sampling = {"temperature": float(request.get("temperature", 0.0)), "top_p": float(request.get("top_p", 1.0))}
    if int(request.get("top_k", 0)) > 0:
        sampling["top_k"] = int(request["top_k"])
    params = SamplingParams(**sampling, max_tokens=need + TAIL_STEPS, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.DELTA)
    llm.llm_engine.add_request("warm", {"prompt_token_ids": list(range(FIRST_TOKEN, FIRST_TOKEN + plen + 1))}, warm)
    while llm.llm_engine.has_unfinished_requests():  # the first use of every path before anything is timed
        llm.llm_engine.step()
    serial = 0
    for k in request["draft_lengths"]:
        for b in request["batch_sizes"]:
            serial += 1
            if time.time() > float(request["deadline"]):
                out.emit(event="unmeasured", draft_length=k, batch_size=b, reason="time budget")
                continue
            got = measure(llm, params, request, int(k), int(b), vocab, serial)
            if "reason" in got:
                out.emit(event="unmeasured", draft_length=k, batch_size=b, reason=got["reason"])
            else:
                out.emit(event="point", draft_length=k, batch_size=b, **got)
    out.emit(event="done")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python steps_worker.py REQUEST.json OUT.jsonl", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GB)
    with open(argv[0], encoding="utf-8") as f:
        request = json.load(f)
    run(request, Out(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
