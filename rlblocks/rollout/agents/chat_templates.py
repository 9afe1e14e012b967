"""Two reference chat templates (Jinja, for Hugging Face ``tokenizer.chat_template``), written for rlblocks.

They reproduce the behaviour of the two template families that matter for tool use, so that multi-turn code can
be exercised on a small local tokenizer without downloading a model:

- :data:`HERMES_TEMPLATE`: ChatML turns (``<|im_start|>role\\n...<|im_end|>\\n``) with Hermes tool calling, the
  format of Qwen2.5 and NousResearch Hermes. Tools are listed in the system turn inside ``<tools></tools>``;
  structured ``tool_calls`` of an assistant message are rendered as ``<tool_call>\\n{"name": ..., "arguments":
  ...}\\n</tool_call>``; consecutive ``tool`` messages are rendered together in ONE user turn, each inside
  ``<tool_response></tool_response>``. Assistant ``content`` is rendered verbatim, so a raw model output stored as
  the content (tool-call text included) renders back to the same text.
- :data:`LLAMA3_TEMPLATE`: Llama-3.1 headers (``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``)
  after ``{{ bos_token }}``; ``tool`` messages use the ``ipython`` role; tools are listed in the system turn as
  JSON; like the Llama 3 templates, every message's content is ``trim``-med, which rewrites history whenever the
  model produced leading or trailing whitespace (a case the token-faithfulness check must catch).

The end-of-turn token is ``<|im_end|>`` (Hermes) or ``<|eot_id|>`` (Llama 3): use it as the stop token.
"""

from __future__ import annotations

__all__ = ["HERMES_TEMPLATE", "LLAMA3_TEMPLATE"]

HERMES_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'user' or message.role == 'system' "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tc in message.tool_calls %}"
    "{%- if tc.function is defined %}{%- set tc = tc.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tc.name + '\", \"arguments\": ' }}"
    "{%- if tc.arguments is string %}{{- tc.arguments }}{%- else %}{{- tc.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}"
    "{%- set system = messages[0].content | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
    "{%- if tools or system %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}"
    "{{- 'Environment: ipython\\n\\nYou have access to the following functions. To call a function, respond '"
    "'with a JSON object inside <tool_call></tool_call> tags.\\n\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n\\n' }}{%- endfor %}"
    "{%- endif %}"
    "{{- system + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + (message.content | trim) + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + ((message.content or '') | trim) }}"
    "{%- for tc in message.tool_calls %}"
    "{%- if tc.function is defined %}{%- set tc = tc.function %}{%- endif %}"
    "{{- '<tool_call>{\"name\": \"' + tc.name + '\", \"arguments\": ' }}"
    "{%- if tc.arguments is string %}{{- tc.arguments }}{%- else %}{{- tc.arguments | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + ((message.content or '') | trim) "
    "+ '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
