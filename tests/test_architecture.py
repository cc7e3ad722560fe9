"""The layout's rules, checked on the source: imports point one way, the planner core is numpy only.

Packages, top down (README, "Layout"): workflows -> training, profiler -> decoder -> kernels,
planner. A package may import the ones below it, never one above; no module imports itself
back through a circle. `planner/__main__.py` (the `python3 -m planner` shim) is the one
allowed upward import.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "decoder", "kernels", "profiler", "training", "workflows")
ALLOWED = {  # package -> packages it may import
    "kernels": set(),
    "planner": set(),
    "decoder": {"kernels", "planner"},
    "profiler": {"decoder", "kernels", "planner"},
    "training": {"decoder", "kernels", "planner", "profiler"},
    "workflows": set(PACKAGES) - {"workflows"},
}
SHIMS = {"planner.__main__"}
# Functions the architecture issue named as too long to hold in the head, and the loop they became.
HOT_PATHS = ("decoder/loop.py", "decoder/guesser.py", "workflows/mainjob/pipeline.py", "workflows/tune/measured.py",
             "profiler/measure.py", "planner/ppd.py")
MAX_FUNCTION_LINES = 65
# The repository explains its own formulas (docs/algorithms.md, docs/seed-systems.md): nothing in it
# may send a reader to the research notes kept outside it. The names are split so that this file
# does not match itself.
SELF_CONTAINED = ("planner", "profiler", "decoder", "kernels", "workflows", "training", "scripts", "bench", "tests",
                  "docs", "README.md", "vllm_plugin")
NOTES_CITATIONS = ("shared/" + "notes", "ALGORITHMS" + ".md", "SEEDS_" + "WAVE", "ANCHORS_" + "WAVE",
                   "EXPORT" + ".md", "PRACTICAL" + ".md")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _lazy_exports(path: Path) -> dict[str, str]:
    """A package __init__'s `_EXPORTS = {name: module}` table (names imported on first use)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def import_graph() -> dict[str, set[str]]:
    """module -> project modules it imports, at top level or inside functions (a lazy import is
    still a dependency), with `from pkg import name` resolved to the submodule that defines name."""
    modules = _modules()
    exports = {m: _lazy_exports(p) for m, p in modules.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub in modules:
                        targets.append(sub)
                    elif a.name in exports.get(node.module, {}):
                        targets.append(exports[node.module][a.name])
                    else:
                        targets.append(node.module)
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def _without_shims(graph):
    return {m: deps for m, deps in graph.items() if m not in SHIMS}


def test_no_import_circle_among_modules():
    assert _cycles(_without_shims(import_graph())) == []


def test_packages_import_only_downwards():
    bad = []
    for mod, deps in _without_shims(import_graph()).items():
        pkg = mod.split(".")[0]
        for d in deps:
            dpkg = d.split(".")[0]
            if dpkg != pkg and dpkg not in ALLOWED[pkg]:
                bad.append(f"{mod} imports {d}")
    assert bad == []
    packages = {p: set() for p in PACKAGES}
    for mod, deps in _without_shims(import_graph()).items():
        packages[mod.split(".")[0]] |= {d.split(".")[0] for d in deps} - {mod.split(".")[0]}
    assert _cycles(packages) == []


def test_the_checks_catch_a_circle_and_an_upward_import():
    """The two tests above can fail: a circle and a planner -> decoder arrow are found."""
    graph = import_graph()
    graph["decoder.layout"] = graph["decoder.layout"] | {"decoder.loop"}  # loop imports layout already
    assert any("decoder.layout" in c and "decoder.loop" in c for c in _cycles(graph))
    assert "decoder.loop" in import_graph()["profiler.acceptance"]  # resolved through a real import
    assert "decoder.guessers.prompt_tokens" in import_graph()["profiler.overhead"]  # resolved through decoder's lazy table


def test_planner_modules_import_without_torch():
    mods = [m for m in _modules() if m.split(".")[0] == "planner" and m not in SHIMS]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n    importlib.import_module(m)\n"
            "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'transformers', 'triton'))\n"
            "print(len(bad)); print(' '.join(bad[:5]))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "0", r.stdout


@pytest.mark.parametrize("rel", HOT_PATHS)
def test_hot_path_functions_are_short(rel):
    tree = ast.parse((ROOT / rel).read_text())
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


def test_one_compact_cache_and_one_oracle():
    defs = {}
    for mod, path in _modules().items():
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in ("compact_cache", "OracleGuesser", "_DepthOracle"):
                defs.setdefault(n.name, []).append(mod)
    assert defs == {"compact_cache": ["decoder.torch_ops.cache"], "OracleGuesser": ["decoder.guessers.oracle"]}


def test_every_public_decoder_name_resolves():
    """The names the issues and the README promise (`from decoder import X`) exist."""
    import decoder

    for name in decoder.__all__:
        assert getattr(decoder, name) is not None, name
    for name in ("DraftModelGuesser", "ParallelDrafter", "PromptLookupGuesser", "PromptTokens", "generate"):
        assert name in decoder.__all__


def notes_citations(root: Path = ROOT) -> list[str]:
    """'path:line: pattern' for every citation of the outside notes in the SELF_CONTAINED text files."""
    hits = []
    for name in SELF_CONTAINED:
        top = root / name
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else []
        for path in files:
            if any(part.startswith(".") or part == "__pycache__" for part in path.relative_to(root).parts):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # weights, images: not text
            for lineno, line in enumerate(text.splitlines(), start=1):
                hits += [f"{path.relative_to(root)}:{lineno}: {pat}" for pat in NOTES_CITATIONS if pat in line]
    return hits


def test_nothing_cites_the_notes_outside_the_repository():
    """Code, tests, scripts, benchmarks and docs cite the repository's own pages, which a clone has."""
    hits = notes_citations()
    assert hits == [], ("cite docs/algorithms.md or docs/seed-systems.md (section by name) instead of the notes "
                        "outside the repository:\n" + "\n".join(hits))


def test_the_notes_check_catches_a_citation(tmp_path):
    """The test above can fail: a citation in a docs page or a code docstring is found, a clean file is not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("See ../" + "shared/" + "notes/" + "ALGORITHMS" + ".md, section 2.\n")
    (tmp_path / "planner").mkdir()
    (tmp_path / "planner" / "m.py").write_text('"""Model (' + "SEEDS_" + 'WAVE2 3.3)."""\n')
    (tmp_path / "planner" / "clean.py").write_text('"""See docs/algorithms.md, section \'Cost model\'."""\n')
    assert notes_citations(tmp_path) == ["planner/m.py:1: " + "SEEDS_" + "WAVE",
                                         "docs/page.md:1: " + "shared/" + "notes",
                                         "docs/page.md:1: " + "ALGORITHMS" + ".md"]


