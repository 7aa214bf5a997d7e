"""MkDocs hooks (mkdocs.yml): the root's Markdown pages join the site, their
links rewritten to the site's layout, and a public name without a docstring
fails the build.

The README, SECURITY.md, BENCHMARKS.md and CONTRIBUTING.md live at the
repository's root, where GitHub shows them, and link into ``docs/``; the
pages in ``docs/`` link back with ``../``. In the site every page is one
level: the README becomes ``index.md`` and the others keep their names, so
``docs/X`` becomes ``X`` on a root page and ``../X.md`` becomes ``X.md`` on a
docs page. Any other link out of ``docs/`` (to a source file, say) stays as
it is, and ``mkdocs build --strict`` fails on it: a page names source files
in backticks instead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.plugins import get_plugin_logger
from mkdocs.structure.files import File, Files

log = get_plugin_logger("ferrogrpc")

ROOT = Path(__file__).resolve().parent.parent
# Root file -> its page in the site.
ROOT_PAGES = {
    "README.md": "index.md",
    "SECURITY.md": "SECURITY.md",
    "BENCHMARKS.md": "BENCHMARKS.md",
    "CONTRIBUTING.md": "CONTRIBUTING.md",
}
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def on_files(files: Files, config: Any) -> Files:
    for source, page in ROOT_PAGES.items():
        path = ROOT / source
        files.append(File.generated(config, page, abs_src_path=str(path)))
    return files


def _root_link(target: str) -> str:
    """A link on a root page, as the site lays it out."""
    path, sep, anchor = target.partition("#")
    if path in ROOT_PAGES:
        path = ROOT_PAGES[path]
    elif path.startswith("docs/"):
        path = path.removeprefix("docs/")
    return path + sep + anchor


def _docs_link(target: str) -> str:
    """A link on a page of docs/, as the site lays it out."""
    path, sep, anchor = target.partition("#")
    if path.startswith("../") and path[3:] in ROOT_PAGES:
        path = ROOT_PAGES[path[3:]]
    return path + sep + anchor


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    rewrite = _root_link if page.file.generated_by else _docs_link

    def one(match: re.Match[str]) -> str:
        target = match["target"]
        if "://" in target or target.startswith(("#", "mailto:")):
            return match[0]
        return f"]({rewrite(target)})"

    return _LINK.sub(one, markdown)


def on_pre_build(config: Any) -> None:
    """Warn (and so fail ``--strict``) for each public name the API page
    would show without a docstring: every name in ``ferrogrpc.__all__``,
    and the public methods and properties of its classes and modules."""
    import griffe

    package = griffe.load("ferrogrpc", search_paths=[str(ROOT)], resolve_aliases=True)
    for name in map(str, package.exports or ()):
        for path in _undocumented(package[name], f"ferrogrpc.{name}"):
            log.warning("%s has no docstring (the API reference shows it)", path)


def _undocumented(obj: Any, path: str) -> list[str]:
    target = obj.final_target if obj.is_alias else obj
    missing = [] if target.docstring else [path]
    if target.is_class:
        members = target.all_members
    elif target.is_module:
        members = {k: v for k, v in target.members.items() if not v.is_alias}
    else:
        return missing
    for member_name, member in members.items():
        if member_name.startswith("_"):
            continue
        member = member.final_target if member.is_alias else member
        public_callable = member.is_function or member.is_class
        if (public_callable or "property" in member.labels) and not member.docstring:
            missing.append(f"{path}.{member_name}")
    return missing
