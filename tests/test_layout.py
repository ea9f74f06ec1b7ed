"""The shape of the code: prefill.py runs alone (the contest takes that file alone), reads top to bottom (no definition
reads a name defined further down), and its table of contents names its sections as they stand."""
import ast
import json
import re
import shutil
import subprocess
import symtable
import sys
from pathlib import Path

import pytest

import prefill
from test_prefill import ROOT, TEXTS, write_checkpoint

ENGINE = ROOT / "prefill.py"
SIBLINGS = ("prefill_corpus", "prefill_dist", "prefill_doctor", "prefill_eval")


def bound_lines(tree):
    """Each module-level name -> the line of the top-level statement that first binds it."""
    bound = {}
    for node in tree.body:
        for sub in ast.walk(node):
            names = []
            if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                names = [sub.name]
            elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                names = [sub.id]
            elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                names = [(a.asname or a.name).split(".")[0] for a in sub.names]
            for name in names:
                bound.setdefault(name, node.lineno)
            if sub is not node and isinstance(sub, (ast.FunctionDef, ast.ClassDef, ast.Lambda)):
                continue  # a function's own names are its locals (symtable tells them apart below)
    return bound


def global_reads(table):
    """The module-level names a function or class (and everything nested in it) reads."""
    names = {s.get_name() for s in table.get_symbols()
             if s.is_referenced() and (s.is_global() or table.get_type() == "class" and not s.is_assigned())}
    for child in table.get_children():
        names |= global_reads(child)
    return names


def forward_reads(path):
    source = path.read_text()
    tree, top = ast.parse(source), symtable.symtable(source, str(path), "exec")
    bound = bound_lines(tree)
    module = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    found = []
    for node in tree.body:
        reads = set()
        for child in top.get_children():
            if node.lineno <= child.get_lineno() <= node.end_lineno:
                reads |= global_reads(child)
        found += [f"{path.name}:{node.lineno} reads {name}, bound at line {bound[name]}" for name in sorted(reads)
                  if name in module and name in bound and bound[name] > node.lineno]
    return found


@pytest.mark.parametrize("name", ["prefill", *SIBLINGS])
def test_no_definition_reads_a_name_defined_further_down(name):
    assert forward_reads(ROOT / f"{name}.py") == []


def test_the_reading_order_check_finds_a_forward_read(tmp_path):
    # the check itself: a function reading a later constant, and one reading a later function, are both found
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    return LATER + g()\n\n\ndef g():\n    return 1\n\n\nLATER = 2\n")
    assert forward_reads(bad) == ["bad.py:1 reads LATER, bound at line 9", "bad.py:1 reads g, bound at line 5"]


def table_of_contents(doc, titles):
    """[(section, [names])] from prefill's docstring: a line "  section: names" each (section one of titles),
    continued on deeper lines; words in parentheses are the Runner's methods, not top-level names."""
    contents = doc.split("with their main definitions")[1].split("Beside it")[0]
    entries = []
    for line in contents.splitlines()[2:]:
        if re.match(r"^  \S", line):
            title = max((t for t in titles if line.strip().startswith(t + ": ")), key=len, default=line.strip())
            entries.append([title, line.strip()[len(title) + 2:]])
        elif line.startswith("      "):
            entries[-1][1] += " " + line.strip()
    return [(title, re.findall(r"\w+", re.sub(r"\([^)]*\)", "", names))) for title, names in entries]


def test_the_table_of_contents_names_every_section_in_order_and_what_each_defines():
    source = ENGINE.read_text()
    lines = source.splitlines()
    banners = [(i + 1, m.group(1)) for i, line in enumerate(lines) if (m := re.match(r"^# -{20,} (.+)$", line))]
    contents = table_of_contents(prefill.__doc__, [title for _, title in banners])
    assert [title for title, _ in contents] == [title for _, title in banners]
    defined = {}  # top-level name -> the line defining it
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined[node.name] = node.lineno
        elif isinstance(node, ast.Assign):
            defined.update((t.id, node.lineno) for t in node.targets if isinstance(t, ast.Name))
    ends = [line for line, _ in banners[1:]] + [len(lines) + 1]
    for (start, title), end, (_, names) in zip(banners, ends, contents):
        assert names, title
        for name in names:
            assert name in defined and start < defined[name] < end, f"{name}, listed under {title!r}"


@pytest.fixture(scope="module")
def alone(tmp_path_factory, qwen_tokenizer_dir):
    # a checkpoint, and prefill.py copied alone into an empty folder
    root = tmp_path_factory.mktemp("alone")
    write_checkpoint(root / "ckpt", qwen_tokenizer_dir)
    (root / "bin").mkdir()
    shutil.copy(ENGINE, root / "bin" / "prefill.py")
    return root


def imported_siblings(importtime_log):
    # the siblings a process imported, from python -X importtime's lines on stderr
    return sorted({name for name in SIBLINGS if re.search(rf"\|\s+{name}$", importtime_log, re.M)})


def test_prefill_py_alone_serves_the_protocol_as_from_the_repository(alone):
    request = json.dumps(TEXTS) + "\n"

    def served(script, cwd):
        return subprocess.run([sys.executable, "-X", "importtime", str(script), "--model", str(alone / "ckpt"),
                               "--device", "cpu", "--attention", "sdpa"], input=request, capture_output=True,
                              text=True, timeout=300, cwd=cwd)
    there, here = served(alone / "bin" / "prefill.py", alone / "bin"), served(ENGINE, ROOT)
    assert there.returncode == 0 and here.returncode == 0, there.stderr[-2000:] + here.stderr[-2000:]
    assert there.stdout.splitlines()[0] == "ready" and there.stdout == here.stdout  # the same bytes
    assert imported_siblings(there.stderr) == [] and imported_siblings(here.stderr) == []


def test_prefill_py_alone_gives_the_python_api_and_names_a_missing_sibling(alone):
    code = f"""
import json, prefill
assert prefill.__file__ == {str(alone / "bin" / "prefill.py")!r}, prefill.__file__
runner = prefill.Runner({str(alone / "ckpt")!r}, device="cpu", attention="sdpa")
scores = [s.loss for s in runner.score(["one text", "and another one"])]
lls = runner.loglikelihoods([([1, 2, 3], [4]), ([1, 2, 3], [5, 6])])
print(json.dumps([scores, [[r.logprob, r.greedy, r.tokens] for r in lls]]))
"""
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=alone / "bin")
    assert p.returncode == 0, p.stderr[-3000:]
    scores, lls = json.loads(p.stdout.splitlines()[-1])
    assert len(scores) == 2 and all(s > 0 for s in scores) and [r[2] for r in lls] == [1, 2]
    assert all(r[0] < 0 for r in lls) and imported_siblings(p.stderr) == []


@pytest.mark.parametrize("option, sibling", [(["--input", "x.jsonl"], "prefill_corpus"),
                                             (["--doctor"], "prefill_doctor")])
def test_an_option_whose_sibling_is_missing_is_one_line_and_exit_2(alone, option, sibling, monkeypatch, capsys):
    # as the contest would have it: prefill.py alone, asked for what lives beside it
    monkeypatch.setitem(sys.modules, sibling, None)  # import then raises ModuleNotFoundError, as without the file
    monkeypatch.setattr(prefill, "take_stdout", lambda: sys.stdout)
    rc = prefill.main(["--model", str(alone / "ckpt"), "--device", "cpu", *option])
    err = capsys.readouterr().err
    assert rc == 2 and err == (f"prefill: error: {option[0]} needs {sibling}.py beside prefill.py (this one runs the "
                               "protocol and the Python API alone)\n"), err