# ---------------------------------------------------------------------------------------------- one job per module, kinds in one place

MAX_MODULE_LINES = 550  # the architecture issue split the 600-700 line modules; none may grow back to that
CODE_PACKAGES = ("decoder", "planner", "profiler", "workflows", "kernels", "training")


def _module_lengths() -> dict[str, int]:
    return {str(f.relative_to(ROOT)): len(f.read_text().splitlines())
            for pkg in CODE_PACKAGES for f in (ROOT / pkg).rglob("*.py")}


def test_no_module_grows_past_one_job():
    long = {m: n for m, n in _module_lengths().items() if n > MAX_MODULE_LINES}
    assert long == {}, f"split these by job (docs/layout.md): {long}"


def kind_branches(source: str, kind_names) -> list[int]:
    """Lines that decide on a guesser kind's name: a comparison of a guesser/kind value with a
    registered name. Traits (planner/guessers.py) say what a kind needs, so code asks them instead."""
    tree = ast.parse(source)
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        named = [c for o in operands for c in ast.walk(o) if isinstance(c, ast.Constant) and c.value in kind_names]
        other = " ".join(ast.get_source_segment(source, o) or "" for o in operands
                         if not isinstance(o, (ast.Constant, ast.Tuple, ast.List, ast.Set))).lower()
        if named and ("guesser" in other or "kind" in other):
            lines.append(node.lineno)
    return lines


def test_no_module_branches_on_a_guesser_name():
    from planner.guessers import names

    found = {}
    for pkg in CODE_PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            if f.name == "guessers.py" and pkg == "planner":
                continue
            lines = kind_branches(f.read_text(), set(names()))
            if lines:
                found[str(f.relative_to(ROOT))] = lines
    assert found == {}, f"ask the registry's traits instead of the kind's name: {found}"


def test_the_kind_check_catches_a_branch_on_a_name():
    names = {"lookup", "parallelspec"}
    assert kind_branches('if args.guesser == "parallelspec":\n    pass\n', names) == [1]
    assert kind_branches('x = kind in ("lookup", "draft")\n', names) == [1]
    assert kind_branches('if plan.method == "lookup":\n    pass\n', names) == []  # another vocabulary


