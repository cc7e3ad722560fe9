"""EAGLE-1, EAGLE-3 and Medusa heads in their released layouts (decoder/torch_ops/heads.py): every layout
loads and decodes token for token as greedy `generate` (chains, static trees, per-step trees), keeps the
target's distribution under sampling (a chi-square test shown to fail for a wrong rule), the drafter's
cache equals a recomputation over the accepted text with the target's features, and a missing or
misshapen tensor is refused in one line naming it."""
import pytest
import torch
from head_layouts import (
    random_head,
    random_medusa,
    trained_like_head,
    write_eagle1,
    write_eagle3,
    write_medusa,
    write_medusa_vllm,
    write_speculators,
)
from test_decoder_sampling import _chi2, _exact_joint
from test_decoder_utils import reference, tiny_model

import decoder.verify as verify
from decoder import generate
from decoder.guessers.draft import DraftModelGuesser
from decoder.guessers.draft_cache import DraftCache
from decoder.guessers.heads import open_eagle
from decoder.torch_ops.heads import read_head
from decoder.guessers.registry import LoadRequest, load_guesser
from decoder.torch_ops.eagle import EAGLE1, EAGLE3, EagleState
from planner.errors import UserError
from planner.tree import Tree, TreeState

torch.set_num_threads(1)

VOCAB = 6  # small: heads guess right often enough to exercise accepted paths; the exact joint enumerates 6 tokens
TREES = {"chain-3": [(0,), (0, 0), (0, 0, 0)],
         "tree-6": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]}


def _tree(nodes, method="sequoia") -> Tree:
    return Tree(method, [TreeState(0, list(nodes), 1.0, 1 + len(nodes))], 1.0)


@pytest.fixture(scope="module")
def target():
    m = tiny_model("llama", vocab=VOCAB, seed=3)
    with torch.no_grad():
        m.lm_head.weight.mul_(0.5)  # flatter: sampled paths reach more branches
    return m


