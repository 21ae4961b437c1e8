"""The documentation's code runs, and the usage pages document every constructor argument.

Conventions for the ```python blocks of README.md and docs/*.md (``>>>`` examples are
doctests instead, through pytest's ``--doctest-glob=*.md``):

- Every block runs standalone, as a reader would paste it: in a namespace of its own
  whose ``__name__`` is ``"__main__"`` (a fresh ``__main__`` module per block), so it
  imports and defines everything it uses itself (no hidden set-up, nothing from an
  earlier block): ``make_env``, ``policy``, a ``learn`` that takes a real step. A page's
  blocks run in order in one Python process started from the repository root.
- Budgets stay small: a page runs in well under 30 s on 2 cores (a few thousand
  ``total_frames``, a few hundred ``frames_per_batch``, 2 to 8 envs).
- A first line ``# not run: <reason>`` opts a block out (a signature with placeholders,
  another library's code). Keep these few: prefer making the example runnable.
- A first line ``# needs CUDA`` runs the block only where CUDA is available, and
  ``# needs envpool`` only where EnvPool imports (an optional extra).
- A block of snippet includes only (``--8<-- "examples/x.py:section"``) shows part of a
  file that tests/test_examples.py runs; here the sections are only checked to exist.
"""

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlcollect import AsyncBatchedCollector

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))]
PAGE_TIMEOUT = 180  # seconds; a page should take well under 30

NOT_RUN = "# not run:"
NEEDS_CUDA = "# needs CUDA"
NEEDS = {NEEDS_CUDA: "cuda", "# needs envpool": "envpool"}
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^":]+)(?::(?P<section>[\w-]+))?"$')

# Pages being rewritten to follow the conventions above (issue 24): their failure is
# expected until then. Remove a page from here once its blocks pass.
PENDING: dict[str, str] = {}

# Pages whose code a test of tests/test_examples.py runs with a smaller budget (the
# home page's loop trains for 100,000 frames to show learning): here only that test's
# presence is checked, so the page's code does not run twice.
RUN_BY_TEST = {"docs/index.md": "test_training_loop_of_the_docs_home_page"}

# Runs in the page's process: argv[1] is a JSON list of [path, first line, code, what it
# needs ("cuda", "envpool" or null)]. Each block is compiled against its page's real line
# numbers, so a traceback shows the page's line.
RUNNER = """
import json, sys, types
for path, line, code, needs in json.loads(sys.argv[1]):
    if needs == "cuda":
        import torch
        if not torch.cuda.is_available():
            print(f"skipped {path}:{line} (needs CUDA)", flush=True)
            continue
    if needs == "envpool":
        try:
            import envpool
        except Exception:
            print(f"skipped {path}:{line} (needs envpool)", flush=True)
            continue
    print(f"running {path}:{line}", flush=True)
    main = types.ModuleType("__main__")  # standalone: nothing of the blocks before
    sys.modules["__main__"] = main
    exec(compile("\\n" * (line - 1) + code, path, "exec"), main.__dict__)
"""


def python_blocks(page: str) -> list[tuple[int, str]]:
    """The page's ```python blocks: (line of the block's first code line, code)."""
    blocks, lines = [], (ROOT / page).read_text().splitlines()
    start = indent = None
    for number, line in enumerate(lines, 1):
        stripped = line.lstrip()
        if start is None and stripped.startswith("```python"):
            start, indent = number + 1, len(line) - len(stripped)
        elif start is not None and stripped.startswith("```"):
            code = "\n".join(row[indent:] for row in lines[start - 1 : number - 1])
            blocks.append((start, code + "\n"))
            start = None
    assert start is None, f"{page}: a ```python block is not closed"
    return blocks


def snippets(code: str) -> list[tuple[str, str | None]] | None:
    """The (path, section) a block of snippet includes shows; None for other blocks."""
    matches = [SNIPPET.match(line.strip()) for line in code.splitlines() if line.strip()]
    if not matches or not all(matches):
        return None
    return [(m["path"], m["section"]) for m in matches if m is not None]


