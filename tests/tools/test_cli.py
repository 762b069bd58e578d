"""The command line: happy paths, and bad input as one line with exit code 2."""

import shutil
import subprocess
import sys

import pytest

import derivgen


def run(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "derivgen", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_list():
    r = run("list")
    assert r.returncode == 0
    catalogue, _, zoo = r.stdout.partition("\n\nthe zoo")
    assert [l.split()[0] for l in catalogue.splitlines()] == derivgen.names()
    assert [l.split()[0] for l in zoo.splitlines()[1:]] == derivgen.zoo()
    assert max(len(l) for l in r.stdout.splitlines()) <= 100


def test_derive_text_to_file(tmp_path):
    out = tmp_path / "ln.txt"
    r = run("derive", "layernorm", "--format", "text", "--prove-sizes", "2-3", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "N = 3: proven" in out.read_text(encoding="utf-8")
    assert [p.name for p in tmp_path.iterdir()] == ["ln.txt"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["derive", "nosuchlayer"], "unknown layer 'nosuchlayer'"),
        (["derive", "layernorm", "--format", "docx"], "--format"),
        (["derive", "layernorm", "--prove-sizes", "1-99"], "--prove-sizes"),
        (["prove", "layernorm", "--prove-sizes", "3-2"], "runs low to high"),
        (["derive"], "NAME or --spec"),
        (["derive", "--spec", "/nonexistent/spec.toml"], "cannot read spec"),
        (["frobnicate"], "No such command"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needle, tmp_path):
    r = run(*args, cwd=tmp_path)
    assert r.returncode == 2
    assert needle in r.stderr
    assert r.stderr.startswith("derivgen: error: "), r.stderr  # usage errors (click's) too
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_pdf_missing_tool_message(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "derivgen",
            "derive",
            "rmsnorm",
            "--no-prove",
            "--pdf",
            str(tmp_path / "x.pdf"),
            "-o",
            str(tmp_path / "x.tex"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2  # checked before the derivation: nothing is written
    assert "texlive-latex-base" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.pdf").exists() and not (tmp_path / "x.tex").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["derive", "rmsnorm", "--no-prove", "-o", "/proc/x.tex"], "-o/--output /proc/x.tex"),
        (["derive", "rmsnorm", "--no-prove", "-o", "notes.txt/x.tex"], "notes.txt is not a directory"),
        (["derive", "rmsnorm", "--no-prove", "--format", "text", "-o", "."], "directory"),
        (["generate", "rmsnorm", "--out", "/proc/gen"], "--out /proc/gen"),
        (["generate", "rmsnorm", "--out", "notes.txt"], "notes.txt"),
        (["generate", "rmsnorm", "--out", "notes.txt/gen"], "notes.txt is not a directory"),
        (["bench", "rmsnorm", "--shape", "8x"], "--shape"),
        (["bench", "rmsnorm", "--shape", "8xx2"], "--shape"),
        (["bench", "rmsnorm", "--shape", "0x4"], "--shape"),
        (["bench", "rmsnorm", "--json", "notes.txt/r.json"], "--json"),
    ],
)
def test_bad_paths_and_values_are_one_line_exit_2(args, needle, tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    r = run(*args, cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_bench_plot_checks_matplotlib_before_any_work(tmp_path, monkeypatch, capsys):
    import importlib.util

    from derivgen import cli
    from derivgen.cli import bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a))
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("the bench ran before the check"))
    rc = cli.main(["bench", "rmsnorm", "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert rc == 2 and "matplotlib" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_generate_spec_writes_beside_it_and_never_over_the_catalogue(tmp_path):
    from conftest import ROOT

    (tmp_path / "specs").mkdir()
    mine = tmp_path / "specs" / "scalenorm.toml"
    mine.write_text((ROOT / "examples" / "scalenorm.toml").read_text())
    r = run("generate", "--spec", str(mine), "--target", "numpy", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "specs" / "generated" / "numpy" / "scalenorm.py").is_file()
    assert not (tmp_path / "generated").exists()
    r = run("generate", "--spec", str(mine), "--target", "numpy", "--check", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # a spec file named like a catalogue layer, aimed at a copy of the catalogue's generated code
    clash = tmp_path / "layernorm.toml"
    clash.write_text((ROOT / "derivgen" / "spec" / "catalogue" / "layernorm.toml").read_text())
    (tmp_path / "generated" / "numpy").mkdir(parents=True)
    committed = (ROOT / "generated" / "numpy" / "layernorm.py").read_text()
    (tmp_path / "generated" / "numpy" / "layernorm.py").write_text(committed)
    r = run("generate", "--spec", str(clash), "--target", "numpy", cwd=tmp_path)
    assert r.returncode == 2 and "catalogue's generated code" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert (tmp_path / "generated" / "numpy" / "layernorm.py").read_text() == committed
    # named explicitly, that folder still refuses a file over the catalogue's own
    r = run("generate", "--spec", str(clash), "--target", "numpy", "--out", "generated", cwd=tmp_path)
    assert r.returncode == 2 and "would replace" in r.stderr, r.stderr
    assert (tmp_path / "generated" / "numpy" / "layernorm.py").read_text() == committed
    # a spec file beside the catalogue's code, by default: refused (give --out)
    (tmp_path / "other.toml").write_text(mine.read_text())
    r = run("generate", "--spec", "other.toml", "--target", "numpy", cwd=tmp_path)
    assert r.returncode == 2 and "--out DIR" in r.stderr, r.stderr
    assert not (tmp_path / "generated" / "numpy" / "scalenorm.py").exists()
    r = run("generate", "--spec", str(clash), "--target", "numpy", "--out", str(tmp_path / "mine"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def test_prove_table_fits_100_columns_and_is_quiet_on_a_pipe():
    r = run("prove", "rmsnorm", "layernorm", "--prove-sizes", "2")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert max(len(line) for line in r.stdout.splitlines()) <= 100
    assert "∂L/∂x = " in r.stdout


@pytest.mark.parametrize("command", ["", "derive", "prove", "generate", "check", "build", "bench", "list", "lint"])
def test_every_help_states_its_defaults(command):
    r = run(*([command] if command else []), "--help")
    assert r.returncode == 0
    if command in ("derive", "prove", "check", "bench"):
        assert "[default: " in r.stdout
    if command == "derive":
        assert "LaTeX by default" in " ".join(r.stdout.split())
    if command == "generate":
        assert "default: ./generated" in " ".join(r.stdout.split())
        for target in ("numpy/NAME.py", "c/NAME.c", "c/NAME.h", "c/NAME.py", "torch/NAME.py", "jax/NAME.py"):
            assert target in r.stdout  # the five targets it writes
        assert "triton/NAME.py" in r.stdout
    if command == "":
        assert "Write the NumPy, C, PyTorch, JAX and Triton code of layers." in r.stdout
        assert "lint" in r.stdout
    if command in ("derive", "check", "lint"):
        assert "--strict" in r.stdout


def test_two_spec_files_of_one_layer_name_are_refused(tmp_path):
    from conftest import ROOT

    text = (ROOT / "examples" / "dynamic_tanh.toml").read_text()
    (tmp_path / "a.toml").write_text(text)
    (tmp_path / "b.toml").write_text(text.replace("0.5", "0.25"))
    r = run("generate", "--spec", "a.toml", "--spec", "b.toml", "--out", "gen", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "b.toml: layer name 'dynamic_tanh' is also the name of a.toml" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.toml", "b.toml"]


def test_output_paths_make_at_most_their_last_directory(tmp_path):
    r = run("derive", "rmsnorm", "--no-prove", "--format", "text", "-o", "notes/r.txt", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "derivgen: created directory notes/\n" and r.stdout == ""
    assert (tmp_path / "notes" / "r.txt").is_file()
    r = run("generate", "rmsnorm", "--target", "numpy", "--out", "notes/gen", cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "derivgen: created directory notes/gen/\n", r.stderr
    for args in (
        ["derive", "rmsnorm", "--no-prove", "-o", "typo/deeper/r.tex"],
        ["generate", "rmsnorm", "--target", "numpy", "--out", "typo/gen"],
        ["bench", "rmsnorm", "--json", "typo/deeper/r.json"],
    ):
        r = run(*args, cwd=tmp_path)
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "does not exist" in r.stderr, r.stderr
        assert "like mkdir without -p" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="needs pdflatex")
def test_derive_pdf_prints_no_latex(tmp_path):
    r = run("derive", "rmsnorm", "--no-prove", "--pdf", "r.pdf", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and (tmp_path / "r.pdf").read_bytes().startswith(b"%PDF")


def test_import_writes_a_spec_that_derives_as_the_catalogue_layer(tmp_path):
    """derivgen import torch.nn:LayerNorm: the spec file it writes derives to the catalogue's
    layer norm's reduction count; a sort is refused in one line, a bad literal too."""
    from conftest import require_module

    require_module("torch")
    out = tmp_path / "ln.toml"
    r = run("import", "torch.nn:LayerNorm", "--shape", "4x8", "--arg", "8", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "imported in" in r.stderr
    spec = derivgen.load_spec(out)
    assert [p.name for p in spec.params] == ["weight", "bias"]
    got = derivgen.derive(spec).modes["train"].reductions
    assert len(got) == len(derivgen.derive("layernorm").modes["train"].reductions)
    for args, says in (
        (("torch:sort", "--shape", "4x8"), "torch.sort"),
        (("torch.nn:LayerNorm", "--shape", "4x8", "--arg", "8x"), "--arg: expected a Python literal"),
        (("torch.nn:NoSuchNorm", "--shape", "4x8"), "NoSuchNorm"),
    ):
        r = run("import", *args)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_import_of_several_tensors_takes_a_shape_each(tmp_path):
    """derivgen import with one --shape per tensor argument: a residual add + RMSNorm file
    imports with residual in [tensors], h in [values] and as an output; shapes that do not
    broadcast are one line (torch's own logged traceback silenced)."""
    from conftest import require_module

    require_module("torch")
    src = tmp_path / "addnorm.py"
    src.write_text(
        "import torch\n\n\n"
        "class AddRMSNorm(torch.nn.Module):\n"
        "    def __init__(self, n, eps=1e-6):\n"
        "        super().__init__()\n"
        "        self.weight = torch.nn.Parameter(torch.ones(n))\n"
        "        self.eps = eps\n\n"
        "    def forward(self, x, residual):\n"
        "        h = x + residual\n"
        "        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight, h\n"
    )
    out = tmp_path / "addnorm.toml"
    r = run("import", f"{src}:AddRMSNorm", "--arg", "16", "--shape", "4x16", "--shape", "4x16", "-o", str(out))
    assert r.returncode == 0, r.stderr
    spec = derivgen.load_spec(out)
    assert [t.name for t in spec.tensors] == ["residual"] and [v.name for v in spec.values] == ["h"]
    assert [o.name for o in spec.outputs] == ["h"]
    r = run("import", f"{src}:AddRMSNorm", "--arg", "16", "--shape", "4x16", "--shape", "4x3")
    assert r.returncode == 2 and "cannot trace" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
