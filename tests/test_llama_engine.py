"""The llama.cpp engine (decoder/engines/llama_cpp/engine.py) on the default model's own Q4_1 GGUF file.

The reference is llama.cpp's plain greedy decoding from the same build (llama-cpp-python's
`Llama.generate`, top-k 1). Chains must give logits bit-identical to one-token steps; every guesser
the engine runs must give exactly the plain tokens.
"""
from __future__ import annotations

import pytest
import torch

from decoder.engine import StepInput, TimerSpec
from decoder.engines.llama_cpp.engine import batch_shape, binary_tree_shape, chain_shape
from decoder.layout import layout_for
from planner.errors import UserError

N_NEW = 32
THREADS = 1  # correctness only; one thread is not slowed by a busy machine (llama.cpp's threads spin at barriers)


def test_batch_shape_depth_first_rank_zero_first():
    # root 0 -> children 1 (rank 0), 2 (rank 1); 1 -> 3 (rank 0), 4 (rank 1); 2 -> 5
    kids = [[1, 2], [3, 4], [5], [], [], []]
    s = batch_shape(kids)
    assert s.order == (0, 1, 3, 4, 2, 5)
    assert s.depth == (0, 1, 2, 2, 1, 2)
    assert s.n_paths == 3  # leaves 3, 4, 5 in that order
    assert s.seqs[0] == (0, 1, 2) and s.seqs[1] == (0, 1) and s.seqs[2] == (0,) and s.seqs[4] == (2,)
    assert s.path_of == (0, 0, 2, 0, 1, 2)
    assert not s.identity and [s.order[i] for i in s.inverse] == [0, 1, 2, 3, 4, 5]
    c = chain_shape(4)
    assert c.identity and c.n_paths == 1 and c.depth == (0, 1, 2, 3)
    b = binary_tree_shape(7)
    assert b.n_paths == 4 and max(b.depth) == 2


def test_numpy_chain_verification_equals_the_torch_rule():
    from decoder.verify import verify_greedy, verify_greedy_chain

    gen = torch.Generator().manual_seed(0)
    for d in (0, 1, 4):
        lay = layout_for(tuple((0,) * k for k in range(1, d + 1)), 1, torch.float32, "cpu")
        for accept in range(d + 1):
            logits = torch.randn(d + 1, 50, generator=gen)
            top = logits.argmax(1).tolist()
            tokens = [7] + [top[i] if i < accept else (top[i] + 1) % 50 for i in range(d)]
            a = verify_greedy_chain(logits, torch.tensor(tokens), lay)
            b = verify_greedy(logits, torch.tensor(tokens), lay)
            assert (a.nodes, a.emitted, a.path.tolist(), a.root.tolist()) == (b.nodes, b.emitted, b.path.tolist(),
                                                                              b.root.tolist())
            assert len(a.nodes) == accept + 1


# ---------------------------------------------------------------------------------------------- with llama.cpp

llama_cpp = pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def gguf():
    from decoder.engines.shipped import gguf_file

    try:
        return gguf_file("smollm2-135m")
    except UserError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def engine(gguf):
    from decoder.engines.llama_cpp.engine import LlamaEngine

    eng = LlamaEngine(gguf, n_ctx=1024, threads=THREADS)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    from decoder.engines.shipped import model_dir
    from workflows.cli.inputs import encode_prompts

    tok = AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))
    texts = ["What is the capital of France? Answer in one sentence.",
             "Rewrite the following text in simpler words, keeping every fact.\n\nThe committee postponed the "
             "vote on the new budget because several members were absent, and the chair said the vote would be "
             "held next Tuesday at the usual time.",
             "Write a Python function that returns the factorial of n, then explain it.",
             "List three colours of the rainbow, then repeat the list in reverse order."]
    return encode_prompts(tok, texts)