PAGES_WITH_CODE = [page for page in PAGES if python_blocks(page)]


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(page, marks=pytest.mark.xfail(reason=PENDING[page], strict=False))
        if page in PENDING
        else page
        for page in PAGES_WITH_CODE
    ],
)
def test_page_code_runs(page):
    if page in RUN_BY_TEST:
        tested = (ROOT / "tests" / "test_examples.py").read_text()
        assert f"def {RUN_BY_TEST[page]}(" in tested, f"{page}: no test runs its code"
        body = tested.split(f"def {RUN_BY_TEST[page]}(", 1)[1].split("\ndef ", 1)[0]
        assert Path(page).name in body, f"{page}: {RUN_BY_TEST[page]} does not read it"
        return
    to_run, checked = [], False
    for line, code in python_blocks(page):
        first = code.lstrip().split("\n", 1)[0].strip()
        if first.startswith(NOT_RUN):
            assert first[len(NOT_RUN) :].strip(), f"{page}:{line}: say why it is not run"
            continue
        included = snippets(code)
        if included is not None:
            tested = (ROOT / "tests" / "test_examples.py").read_text()
            for path, section in included:
                text = (ROOT / path).read_text()
                assert path in tested, f"{page}:{line}: no test in test_examples.py runs {path}"
                if section is not None:
                    for marker in (f"[start:{section}]", f"[end:{section}]"):
                        assert marker in text, f"{page}:{line}: {path} has no {marker}"
            checked = True
            continue
        to_run.append([page, line, code, NEEDS.get(first)])
    if not to_run:
        if not checked:
            pytest.skip("every block is opted out")
        return
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(to_run)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT,
    )
    assert done.returncode == 0, f"{page}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


def test_pending_pages_exist():
    assert set(PENDING) <= set(PAGES), set(PENDING) - set(PAGES)


# Every constructor argument: named on docs/arguments.md (the table generated from the
# collector's options), and detailed on the usage pages: docs/usage.md and the reference
# pages it points to, each argument where a user meets it.

ARGUMENT_PAGES = (
    "docs/usage.md",
    "docs/layout.md",
    "docs/policies.md",
    "docs/batch-keys.md",
    "docs/reproducibility.md",
)

PARAMETERS = [
    name for name in inspect.signature(AsyncBatchedCollector.__init__).parameters if name != "self"
]


def test_arguments_page_names_every_argument():
    text = (ROOT / "docs" / "arguments.md").read_text()
    named = set(re.findall(r"`(\w+)`", text))
    assert set(PARAMETERS) <= named, (
        f"docs/arguments.md does not name {sorted(set(PARAMETERS) - named)}"
    )


def detailed(page: str) -> tuple[set[str], set[str]]:
    """What a page details: the arguments named in a heading (``### `name` ``), and the
    names in bold at the head of a list item (``- **`name`**: ...``)."""
    headed: set[str] = set()
    bold: set[str] = set()
    for line in (ROOT / page).read_text().splitlines():
        if line.startswith("#"):
            headed.update(name for name in re.findall(r"`(\w+)`", line) if name in PARAMETERS)
        elif line.startswith("- ") and ":" in line:
            bold.update(re.findall(r"\*\*`(\w+)`\*\*", line.split(":", 1)[0]))
    return headed, bold


def test_usage_pages_detail_every_argument():
    headed: set[str] = set()
    bold: set[str] = set()
    for page in ARGUMENT_PAGES:
        page_headed, page_bold = detailed(page)
        headed |= page_headed
        bold |= page_bold
    assert headed | bold == set(PARAMETERS), (
        f"the usage pages ({', '.join(ARGUMENT_PAGES)}): "
        f"missing {sorted(set(PARAMETERS) - headed - bold)}, "
        f"not parameters {sorted(bold - set(PARAMETERS))}"
    )
