"""Released head layouts at SmolLM2-135M-Instruct's own shape (hidden 576, 30 layers, 49152 tokens), random
weights: each loads against the real default model (the cached conversion) and decodes token for token as
its greedy `generate`; a head of another width is refused in one line."""
import pytest
import torch
from head_layouts import random_head, random_medusa, write_eagle1, write_eagle3, write_medusa, write_speculators

from decoder import generate
from decoder.guessers.heads import open_eagle
from decoder.guessers.registry import LoadRequest, load_guesser
from decoder.torch_ops.eagle import EAGLE1, EAGLE3
from planner.errors import UserError

torch.set_num_threads(2)
TOKENS = 16


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    from decoder.engines.hf.load import load_model

    loaded = load_model("smollm2-135m", device="cpu", dtype="fp32")
    tok = AutoTokenizer.from_pretrained(loaded.tokenizer_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = torch.as_tensor(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)[0]
    with torch.inference_mode():
        ref = loaded.model.generate(ids[None], do_sample=False, max_new_tokens=TOKENS, pad_token_id=2)[0, ids.numel():]
    return loaded.model, ids, ref.tolist()


def _write(layout: str, model, path):
    if layout == "eagle":
        return write_eagle1(random_head(model, EAGLE1, seed=1), path)
    if layout == "eagle3":  # yuhuili's EAGLE3-LLaMA3.1 keeps a 32000-token draft vocabulary
        return write_eagle3(random_head(model, EAGLE3, draft_vocab=32000, seed=2), path)
    if layout == "speculators":
        return write_speculators(random_head(model, EAGLE3, draft_vocab=8192, seed=3), path,
                                 model.get_input_embeddings().weight)
    return write_medusa(random_medusa(model, heads=3, seed=4), path, 3, 1)


@pytest.mark.parametrize("layout", ["eagle", "eagle3", "speculators", "medusa"])
def test_each_layout_at_smollm2_shape_decodes_as_generate(smol, layout, tmp_path):
    model, ids, ref = smol
    folder = _write(layout, model, tmp_path / layout)
    g = load_guesser("medusa-heads" if layout == "medusa" else "eagle-head", LoadRequest(model, path=str(folder), top_k=4))
    out = generate(model, ids, plan=None, guesser=g, max_new_tokens=TOKENS)
    assert out.tokens.tolist() == ref


def test_a_head_of_another_width_is_refused(smol, tmp_path):
    from test_decoder_utils import tiny_model

    model, _, _ = smol
    folder = write_eagle3(random_head(tiny_model("llama", vocab=49152, seed=1), EAGLE3, seed=2), tmp_path / "narrow")
    with pytest.raises(UserError, match=r"target_hidden_size 64, the target's hidden size is 576"):
        open_eagle(folder, model)


def test_decode_with_only_a_drafter_runs_the_heads_chain(smol, tmp_path, capsys):
    """`planner decode --drafter DIR` with no other decoding flag decodes with the head (its own chain), not the
    default guesser; the output is plain greedy decoding's."""
    from workflows.cli.main import main

    model, _, _ = smol
    folder = _write("eagle3", model, tmp_path / "eagle3")
    rc = main(["decode", "--drafter", str(folder), "--prompt", "Name three rivers in Europe.", "--max-new-tokens", "8",
               "--compare-plain", "--no-progress"])
    err = capsys.readouterr()
    assert rc == 0, err.err
    assert "chain:" in err.err + err.out and "identical: True" in err.err + err.out
