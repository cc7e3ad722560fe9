"""The default model, SmolLM2-135M-Instruct from the package registry, end to end in fp32 on the CPU:
the cached conversion, the chat format, and greedy decoding with every shipped guesser
token-identical to model.generate. One module-scoped load serves every test here (the conversion
into the cache runs once per machine, about 30 s)."""
import pytest
import torch

from decoder import PromptLookupGuesser, PromptTokens, generate
from decoder.engines.shipped import MARKER, model_dir
from decoder.guessers.parallel import ParallelDrafter
from decoder.guessers.registry import LoadRequest, load_guesser
from planner.tree import Tree, TreeState
from workflows.cli.inputs import SHIPPED_DIR, encode_prompts, held_out_prompts

torch.set_num_threads(2)
SHIPPED = SHIPPED_DIR / "smollm2-135m"


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    from decoder.engines.hf.load import load_model

    loaded = load_model("smollm2-135m", device="cpu", dtype="fp32")
    return loaded, AutoTokenizer.from_pretrained(loaded.tokenizer_dir)


@pytest.fixture(scope="module")
def prompts(smol):
    _, tok = smol
    _, texts = held_out_prompts(str(SHIPPED_DIR.parent / ".." / "shared" / "data" / "mt_bench_questions.jsonl"), 0, 2)
    return encode_prompts(tok, texts)


_REFERENCES: dict = {}  # model.generate's greedy answer per (prompt, length): the same for every guesser


def _reference(model, ids, n):
    key = (id(model), tuple(ids.tolist()), n)
    if key not in _REFERENCES:
        with torch.inference_mode():
            out = model.generate(ids[None], do_sample=False, max_new_tokens=n, pad_token_id=2)
        _REFERENCES[key] = out[0, ids.numel():].tolist()
    return _REFERENCES[key]


def test_the_conversion_is_cached_and_complete(smol):
    loaded, tok = smol
    d = model_dir("smollm2-135m", progress=False)
    assert (d / MARKER).is_file() and (d / "model.safetensors").is_file()
    cfg = loaded.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == \
        (30, 576, 9, 3, 49152)
    assert loaded.has_weights and loaded.name == "smollm2-135m"
    ids = encode_prompts(tok, ["What is the capital of France?"])[0]
    assert tok.decode(ids[-4:]) == "<|im_start|>assistant\n"  # the chat template's assistant turn opens
    text = tok.decode(_reference(loaded.model, ids, 12), skip_special_tokens=True)
    assert "Paris" in text


def _static(nodes):
    return Tree("medusa", [TreeState(0, nodes, 1.0, 1 + len(nodes))], 1.0)


def _head(model):
    """The shipped EAGLE-3 head, loaded as `--drafter models/smollm2-135m/eagle3` loads it."""
    return load_guesser("eagle-head", LoadRequest(model, path=str(SHIPPED / "eagle3"), top_k=4))


@pytest.mark.parametrize("kind", ["ppd", "eagle-head", "parallelspec", "chain", "lookup"])
def test_every_shipped_guesser_is_token_identical(smol, prompts, kind):
    loaded, _ = smol
    model = loaded.model
    if kind == "ppd":
        g = PromptTokens.load(SHIPPED / "prompt_tokens", model=model)
        from test_decoder_utils import ppd_tree

        plan = ppd_tree(g.num_prompt_tokens, [0] + [4] * g.num_prompt_tokens, seed=1)
    elif kind == "eagle-head":
        g, plan = _head(model), _static([(0,), (1,), (0, 0), (0, 0, 0)])
    elif kind in ("parallelspec", "chain"):
        g = ParallelDrafter.load(SHIPPED / "parallelspec", mode="parallel" if kind == "parallelspec" else "chain")
        plan = _static([(0,), (1,), (0, 0), (0, 0, 0)]) if kind == "parallelspec" else None
    else:
        g, plan = PromptLookupGuesser(), None
    accepted = 0
    for ids in prompts:
        out = generate(model, ids, plan=plan, guesser=g, max_new_tokens=24)
        assert out.tokens.tolist() == _reference(model, ids, 24)
        accepted += sum(out.stats.accepted)
    if kind != "lookup":
        assert accepted > 0  # trained guessers are right some of the time


@pytest.mark.parametrize("kind", ["lookup+parallelspec", "lookup+chain", "eagle-head"])
def test_dynamic_plans_are_token_identical(smol, prompts, kind):
    """Per-step trees (a hybrid, and the head's expanding tree) on SmolLM2: what model.generate gives."""
    from decoder.guessers.dynamic import HybridGuesser
    from planner.accept import load_acceptance
    from planner.dynamic_plan import plan_dynamic

    loaded, _ = smol
    model = loaded.model
    acc = SHIPPED_DIR.parent / "reports" / "accept-smollm2-135m-heldout"
    kinds = kind.split("+")
    files = {k: SHIPPED / "eagle3" / "accept_heldout.json" if k == "eagle-head" else acc / f"accept-{k}.json" for k in kinds}
    plan = plan_dynamic([(k, load_acceptance(str(files[k]))) for k in kinds], None, 8, 4)
    if kind == "eagle-head":
        g = _head(model)
    else:
        mode = "chain" if kinds[1] == "chain" else "parallel"  # lookup+chain: the main job's quiet-machine choice
        g = HybridGuesser(PromptLookupGuesser(), ParallelDrafter.load(SHIPPED / "parallelspec", mode=mode), kinds[1])
    accepted = 0
    for ids in prompts:
        out = generate(model, ids, plan=plan, guesser=g, max_new_tokens=16)
        assert out.tokens.tolist() == _reference(model, ids, 16)
        accepted += sum(out.stats.accepted)
    assert accepted > 0
