"""Greedy tree decoding equals model.generate; edge cases; KV compaction equals plain decoding."""
import pytest
import torch
from test_decoder_utils import V, ppd_tree, reference, static_tree, tiny_model

from decoder import (
    OracleGuesser,
    PromptTokens,
    generate,
    prompt_block_mask,
)
from decoder.torch_ops.cache import compact_cache
from decoder.torch_ops.forward import prefill, step_mask, tree_forward
from decoder.verify import verify_greedy
from planner.errors import UserError

torch.set_num_threads(1)

PLANS = [
    ("medusa", static_tree("medusa", 1, 1)),
    ("medusa", static_tree("medusa", 6, 2)),
    ("medusa", static_tree("medusa", 20, 4)),
    ("sequoia", static_tree("sequoia", 5, 3, seed=1)),
    ("sequoia", static_tree("sequoia", 12, 2, seed=2)),
    ("ppd", ppd_tree(2, [0, 3, 8])),
    ("ppd", ppd_tree(3, [0, 4, 10, 16], seed=3)),
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return tiny_model(request.param)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 5, 9, 17][:n]
    return [torch.randint(1, V, (t,), generator=g) for t in lengths]


@pytest.mark.parametrize("ensemble", [1, 2])
@pytest.mark.parametrize("plan_i", range(len(PLANS)))
def test_greedy_random_prompt_tokens_equal_generate(model, plan_i, ensemble):
    _, tree = PLANS[plan_i]
    P = tree.prompt_tokens_max or tree.depth
    guesser = PromptTokens.random(model, P, ensemble=ensemble, seed=plan_i, top_k=4)
    for i, ids in enumerate(_prompts(4, seed=plan_i)):
        n = [7, 16, 25, 3][i]
        out = generate(model, ids, plan=tree, guesser=guesser, max_new_tokens=n)
        assert out.tokens.tolist() == reference(model, ids, n)
        assert sum(out.stats.emitted) == n
        assert out.stats.states[0] == -1


