"""The documentation, held by tests: the README stays a front page (300
lines) and BENCHMARKS.md one screen (150), every shell command in the README
and docs/ is run by a test or marked as needing a cluster, each guide's
complete example runs as written, the configuration page lists exactly the
variables the code reads, every link lands, and every public name has a
docstring.

The marker convention (CONTRIBUTING.md, "Tests that read the docs"): every
fenced shell block (bash, sh, shell, console) in README.md and docs/ follows
an HTML comment on the line before it:

- ``<!-- run -->``: this file runs the block, in a fresh directory holding
  the page's ``<!-- file: NAME -->`` blocks, in a network namespace of its
  own (so the fixed ports the docs show are free), with the virtual
  environment's programs first on PATH, as a user with the venv active;
- ``<!-- needs-cluster: WHAT -->``: no test runs it; WHAT says what it needs
  (two hosts, a GPU, Docker, a dedicated benchmark host);
- a marker of READERS: a block that another test or CI finds by its marker
  and runs (the README's test command, its compose commands, ...).

docs/benchmarks-history.md is left out: its commands are records of the
runs that produced its figures, at their commits, not instructions.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT

README = ROOT / "README.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
README_MAX_LINES = 300
BENCHMARKS_MAX_LINES = 150
HISTORY = ROOT / "docs" / "benchmarks-history.md"
# The pages whose shell blocks must be run or marked.
PAGES = [README, *sorted(p for p in (ROOT / "docs").rglob("*.md") if p != HISTORY)]
SHELL = {"bash", "sh", "shell", "console", "zsh"}
# A marker that another reader runs, and that reader: it must name the marker.
READERS = {
    "test-command": ".ci/run",
    "docs-command": ".ci/run",
    "compose-commands": "tests/test_compose.py",
    "elastic-compose-commands": "tests/test_compose.py",
    # Its install is the test command's with the demo extra (checked below);
    # tests/test_demo.py runs `ferrogrpc demo`.
    "demo-command": "tests/test_docs.py",
}
RUN = "run"
CLUSTER = re.compile(r"needs-cluster:\s*(\S.*)")
FILE = re.compile(r"file:\s*(\S+)")
# What a page's examples must print (its claims, checked as they run).
EXPECT = {
    "docs/elastic.md": [
        "a joiner: rank -1 until steps() admits it",
        "rank 0 of 3: done at step 80",
        "rank 1 of 3: done at step 80",
        "rank 2 of 3: done at step 80",
    ],
    "docs/launchers.md": ["rank 0 of 2: done at step 20", "rank 1 of 2: done at step 20"],
    "docs/troubleshooting.md": [
        "CollectiveTimeoutError: [rank 0/2 all_reduce#5] did not finish",
        "culprit: rank 1 (",
        "it never reached all_reduce#5",
    ],
    "docs/configuration.md": [
        "refused: Timeouts.collective must be a positive number, got -1",
        ", grpc",
    ],
    "docs/observability.md": ["/metrics", "wrote run.json: ranks [0, 1]"],
    "docs/torch-backend.md": ["sum of ranks 1, objects [{'rank': 0}, {'rank': 1}]"],
    "docs/slow-links.md": ["rank 1: DDP int8, DiLoCo int4 and a bfloat16 all_reduce done"],
    "docs/diloco.md": ["rank 1: 40 inner steps, 4 outer syncs"],
    "docs/collectives.md": ["rank 1: 2 parts"],
    "docs/ARCHITECTURE.md": ["every rank holds 3.0"],
}


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    marker: str | None  # the HTML comment on the line before, if any
    text: str

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page (indented ones in lists too)."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = re.match(r"\s*(```+|~~~+)\s*([\w-]*)", lines[i])
        if not opening:
            i += 1
            continue
        fence, lang = opening.groups()
        end = next(
            (j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)), len(lines)
        )
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        comment = re.fullmatch(r"<!--\s*(.*?)\s*-->", before)
        indent = len(lines[i]) - len(lines[i].lstrip())  # a block in a list item
        body = "".join(line[indent:] + "\n" for line in lines[i + 1 : end])
        found.append(Block(page, i + 1, lang, comment.group(1) if comment else None, body))
        i = end + 1
    return found


def shell_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang in SHELL]


def test_the_readme_stays_a_front_page() -> None:
    # A new feature adds a guide in docs/ and one link here, not a section
    # (STYLE.md, "Docs by reader, held by a test").
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines, over {README_MAX_LINES}: move a section to a guide in docs/ "
        "and link it"
    )


def test_benchmarks_stays_one_screen() -> None:
    n = len(BENCHMARKS.read_text().splitlines())
    assert n <= BENCHMARKS_MAX_LINES, (
        f"BENCHMARKS.md has {n} lines, over {BENCHMARKS_MAX_LINES}: it holds the current ratios to "
        "gloo; move the rest to docs/benchmarks-history.md, naming each figure's script and commit"
    )


def test_every_shell_command_is_run_by_a_test_or_marked() -> None:
    problems = []
    for page in PAGES:
        for b in blocks(page):
            if b.lang == "" and b.text.lstrip().startswith("$ "):
                problems.append(f"{b.where()}: a shell transcript: tag it ```bash and mark it")
            if b.lang not in SHELL:
                continue
            if b.marker is None:
                problems.append(
                    f"{b.where()}: a {b.lang} block without a marker on the line before"
                )
            elif b.marker in READERS or b.marker == RUN:
                continue
            elif CLUSTER.fullmatch(b.marker) is None:
                problems.append(f"{b.where()}: unknown marker <!-- {b.marker} -->")
    assert not problems, "\n".join(
        [*problems, "use <!-- run --> (tests/test_docs.py runs it) or <!-- needs-cluster: WHAT -->"]
    )


def test_every_reader_reads_its_marker() -> None:
    readme = README.read_text()
    for marker, reader in READERS.items():
        if reader != "tests/test_docs.py":
            assert f"<!-- {marker} -->" in (ROOT / reader).read_text(), (marker, reader)
        # These readers read the README.
        assert f"<!-- {marker} -->" in readme, f"README.md lost its <!-- {marker} --> block"


def _readme_command(marker: str) -> str:
    """The line after the marker's opening fence, as .ci/run takes it."""
    lines = README.read_text().splitlines()
    return lines[lines.index(f"<!-- {marker} -->") + 2]


