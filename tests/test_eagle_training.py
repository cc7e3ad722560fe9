"""EAGLE-3 training (training/eagle.py): the training-time test's unrolled chains are exactly what the head
computes when it drafts (same inputs, same attention), training lowers the loss and raises held-out chain
acceptance on a tiny target, and the answer mask finds the assistant's turns in the chat template."""
import torch
from test_decoder_utils import tiny_model

from decoder.torch_ops.eagle import EagleState, eagle3_from_target
from decoder.torch_ops.forward import pick_features
from training.eagle import EagleTrainConfig, eagle_loss, unrolled

torch.set_num_threads(1)
AUX = (0, 1)


def _data(target, n=12, T=40, seed=0):
    """Windows of the target's own greedy text, its top-k and its features."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    with torch.no_grad():
        for _ in range(n):
            ids = torch.randint(1, target.config.vocab_size, (4,), generator=g)
            out = target.generate(ids[None], do_sample=False, max_new_tokens=T - 4, min_new_tokens=T - 4, pad_token_id=0)
            rows.append(out[0, :T])
        tok = torch.stack(rows)
        o = target(input_ids=tok, output_hidden_states=True)
    top = torch.softmax(o.logits, -1).topk(8, -1)
    return tok, pick_features(o.hidden_states, AUX), top.indices, top.values


def test_the_unrolled_chain_is_what_the_head_drafts():
    target = tiny_model("llama", seed=1)
    head = eagle3_from_target(target, AUX, torch.arange(0, target.config.vocab_size, 2))
    tok, feats, _, _ = _data(target, n=1, T=24)
    steps = 3
    with torch.no_grad():
        train = unrolled(head, tok, feats, steps)  # step j: [1, S - j, H]
        g = head.combine(feats[0])  # [T, H]
        for s in (0, 5, 17):
            st = EagleState(head)
            # the head's cache holds slots 0..s-1, then its first pass feeds slot s (token x_{s+1}, feature g_s)
            out = st.forward(tok[0, 1: s + 2], torch.arange(1, s + 2), None, g[: s + 1])
            nxt = out.hidden[-1]
            want = [head.draft_logits(train[j][0, s]) for j in range(steps)]
            torch.testing.assert_close(out.logits[-1][head.target_ids()], want[0], atol=1e-4, rtol=1e-4)
            L = st.length
            for j in range(1, steps):  # its own chain: token x_{s+1+j} beside its previous output
                visible = torch.zeros(1, st.length + 1, dtype=torch.bool)
                visible[0, : L] = True  # the true slots 0..s
                visible[0, L:] = True  # its own chain's earlier drafts and itself
                step = st.forward(tok[0, s + 1 + j: s + 2 + j], torch.tensor([s + 1 + j]), visible, nxt[None])
                nxt = step.hidden[-1]
                torch.testing.assert_close(step.logits[-1][head.target_ids()], want[j], atol=1e-4, rtol=1e-4)


def test_training_lowers_the_training_and_the_held_out_loss():
    target = tiny_model("llama", vocab=24, seed=2)
    for p in target.parameters():
        p.requires_grad_(False)
    tok, feats, ids, probs = _data(target, n=20, T=40)
    head = eagle3_from_target(target, AUX, torch.arange(24))
    with torch.no_grad():
        for p in head.parameters():  # start away from the target's own layer, so there is something to learn
            if p.dim() == 2:
                p.add_(0.5 * torch.randn_like(p) * p.abs().mean())
    cfg = EagleTrainConfig(ttt_steps=3)
    w = torch.ones(tok.shape)

    def loss(rows):
        with torch.no_grad():
            return float(eagle_loss(head, tok[rows], feats[rows], ids[rows], probs[rows], w[rows], cfg)[0])

    train, held = torch.arange(16), torch.arange(16, 20)
    first, first_held = loss(train), loss(held)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        rows = torch.randint(0, 16, (4,), generator=gen)
        value, _ = eagle_loss(head, tok[rows], feats[rows], ids[rows], probs[rows], w[rows], cfg)
        opt.zero_grad()
        value.backward()
        opt.step()
    assert loss(train) < 0.9 * first
    assert loss(held) < first_held


def test_the_answer_mask_finds_the_assistants_turns():
    from workflows.cli.train_eagle import answer_weights

    class Tok:  # a chat template over single-character tokens: <a> opens the assistant's turn, $ ends a turn
        eos_token = "$"

        def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
            text = "".join(("u" if m["role"] == "user" else "<a>") + m["content"] + "$" for m in messages)
            return text + ("<a>" if add_generation_prompt else "")

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

        def convert_tokens_to_ids(self, t):
            return ord(t)

    text = "uhi$<a>yo$uq$<a>ok$"
    w = answer_weights(Tok(), torch.tensor([[ord(c) for c in text]]), 0.1)[0]
    predicts = [text[t + 1] if t + 1 < len(text) else None for t in range(len(text))]
    full = [p for p, x in zip(predicts, w.tolist()) if x == 1.0]
    assert full == ["y", "o", "$", "o", "k", "$"]
    assert sorted(set(round(x, 6) for x in w.tolist())) == [0.1, 1.0]
