"""The API pages of the docs site cover every public name.

A page renders a package's API with a mkdocstrings directive: ``::: rlblocks.losses`` (every name of its
``__all__``), ``::: rlblocks.rollout`` with ``options: members: [...]`` (those names: the rollout pages split the
package between them), or ``::: rlblocks.sandbox.run_python`` (one name). Every name of every public module's
``__all__`` must be rendered by some page, so a name added to a package is documented or this test fails.
(``mkdocs build --strict``, run by ``make test``, checks that every directive resolves.)
"""

from __future__ import annotations

import importlib
import re
import textwrap
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# the public modules whose names the API pages render: every public top-level module or package, the rollout
# subpackages (each the one import path of its names) and the simulator
API = ("rlblocks.checkpoint", "rlblocks.errors", "rlblocks.kernels", "rlblocks.losses", "rlblocks.reward",
       "rlblocks.rollout", "rlblocks.rollout.agents", "rlblocks.rollout.engines", "rlblocks.rollout.gateway",
       "rlblocks.rollout.moe_replay", "rlblocks.sandbox", "rlblocks.sched", "rlblocks.sched.sim", "rlblocks.sync",
       "rlblocks.tinker")
_DIRECTIVE = re.compile(r"^::: *([\w.]+) *$")


def directives(text: str) -> list[tuple[str, list[str] | None]]:
    """``[(identifier, members or None)]`` of the ``:::`` directives of a page (``members`` from its options)."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        m = _DIRECTIVE.match(line)
        if not m:
            continue
        j = i + 1  # the directive's YAML: the indented lines below it
        while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j].strip()):
            j += 1
        config = yaml.safe_load(textwrap.dedent("\n".join(lines[i + 1 : j]))) or {}
        members = (config.get("options") or {}).get("members")
        out.append((m.group(1), None if members is None else list(members)))
    return out


def rendered() -> dict[str, set[str] | None]:
    """``{module: names rendered}`` over every page; ``None`` means the whole ``__all__``."""
    out: dict[str, set[str] | None] = {}
    for page in sorted(DOCS.rglob("*.md")):
        for ident, members in directives(page.read_text()):
            if ident in API:
                if members is None or out.get(ident, set()) is None:
                    out[ident] = None
                else:
                    out[ident] = out.get(ident, set()) | set(members)
            else:
                mod, _, name = ident.rpartition(".")
                if mod in API and out.get(mod, set()) is not None:
                    out[mod] = out.get(mod, set()) | {name}
    return out


def test_every_public_name_is_rendered():
    done = rendered()
    missing = {}
    for mod in API:
        names = set(importlib.import_module(mod).__all__)
        have = done.get(mod, set())
        if have is not None:
            if names - have:
                missing[mod] = sorted(names - have)
            unknown = have - names
            assert not unknown, f"docs render {mod} names that are not in its __all__: {sorted(unknown)}"
    assert not missing, f"public names no docs page renders: {missing}"


def test_every_public_top_level_module_has_api_docs():
    top = {f"rlblocks.{p.stem if p.is_file() else p.name}" for p in (ROOT / "rlblocks").iterdir()
           if not p.name.startswith(("_", ".")) and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert top <= set(API), f"add these to API and give them a page: {sorted(top - set(API))}"


def test_directive_parsing():
    text = ("# P\n::: rlblocks.rollout\n    options:\n      members: [TorchEngine, \"Router\"]\n\nText\n"
            "::: rlblocks.sync\n    options:\n      members:\n        - pack_buckets\n        - unpack_bucket\n"
            "::: rlblocks.losses\n\n::: rlblocks.sandbox.run_python\n")
    assert directives(text) == [("rlblocks.rollout", ["TorchEngine", "Router"]),
                                ("rlblocks.sync", ["pack_buckets", "unpack_bucket"]),
                                ("rlblocks.losses", None), ("rlblocks.sandbox.run_python", None)]