def test_the_demo_command_installs_as_the_tests_do_and_runs_the_demo() -> None:
    demo = _readme_command("demo-command").split(" && ")
    test = _readme_command("test-command").split(" && ")
    assert demo[0] in test, (demo, test)  # the same venv
    assert demo[1] == test[test.index(demo[0]) + 1].replace("'.[test]'", "'.[demo]'"), demo
    assert demo[2] == ".venv/bin/ferrogrpc demo", demo
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "demo" in extras["optional-dependencies"], extras
    assert '"demo"' in (ROOT / "tests" / "test_demo.py").read_text()


def test_the_docs_command_builds_the_site_strictly() -> None:
    parts = _readme_command("docs-command").split(" && ")
    assert parts[0] == ".venv/bin/pip install -q -c constraints.txt -e '.[docs]'", parts
    assert shlex.split(parts[1]) == [".venv/bin/mkdocs", "build", "--strict"], parts
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    docs = extras["optional-dependencies"]["docs"]
    names = {re.split(r"[<>=\[ ]", d, maxsplit=1)[0] for d in docs}
    assert {"mkdocs", "mkdocs-material", "mkdocstrings"} <= names, docs
    assert all(">=" in d and "==" not in d for d in docs), f"floors, not pins: {docs}"
    config = (ROOT / "mkdocs.yml").read_text()
    assert "strict: true" in config and "font: false" in config, config


def _guides() -> list[str]:
    """The guides of the site's navigation, as paths under docs/."""

    class Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml names a Python function (the slugify): read as None here.
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"]
    guides = next(entry["Guides"] for entry in nav if "Guides" in entry)
    return [f"docs/{g}" for g in guides]


