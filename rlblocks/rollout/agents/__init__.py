"""Multi-turn agents: :class:`Trajectory` (the token-exact record of an episode: ids, roles, turns, processed
log-probs and weight versions), the episode loop (:func:`run_episode`, :func:`generate_turn`, :class:`Env`,
:class:`ToolEnv`, :class:`Tool` and the calculator / python tools, :class:`Episode`, :class:`EpisodeStats`) and
the reference chat templates.

Layout: ``trajectory.py``, ``episode.py`` (the environment protocol and the episode loop), ``tools.py`` (tools and
``ToolEnv``), ``tool_calls.py`` (the tool-call format), ``chat_templates.py``. Only
torch is imported (transformers inside the functions that load a tokenizer).
"""

from __future__ import annotations

from .chat_templates import HERMES_TEMPLATE, LLAMA3_TEMPLATE
from .episode import EPISODE_FINISH_REASONS, Env, Episode, EpisodeStats, StepResult, generate_turn, run_episode
from .tool_calls import TOOL_CALL_TAGS, ToolCall, parse_tool_calls
from .tools import Tool, ToolEnv, calculator_tool, python_tool
from .trajectory import ROLES, Trajectory, render_chat, render_chat_text, to_tensors, trajectory_rows

__all__ = [
    "EPISODE_FINISH_REASONS",
    "HERMES_TEMPLATE",
    "LLAMA3_TEMPLATE",
    "ROLES",
    "TOOL_CALL_TAGS",
    "Env",
    "Episode",
    "EpisodeStats",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "Trajectory",
    "calculator_tool",
    "generate_turn",
    "parse_tool_calls",
    "python_tool",
    "render_chat",
    "render_chat_text",
    "run_episode",
    "to_tensors",
    "trajectory_rows",
]