# ---------------------------------------------------------------------------------------------- the layout page names every module

LAYOUT_PAGE = ROOT / "docs" / "layout.md"


def _layout_modules(root: Path = ROOT) -> list[str]:
    """'pkg/name.py' for every module of the code packages but package files (__init__, __main__)."""
    return sorted(str(f.relative_to(root).as_posix()) for pkg in CODE_PACKAGES for f in (root / pkg).rglob("*.py")
                  if f.name not in ("__init__.py", "__main__.py") and "__pycache__" not in f.parts)


def unnamed_modules(page: str, modules) -> list[str]:
    """The modules ('pkg/name.py') the page does not name: by path, or by file name alone when no other
    module has that file name (decoder/guessers/registry.py and decoder/engines/shipped.py need their paths). A name
    must stand alone: `hf_engine.py` does not name `engine.py`."""
    counts = Counter(PurePosixPath(m).name for m in modules)
    missing = []
    for m in modules:
        name = PurePosixPath(m).name
        patterns = [rf"(?<!\w){re.escape(m)}(?!\w)"]
        if counts[name] == 1:
            patterns.append(rf"(?<![\w/]){re.escape(name)}(?!\w)")
        if not any(re.search(p, page) for p in patterns):
            missing.append(m)
    return missing


def test_layout_names_every_module():
    missing = unnamed_modules(LAYOUT_PAGE.read_text(encoding="utf-8"), _layout_modules())
    assert missing == [], f"docs/layout.md: give each a line with its one job: {missing}"


def test_the_layout_check_catches_a_missing_module():
    """The test above can fail: a module the page leaves out is found, a longer name or another
    package's file of the same name does not stand in for it."""
    modules = ["decoder/engine.py", "decoder/hf_engine.py", "decoder/llama_engine.py",
               "decoder/registry.py", "profiler/registry.py", "training/splits.py"]
    page = "| `decoder/hf_engine.py` | ... |\n| `llama_engine.py` | ... |\n`profiler/registry.py`, `splits.py`\n"
    assert unnamed_modules(page, modules) == ["decoder/engine.py", "decoder/registry.py"]
    page += "`engine.py` and `decoder/registry.py`\n"
    assert unnamed_modules(page, modules) == []
    assert unnamed_modules("registry.py\n", ["decoder/registry.py", "profiler/registry.py"]) == [
        "decoder/registry.py", "profiler/registry.py"]
    assert "decoder/engine.py" in _layout_modules() and "planner/__main__.py" not in _layout_modules()


MAX_KIND_MODULES = 4  # modules, past the registry, the kind's own module and the CLI, that may spell a kind