def test_every_guide_says_what_it_is_for_and_runs_a_complete_example() -> None:
    problems = []
    for guide in [*_guides(), "docs/ARCHITECTURE.md"]:
        page = ROOT / guide
        text = page.read_text().splitlines()
        first = next(line for line in text[1:] if line.strip())
        if first.startswith(("#", "```", "<!--", "|", "-")):
            problems.append(f"{guide}: opens with {first!r}, not with what it is for")
        found = blocks(page)
        if not any(b.marker and FILE.fullmatch(b.marker) for b in found):
            problems.append(f"{guide}: no complete example (<!-- file: NAME --> before it)")
        if not any(b.marker == RUN for b in found):
            problems.append(f"{guide}: no <!-- run --> block that runs its example")
        if guide not in EXPECT:
            problems.append(f"{guide}: add what its example prints to EXPECT")
    assert not problems, "\n".join(problems)


def _user_env() -> dict[str, str]:
    """A user's shell with the virtual environment active: its programs first
    on PATH, none of a job's variables, nothing on PYTHONPATH (the package is
    the one pip installed)."""
    venv_bin = str(Path(sys.executable).parent)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FERROGRPC_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        and k != "PYTHONPATH"
    }
    env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


RUN_PAGES = sorted(
    str(page.relative_to(ROOT))
    for page in PAGES
    if any(b.marker == RUN and b.lang in SHELL for b in blocks(page))
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", RUN_PAGES)
def test_the_page_runs_as_written(name: str, tmp_path: Path) -> None:
    # Each <!-- run --> block in order, as bash runs it (-e: a failing line
    # fails the page), beside the page's <!-- file: NAME --> blocks.
    page = ROOT / name
    found = blocks(page)
    for b in found:
        match = FILE.fullmatch(b.marker or "")
        if match:
            (tmp_path / match.group(1)).write_text(b.text)
    script = "".join(b.text for b in found if b.marker == RUN and b.lang in SHELL)
    (tmp_path / "page.sh").write_text(script)
    # A network namespace of its own: the fixed ports a page shows (29400,
    # 29500) are free there, whatever else runs on this host.
    assert shutil.which("unshare"), "the docs' examples run in a network namespace: need unshare"
    proc = subprocess.run(
        ["unshare", "--net", "--", "bash", "-c", "ip link set lo up && bash -euo pipefail page.sh"],
        cwd=tmp_path,
        env=_user_env(),
        capture_output=True,
        text=True,
        timeout=220,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{script}\n{out}"
    assert "Traceback" not in out, out
    missing = [line for line in EXPECT.get(name, []) if line not in out]
    assert not missing, f"{name}: its example did not print {missing}\n{out}"


def _code_variables() -> set[str]:
    """Every FERROGRPC_* name the library, its programs, scripts and compose
    files read (a prefix such as FERROGRPC_TLS_ in a message is not one)."""
    sources = [
        *(ROOT / "ferrogrpc").rglob("*.py"),
        *(ROOT / "client").rglob("*.py"),
        *(ROOT / "server").rglob("*.py"),
        *(ROOT / "scripts").glob("*"),
        *(ROOT / "docker").rglob("*"),
        ROOT / "docker-compose.yml",
        ROOT / "Dockerfile",
    ]
    names: set[str] = set()
    for path in sources:
        if path.is_file() and not path.name.endswith("_pb2.py"):
            names |= set(re.findall(r"FERROGRPC_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return names


def _library_variables() -> set[str]:
    """The variables env.py defines (and grpc_tuning's, read as grpc loads)."""
    import ferrogrpc.env as env_module
    from ferrogrpc.transport import grpc_tuning

    names = {
        value
        for name, value in vars(env_module).items()
        if name.endswith("_ENV") and isinstance(value, str) and value.startswith("FERROGRPC_")
    }
    return names | {grpc_tuning.TUNING_ENV}


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_configuration_page_lists_exactly_what_the_code_reads() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = [
        line
        for line in _section(text, "The library's variables").splitlines()
        if line.startswith("| `")
    ]
    in_table = {
        name for row in table for name in re.findall(r"FERROGRPC_[A-Z0-9_]+", row.split(" | ")[0])
    }
    library = _library_variables()
    assert in_table == library, (
        f"docs/configuration.md's table lacks {sorted(library - in_table)} and lists "
        f"{sorted(in_table - library)}, which env.py does not define"
    )
    on_page = set(re.findall(r"FERROGRPC_[A-Z0-9_]*[A-Z0-9]\b", text))
    code = _code_variables()
    assert code <= on_page, f"docs/configuration.md lacks {sorted(code - on_page)}"


def test_no_page_names_a_variable_the_code_does_not_read() -> None:
    code = _code_variables()
    stale = sorted(
        f"{page.relative_to(ROOT)}: {name}"
        for page in [*PAGES, ROOT / "SECURITY.md", ROOT / "CONTRIBUTING.md", BENCHMARKS]
        for name in set(re.findall(r"FERROGRPC_[A-Z0-9_]*[A-Z0-9]\b", page.read_text()))
        if name not in code
    )
    assert not stale, stale


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading (the site uses the same: mkdocs.yml)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors: set[str] = set()
    fence = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        match = None if fence else re.match(r"#{1,6} (.+)", line)
        if match:
            slug, n = _slug(match.group(1)), 1
            while slug in anchors:
                slug, n = f"{_slug(match.group(1))}-{n}", n + 1
            anchors.add(slug)
    return anchors


def test_every_link_lands() -> None:
    # mkdocs build --strict checks the same in CI; this needs no mkdocs.
    pages = [*PAGES, HISTORY, BENCHMARKS, ROOT / "SECURITY.md", ROOT / "CONTRIBUTING.md"]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _attribute_docstring(name: str) -> bool:
    """Whether a module-level ``name = ...`` in ferrogrpc/ has a docstring
    (the string literal after it, which the API reference shows)."""
    for path in (ROOT / "ferrogrpc").rglob("*.py"):
        body = ast.parse(path.read_text()).body
        for stmt, after in itertools.pairwise(body):
            targets = (
                [stmt.target]
                if isinstance(stmt, ast.AnnAssign)
                else stmt.targets
                if isinstance(stmt, ast.Assign)
                else []
            )
            if any(isinstance(t, ast.Name) and t.id == name for t in targets) and (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                return True
    return False


def _undocumented(name: str, obj: object) -> list[str]:
    if not (inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj)):
        return [] if _attribute_docstring(name) else [name]
    missing = [] if (obj.__doc__ or "").strip() else [name]
    if inspect.ismodule(obj):
        members = {
            k: v
            for k, v in vars(obj).items()
            if (inspect.isclass(v) or inspect.isfunction(v))
            and getattr(v, "__module__", None) == obj.__name__
        }
    elif inspect.isclass(obj):
        members = {}
        for cls in reversed(obj.__mro__):
            if cls.__module__.startswith("ferrogrpc"):
                members.update(vars(cls))
    else:
        members = {}
    for member, value in members.items():
        if member.startswith("_"):
            continue
        function = value.__func__ if isinstance(value, classmethod | staticmethod) else value
        documentable = isinstance(function, property) or inspect.isroutine(function)
        if (documentable or inspect.isclass(value)) and not (function.__doc__ or "").strip():
            missing.append(f"{name}.{member}")
    return missing


def test_every_public_name_has_a_docstring() -> None:
    # The API reference (docs/api.md) is generated from these; mkdocs build
    # --strict fails on the same (docs/hooks.py). A dataclass's fields and an
    # enum's members are described in its class docstring.
    import ferrogrpc as fg

    missing = [m for name in fg.__all__ for m in _undocumented(name, getattr(fg, name))]
    assert not missing, f"public names without a docstring: {missing}"
