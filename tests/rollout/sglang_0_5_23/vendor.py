"""Regenerate the SGLang 0.5.23 pieces the contract tests read, verbatim, from the wheel.

Why vendored: ``sglang==0.5.23`` installed without its dependencies does not import on a CPU machine (the package
``__init__`` pulls in FlashInfer/CUDA patches, ``sglang.srt.managers.io_struct`` imports the scheduler, multimodal
processors and torchvision), and its dependency tree is not installed where the tests run. So only the
request/response *types* and the sampling-parameter checks are kept here, copied byte for byte:

- ``api_types.py``: ``sglang/api/v1/api_types.py`` (the generated JSON contract of ``/generate``, ``/abort_request``
  and ``/model_info``, with the decoders the server runs on every ``/generate`` body), whole file.
- ``sampling_params.py``: ``sglang/srt/sampling/sampling_params.py`` (``SamplingParams.__post_init__``,
  ``verify``, ``normalize``), whole file; its one import of the watermarking package is pointed at ``_support``.
- ``io_struct.py``: the control request/response classes of ``sglang/srt/managers/io_struct.py`` (weight updates,
  weight-update session, pause/continue, abort, memory release), each class copied whole.
- ``_support.py``: what those need from ``sglang/srt/utils/msgspec_utils.py`` (the FastAPI body parser
  ``msgspec_struct_pydantic_core_schema``, ``Base64Bytes``), ``utils/weight_versions.py`` (``WeightVersionSpan``),
  ``sampling/watermarking`` (``WatermarkRequestConfig``, ``normalize_watermark_request``, ``parse_watermark_key``)
  and ``io_struct.py`` (``FinishReasonDict``).

Usage: ``pip download --no-deps sglang==0.5.23 -d /tmp/sgl && python tests/rollout/sglang_0_5_23/vendor.py
/tmp/sgl/sglang-0.5.23-*.whl``. Each file's header names its source path and the SHA-256 of that source file.
SGLang is Apache-2.0 licensed, Copyright 2023-2024 SGLang Team.
"""

from __future__ import annotations

import ast
import hashlib
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).parent

IO_STRUCT_CLASSES = [
    "BaseReq",
    "PauseGenerationReqInput",
    "ContinueGenerationReqInput",
    "UpdateWeightFromDiskReqInput",
    "UpdateWeightFromDiskReqOutput",
    "UpdateWeightsFromDistributedReqInput",
    "UpdateWeightsFromDistributedReqOutput",
    "UpdateWeightsFromTensorReqInput",
    "UpdateWeightsFromTensorReqOutput",
    "InitWeightsUpdateGroupReqInput",
    "InitWeightsUpdateGroupReqOutput",
    "ReleaseMemoryOccupationReqInput",
    "ResumeMemoryOccupationReqInput",
    "BeginWeightUpdateReqInput",
    "BeginWeightUpdateReqOutput",
    "EndWeightUpdateReqInput",
    "EndWeightUpdateReqOutput",
    "AbortReq",
]

SUPPORT = [
    ("sglang/srt/utils/msgspec_utils.py", ["Base64Bytes", "msgspec_struct_pydantic_core_schema"]),
    (
        "sglang/srt/utils/weight_versions.py",
        [
            "WeightVersionSpan",
            "WeightVersionSpans",
            "WeightVersionEvent",
            "compute_weight_version_spans",
            "add_weight_versions_to_meta_info",
        ],
    ),
    ("sglang/srt/sampling/watermarking/config.py", ["parse_watermark_key"]),
    ("sglang/srt/sampling/watermarking/core.py", ["WatermarkRequestConfig", "normalize_watermark_request"]),
    ("sglang/srt/managers/io_struct.py", ["FinishReasonDict"]),
]