def _json_keys(tree: ast.AST) -> set[int]:
    """String constants used as JSON field names (subscripts, dict keys, .get/.pop keys): the file
    boundary, where kind names such as "pearl" or "plain" are fields, not decisions."""
    keys = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant):
            keys.add(id(n.slice))
        elif isinstance(n, ast.Dict):
            keys.update(id(k) for k in n.keys if isinstance(k, ast.Constant))
        elif (isinstance(n, ast.Call) and getattr(n.func, "attr", "") in ("get", "pop", "setdefault") and n.args
              and isinstance(n.args[0], ast.Constant)):
            keys.add(id(n.args[0]))
    return keys


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def kind_spellings(sources: dict[str, str], own: dict[str, str]) -> dict[str, set[str]]:
    """kind -> modules that spell its name as a string (not a docstring, not a JSON field name),
    outside the registry, the kind's own module (`own`: kind -> its loader's module) and the CLI."""
    out: dict[str, set[str]] = {}
    for rel, source in sources.items():
        if rel == "planner/guessers.py" or rel.startswith("workflows/cmd_") or rel in ("workflows/cli/inputs.py", "workflows/cli/main.py"):
            continue
        tree = ast.parse(source)
        skip = _docstrings(tree) | _json_keys(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and n.value in own and id(n) not in skip and rel != own[n.value]:
                out.setdefault(n.value, set()).add(rel)
    return out


def test_guesser_kinds_are_spelled_in_few_modules():
    from planner.guessers import kinds

    own = {k.name: (k.loader.split(":")[0].replace(".", "/") + ".py") if isinstance(k.loader, str) else ""
           for k in kinds()}
    sources = {str(f.relative_to(ROOT)): f.read_text() for pkg in CODE_PACKAGES for f in (ROOT / pkg).rglob("*.py")}
    wide = {k: sorted(m) for k, m in kind_spellings(sources, own).items() if len(m) > MAX_KIND_MODULES}
    assert wide == {}, f"name these kinds through planner/guessers.py: {wide}"


def test_the_spelling_check_counts_decisions_not_fields():
    own = {"lookup": "decoder/guessers/lookup.py"}
    sources = {f"workflows/m{i}.py": 'if g == "lookup":\n    pass\n' for i in range(3)}
    sources["workflows/fields.py"] = 'x = row["lookup"]\ny = {"lookup": 1}\nz = d.get("lookup")\n'
    sources["decoder/guessers/lookup.py"] = 'kind = "lookup"\n'
    sources["workflows/cmd_x.py"] = 'if a == "lookup":\n    pass\n'
    assert kind_spellings(sources, own) == {"lookup": {"workflows/m0.py", "workflows/m1.py", "workflows/m2.py"}}


# ---------------------------------------------------------------------------------------------- engines: one door to the model

ENGINE_REGISTRY = "planner/engines.py"
# Where a model's internals may be touched: each engine's own package and the neutral torch helpers the hf
# engine and the drafters share (decoder/torch_ops). The proposers reach models only through the drafter
# interface (decoder/drafter.py) and the engine's narrow methods (open_drafter, token_modules: decoder/engine.py).
INTERNALS_OWNERS = ("decoder/engines/", "decoder/torch_ops/")
# Proposer modules that still read a checkpoint against the target's modules themselves, and why.
INTERNALS_ALLOWED = {
}
# torch_model() hands out the whole torch model: the engines use it among themselves; every other layer asks the
# engine's narrow methods. Benchmarks may: they time transformers' own machinery beside the project's.
TORCH_MODEL_ALLOWED: dict[str, str] = {}  # module -> why it may (none does)
FENCED = ("decoder", "profiler", "workflows", "training", "kernels", "planner", "bench")
HF_ATTRS = {"get_input_embeddings", "get_output_embeddings", "lm_head", "generation_config", "_attn_implementation",
            "set_attn_implementation", "tie_weights", "get_text_config", "last_hidden_state", "embed_tokens",
            "save_pretrained", "from_pretrained", "named_parameters"}
HF_KEYWORDS = {"output_hidden_states", "past_key_values", "inputs_embeds", "use_cache", "logits_to_keep"}


def _code_files(packages=FENCED) -> dict[str, str]:
    out = {}
    for pkg in packages:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" not in f.parts:
                out[str(f.relative_to(ROOT).as_posix())] = f.read_text()
    return out


def engine_name_comparisons(source: str, engine_names) -> list[int]:
    """Lines that decide on an engine's name: a comparison of an engine, caps or target value with a
    registered engine name. Capabilities (planner/engines.py) say what an engine can do, so code asks them."""
    tree = ast.parse(source)
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        # a name compared directly, or in a tuple/list/set compared: a name inside a call's arguments is passed on
        named = [c for o in operands for c in ([o] if isinstance(o, ast.Constant) else getattr(o, "elts", []))
                 if isinstance(c, ast.Constant) and c.value in engine_names]
        other = " ".join(ast.get_source_segment(source, o) or "" for o in operands
                         if not isinstance(o, (ast.Constant, ast.Tuple, ast.List, ast.Set))).lower()
        if named and any(w in other for w in ("engine", "caps", "target", "backend")):
            lines.append(node.lineno)
    return lines


def test_no_module_compares_engine_names():
    from planner.engines import names

    found = {rel: lines for rel, src in _code_files().items()
             if rel != ENGINE_REGISTRY and (lines := engine_name_comparisons(src, set(names())))}
    assert found == {}, f"ask the engine's capabilities (planner/engines.py) instead of its name: {found}"


def test_the_engine_check_catches_a_comparison():
    names = {"hf", "llama.cpp"}
    assert engine_name_comparisons('if engine.caps.name == "hf":\n    pass\n', names) == [1]
    assert engine_name_comparisons('x = args.engine in ("hf", "llama.cpp")\n', names) == [1]
    assert engine_name_comparisons('y = target != "llama.cpp"\n', names) == [1]
    assert engine_name_comparisons('if plan.method == "hf":\n    pass\n', names) == []  # another vocabulary
    assert engine_name_comparisons('e = kind("llama.cpp")\n', names) == []  # naming one is not deciding on it
    assert engine_name_comparisons('ok = main(["--engine", "hf"]) != 0\n', names) == []  # passing one on neither


def hf_internals(source: str) -> list[tuple[int, str]]:
    """(line, what) where code reaches into a transformers model: the library itself, the modules and
    configs under a model, its cache and forward keywords. An engine's package owns those."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "transformers" for a in n.names):
            out.append((n.lineno, "import transformers"))
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "transformers":
            out.append((n.lineno, "from transformers"))
        elif isinstance(n, ast.Attribute) and n.attr in HF_ATTRS:
            out.append((n.lineno, n.attr))
        elif isinstance(n, ast.Attribute) and n.attr == "config" and not isinstance(n.value, ast.Call):
            out.append((n.lineno, ".config"))
        elif isinstance(n, ast.keyword) and n.arg in HF_KEYWORDS:
            out.append((n.lineno, n.arg))
        elif isinstance(n, ast.Name) and n.id == "DynamicCache":
            out.append((n.lineno, "DynamicCache"))
    return sorted(set(out))


def test_no_model_internals_outside_the_engine_packages():
    found = {rel: hits for rel, src in _code_files().items()
             if not rel.startswith(INTERNALS_OWNERS) and rel not in INTERNALS_ALLOWED and (hits := hf_internals(src))}
    assert found == {}, f"reach the model through the engine (decoder/engine.py) instead: {found}"


def torch_model_calls(source: str) -> list[int]:
    """Lines that call torch_model(...) or x.torch_model(): the whole torch model handed out."""
    return sorted({n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
                   and (getattr(n.func, "id", None) == "torch_model" or getattr(n.func, "attr", None) == "torch_model")})


def test_only_engines_take_the_torch_model():
    """Guessers, the profiler, training and the workflows ask the engine's narrow methods (open_drafter,
    token_modules, training, context_forwards) instead of the torch model itself."""
    found = {rel: lines for rel, src in _code_files(("decoder", "profiler", "training", "workflows")).items()
             if not rel.startswith("decoder/engines/") and rel not in TORCH_MODEL_ALLOWED
             and (lines := torch_model_calls(src))}
    assert found == {}, f"ask the engine's narrow methods (decoder/engine.py) instead: {found}"
    assert torch_model_calls("m = engine.torch_model()\nn = torch_model(target)\nk = engine.token_modules()\n") == [1, 2]


def test_guessers_import_no_engine_package():
    """A proposer runs on any engine that gives what its kind needs: it imports the engine protocol
    (decoder/engine.py) and the drafter interface, never an engine's package."""
    bad = sorted(f"{m} imports {d}" for m, deps in import_graph().items() if m.startswith("decoder.guessers")
                 for d in deps if d.startswith("decoder.engines"))
    assert bad == []


