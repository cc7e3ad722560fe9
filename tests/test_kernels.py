"""kernels/: Triton kernels against their PyTorch references, and the transformers integration.

Without CUDA the kernels run under the Triton interpreter on CPU tensors. TRITON_INTERPRET=1 is
read when triton itself is imported (its own tl.* helpers are jit functions), so it is set here
before anything imports triton. If something in this pytest process imported triton earlier
(importing a transformers model does), the kernel tests skip here and one test reruns this file
in a fresh process instead.
"""
import importlib
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import kernels  # noqa: E402
from kernels import reference  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_RUN_HERE = HAS_TRITON and (
    DEVICE == "cuda"
    or (importlib.import_module("kernels.tree_attention").INTERPRETED and importlib.import_module("kernels.kv_compact").INTERPRETED)
)
needs_triton = pytest.mark.skipif(
    not KERNELS_RUN_HERE,
    reason="triton not installed" if not HAS_TRITON else "triton was imported before TRITON_INTERPRET=1 could be set "
    "(see test_kernels_in_a_fresh_process)",
)

torch.set_num_threads(min(2, torch.get_num_threads()))


def _kernel_modules():
    return importlib.import_module("kernels.tree_attention"), importlib.import_module("kernels.kv_compact")


@pytest.mark.skipif(KERNELS_RUN_HERE or not HAS_TRITON, reason="the kernel tests run in this process")
def test_kernels_in_a_fresh_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)],
        capture_output=True, text=True, env=env, timeout=900,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]


