"""The shipped built-in model (models/builtin/): loads on CPU in fp32 from fp16 weights, its
tokenizer round-trips the chat format, its perplexity on held-out text is what training.json
says (recomputed on a slice, with tolerance), and its shipped prompt tokens load and guess."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from training import data
from training import prompts as tp

REPO = Path(__file__).resolve().parents[1]
BUILTIN = REPO / "models" / "builtin"
PROMPTS = BUILTIN / "prompt_tokens"
torch.set_num_threads(2)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(BUILTIN, dtype=torch.float32, local_files_only=True)
    return m.eval()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BUILTIN, local_files_only=True)


@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus(data.DEFAULT_DATA)


def test_checkpoint_is_small_and_documented():
    size = (BUILTIN / "model.safetensors").stat().st_size
    assert size < 8 * 2**20, size
    meta = json.loads((BUILTIN / "training.json").read_text())
    assert meta["validation"]["web_ppl"] > 1 and meta["validation"]["chat_ppl"] > 1
    assert set(meta["data_sha256"]) == {data.WEB_FILE, data.ANSWERS_FILE, data.QUESTIONS_FILE}
    cfg = json.loads((BUILTIN / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["max_position_embeddings"] >= 768


def test_tokenizer_chat_format(tokenizer):
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<unk>", "<pad>")] == [0, 1, 2, 3]
    text = data.chat_text(["What is 2 + 2?"], ["It is 4."])
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == 0 and ids[-1] == 1
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_heldout_questions_are_not_in_training(corpus):
    held = [q for q in range(81, 161) if data.held_out_question(q)]
    assert len(held) == 16 and len(corpus["chat_val"]) == 16 and len(corpus["chat_train"]) == 64
    train = "\n".join(corpus["chat_train"])
    questions = {r["question_id"]: r["turns"] for r in data.read_jsonl(data.DEFAULT_DATA / data.QUESTIONS_FILE)}
    for q in held:
        assert questions[q][0].strip() not in train


def _ppl(model, windows):
    with torch.no_grad():
        logits = model(input_ids=windows).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    return math.exp(nll.item())


def test_perplexity_matches_training_json(model, tokenizer, corpus):
    val = json.loads((BUILTIN / "training.json").read_text())["validation"]
    chat = data.token_windows(tokenizer, corpus["chat_val"], 256)[:12]
    web = data.token_windows(tokenizer, corpus["web_val"], 256)[:12]
    chat_ppl, web_ppl = _ppl(model, chat), _ppl(model, web)
    # A slice of the validation split, so allow sampling spread; a broken load would be ~vocab size.
    assert abs(math.log(chat_ppl / val["chat_ppl"])) < 0.35, (chat_ppl, val["chat_ppl"])
    assert abs(math.log(web_ppl / val["web_ppl"])) < 0.35, (web_ppl, val["web_ppl"])
    assert chat_ppl < 0.25 * model.config.vocab_size  # an untrained model scores about the vocabulary size


def test_greedy_continuation_is_not_degenerate(model, tokenizer, corpus):
    prompt = corpus["chat_val"][0].split(" ASSISTANT: ")[0] + " ASSISTANT:"
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=3)
    new = out[0, ids.shape[1] :].tolist()
    assert len(set(new)) >= 6, tokenizer.decode(new)


def test_shipped_prompt_tokens(model, tokenizer, corpus):
    from decoder.guessers.prompt_tokens import PromptTokens
    from planner.accept import load_acceptance

    pt = PromptTokens.load(PROMPTS, model)
    assert pt.embeddings.shape == (pt.num_prompt_tokens * pt.ensemble, model.config.hidden_size)
    acc = load_acceptance(str(PROMPTS / "accept_heldout.json"))
    assert acc.accuracy.shape[0] == pt.num_prompt_tokens
    report = json.loads((PROMPTS / "training.json").read_text())
    chat = data.token_windows(tokenizer, corpus["chat_val"], 256)[:6]
    ev = tp.evaluate(model, pt, chat, ranks=10, stride=4)
    documented = report["heldout"]["chat"]["top1"]
    for d in range(pt.num_prompt_tokens):
        assert abs(ev["top1"][d] - documented[d]) < 0.08, (ev["top1"], documented)
    # Trained tokens beat their initialisation (copies of vocabulary embeddings) on average top-1
    # and on the distillation KL at every distance.
    init = tp.evaluate(model, tp.init_prompt_tokens(model, pt.num_prompt_tokens, pt.ensemble, 0), chat, stride=4)
    assert sum(ev["top1"]) > sum(init["top1"]) + 0.05, (init["top1"], ev["top1"])
    assert all(a < b for a, b in zip(ev["kl"], init["kl"])), (init["kl"], ev["kl"])
