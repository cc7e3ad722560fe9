"""planner accept's library: accuracy counts against brute force, and plan transitions against the Markov model."""
import numpy as np
import pytest
import torch
from test_decoder_utils import V, ppd_tree, reference, tiny_model

from decoder import OracleGuesser, PromptTokens
from decoder.loop import generate
from planner.accept import from_entry
from profiler.acceptance import chain_plan, measure_accuracy, measure_transitions

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (int(t),), generator=g) for t in torch.randint(1, 12, (n,), generator=g)]


@pytest.mark.parametrize("conditional", [False, True])
@pytest.mark.parametrize("ensemble", [1, 2])
def test_accuracy_counts_equal_brute_force(model, ensemble, conditional):
    P, K, n = 3, 4, 12
    pt = PromptTokens.random(model, P, ensemble=ensemble, seed=5, top_k=K)
    prompts = _prompts(3, seed=ensemble)
    got = measure_accuracy(model, pt, prompts, max_new_tokens=n, conditional=conditional, allow_empty=True)
    hits = np.zeros((P, K), dtype=int)
    totals = np.zeros(P, dtype=int)
    embed = model.get_input_embeddings()
    for ids in prompts:
        cont = reference(model, ids, n)
        full = torch.cat([ids, torch.tensor(cont)])
        T = ids.numel()
        for i in range(n):  # the step emitting cont[i] has root full[T - 1 + i]
            prefix = embed(full[: T + i])  # up to and including the root
            logits = 0
            for e in range(ensemble):
                seq = torch.cat([prefix, pt.embeddings[[j * ensemble + e for j in range(P)]]])
                with torch.no_grad():
                    logits = logits + model(inputs_embeds=seq[None]).logits[0, -P:]
            guesses = (logits / ensemble).topk(K, dim=-1).indices  # [P, K]
            for d in range(1, P + 1):
                # conditional: only while the rank-0 guesses at distances 1..d-1 were right
                if i + d >= n:
                    continue
                path_ok = all(int(guesses[e - 1, 0]) == cont[i + e] for e in range(1, d))
                if path_ok or not conditional:
                    totals[d - 1] += 1
                    hits[d - 1] += (guesses[d - 1] == cont[i + d]).numpy()
    assert got["counts"] == hits.tolist()
    assert got["totals"] == totals.tolist()
    assert got["positions"] == n * len(prompts)
    acc = from_entry({"accuracy": got["accuracy"]})  # loadable by the planner
    assert acc.accuracy.shape == (P, K)


def test_oracle_accuracy_is_recovered(model):
    """An oracle with known per-rank accuracy is measured within binomial error."""
    a = [[0.5, 0.2, 0.1], [0.3, 0.2, 0.1]]  # one row per distance
    prompts = _prompts(6, seed=3)
    n = 60
    # the oracle is built per prompt, from that prompt's greedy continuation
    hits, totals = np.zeros((2, 3)), np.zeros(2)
    pt = PromptTokens.random(model, 2, top_k=3)
    for i, ids in enumerate(prompts):
        seq = torch.cat([ids, torch.tensor(reference(model, ids, n + 5))])
        oracle = OracleGuesser(seq, V, 2, top_k=3, accuracy=a, seed=i, prompt_tokens=pt)
        got = measure_accuracy(model, oracle, [ids], max_new_tokens=n)
        hits += np.array(got["counts"])
        totals += np.array(got["totals"])
    acc = hits / totals[:, None]
    for d in range(2):
        want = np.array(a[d])
        se = np.sqrt(want * (1 - want) / totals[d])
        assert np.all(np.abs(acc[d] - want) < 4 * se + 1e-9), (acc[d], want)


def _markov(tree, a):
    """M[s][k] = sum over nodes u of state s with k_u = k of P(u is the last accepted node), computed directly."""
    P = tree.prompt_tokens_max
    M = np.zeros((P + 1, P + 1))
    for st in tree.states:
        prob = {(): 1.0}
        for p in st.nodes:
            prob[p] = prob[p[:-1]] * a[p[-1]]
        for u, k in zip([()] + list(st.nodes), st.prompt_tokens):
            kids = sum(prob[c] for c in st.nodes if c[:-1] == u)
            M[st.state, k] += prob[u] - kids
    return M


def test_transitions_match_markov_model(model):
    a = [0.6, 0.2, 0.1, 0.05]
    tree = ppd_tree(3, [0, 3, 6, 9], seed=2)
    M = _markov(tree, a)
    assert np.allclose(M.sum(1), 1)
    for st in tree.states:
        st.transitions = M[st.state].tolist()
    counts = np.zeros((4, 4))
    prompts = _prompts(12, seed=4)
    n = 60
    for i, ids in enumerate(prompts):
        seq = torch.cat([ids, torch.tensor(reference(model, ids, n + 5))])
        oracle = OracleGuesser(seq, V, 3, top_k=4, accuracy=a, seed=100 + i)
        t = measure_transitions(model, [ids], tree, oracle, max_new_tokens=n)
        counts += t.counts
        assert np.array_equal(t.model_transitions, M)
        # every step's tokens are counted in its state
        assert t.tokens.sum() >= t.visits.sum()
    rows = counts.sum(1)
    emp = counts / np.maximum(rows[:, None], 1)
    for s in range(1, 4):  # state 0 is never entered: every node carries >= 1 prompt token
        assert rows[s] > 30
        se = np.sqrt(M[s] * (1 - M[s]) / rows[s])
        assert np.all(np.abs(emp[s] - M[s]) < 4 * se + 0.02), (s, emp[s], M[s])


def test_chain_plan_emits_one_token_per_step(model):
    pt = PromptTokens.random(model, 2, top_k=3)
    ids = torch.tensor([3, 4, 5])
    out = generate(model, ids, plan=chain_plan(2), guesser=pt, max_new_tokens=10, record_guesses=True)
    assert out.steps == 10 and out.tokens.tolist() == reference(model, ids, 10)
    # each step records the guesses its proposal used; the bootstrap step has none
    assert out.stats.guesses[0] is None and all(g.shape == (2, 3) for g in out.stats.guesses[1:])