def random_parents(n: int, kind: str, gen: torch.Generator) -> list[int]:
    if kind == "chain":
        return list(range(-1, n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    if kind == "forest":  # several roots hanging off the prefix, like PPD prompt tokens
        return [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)]
    # random tree with a bias towards deep paths: parent among the last few nodes
    return [-1] + [int(torch.randint(max(0, i - 4), i, (1,), generator=gen)) for i in range(1, n)]


def brute_force_attention(q, k, v, parents, prefix_len):
    """One query at a time over exactly the keys it may see (walk up the parents), fp64."""
    B, H, n, D = q.shape
    G = H // k.shape[1]
    out = torch.zeros(B, H, n, D, dtype=torch.float64)
    for i in range(n):
        seen, j = [], i
        while j >= 0:
            seen.append(prefix_len + j)
            j = parents[j]
        cols = list(range(prefix_len)) + sorted(seen)
        for h in range(H):
            kk = k[:, h // G, cols].double()  # [B, c, d]
            s = (q[:, h, i : i + 1].double() @ kk.transpose(-1, -2)) / D**0.5  # [B, 1, c]
            out[:, h, i] = (s.softmax(-1) @ v[:, h // G, cols].double())[:, 0]
    return out


# --- tree form -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 64, 65, 150, 300])
@pytest.mark.parametrize("kind", ["random", "chain", "star", "forest"])
def test_ancestor_bitmask_matches_reference(n, kind):
    parents = random_parents(n, kind, torch.Generator().manual_seed(n))
    tm = kernels.tree_mask(parents)
    assert tm.bits.shape == (n, (n + 31) // 32) and tm.bits.dtype == torch.int32
    j = torch.arange(n)
    unpacked = ((tm.bits[:, j // 32] >> (j % 32)) & 1).bool()  # [n, n]
    expected = reference.ancestor_matrix_ref(parents)
    assert torch.equal(unpacked, expected)
    assert torch.equal(tm.ancestors, expected)


@pytest.mark.parametrize("bad", [[0], [-1, 1], [-1, 0, 3], [-2]])
def test_tree_mask_rejects_non_topological_parents(bad):
    with pytest.raises(ValueError, match="parents"):
        kernels.tree_mask(bad)
    with pytest.raises(ValueError, match="parents"):
        reference.ancestor_matrix_ref(bad)


@pytest.mark.parametrize("kind", ["random", "chain", "star", "forest"])
def test_parents_from_visibility_round_trip(kind):
    parents = random_parents(40, kind, torch.Generator().manual_seed(1))
    anc = reference.ancestor_matrix_ref(parents)
    assert kernels.parents_from_visibility(anc) == parents
    additive = torch.zeros(40, 40).masked_fill(~anc, torch.finfo(torch.float32).min)
    assert kernels.parents_from_visibility(additive) == parents


def test_parents_from_visibility_matches_ppd_decoder_mask():
    """The decoder's step mask (tree + PPD prompt-token lanes) is a tree, so the kernel can express it."""
    from decoder.guessers.prompt_tokens import prompt_block_mask

    P, E, u_parents = 3, 2, [-1, 0, 0, 1]
    anc = reference.ancestor_matrix_ref(u_parents)
    n = 4 + P * E
    visible = torch.zeros(n, n, dtype=torch.bool)
    visible[:4, :4] = anc
    visible[4:, :4] = anc[3]  # prompt tokens hang off node 3
    visible[4:, 4:] = prompt_block_mask(P, E)
    parents = kernels.parents_from_visibility(visible)
    assert parents[4:] == [3, 3, 4, 5, 6, 7]  # slot (j, e) = 4 + j * E + e follows (j - 1, e)
    assert torch.equal(reference.ancestor_matrix_ref(parents), visible)


def test_parents_from_visibility_rejects_non_trees():
    bad = reference.ancestor_matrix_ref([-1, 0, 1]).clone()
    bad[2, 0] = False  # sees its parent but not its grandparent
    with pytest.raises(ValueError, match="not the ancestor relation"):
        kernels.parents_from_visibility(bad)


def test_reference_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    for n, C, H, H_kv in [(1, 0, 2, 1), (9, 5, 4, 2), (13, 0, 4, 1), (6, 30, 2, 2)]:
        parents = random_parents(n, "forest", gen)
        q = torch.randn(2, H, n, 16, generator=gen)
        k = torch.randn(2, H_kv, C + n, 16, generator=gen)
        v = torch.randn(2, H_kv, C + n, 16, generator=gen)
        got = reference.tree_attention_ref(q, k, v, parents, C).double()
        torch.testing.assert_close(got, brute_force_attention(q, k, v, parents, C), atol=1e-5, rtol=1e-5)


# --- tree attention kernel -----------------------------------------------------------------

# (n, prefix_len, H, H_kv, head_dim, dtype, tree kind): a sample that covers n from 1 to 300 with
# odd sizes, prefix 0 and large, GQA ratios 1/4/8, head dims 64/128, fp32/fp16/bf16, degenerate
# trees, while keeping the interpreter's time modest.
ATTN_CASES = [
    (1, 0, 4, 4, 64, torch.float32, "chain"),
    (1, 1000, 8, 1, 128, torch.float16, "star"),
    (7, 0, 8, 2, 64, torch.float32, "random"),
    (17, 1024, 4, 1, 64, torch.float32, "forest"),
    (33, 77, 16, 2, 128, torch.float16, "random"),
    (64, 0, 8, 8, 64, torch.bfloat16, "star"),
    (63, 129, 4, 1, 128, torch.bfloat16, "chain"),
    (127, 5, 8, 1, 64, torch.float16, "forest"),
    (255, 0, 2, 2, 128, torch.float32, "random"),
    (300, 0, 8, 1, 64, torch.float16, "chain"),
    (300, 257, 2, 2, 64, torch.float32, "star"),
    (300, 64, 2, 1, 128, torch.bfloat16, "random"),
]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@needs_triton
@pytest.mark.parametrize("n,C,H,H_kv,D,dtype,kind", ATTN_CASES)
def test_tree_attention_kernel_matches_reference(n, C, H, H_kv, D, dtype, kind):
    ta, _ = _kernel_modules()
    gen = torch.Generator().manual_seed(n * 7 + C)
    B = 2 if n < 100 else 1
    parents = random_parents(n, kind, gen)
    q = torch.randn(B, H, n, D, generator=gen).to(DEVICE, dtype)
    k = torch.randn(B, H_kv, C + n, D, generator=gen).to(DEVICE, dtype)
    v = torch.randn(B, H_kv, C + n, D, generator=gen).to(DEVICE, dtype)
    got = ta.tree_attention(q, k, v, parents, C, backend="triton")
    want = reference.tree_attention_ref(q, k, v, parents, C)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_triton
@pytest.mark.parametrize(
    "n,C,H,H_kv,D,dtype,splits",
    [(7, 300, 8, 2, 64, torch.float32, 3), (16, 1000, 4, 1, 128, torch.float16, 4),
     (5, 65, 2, 2, 64, torch.bfloat16, 2), (3, 64, 2, 1, 64, torch.float32, 8), (9, 0, 2, 1, 64, torch.float32, 4)],
)
def test_tree_attention_split_prefix_matches_reference(n, C, H, H_kv, D, dtype, splits):
    """Flash-decoding path: prefix split over programs, partial softmaxes combined by a second kernel."""
    ta, _ = _kernel_modules()
    gen = torch.Generator().manual_seed(n + C)
    parents = random_parents(n, "forest", gen)
    q = torch.randn(2, H, n, D, generator=gen).to(DEVICE, dtype)
    k = torch.randn(2, H_kv, C + n, D, generator=gen).to(DEVICE, dtype)
    v = torch.randn(2, H_kv, C + n, D, generator=gen).to(DEVICE, dtype)
    out = torch.empty(2, n, H, D, dtype=dtype, device=DEVICE)
    ta.tree_attention(q, k, v, parents, C, backend="triton", num_splits=splits, out=out.transpose(1, 2))
    want = reference.tree_attention_ref(q, k, v, parents, C)
    torch.testing.assert_close(out.transpose(1, 2).float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_triton
def test_tree_attention_kernel_strided_inputs_and_out_buffer():
    """q as transformers hands it over (a transposed [B, n, H, d] view), output into a [B, n, H, d] buffer."""
    ta, _ = _kernel_modules()
    gen = torch.Generator().manual_seed(3)
    B, n, H, H_kv, D, C = 2, 21, 8, 2, 64, 40
    parents = random_parents(n, "random", gen)
    q = torch.randn(B, n, H, D, generator=gen).to(DEVICE).transpose(1, 2)  # [B, H, n, d], not contiguous
    kv = torch.randn(B, C + n, 2 * H_kv, D, generator=gen).to(DEVICE).transpose(1, 2)
    k, v = kv[:, :H_kv], kv[:, H_kv:]  # views into one buffer
    out = torch.full((B, n, H, D), float("nan"), device=DEVICE)
    tm = ta.tree_mask(parents, device=DEVICE)
    ta.tree_attention(q, k, v, tm, C, backend="triton", out=out.transpose(1, 2))
    want = reference.tree_attention_ref(q, k, v, parents, C).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@needs_triton
def test_tree_attention_custom_scale_and_non_power_of_two_head_dim():
    ta, _ = _kernel_modules()
    gen = torch.Generator().manual_seed(4)
    n, C, D = 11, 19, 80
    parents = random_parents(n, "forest", gen)
    q, k, v = (torch.randn(1, 4, L, D, generator=gen).to(DEVICE) for L in (n, C + n, C + n))
    got = ta.tree_attention(q, k[:, :2], v[:, :2], parents, C, backend="triton", scale=0.05)
    want = reference.tree_attention_ref(q, k[:, :2], v[:, :2], parents, C, scale=0.05)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_tree_attention_reference_backend_and_shape_errors():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8)
    out = kernels.tree_attention(q, k, k, [-1, 0, 0], 2, backend="reference")
    torch.testing.assert_close(out, reference.tree_attention_ref(q, k, k, [-1, 0, 0], 2))
    with pytest.raises(ValueError, match="prefix_len"):
        kernels.tree_attention(q, k, k, [-1, 0, 0], 3)
    with pytest.raises(ValueError, match="multiple"):
        kernels.tree_attention(torch.randn(1, 3, 3, 8), k, k, [-1, 0, 0], 2)


def test_import_without_triton_uses_references():
    """`import kernels` works with triton absent; auto falls back, backend='triton' says why it cannot run."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kernels\n"
        "q = torch.randn(1, 2, 3, 8); k = torch.randn(1, 1, 7, 8)\n"
        "out = kernels.tree_attention(q, k, k, [-1, 0, 1], 4)\n"
        "assert torch.allclose(out, kernels.tree_attention_ref(q, k, k, [-1, 0, 1], 4))\n"
        "ks = [torch.randn(1, 1, 9, 8)]; vs = [torch.randn(1, 1, 9, 8)]; want = ks[0][:, :, [5, 8]].clone()\n"
        "assert kernels.kv_compact(ks, vs, 4, torch.tensor([1, 4])) == 6 and torch.equal(ks[0][:, :, 4:6], want)\n"
        "try:\n    kernels.tree_attention(q, k, k, [-1, 0, 1], 4, backend='triton')\nexcept RuntimeError as e:\n"
        "    assert 'triton is not installed' in str(e); print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


# --- KV compaction -------------------------------------------------------------------------


def _accepted(n: int, m: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(n, generator=gen)[:m].sort().values


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize(
    "layers,B,H_kv,C,n,m,D,dtype",
    [
        (1, 1, 1, 0, 1, 1, 64, torch.float32),
        (4, 2, 2, 10, 30, 5, 64, torch.float16),
        (3, 1, 8, 0, 300, 40, 128, torch.bfloat16),
        (2, 1, 4, 100, 64, 64, 128, torch.float32),  # every node accepted: a no-op move
        (5, 1, 2, 7, 45, 0, 64, torch.float16),  # nothing accepted
    ],
)
def test_kv_compact_moves_accepted_rows(backend, layers, B, H_kv, C, n, m, D, dtype):
    if backend == "triton":
        _kernel_modules()
    gen = torch.Generator().manual_seed(layers * 100 + n)
    L = C + n + 3  # a few stale rows past the tree, as after an earlier longer step
    ks = [torch.randn(B, H_kv, L, D, generator=gen).to(DEVICE, dtype) for _ in range(layers)]
    vs = [torch.randn(B, H_kv, L, D, generator=gen).to(DEVICE, dtype) for _ in range(layers)]
    idx = _accepted(n, m, gen)
    if m > 2:
        idx[:2] = torch.tensor([0, 1])  # a leading identity run mixed with real moves
        idx = idx.unique()
        m = idx.numel()
    before_k, before_v = [t.clone() for t in ks], [t.clone() for t in vs]
    new_len = kernels.kv_compact(ks, vs, C, idx.to(DEVICE), backend=backend)
    assert new_len == C + m
    src = (C + idx).to(DEVICE)
    for t, t0 in zip(ks + vs, before_k + before_v):
        assert torch.equal(t[:, :, :C], t0[:, :, :C])  # prefix untouched
        assert torch.equal(t[:, :, C : C + m], t0[:, :, src])  # accepted rows, in order


@needs_triton
def test_kv_compact_kernel_on_stacked_and_cropped_views():
    _, kc = _kernel_modules()
    gen = torch.Generator().manual_seed(9)
    big = torch.randn(3, 1, 2, 50, 64, generator=gen).to(DEVICE)
    ks = [big[i, :, :, :40] for i in range(3)]  # cropped views: strides of a longer cache
    vs = torch.randn(3, 1, 2, 40, 64, generator=gen).to(DEVICE)  # stacked tensor
    ref_k, ref_v = [t.clone() for t in ks], [t.clone() for t in vs]
    idx = torch.tensor([0, 3, 4, 9, 17], device=DEVICE)
    kc.kv_compact(ks, vs, 12, idx, backend="triton")
    reference.kv_compact_ref(ref_k, ref_v, 12, idx)
    assert all(torch.equal(a, b) for a, b in zip(ks + list(vs), ref_k + ref_v))
    assert torch.equal(big[:, :, :, 40:], big[:, :, :, 40:].clone())


def test_kv_compact_rejects_bad_indices():
    ks, vs = [torch.zeros(1, 1, 10, 8)], [torch.zeros(1, 1, 10, 8)]
    for bad in ([2, 1], [0, 0], [-1, 2], [0, 6]):
        with pytest.raises(ValueError, match="strictly increasing"):
            kernels.kv_compact(ks, vs, 4, torch.tensor(bad))
    with pytest.raises(ValueError, match="share shape"):
        kernels.kv_compact(ks, [torch.zeros(1, 1, 11, 8)], 4, torch.tensor([0]))


# --- transformers integration --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


def _with_kernels(model, backend):
    import copy

    from decoder.engines.hf.attention import enable_tree_attention

    _kernel_modules()
    return enable_tree_attention(copy.deepcopy(model), backend)


BACKENDS = ["sdpa", "reference", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_tree_step_logits_equal_dense_mask_path(tiny_llama, backend):
    from decoder.torch_ops.forward import prefill, tree_attention_mask, tree_forward
    from planner.tree import ancestor_matrix, tree_depths

    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 101, (1, 23), generator=gen)
    parents = random_parents(19, "forest", gen)
    n, C = len(parents), prompt.shape[1]
    tok = torch.randint(0, 101, (1, n), generator=gen)
    pos = torch.tensor([tree_depths(parents)]) + C

    from decoder.engines.hf.attention import prepare_tree

    pre = prefill(tiny_llama, prompt)
    want = tree_forward(tiny_llama, tok, pos, tree_attention_mask(ancestor_matrix(parents), C, torch.float32), pre.cache).logits

    model = _with_kernels(tiny_llama, backend)
    assert model.config._attn_implementation == "tree_triton"
    pre2 = prefill(model, prompt)
    got = tree_forward(model, tok, pos, None, pre2.cache, tree=prepare_tree(parents, "cpu")).logits
    torch.testing.assert_close(pre2.logits, pre.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a tree on a model without the kernels is ignored: the dense mask path still runs
    cache3 = prefill(tiny_llama, prompt).cache
    mask = tree_attention_mask(ancestor_matrix(parents), C, torch.float32)
    got3 = tree_forward(tiny_llama, tok, pos, mask, cache3, tree=prepare_tree(parents, "cpu")).logits
    torch.testing.assert_close(got3, want)


def test_hf_chunk_after_cache_is_causal(tiny_llama):
    """A plain block of tokens after a cache (no tree, no mask) gets causal attention with the offset."""
    from decoder.torch_ops.forward import kv, prefill

    ids = torch.randint(0, 101, (1, 30), generator=torch.Generator().manual_seed(2))
    want = tiny_llama(input_ids=ids).logits
    model = _with_kernels(tiny_llama, "reference")
    cache = prefill(model, ids[:, :18]).cache
    with torch.inference_mode():
        got = model(input_ids=ids[:, 18:], **kv(cache), use_cache=True).logits
    torch.testing.assert_close(got, want[:, 18:], atol=1e-5, rtol=1e-5)


def _plain_greedy(model, prompt, steps):
    from decoder.torch_ops.forward import kv, prefill

    logits, _, cache = prefill(model, prompt)
    out = [int(logits[0, -1].argmax())]
    with torch.inference_mode():
        while len(out) < steps:
            logits = model(input_ids=torch.tensor([[out[-1]]]), **kv(cache), use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
    return out


def _tree_greedy(model, prompt, steps, parents, oracle, gen, kernel_path):
    """Greedy tree decoding at the tree_forward level; node tokens are the oracle's with prob. 0.7."""
    from decoder.engines.hf.attention import prepare_tree
    from decoder.torch_ops.cache import crop_cache
    from decoder.torch_ops.forward import prefill, tree_attention_mask, tree_forward
    from planner.tree import ancestor_matrix, tree_depths

    depths = tree_depths(parents)
    children = [[j for j, p in enumerate(parents) if p == i] for i in range(len(parents))]
    cache = prefill(model, prompt[:, :-1]).cache
    C, root, out, n_steps = prompt.shape[1] - 1, int(prompt[0, -1]), [], 0
    while len(out) < steps:
        n_steps += 1
        k = len(out)  # the root is oracle[k - 1] (or the prompt's last token); node at depth d guesses oracle[k + d - 1]
        tok = [root] + [
            oracle[k + depths[i] - 1] if torch.rand(1, generator=gen) < 0.7 else int(torch.randint(0, 101, (1,), generator=gen))
            for i in range(1, len(parents))
        ]
        pos = torch.tensor([depths]) + C
        if kernel_path:
            logits = tree_forward(model, torch.tensor([tok]), pos, None, cache, tree=prepare_tree(parents, "cpu")).logits[0]
        else:
            mask = tree_attention_mask(ancestor_matrix(parents), C, torch.float32)
            logits = tree_forward(model, torch.tensor([tok]), pos, mask, cache).logits[0]
        path, node = [0], 0
        while True:
            want = int(logits[node].argmax())
            nxt = next((c for c in children[node] if tok[c] == want), None)
            if nxt is None:
                out.append(want)
                break
            out.append(want)
            path.append(nxt)
            node = nxt
        if kernel_path:
            layers = [layer for layer in cache.layers if layer.keys is not None]
            kernels.kv_compact([layer.keys for layer in layers], [layer.values for layer in layers], C, torch.tensor(path),
                       backend="triton" if KERNELS_RUN_HERE else "reference")
            crop_cache(cache, C + len(path))
        else:
            idx = torch.tensor(path) + C
            with torch.inference_mode():
                for layer in cache.layers:
                    layer.keys[:, :, C : C + len(path)] = layer.keys[:, :, idx].clone()
                    layer.values[:, :, C : C + len(path)] = layer.values[:, :, idx].clone()
            crop_cache(cache, C + len(path))
        C += len(path)
        root = out[-1]
    return out[:steps], n_steps


GREEDY_STEPS, GREEDY_TREE = 20, [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 8]


@pytest.fixture(scope="module")
def greedy_oracle(tiny_llama):
    """Plain greedy tokens, and the dense-mask tree decoder's tokens (it must agree too)."""
    prompt = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(5))
    oracle = _plain_greedy(tiny_llama, prompt, GREEDY_STEPS + 8)
    dense, _ = _tree_greedy(tiny_llama, prompt, GREEDY_STEPS, GREEDY_TREE, oracle, torch.Generator().manual_seed(6),
                            kernel_path=False)
    assert dense == oracle[:GREEDY_STEPS]
    return prompt, oracle


@pytest.mark.parametrize("backend", ["sdpa", pytest.param("triton", marks=needs_triton)])
def test_hf_greedy_tree_decoding_is_token_identical(tiny_llama, greedy_oracle, backend):
    prompt, oracle = greedy_oracle
    model = _with_kernels(tiny_llama, backend)
    got, n_steps = _tree_greedy(model, prompt, GREEDY_STEPS, GREEDY_TREE, oracle, torch.Generator().manual_seed(6),
                                kernel_path=True)
    assert got == oracle[:GREEDY_STEPS]
    assert n_steps <= GREEDY_STEPS // 2  # trees were really accepted, so compaction moved rows


@needs_triton
@pytest.mark.parametrize("family,ensemble", [("llama", 2), ("mistral", 1)])
def test_decoder_generate_through_kernels_is_token_identical(monkeypatch, family, ensemble):
    """The real decoder (PPD tree with prompt-token lanes, oracle guesses) on a model switched to the
    tree kernels: generate(attention="kernels") passes the tree as parents (no dense mask) and
    compacts the cache with kv_compact; tokens stay those of plain greedy decoding."""
    utils = pytest.importorskip("test_decoder_utils")
    import decoder.engines.hf.attention as hf
    from decoder import OracleGuesser, PromptTokens, generate

    model = utils.tiny_model(family)
    ids = torch.randint(1, utils.V, (9,), generator=torch.Generator().manual_seed(7))
    n = 20
    ref = utils.reference(model, ids, n)
    hf.enable_tree_attention(model, "triton")
    calls = {"tree": 0, "compact": 0}
    import kernels

    prepare_tree, kv_compact = hf.prepare_tree, kernels.kv_compact

    def counted_prepare(parents, device):
        calls["tree"] += 1
        return prepare_tree(parents, device)

    def counted_compact(keys, values, prefix_len, accepted, backend="auto", validate=True):
        calls["compact"] += 1
        assert validate is False  # the decoder skips the host-side index check on its hot path
        return kv_compact(keys, values, prefix_len, accepted, backend="triton", validate=True)  # the test checks it

    monkeypatch.setattr(hf, "prepare_tree", counted_prepare)
    monkeypatch.setattr(kernels, "kv_compact", counted_compact)
    tree = utils.ppd_tree(3, [0, 4, 10, 16], seed=3)
    pt = PromptTokens.random(model, 3, ensemble=ensemble, top_k=4)
    oracle = OracleGuesser(torch.cat([ids, torch.tensor(ref)]), utils.V, 3, top_k=4, prompt_tokens=pt)
    out = generate(model, ids, plan=tree, guesser=oracle, max_new_tokens=n, attention="kernels")
    assert out.tokens.tolist() == ref
    # every step compacts with the kernel, except one whose accepted path is the step input's own
    # prefix (0, 1, .., a): that only cuts the cache (decoder.torch_ops.cache.compact_cache), nothing moves
    assert 1 <= calls["compact"] <= out.steps
    assert calls["tree"] >= out.steps  # the tree form reached the attention path every step (and per layer)
    assert out.steps <= n // 2  # the oracle's trees were accepted: compaction really moved rows


def test_models_the_kernels_cannot_serve_get_a_clear_answer():
    """Softcapping (Gemma 2): no kernel path, a one-line reason; attention="kernels" is a user
    error, attention="auto" keeps the dense mask. Sliding windows: served while the keys fit."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    import decoder.engines.hf.attention as hf
    from decoder import PromptTokens, generate
    from decoder.engines.hf.engine import select_attention
    from planner.errors import UserError

    utils = pytest.importorskip("test_decoder_utils")
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=utils.V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           max_position_embeddings=512, attn_logit_softcapping=50.0)).eval()
    assert "softcapping" in hf.unsupported_reason(gemma)
    with pytest.raises(ValueError, match="softcapping"):
        hf.enable_tree_attention(gemma)
    pt = PromptTokens.random(gemma, 2, top_k=4)
    with pytest.raises(UserError, match="softcapping"):
        generate(gemma, torch.tensor([3, 4, 5]), plan=utils.ppd_tree(2, [0, 3, 6], seed=5), guesser=pt,
                 max_new_tokens=4, attention="kernels")
    select_attention(gemma, "auto")  # off CUDA, and never for this model: stays as it was
    assert gemma.config._attn_implementation != hf.ATTN_NAME

    mistral = utils.tiny_model("mistral")
    assert hf.unsupported_reason(mistral) is None and hf.unsupported_reason(utils.tiny_model("llama")) is None
    q = torch.randn(1, 4, 3, 16)
    kv = torch.randn(1, 2, 10, 16)
    out, _ = hf.tree_attention_forward(None, q, kv, kv, None, 0.25, tree_parents=[-1, 0, 0], sliding_window=10)
    assert out.shape == (1, 3, 4, 16)
    with pytest.raises(ValueError, match="exceed the sliding window of 9"):
        hf.tree_attention_forward(None, q, kv, kv, None, 0.25, tree_parents=[-1, 0, 0], sliding_window=9)