@pytest.fixture(scope="module")
def folders(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    med = random_medusa(target, heads=3, layers=1, seed=4)
    return {
        "eagle": write_eagle1(random_head(target, EAGLE1, seed=2), root / "eagle1"),
        "eagle3": write_eagle3(trained_like_head(target, draft_vocab=5, seed=1), root / "eagle3"),
        "eagle3-full-vocab": write_eagle3(random_head(target, EAGLE3, seed=5), root / "eagle3-full"),
        "speculators": write_speculators(trained_like_head(target, draft_vocab=5, seed=6), root / "spec",
                                         target.get_input_embeddings().weight),
        "medusa": write_medusa(med, root / "medusa", 3, 1),
        "medusa-vllm": write_medusa_vllm(med, root / "medusa-vllm", 3, 1, 64, VOCAB),
    }


def _guesser(target, path, **kw):
    kind = "medusa-heads" if "medusa" in str(path) else "eagle-head"
    return load_guesser(kind, LoadRequest(target, path=str(path), top_k=4, **kw))


@pytest.mark.parametrize("layout", ["eagle", "eagle3", "eagle3-full-vocab", "speculators", "medusa", "medusa-vllm"])
def test_every_layout_is_read_as_released(folders, layout):
    assert read_head(folders[layout]).layout == {"eagle3-full-vocab": "eagle3"}.get(layout, layout)


@pytest.mark.parametrize("layout", ["eagle", "eagle3", "speculators", "medusa", "medusa-vllm"])
@pytest.mark.parametrize("tree", [None, "chain-3", "tree-6"])
def test_greedy_decoding_equals_generate(target, folders, layout, tree):
    g = _guesser(target, folders[layout])
    plan = None if tree is None else _tree(TREES[tree], "medusa" if layout.startswith("medusa") else "sequoia")
    accepted = 0
    for prompt in ([2, 5, 1, 4], [3]):
        ids = torch.tensor(prompt)
        out = generate(target, ids, plan=plan, guesser=g, max_new_tokens=24)
        assert out.tokens.tolist() == reference(target, ids, 24)
        accepted += sum(out.stats.accepted)
    assert accepted > 0, "the test must exercise accepted draft tokens"


@pytest.mark.parametrize("kind", ["eagle-head", "lookup+eagle-head"])
def test_eagle_per_step_trees_equal_generate(target, folders, kind):
    from decoder.guessers.dynamic import HybridGuesser
    from decoder.guessers.lookup import PromptLookupGuesser
    from planner.accept import from_entry
    from planner.dynamic_plan import plan_dynamic

    rows = [[0.5, 0.2, 0.1, 0.05]] * 4
    acc = {"eagle-head": from_entry({"accuracy": rows, "guesser": {"kind": "eagle-head", "draft_s": 0.002}},
                                    label="eagle-head"),
           "lookup": from_entry({"accuracy": [[0.4], [0.8], [0.85], [0.9]], "guesser": {"kind": "lookup"}}, label="lookup")}
    kinds = kind.split("+")
    plan = plan_dynamic([(k, acc[k]) for k in kinds], None, max_size=8, max_depth=4)
    eagle = _guesser(target, folders["eagle3"])
    g = eagle if kind == "eagle-head" else HybridGuesser(PromptLookupGuesser(), eagle, "eagle-head")
    accepted = 0
    for prompt in ([2, 5, 1, 4, 2, 5, 1], [3]):
        ids = torch.tensor(prompt)
        out = generate(target, ids, plan=plan, guesser=g, max_new_tokens=24)
        assert out.tokens.tolist() == reference(target, ids, 24)
        accepted += sum(out.stats.accepted)
    assert accepted > 0


def test_the_drafter_cache_equals_a_recomputation_over_the_accepted_text(target, folders, monkeypatch):
    """Before every step's drafting the head's cache holds exactly the accepted text fed with the target's
    true features (token x_p beside the feature at p - 1): one pass over the whole text gives the same
    keys, and the root's logits equal that pass's last row."""
    from decoder.guessers.draft import DraftSession

    drafter = open_eagle(folders["eagle3"], target)
    ids = torch.tensor([2, 5, 1, 4, 3])
    emitted: list[int] = []
    checks = []
    first, commit = DraftCache.first_pass, DraftSession.commit

    def checked(self, root):
        logits = first(self, root)
        text = torch.cat([ids, torch.tensor(emitted, dtype=torch.long)])  # accepted so far, the root last
        with torch.no_grad():
            out = target(input_ids=text[None], output_hidden_states=True)
        feats = drafter.combine(torch.cat([out.hidden_states[i][0] for i in drafter.features], dim=-1))
        ref = EagleState(drafter.head)
        want = ref.forward(text[1:], torch.arange(1, text.numel()), None, feats[:-1], last_only=True)
        torch.testing.assert_close(self.state.k, ref.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, want.logits[-1], atol=1e-5, rtol=1e-5)
        checks.append(text.numel())
        return logits

    def track(self, outcome):
        emitted.extend(outcome.verdict.emitted)
        commit(self, outcome)

    monkeypatch.setattr(DraftCache, "first_pass", checked)
    monkeypatch.setattr(DraftSession, "commit", track)
    out = generate(target, ids, plan=_tree(TREES["tree-6"]), guesser=DraftModelGuesser(drafter, top_k=4),
                   max_new_tokens=20)
    assert out.tokens.tolist() == reference(target, ids, 20) and len(checks) == out.steps
    assert sum(out.stats.accepted) > 0


# ---------------------------------------------------------------------------------------------- sampling

N_SAMPLES = 800
P_MIN = 1e-3
SETTING = dict(temperature=1.0, top_k=VOCAB, top_p=1.0)


def _counts(target, g, nodes, n=N_SAMPLES):
    counts, accepted = {}, 0
    for seed in range(n):
        out = generate(target, torch.tensor([2]), plan=_tree(nodes), guesser=g, max_new_tokens=3, seed=seed,
                       temperature=0.8)
        key = tuple(out.tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(out.stats.accepted)
    return counts, accepted


@pytest.fixture(scope="module")
def sampled(target, folders):
    """EAGLE-3 drafts drawn from the head's q (a draft vocabulary smaller than the target's): the exact
    joint of three tokens and the right rule's counts."""
    g = _guesser(target, folders["eagle3"])
    joint = _exact_joint(target, [2], 3, dict(SETTING, temperature=0.8))
    return g, joint


def test_sampled_eagle_trees_keep_the_target_distribution(target, sampled):
    g, joint = sampled
    counts, accepted = _counts(target, g, TREES["tree-6"])
    assert accepted > N_SAMPLES // 4, "the test must exercise accepted draft tokens"
    assert _chi2(counts, joint, N_SAMPLES) > P_MIN


def test_the_sampling_test_fails_for_a_wrong_rule(target, sampled, monkeypatch):
    g, joint = sampled
    monkeypatch.setattr(verify, "residual", lambda p, q: p)  # after a rejection keep sampling from p itself
    counts, _ = _counts(target, g, TREES["tree-6"])
    assert _chi2(counts, joint, N_SAMPLES) < P_MIN


# ---------------------------------------------------------------------------------------------- refusals


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_missing_tensor_is_refused_naming_it(target, folders, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(folders["eagle3"], tmp_path / "h")
    t = load_file(str(d / "model.safetensors"))
    del t["midlayer.hidden_norm.weight"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(UserError, match=r"model.safetensors: tensor midlayer.hidden_norm.weight is missing") as e:
        open_eagle(d, target)
    assert "\n" not in str(e.value)


def test_a_wrong_width_is_refused_naming_the_tensor(target, folders, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(folders["eagle3"], tmp_path / "h")
    t = load_file(str(d / "model.safetensors"))
    t["fc.weight"] = t["fc.weight"][:, :-8].contiguous()
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(UserError, match=r"tensor fc.weight has shape \[64, 120\], expected \[64, 128\]"):
        open_eagle(d, target)


def test_a_head_for_another_target_is_refused(folders, tmp_path):
    other = tiny_model("llama", vocab=VOCAB + 4, seed=3)
    with pytest.raises(UserError, match="vocab_size 6, the target's vocabulary has 10 tokens"):
        open_eagle(folders["eagle3"], other)


def test_medusa_with_a_missing_head_is_refused(target, folders, tmp_path):
    d = _copy(folders["medusa"], tmp_path / "m")
    t = torch.load(d / "medusa_lm_head.pt")
    del t["2.1.weight"]
    torch.save(t, d / "medusa_lm_head.pt")
    with pytest.raises(UserError, match=r"tensor 2.1.weight is missing"):
        load_guesser("medusa-heads", LoadRequest(target, path=str(d)))


def test_bad_folders_are_refused_in_one_line(target, tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        open_eagle(tmp_path / "nope", target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="config.json: file not found"):
        open_eagle(tmp_path / "empty", target)
    (tmp_path / "empty" / "config.json").write_text("{")
    with pytest.raises(UserError, match="not valid JSON"):
        open_eagle(tmp_path / "empty", target)


@pytest.mark.parametrize("grow", [(3, 1, 4), (3, 2, 5), (5, 4, 8)])
def test_trees_grown_at_run_time_equal_generate(target, folders, grow):
    """SGLang's and TensorRT-LLM's run-time EAGLE-2 trees (steps, topk, draft tokens), grown by the head here."""
    from decoder.guessers.draft import Grow

    drafter = open_eagle(folders["eagle3"], target)
    g = DraftModelGuesser(drafter, top_k=grow[1], grow=Grow(*grow))
    accepted = 0
    for prompt in ([2, 5, 1, 4], [3]):
        ids = torch.tensor(prompt)
        out = generate(target, ids, plan=None, guesser=g, max_new_tokens=24)
        assert out.tokens.tolist() == reference(target, ids, 24)
        assert max(out.stats.input_lengths) <= grow[2]
        accepted += sum(out.stats.accepted)
    assert accepted > 0
