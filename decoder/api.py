"""The library in five lines: open a model as an engine, load the plan the main job chose, generate.

    from decoder import api
    engine = api.open_engine("hf", model="smollm2-135m")           # or "llama.cpp"; any registered engine
    plan = api.load_plan("runs/latest/chosen.json", engine)         # the newest main job's plan, its guesser, how it was raced
    out = api.generate(engine, "Rewrite politely: send me the file.", plan, max_new_tokens=64)
    print(out.text, f"{out.tokens_per_s:.1f} tokens/s")

`load_plan` does what `planner decode --plan` does with no other flag: it loads the guesser the plan
was made for with the files it was raced with (each checked against its recorded checksum), installs
the profile's CPU matmul paths where the engine has them, and takes the verification rule the plan
was raced with under sampling. The plan names its strategy (decoder/loop.py): the tree's Steps with
its guesser, PEARL's rounds with its drafter, or plain decoding the engine's fastest way. `generate`
takes a text (formatted with the model's chat template) or token ids, and the decoding options of
decoder/config.py (max_new_tokens, temperature, top_k, top_p, seed, ...), and runs the one loop.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from decoder.config import DecodeConfig, decode_config
from decoder.output import GenerateOutput
from planner.errors import UserError
from planner.guessers import kind as guesser_kind
from planner.tree import Tree, load_tree


def open_engine(name: str | None = None, model: str | None = None, **request):
    """The engine `name` registers (planner/engines.py; None: the default) on `model`, with any other
    decoder.engines.registry.EngineRequest field (device, dtype, threads, ...)."""
    from decoder.engines.registry import EngineRequest
    from decoder.engines.registry import open_engine as open_

    return open_(name, EngineRequest(model=model, **request))


@dataclass
class Plan:
    """A plan file made ready for an engine: the strategy it decodes with, the decoding settings it was
    raced with, and what it is in words."""

    path: str
    strategy: object  # decoder/loop.py Strategy: Steps (the tree and its guesser), Pearl; None: plain decoding
    decoding: DecodeConfig  # the settings it was raced with (the rule under sampling)
    label: str  # "plain decoding", "PEARL, gamma 4", "lookup+draft sequoia (12 nodes)"

    @property
    def plain(self) -> bool:
        """The main job decided plain decoding: the engine's fastest plain way."""
        return self.strategy is None


@dataclass
class Completion:
    tokens: list[int]
    text: str | None  # None: the engine has no tokenizer
    output: GenerateOutput  # steps, per-step records, timings

    @property
    def tokens_per_s(self) -> float:
        s = self.output.stats.total_s
        return len(self.tokens) / s if s > 0 else 0.0


def load_plan(path, engine) -> Plan:
    """The plan at `path` (a tree file from `planner plan`, a main job's chosen.json, or its run folder:
    runs/latest is the newest run's), ready for `engine`."""
    from decoder.loop import resolve
    from planner.plan_settings import plan_settings

    if Path(path).is_dir():
        if not (Path(path) / "chosen.json").is_file():
            raise UserError(f"{path}: no chosen.json in this folder (the main job writes it when its race is done)")
        path = Path(path) / "chosen.json"
    label = str(path)
    tree = load_tree(path)
    made_for = tree.engine or "hf"
    if made_for != engine.caps.name:
        raise UserError(f"{label}: made for the {made_for} engine (its profile), not {engine.caps.name}")
    run = plan_settings(tree.settings, label)
    raced, folder = run.raced_with, Path(path).parent
    if raced is not None and raced.profile is not None and engine.caps.matmul_paths:
        engine.use_matmul_paths(str(raced.profile.check(folder, label, "the profile (matmul paths)")))
    sampling = decode_config().sampling
    if tree.settings.get("verify") in ("coupled", "lossless"):
        sampling = replace(sampling, mode=tree.settings["verify"])
    decoding = DecodeConfig(sampling=sampling)
    kind = run.guesser
    if kind is None or not guesser_kind(kind).guesses:
        return Plan(label, None, decoding, "plain decoding (the engine's fastest plain)")
    spec = guesser_kind(kind)
    files = _files(tree, raced, folder, label, spec, engine)
    if spec.loop is not None and run.pearl is not None:  # PEARL's rounds, drafting with its files' drafter
        from decoder.guessers.pearl import Pearl

        drafter = _load(_pearl_drafter(spec), files, engine).drafter
        return Plan(label, Pearl(drafter, run.pearl.gamma, run.pearl.threads), decoding, f"PEARL, gamma {run.pearl.gamma}")
    nodes = len(tree.states[0].nodes) if tree.states else 0
    steps = resolve(engine, tree, _load(kind, files, engine), decoding)  # the tree's Steps (a dynamic plan's too)
    return Plan(label, steps, decoding, f"{kind} {tree.method} ({nodes} nodes)")


def generate(engine, prompt, plan: Plan | None = None, config: DecodeConfig | None = None, **options) -> Completion:
    """Decode `prompt` (a text, formatted with the model's chat template, or token ids) with `plan`
    (None: plain decoding); options: decoder/config.py's fields (max_new_tokens, temperature, ...)."""
    from decoder.loop import generate as loop_generate

    ids = _ids(engine, prompt)
    cfg = decode_config(config or (plan.decoding if plan is not None else None), **options)
    out = loop_generate(engine, ids, plan.strategy if plan is not None else None, config=cfg)
    tokens = out.tokens.tolist()
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True) if engine.tokenizer is not None else None
    return Completion(tokens, text, out)


def _ids(engine, prompt) -> torch.Tensor:
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise UserError("prompt: a text needs a model with a tokenizer; give token ids")
        messages = [{"role": "user", "content": prompt.strip()}]
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return torch.tensor(list(ids), dtype=torch.long)
    return torch.as_tensor(prompt, dtype=torch.long).reshape(-1)


def _files(tree: Tree, raced, folder: Path, label: str, spec, engine) -> str | None:
    """The guesser's files: the ones it was raced with (checked), else the recorded folder, else the
    ones shipped for the engine's model."""
    if spec.files is None:
        return None
    if raced is not None and raced.guesser is not None:
        return str(raced.guesser.check(folder, label, "the guesser's files"))
    where = tree.provenance.get("guesser_dir")
    if isinstance(where, str) and Path(where).is_dir():
        return where
    from decoder.engines.models import shipped

    found = shipped(engine.model_name, spec.files)
    if found is None:
        raise UserError(f"{label}: the {spec.name} guesser's files ({spec.files}) are not at hand for model "
                        f"{engine.model_name}")
    return str(found)


def _pearl_drafter(spec) -> str:
    from planner.guessers import kinds

    return next(k.name for k in kinds(hybrids=False) if k.files == spec.files and k.loop is None and k.autotune)


def _load(kind: str, files: str | None, engine):
    from decoder.guessers.registry import LoadRequest, load_guesser

    return load_guesser(kind, LoadRequest(engine, files, label=files or kind))