def test_the_internals_check_catches_a_reach():
    src = ("from transformers import AutoTokenizer\n"
           "w = model.get_input_embeddings().weight\n"
           "n = model.config.vocab_size\n"
           "out = model(input_ids=x, use_cache=False)\n"
           "v = engine.vocab_size\n")
    assert [line for line, _ in hf_internals(src)] == [1, 2, 3, 4]
    assert hf_internals("s = replace(cfg, seed=1)\nd = engine.record()\n") == []


def namespace_writes(source: str) -> list[int]:
    """Lines that write into an argparse namespace: `args.x = ...`, `args.x += ...`, setattr(args, ...)."""
    lines = []
    for n in ast.walk(ast.parse(source)):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "args":
                    lines.append(n.lineno)
        if (isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setattr" and n.args
                and isinstance(n.args[0], ast.Name) and n.args[0].id == "args"):
            lines.append(n.lineno)
    return sorted(set(lines))


def test_no_writes_into_the_argparse_namespace():
    found = {rel: lines for rel, src in _code_files(("workflows", "bench")).items() if (lines := namespace_writes(src))}
    assert found == {}, f"resolve settings into a typed object (workflows/cli/run_config.py) instead: {found}"


def test_the_namespace_check_catches_a_write():
    assert namespace_writes("args.threads = 2\n") == [1]
    assert namespace_writes("args.verify, args.plan = 'x', None\n") == [1]
    assert namespace_writes("setattr(args, 'rounds', 3)\n") == [1]
    assert namespace_writes("x = args.threads\nrun = replace(run, threads=2)\n") == []
