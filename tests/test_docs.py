"""The docs as a new user reads them: every repository file they cite exists, and every flag a
`python SCRIPT ...` command in them passes is in that script's --help (a renamed or removed
flag fails here, not in a user's shell). Running the commands is the benches' own tests'
job; this checks only what a reader types."""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))]


def read(doc: str) -> str:
    with open(os.path.join(ROOT, doc)) as f:
        return f.read()


def cited_files(text: str) -> set[str]:
    """bench/..., tests/..., docs/... paths, bare *.py / *.sh names and image links."""
    paths = set(re.findall(r"(?<![\w/.~-])((?:bench|tests|docs)/[\w./-]*\w|[\w-]+\.(?:py|sh))\b", text))
    paths |= set(re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text))
    return {p for p in paths if not p.startswith("bench/results")}  # the benches' (git-ignored) output


def exists(path: str, doc: str) -> bool:
    """A path from the root, from the doc's folder, or a bare name of bench/ or tests/."""
    bases = ["", os.path.dirname(doc)] + (["bench", "tests"] if "/" not in path else [])
    return any(os.path.exists(os.path.join(ROOT, base, path)) for base in bases)


def commands(text: str) -> list[tuple[str, list[str]]]:
    """(script, its flags) for each `python SCRIPT args`: continued lines joined, quoted
    arguments left out of the flags (a quoted server command is a command of its own)."""
    text = re.sub(r"\\\n\s*", " ", text)
    found = []
    for m in re.finditer(r"(?<![\w/])(?=python3? ((?:bench/)?\w+\.py)([^`\n|]*))", text):
        args = m.group(2)
        if text[m.start() - 1] in "=\"'":  # quoted inside another command: it ends at the quote
            args = re.split(r"[\"']", args, maxsplit=1)[0]
        args = re.sub(r"\"[^\"]*\"|'[^']*'", "", args)
        found.append((m.group(1), re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", args)))
    return found


@functools.lru_cache(maxsize=None)
def help_flags(script: str) -> frozenset[str]:
    out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{script} --help: {out.stderr[-2000:]}"
    return frozenset(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", out.stdout))


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_a_doc_cites_exists(doc):
    missing = sorted(p for p in cited_files(read(doc)) if not exists(p, doc))
    assert missing == [], f"{doc} cites files that are not in the repository: {missing}"


MODULES = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))
FILE_SUFFIXES = {"json", "model", "safetensors", "gguf", "yaml", "md", "png", "py", "sh"}  # config.json, tokenizer.model


def defined_names(tree: ast.AST) -> set[str]:
    """Every name a module or class body defines: functions, classes, assigned names and
    attributes (self.x = ...), imports (a re-export is a name of the module too)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(t) if isinstance(n, ast.Attribute)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@functools.lru_cache(maxsize=None)
def code_names() -> tuple[dict[str, set[str]], dict[str, tuple[set[str], list[str]]]]:
    """module -> its names; class -> (its names, its bases), over the top-level modules."""
    modules, classes = {}, {}
    for m in MODULES:
        tree = ast.parse(read(f"{m}.py"))
        modules[m] = defined_names(tree)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (defined_names(node), [b.id for b in node.bases if isinstance(b, ast.Name)])
    return modules, classes


def undefined_names(text: str) -> set[str]:
    """`module.name` and `Class.name` citations (module.py and the class in the repository)
    whose name the module, or the class and its bases, does not define."""
    modules, classes = code_names()

    def in_class(c: str, name: str) -> bool:
        names, bases = classes[c]
        return name in names or any(b in classes and in_class(b, name) for b in bases)

    cited = re.findall(r"(?<![\w/.-])([A-Za-z_]\w*)\.([A-Za-z_]\w*)", text)
    return {f"{a}.{b}" for a, b in cited if a in modules and b not in FILE_SUFFIXES and b not in modules[a]
            or a in classes and a[0].isupper() and not in_class(a, b)}


@pytest.mark.parametrize("doc", DOCS)
def test_every_module_and_class_attribute_a_doc_cites_is_defined(doc):
    missing = sorted(undefined_names(read(doc)))
    assert missing == [], f"{doc} cites names the code does not define (renamed or moved?): {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_flag_of_a_documented_command_is_in_its_scripts_help(doc):
    wrong = []
    for script, flags in commands(read(doc)):
        if not os.path.exists(os.path.join(ROOT, script)):
            wrong.append(f"python {script}: no such script")
            continue
        wrong += [f"python {script} {f}" for f in flags if f not in help_flags(script)]
    assert wrong == [], f"{doc}: flags that the script's --help does not list: {wrong}"


def test_docs_benchmarks_names_every_bench():
    """The README sends a reader to docs/BENCHMARKS.md for what each bench measures: every
    runnable script in bench/ is there, told in place or pointed to."""
    bench = os.path.join(ROOT, "bench")
    runnable = [f"bench/{f}" for f in sorted(os.listdir(bench)) if f.endswith(".sh")
                or f.endswith(".py") and "__main__" in read(f"bench/{f}")]
    text = read("docs/BENCHMARKS.md")
    assert [b for b in runnable if b not in text] == [], "bench scripts docs/BENCHMARKS.md does not name"


def test_the_checks_catch_what_they_look_for():
    """The extraction itself, on text with one of each mistake."""
    text = ("Run `python bench/offline.py --tiny --no-such-flag` or\n"
            "```bash\npython bench/mixed.py --peer \\\n  --compare \"x=python server.py --port {port} --bogus\"\n```\n"
            "See bench/no_such_bench.py and ![plot](no_such_plot.png).")
    assert commands(text) == [("bench/offline.py", ["--tiny", "--no-such-flag"]),
                              ("bench/mixed.py", ["--peer", "--compare"]),
                              ("server.py", ["--port", "--bogus"])]
    assert {p for p in cited_files(text) if not exists(p, "docs/X.md")} == {"bench/no_such_bench.py",
                                                                            "no_such_plot.png"}
    assert "--no-such-flag" not in help_flags("bench/offline.py") and "--tiny" in help_flags("bench/offline.py")
    assert undefined_names("outputs.stop_reason, engine.stop_reason, `LLMEngine.validate`, LLMEngine.nothing, "
                           "config.json") == {"engine.stop_reason", "LLMEngine.nothing"}