@pytest.mark.parametrize("plan_i", range(len(PLANS)))
def test_greedy_oracle_accepts_almost_everything(model, plan_i):
    _, tree = PLANS[plan_i]
    P = tree.prompt_tokens_max or tree.depth
    ids = _prompts(3, seed=10 + plan_i)[2]
    n = 40
    ref = reference(model, ids, n)
    seq = torch.cat([ids, torch.tensor(ref)])
    pt = PromptTokens.random(model, P, top_k=4)
    oracle = OracleGuesser(seq, V, P, top_k=4, prompt_tokens=pt)
    out = generate(model, ids, plan=tree, guesser=oracle, max_new_tokens=n)
    assert out.tokens.tolist() == ref
    # every step but the last accepts the deepest path its tree offers
    buffers = oracle.layouts(tree, torch.float32, "cpu")
    for state, a in list(zip(out.stats.states, out.stats.accepted))[:-1]:
        buf = buffers.bootstrap if state == -1 else buffers.states[state]
        assert a == buf.depth
    plain = generate(model, ids, max_new_tokens=n)
    assert plain.tokens.tolist() == ref and plain.steps == n
    assert out.steps < plain.steps if tree.depth > 0 else True
    if tree.method != "ppd":
        assert out.steps == 1 + -(-(n - 1) // (tree.depth + 1))


@pytest.mark.parametrize("plan_i", [2, 4, 6])
def test_greedy_noisy_oracle_with_deep_ranks(model, plan_i):
    """Truth at rank r with probability a_r (or missing): verification must pick the right branch."""
    _, tree = PLANS[plan_i]
    P = tree.prompt_tokens_max or tree.depth
    for seed, ids in enumerate(_prompts(5, seed=20)):
        n = 30
        ref = reference(model, ids, n)
        seq = torch.cat([ids, torch.tensor(ref)])
        oracle = OracleGuesser(seq, V, P, top_k=4, accuracy=[0.4, 0.3, 0.2, 0.05], seed=seed)
        out = generate(model, ids, plan=tree, guesser=oracle, max_new_tokens=n)
        assert out.tokens.tolist() == ref


def test_eos_inside_accepted_path_stops_there():
    model = tiny_model("llama")
    ids = torch.randint(1, V, (6,), generator=torch.Generator().manual_seed(5))
    ref = reference(model, ids, 30)
    eos = ref[11]  # a token the model produces mid-sequence
    want = reference(model, ids, 30, eos=eos)
    assert want[-1] == eos and len(want) <= 12
    tree = static_tree("medusa", 8, 4)
    oracle = OracleGuesser(torch.cat([ids, torch.tensor(ref)]), V, 4, top_k=4)
    out = generate(model, ids, plan=tree, guesser=oracle, max_new_tokens=30, eos_token_id=eos)
    assert out.tokens.tolist() == want
    # the last step accepted more than it emitted: the EOS fell inside an accepted path
    assert out.stats.emitted[-1] < out.stats.accepted[-1] + 1
    assert generate(model, ids, max_new_tokens=30, eos_token_id=eos).tokens.tolist() == want


def test_max_new_tokens_mid_path_and_tiny_budgets():
    model = tiny_model("llama")
    ids = torch.tensor([3])
    ref = reference(model, ids, 12)
    tree = static_tree("medusa", 6, 3)
    oracle = OracleGuesser(torch.cat([ids, torch.tensor(ref)]), V, 3, top_k=4)
    for n in range(1, 12):
        out = generate(model, ids, plan=tree, guesser=oracle, max_new_tokens=n)
        assert out.tokens.tolist() == ref[:n]
    assert generate(model, ids, plan=tree, guesser=oracle, max_new_tokens=0).tokens.numel() == 0


def test_plan_errors_before_decoding():
    model = tiny_model("llama")
    ids = torch.tensor([1, 2, 3])
    deep = static_tree("medusa", 20, 4)
    with pytest.raises(UserError, match=f"depth {deep.depth}, the guesser guesses 2 distances"):
        generate(model, ids, plan=deep, guesser=PromptTokens.random(model, 2, top_k=4), max_new_tokens=5)
    with pytest.raises(UserError, match="uses rank 3, the guesser gives top-2"):
        generate(model, ids, plan=deep, guesser=PromptTokens.random(model, 4, top_k=2), max_new_tokens=5)
    ppd = ppd_tree(3, [0, 2, 3, 4])
    with pytest.raises(UserError, match="prompt_tokens_max = 3"):
        generate(model, ids, plan=ppd, guesser=PromptTokens.random(model, 2, top_k=4), max_new_tokens=5)
    with pytest.raises(UserError, match="batch size 2"):
        generate(model, torch.ones(2, 3, dtype=torch.long), plan=ppd, guesser=PromptTokens.random(model, 3, top_k=4))


def test_plan_from_file(tmp_path):
    from planner.tree import save_tree

    model = tiny_model("qwen2")
    tree = ppd_tree(2, [0, 3, 6], seed=4)
    path = save_tree(tree, tmp_path / "t.json")
    ids = torch.tensor([5, 6, 7, 8])
    g = PromptTokens.random(model, 2, ensemble=3, top_k=4)
    assert generate(model, ids, plan=str(path), guesser=g, max_new_tokens=9).tokens.tolist() == reference(model, ids, 9)


def test_prompt_tokens_save_load_roundtrip(tmp_path):
    model = tiny_model("llama")
    pt = PromptTokens.random(model, 3, ensemble=2, seed=7)
    pt.save(tmp_path / "pt")
    back = PromptTokens.load(tmp_path / "pt", model=model)
    assert (back.num_prompt_tokens, back.ensemble) == (3, 2)
    assert torch.equal(back.embeddings, pt.embeddings)
    other = tiny_model("llama")
    other.resize_token_embeddings(V)  # same hidden size loads fine
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "prompt_tokens.json").write_text('{"num_prompt_tokens": 3, "ensemble": 2, "hidden_size": 32}')
    (tmp_path / "bad" / "prompt_tokens.safetensors").write_bytes((tmp_path / "pt" / "prompt_tokens.safetensors").read_bytes())
    with pytest.raises(UserError, match="expected \\[6, 32\\]"):
        PromptTokens.load(tmp_path / "bad")
    with pytest.raises(UserError, match="file not found"):
        PromptTokens.load(tmp_path / "missing")


