"""SmolLM2-135M with every Linear on non-default CPU matmul paths: greedy decoding stays
token-identical across plain and tree steps, and against transformers' generate (without paths)
differs at most by a near tie of the top two logits (profiler.compare). Shares the cached conversion."""
import pytest
import torch

import decoder.engines.hf.cpu_paths as cp
from decoder import PromptLookupGuesser, generate
from planner.matmul_paths import matmul_paths_from_json
from profiler.compare import classify
from workflows.cli.inputs import SHIPPED_DIR, encode_prompts, held_out_prompts

torch.set_num_threads(2)
PICK = ("t", "onednn", "chunked", "linear")


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    from decoder.engines.hf.load import load_model

    loaded = load_model("smollm2-135m", device="cpu", dtype="fp32")
    tok = AutoTokenizer.from_pretrained(loaded.tokenizer_dir)
    _, texts = held_out_prompts(str(SHIPPED_DIR.parent / ".." / "shared" / "data" / "mt_bench_questions.jsonl"), 0, 1)
    return loaded.model, encode_prompts(tok, texts)


def test_paths_keep_smollm2_greedy_exact(smol):
    model, prompts = smol
    rows = list(range(1, 9))
    shapes = sorted({(m.out_features, m.in_features) for _, m in cp.linears(model)})
    table = matmul_paths_from_json({"version": 1, "rows": rows, "shapes": [
        {"out_features": o, "in_features": i, "paths": [PICK[(M + k) % 4] for M in rows]} for k, (o, i) in enumerate(shapes)]})
    refs = []
    for ids in prompts:
        with torch.inference_mode():
            refs.append(model.generate(ids[None], do_sample=False, max_new_tokens=16, pad_token_id=2)[0, ids.numel():].tolist())
    try:
        assert cp.install_paths(model, table) > 0
        for ids, ref in zip(prompts, refs):
            plain = generate(model, ids, max_new_tokens=16).tokens.tolist()
            assert classify(model, ids, ref, plain)["status"] != "mismatch"
            tree = generate(model, ids, plan=None, guesser=PromptLookupGuesser(), max_new_tokens=16).tokens.tolist()
            assert tree == plain
    finally:
        cp.remove_paths(model)
