"""mkdocs hook: render the reStructuredText roles of rlblocks' docstrings as inline code.

The docstrings name objects as ``:class:`~rlblocks.rollout.Generation```, which Markdown renders as the text
``:class:`` followed by the code. This hook drops the role and, as Sphinx does for a leading ``~``, keeps only the
last dotted component.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):<code>(~)?([^<]*)</code>")


def _code(m: re.Match) -> str:
    path = m.group(2)
    return f"<code>{path.rsplit('.', 1)[-1] if m.group(1) else path}</code>"


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub(_code, html)