def test_prompt_block_mask_is_per_group_causal():
    m = prompt_block_mask(3, 2)  # index j * 2 + e
    for a in range(6):
        for b in range(6):
            assert bool(m[a, b]) == ((a % 2 == b % 2) and (b // 2 <= a // 2))


def test_prompt_token_logits_match_a_plain_sequence(model):
    """A prompt token's logits in the tree step equal those of the same embeddings fed as a plain sequence."""
    torch.manual_seed(0)
    tree = static_tree("medusa", 4, 2)
    pt = PromptTokens.random(model, 2, ensemble=2, top_k=4)
    ids = torch.tensor([4, 9, 17, 33, 2])
    buf = pt.layouts(tree, torch.float32, "cpu").states[0]
    cache = prefill(model, ids[None, :-1]).cache
    C = ids.numel() - 1
    cand = torch.tensor([11, 12, 13, 14])[: buf.num_tree - 1]
    tree_ids = torch.cat([ids[-1:], cand])
    embed = model.get_input_embeddings()
    x = torch.cat([embed(tree_ids), pt.embeddings[buf.slot_embedding]])[None]
    mask = step_mask(buf.mask_block, C)
    logits = tree_forward(model, None, buf.position_offsets + C, mask, cache, inputs_embeds=x).logits[0]
    # node u = the first candidate (depth 1), its prompt slots of ensemble copy 1
    u = 1
    for j in range(2):
        slot = int(buf.slot_index[u, j, 1])
        seq = torch.cat([embed(torch.cat([ids, tree_ids[u : u + 1]])), pt.embeddings[[1, 3][: j + 1]]])
        with torch.inference_mode():
            plain = model(inputs_embeds=seq[None]).logits[0, -1]
        torch.testing.assert_close(logits[slot], plain, atol=1e-4, rtol=1e-4)


def test_kv_compaction_equals_plain_decoding(model):
    ids = torch.tensor([4, 9, 17, 33, 2, 8])
    ref = reference(model, ids, 6)
    tree = static_tree("medusa", 10, 3)
    oracle = OracleGuesser(torch.cat([ids, torch.tensor(ref)]), V, 3, top_k=4, accuracy=[0.6, 0.3, 0.1, 0.0], seed=1)
    buf = oracle.layouts(tree, torch.float32, "cpu").states[0]
    C = ids.numel() - 1
    cache = prefill(model, ids[None, :-1]).cache
    guesses = oracle.guess(None, C, 3)
    tree_ids = torch.cat([ids[-1:], guesses.reshape(-1)[buf.cand_index]])
    mask = step_mask(buf.mask_block, C)
    logits = tree_forward(model, tree_ids[None], buf.position_offsets + C, mask, cache).logits[0]
    verdict = verify_greedy(logits, tree_ids, buf)
    path = verdict.path
    a = path.numel() - 1
    assert verdict.emitted == ref[: a + 1]
    assert verdict.nodes == path.tolist() and verdict.root.tolist() == ref[a : a + 1]
    compact_cache(cache, C, path)
    kept = torch.cat([ids, torch.tensor(ref[:a])])  # prompt + accepted candidates; the new root is not cached
    plain = prefill(model, kept[None]).cache
    assert cache.get_seq_length() == kept.numel()
    for got, want in zip(cache.layers, plain.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


def test_mistral_sliding_window_model_below_the_window():
    model = tiny_model("mistral")
    tree = ppd_tree(2, [0, 3, 6], seed=5)
    g = PromptTokens.random(model, 2, ensemble=2, top_k=4)
    for ids in _prompts(3, seed=30):
        assert generate(model, ids, plan=tree, guesser=g, max_new_tokens=20).tokens.tolist() == reference(model, ids, 20)
    with pytest.raises(UserError, match="sliding window of 256 tokens"):
        generate(model, torch.ones(200, dtype=torch.long), plan=tree, guesser=g, max_new_tokens=60)


class _HostReads:
    """Counts reads of tensor data into Python (each is a device sync on a GPU)."""

    NAMES = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def wrapped(t, *a, _orig=orig, **k):
                self.count += 1
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapped)


@pytest.mark.parametrize("plan_i", [1, 2, 4, 6])
def test_greedy_verification_reads_the_device_once_and_matches_brute_force(monkeypatch, plan_i):
    _, tree = PLANS[plan_i]
    P = tree.prompt_tokens_max or tree.depth
    oracle = OracleGuesser(torch.arange(200) % V, V, P, top_k=4)
    buffers = oracle.layouts(tree, torch.float32, "cpu")
    g = torch.Generator().manual_seed(plan_i)
    for buf in buffers.states.values():
        parents = buf.parents.tolist()
        for trial in range(20):
            logits = torch.randn(buf.num_tree, 6, generator=g)  # few classes, so candidates often match
            tokens = torch.randint(0, 6, (buf.num_tree,), generator=g)
            top = logits.argmax(-1).tolist()
            # brute force: every node whose whole chain of candidates matches its parent's argmax
            accepted = [0]
            for u in range(1, buf.num_tree):
                chain, v = [], u
                while v != 0:
                    chain.append(v)
                    v = parents[v]
                if all(tokens[w].item() == top[parents[w]] for w in chain):
                    accepted.append(u)
            depth = lambda u: 0 if u == 0 else 1 + depth(parents[u])  # noqa: E731
            deepest = max(depth(u) for u in accepted)
            reads = _HostReads(monkeypatch)
            v = verify_greedy(logits, tokens, buf)
            assert reads.count == 1
            monkeypatch.undo()
            a = len(v.nodes) - 1
            assert a == deepest and all(u in accepted for u in v.nodes) and v.path.tolist() == v.nodes
            assert v.emitted == [tokens[u].item() for u in v.nodes[1:]] + [top[v.nodes[-1]]]
            assert v.root.tolist() == v.emitted[-1:]


def test_phase_times_off_changes_nothing_on_the_cpu(model):
    from decoder.output import DecodeStats

    ids = _prompts(3, seed=40)[2]
    tree = PLANS[5][1]
    g = PromptTokens.random(model, 2, top_k=4)
    on = generate(model, ids, plan=tree, guesser=g, max_new_tokens=12)
    off = generate(model, ids, plan=tree, guesser=g, max_new_tokens=12, phase_times=False)
    plain = generate(model, ids, max_new_tokens=12, phase_times=False)
    assert on.tokens.tolist() == off.tokens.tolist() == plain.tokens.tolist() == reference(model, ids, 12)
    assert len(off.stats.times["forward"]) == off.steps  # CPU work is synchronous: phases stay exact
    # on CUDA without phase syncs the phase lists stay empty; the summary says unknown, not zero
    s = DecodeStats(states=[0, 0], accepted=[0, 1], emitted=[1, 2]).summary()
    assert s["forward_s"] is None and s["tokens"] == 3