# Lines the client relies on that live outside the generated types: each must appear verbatim in the wheel, and is
# copied into _support.SOURCE_LINES so that the contract tests can check the names the client uses against them.
SOURCE_LINES = [
    # the sampling-mask logprobs the client reads with return_sampling_mask (meta_info is a plain dict there)
    ("sglang/srt/managers/tokenizer_manager.py", 'meta_info["output_token_sampling_logprobs"] = ('),
    # the body of every weight-update answer the client reads
    ("sglang/srt/entrypoints/http_server.py", 'content = {"success": success, "message": message}'),
    # the refusal of a second session, which the client recognises to recover a session left open
    (
        "sglang/srt/managers/scheduler_components/weight_updater.py",
        'message="a weight-update session is already open; "',
    ),
    # the launch flags the client reads from /server_info
    ("sglang/srt/arg_groups/fields/exec_.py", "    enable_memory_saver: A["),
    ("sglang/srt/arg_groups/fields/exec_.py", "    enable_weights_cpu_backup: A["),
    ("sglang/srt/arg_groups/fields/exec_.py", "    enable_deterministic_inference: A["),
    # the memory tags of /release_memory_occupation
    ("sglang/srt/constants.py", 'GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"'),
    ("sglang/srt/constants.py", 'GPU_MEMORY_TYPE_WEIGHTS = "weights"'),
    ("sglang/srt/constants.py", 'GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"'),
    # the initial weight version of a server started without --weight-version
    ("sglang/srt/arg_groups/fields/serving.py", '    ] = "default"'),
]

HEADER = (
    "# ruff: noqa\n"
    "# Vendored verbatim from sglang 0.5.23 (Apache-2.0, Copyright 2023-2024 SGLang Team) by vendor.py.\n"
    "# Do not edit: regenerate with vendor.py. Sources (path in the wheel: sha256 of the file):\n"
)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _extract(source: str, names: list[str]) -> str:
    """The source text of the named top-level definitions/assignments, in the order asked, each copied whole."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            name = node.name
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        else:
            continue
        if name in names:
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
            found[name] = "".join(lines[start : node.end_lineno])
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"not found in the source: {missing}")
    return "\n\n".join(found[n].rstrip("\n") + "\n" for n in names)


def _source_lines(z: zipfile.ZipFile) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path, line in SOURCE_LINES:
        if line not in z.read(path).decode():
            raise SystemExit(f"{path}: the line {line!r} is gone; check what the client relies on")
        out.setdefault(path, []).append(line)
    return out


def main(wheel: str) -> None:
    with zipfile.ZipFile(wheel) as z:
        read = lambda p: z.read(p).decode()

        api = read("sglang/api/v1/api_types.py")
        (HERE / "api_types.py").write_text(
            HEADER + f"#   sglang/api/v1/api_types.py: {_sha(api)} (whole file)\n" + api
        )

        sp = read("sglang/srt/sampling/sampling_params.py")
        old_import = (
            "from sglang.srt.sampling.watermarking.core import (\n"
            "    WatermarkRequestConfig,\n"
            "    normalize_watermark_request,\n"
            ")\n"
        )
        if old_import not in sp:
            raise SystemExit("sampling_params.py: the watermarking import changed; update vendor.py")
        (HERE / "sampling_params.py").write_text(
            HEADER
            + f"#   sglang/srt/sampling/sampling_params.py: {_sha(sp)} (whole file; its watermarking import is\n"
            + "#   pointed at _support.py, which holds those two definitions verbatim)\n"
            + sp.replace(old_import, "from ._support import WatermarkRequestConfig, normalize_watermark_request\n")
        )

        parts, sources = [], []
        for path, names in SUPPORT:
            text = read(path)
            sources.append(f"#   {path}: {_sha(text)} ({', '.join(names)})\n")
            parts.append(_extract(text, names))
        (HERE / "_support.py").write_text(
            HEADER
            + "".join(sources)
            + "from __future__ import annotations\n\n"
            + "import base64\nimport binascii\nimport dataclasses\n"
            + "from typing import Any, Dict, List, Optional, Union\n\n"
            + "import msgspec\nfrom pydantic_core import core_schema\n\n\n"
            + "\n\n".join(parts)
            + "\n\n# Single lines of the wheel's source the client relies on (see vendor.py), by path.\n"
            + f"SOURCE_LINES = {_source_lines(z)!r}\n"
        )

        io = read("sglang/srt/managers/io_struct.py")
        (HERE / "io_struct.py").write_text(
            HEADER
            + f"#   sglang/srt/managers/io_struct.py: {_sha(io)} ({', '.join(IO_STRUCT_CLASSES)})\n"
            + "from __future__ import annotations\n\n"
            + "from typing import Annotated, Any, Dict, List, Literal, Optional, Union\n\n"
            + "import msgspec\n\n"
            + "from ._support import Base64Bytes, FinishReasonDict, WeightVersionSpans, "
            + "msgspec_struct_pydantic_core_schema\n\n\n"
            + "\n\n".join(_extract(io, [n]) for n in IO_STRUCT_CLASSES)
        )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
