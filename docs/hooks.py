"""mkdocs hooks: publish the committed benchmark results that pages link to.

Pages link to results outside ``docs/`` as ``../benchmarks/results/...``, so that the
links work where the Markdown is read as plain files (a repository browser, an editor).
The site publishes every file under ``benchmarks/results/`` at the same path inside
the site and drops the one ``../`` that leaves ``docs/`` from such links. A link to a
result that does not exist still fails the strict build: only the prefix is rewritten,
and mkdocs then checks the target like any other link.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

_RESULTS = "benchmarks/results"
# "](../" then any further "../" (pages in sub-folders), then the results folder.
_LINK = re.compile(r"\]\(\.\./((?:\.\./)*" + re.escape(_RESULTS) + r"/)")


def on_files(files: Files, config: Any) -> Files:
    root = Path(config["config_file_path"]).resolve().parent
    for path in sorted((root / _RESULTS).rglob("*")):
        if path.is_file():
            src_uri = path.relative_to(root).as_posix()
            files.append(File.generated(config, src_uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    return _LINK.sub(r"](\1", markdown)