@pytest.fixture(scope="module")
def reference(gguf, prompts, engine):
    """llama-cpp-python's own plain greedy decoding (same build, same threads)."""
    llm = llama_cpp.Llama(str(gguf), n_ctx=1024, n_threads=engine.threads, n_threads_batch=engine.threads,
                          verbose=False)
    out = []
    for ids in prompts:
        toks = []
        for t in llm.generate(ids.tolist(), top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            toks.append(int(t))
            if t in engine.eos_ids() or len(toks) == N_NEW:
                break  # the loop keeps the EOS token, as decoder.output.truncate does
        out.append(toks)
    llm.close()
    return out


def decode(engine, ids, guesser=None, plan=None, max_new=N_NEW):
    """The project's one decoding loop over the engine -> (tokens, accepted per step)."""
    from decoder.guesser import PlainGuesser
    from decoder.loop import generate

    out = generate(engine, ids, plan=plan, guesser=guesser or PlainGuesser(), max_new_tokens=max_new)
    return out.tokens.tolist(), out.stats.accepted


def test_plain_loop_equals_llama_generate(engine, prompts, reference):
    for ids, ref in zip(prompts, reference):
        assert decode(engine, ids)[0] == ref


def test_chain_rows_bit_identical_to_one_token_steps(engine, prompts, reference):
    """Score root + the plain continuation as one chain: every row equals the one-token step's logits."""
    ids, ref = prompts[1], reference[1]
    from decoder.verify import Verdict

    seq, _ = engine.start(ids)
    C = seq.context_length
    one = []
    for t, nxt in zip([int(ids[-1])] + ref[:7], ref[:8]):
        scored = seq.score(StepInput(torch.tensor([t]), layout_for((), 1, torch.float32, "cpu")))
        one.append(scored.logits[0].clone())
        seq.commit(Verdict(torch.tensor([0]), [0], [nxt], torch.tensor([nxt])))
    seq.rollback(C)
    chain = tuple((0,) * d for d in range(1, 8))
    scored = seq.score(StepInput(torch.tensor([int(ids[-1])] + ref[:7]), layout_for(chain, 1, torch.float32, "cpu")))
    assert torch.equal(scored.logits, torch.stack(one))


def test_lookup_chains_token_identical(engine, prompts, reference):
    from decoder.guessers.lookup import PromptLookupGuesser

    total = 0
    for k in (2, 6):
        for ids, ref in zip(prompts, reference):
            out, accepted = decode(engine, ids, PromptLookupGuesser(num_tokens=k))
            assert out == ref
            total += sum(accepted)
    assert total > 0  # lookup guessed right somewhere: chains were really committed


@pytest.fixture(scope="module")
def tree_engine(gguf):
    from decoder.engines.llama_cpp.engine import LlamaEngine

    eng = LlamaEngine(gguf, n_ctx=1024, threads=THREADS, trees=True)
    yield eng
    eng.close()


def test_tree_first_path_bit_identical_and_trees_refused_by_default(engine, tree_engine, prompts, reference):
    """A tree's depth-first first path owns the cells a one-token loop would use: its rows equal the
    plain one-token logits bit for bit. The default engine scores chains only."""
    from decoder.verify import Verdict

    ids, ref = prompts[3], reference[3]
    seq, _ = tree_engine.start(ids)
    C = seq.context_length
    one = []
    for t, nxt in zip([int(ids[-1])] + ref[:3], ref[:4]):
        one.append(seq.score(StepInput(torch.tensor([t]), layout_for((), 1, torch.float32, "cpu"))).logits[0].clone())
        seq.commit(Verdict(torch.tensor([0]), [0], [nxt], torch.tensor([nxt])))
    seq.rollback(C)
    nodes = ((0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 1))
    wrong = [(t + 5) % tree_engine.vocab_size for t in ref[:3]]
    tokens = torch.tensor([int(ids[-1]), ref[0], wrong[0], ref[1], wrong[1], ref[2], wrong[2]])
    lay = layout_for(nodes, 2, torch.float32, "cpu")
    scored = seq.score(StepInput(tokens, lay))
    first_path = [0, 1, 3, 5]  # root, (0,), (0, 0), (0, 0, 0)
    assert torch.equal(scored.logits[first_path], torch.stack(one))
    seq2, _ = engine.start(ids)
    with pytest.raises(UserError, match="one chain per step"):
        seq2.score(StepInput(tokens, lay))


def test_commit_leaves_only_the_accepted_path(tree_engine, prompts, reference):
    engine = tree_engine
    lib, mem = engine.lib, engine._mem
    nodes = ((0,), (1,), (0, 0), (1, 0))
    ids, ref = prompts[0], reference[0]
    seq, _ = engine.start(ids)
    C = seq.context_length
    lay = layout_for(nodes, 2, torch.float32, "cpu")
    wrong = (ref[0] + 1) % engine.vocab_size
    tokens = torch.tensor([int(ids[-1]), wrong, ref[0], wrong, ref[1]])  # the second path is right
    from decoder.verify import Sampling, verify

    scored = seq.score(StepInput(tokens, lay))
    verdict = verify(scored.logits, tokens, lay, Sampling())
    assert verdict.nodes == [0, 2, 4]
    seq.commit(verdict)
    assert seq.context_length == C + 3
    assert lib.llama_memory_seq_pos_max(mem, 0) == C + 2
    assert all(lib.llama_memory_seq_pos_max(mem, s) == -1 for s in range(1, 4))
    seq.rollback(C)
    assert lib.llama_memory_seq_pos_max(mem, 0) == C - 1


def test_refuses_hidden_states_and_prompt_token_inputs(engine, prompts):
    with pytest.raises(UserError, match="hidden states"):
        engine.start(prompts[0], hidden=True)
    seq, _ = engine.start(prompts[0])
    from decoder.layout import build_layout

    lay = build_layout(0, [(0,)], [0, 1], 1, 1, torch.float32, "cpu")  # one prompt-token slot
    with pytest.raises(UserError, match="vocabulary tokens only"):
        seq.score(StepInput(torch.tensor([1, 2]), lay, extra_embeds=torch.zeros(1, 576)))
    with pytest.raises(UserError, match="outside the model's vocabulary"):
        engine.start(torch.tensor([1, engine.vocab_size]))


def test_forward_timer_runs_trees_and_chains(engine, tree_engine):
    for eng, tree in ((engine, True), (tree_engine, True), (tree_engine, False)):
        timer = eng.forward_timer(TimerSpec(64, tree=tree))
        assert timer.tree == (tree and eng.caps.trees)  # a chain-only engine times chains
        for n in (1, 5, 16):
            timer.sample(n)()
        deepest = 64 + (4 if timer.tree else 15)  # node 15 of the binary tree: 15 -> 7 -> 3 -> 1 -> 0
        assert max(eng.lib.llama_memory_seq_pos_max(eng._mem, s) for s in range(8)) == deepest
        timer.sample(1)
        assert max(eng.lib.llama_memory_seq_pos_max(eng._mem, s) for s in range(8)) == 63


def test_lookup_acceptance_and_calibration_replayed_equal_decoded(engine, prompts):
    """One shared greedy decode serves lookup's acceptance and calibration (autotune --engine llama.cpp):
    replaying the text gives exactly the counts that decoding with the guesser gives."""
    import numpy as np

    from decoder.guessers.registry import LoadRequest, load_guesser
    from profiler.acceptance import measure_accuracy
    from profiler.calibration import measure_calibration, replay_calibration
    from profiler.teacher_forced import greedy_continuations, replay_accuracy

    lookup = load_guesser("lookup", LoadRequest(engine, depth=6))
    some = prompts[1:3]
    decoded = measure_accuracy(engine, lookup, some, max_new_tokens=24, depth=6, width=1)
    cont = greedy_continuations(engine, some, 24)
    replayed = replay_accuracy(engine, lookup, cont, 6, 1)
    assert replayed["counts"] == decoded["counts"] and replayed["totals"] == decoded["totals"]
    prior = np.array(decoded["accuracy"])
    a = measure_calibration(engine, lookup, some, prior, max_new_tokens=24)
    b = replay_calibration(lookup, cont.prompts, cont.tokens, prior)
    assert a["hits"] == b["hits"] and a["totals"] == b["totals"] and a["p"] == b["p"]


def test_plain_decision_is_llama_generate_in_a_context_of_its_own(gguf, prompts, reference, tmp_path):
    """A plain decision (the llama.cpp main job's usual one) decodes with llama.cpp's own `Llama.generate`:
    the tokens of a user's own Llama, from a Llama opened once at a user's context size. The step context
    growing does not reload it (it used to: the stock Llama shared the step context's size, so a longer
    prompt closed it and loaded the model again inside the timed call), a shorter prompt reuses it, and only a
    sequence past its size opens a larger one."""
    from decoder import api
    from decoder.engines.llama_cpp.engine import STOCK_MIN_CTX, LlamaEngine
    from planner.tree import save_tree
    from workflows.mainjob.write import plain_plan

    tree = plain_plan("every plan measured slower than plain")
    tree.engine = "llama.cpp"
    save_tree(tree, tmp_path / "chosen.json")
    eng = LlamaEngine(gguf, n_ctx=256, threads=THREADS)
    try:
        plan = api.load_plan(tmp_path, eng)  # a run folder: its chosen.json
        assert plan.plain
        order = sorted(range(len(prompts)), key=lambda i: prompts[i].numel())  # growing prompts
        got = [api.generate(eng, prompts[i], plan, max_new_tokens=N_NEW).tokens for i in order]
        assert got == [reference[i] for i in order]
        stock = eng.stock()
        assert stock.n_ctx >= STOCK_MIN_CTX and eng.n_ctx == 256  # the step context stays small
        eng.reserve(1000)  # the step context grows ...
        assert eng.n_ctx >= 1000 and eng.stock() is stock  # ... the stock Llama stays loaded
        assert api.generate(eng, prompts[0], plan, max_new_tokens=N_NEW).tokens == reference[0]
        assert eng.stock() is stock
        longer = eng.stock(STOCK_MIN_CTX + 300)
        assert longer is not stock and longer.n_ctx >= STOCK_MIN_CTX + 300
        assert eng.stock_generate(prompts[1], N_NEW)[0] == reference[1]
    finally:
        eng.close()
