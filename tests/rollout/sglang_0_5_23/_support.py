# ruff: noqa
# Vendored verbatim from sglang 0.5.23 (Apache-2.0, Copyright 2023-2024 SGLang Team) by vendor.py.
# Do not edit: regenerate with vendor.py. Sources (path in the wheel: sha256 of the file):
#   sglang/srt/utils/msgspec_utils.py: f5149a93d6c3de0eb79db2bbb9516418b2d8445638ab9b1d61f6719b2bf58b90 (Base64Bytes, msgspec_struct_pydantic_core_schema)
#   sglang/srt/utils/weight_versions.py: c4a233ade05e6c4c41e896e9fa29c150f7b0071daca1233288981e8e223d6a61 (WeightVersionSpan, WeightVersionSpans, WeightVersionEvent, compute_weight_version_spans, add_weight_versions_to_meta_info)
#   sglang/srt/sampling/watermarking/config.py: 37117803362cdbe6783b0d3ebef713c2461c9176caf26d90472d307d631672b9 (parse_watermark_key)
#   sglang/srt/sampling/watermarking/core.py: 1f9f0f45d95f08e8ae98e9187fd7914dea69e76f0bef5ebc22c96068b7d84d02 (WatermarkRequestConfig, normalize_watermark_request)
#   sglang/srt/managers/io_struct.py: 0518aa62b3d864be6f4d76a7fcf14720a2f5854b557df19ddd8ea717de62cb57 (FinishReasonDict)
from __future__ import annotations

import base64
import binascii
import dataclasses
from typing import Any, Dict, List, Optional, Union

import msgspec
from pydantic_core import core_schema


class Base64Bytes:
    """Pydantic marker for HTTP JSON base64-encoded bytes fields."""

    def __get_pydantic_core_schema__(self, source_type: Any, handler):
        return core_schema.no_info_before_validator_function(
            self._decode_value,
            handler(source_type),
        )

    @classmethod
    def _decode_value(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return base64.b64decode(value, validate=True)
            except binascii.Error as exc:
                raise ValueError("Expected base64-encoded bytes") from exc

        if isinstance(value, list):
            return [cls._decode_value(item) for item in value]

        if isinstance(value, tuple):
            return tuple(cls._decode_value(item) for item in value)

        return value


def msgspec_struct_pydantic_core_schema(cls: type[msgspec.Struct], handler):
    fields = {}
    for struct_field in msgspec.structs.fields(cls):
        field_schema = handler.generate_schema(struct_field.type)
        required = (
            struct_field.default is msgspec.NODEFAULT
            and struct_field.default_factory is msgspec.NODEFAULT
        )

        if struct_field.default is not msgspec.NODEFAULT:
            field_schema = core_schema.with_default_schema(
                field_schema,
                default=struct_field.default,
            )
        elif struct_field.default_factory is not msgspec.NODEFAULT:
            field_schema = core_schema.with_default_schema(
                field_schema,
                default_factory=struct_field.default_factory,
            )

        fields[struct_field.name] = core_schema.typed_dict_field(
            field_schema,
            required=required,
        )

    typed_dict_schema = core_schema.typed_dict_schema(
        fields,
        cls_name=cls.__name__,
        extra_behavior="ignore",
        ref=cls.__name__,
    )

    def build_struct(value):
        return value if isinstance(value, cls) else cls(**value)

    dict_to_struct_schema = core_schema.no_info_after_validator_function(
        build_struct,
        typed_dict_schema,
    )
    return core_schema.json_or_python_schema(
        json_schema=dict_to_struct_schema,
        python_schema=core_schema.union_schema(
            [
                core_schema.is_instance_schema(cls),
                dict_to_struct_schema,
            ],
            mode="left_to_right",
        ),
    )


class WeightVersionSpan(msgspec.Struct, kw_only=True, array_like=True):
    version: str
    start: int
    end: int

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        return msgspec_struct_pydantic_core_schema(cls, handler)


WeightVersionSpans = List[WeightVersionSpan]


@dataclasses.dataclass(frozen=True, slots=True)
class WeightVersionEvent:
    old_version: str
    num_output_tokens: int


def compute_weight_version_spans(
    events: List[WeightVersionEvent],
    current_version: str,
    num_output_tokens: int,
) -> WeightVersionSpans:
    changes = [(event.old_version, event.num_output_tokens) for event in events]
    changes.append((current_version, num_output_tokens))

    spans: WeightVersionSpans = []
    for version, end in changes:
        end = min(end, num_output_tokens)
        if spans and end <= spans[-1].end:
            continue
        if spans and version == spans[-1].version:
            spans[-1].end = end
            continue
        start = spans[-1].end if spans else 0
        spans.append(WeightVersionSpan(version=version, start=start, end=end))
    return spans


def add_weight_versions_to_meta_info(
    meta_info: Dict[str, Any],
    spans: WeightVersionSpans,
    num_output_tokens: int,
) -> None:
    visible = [
        span for span in spans if span.start < num_output_tokens or span.start == 0
    ]

    meta_info["weight_versions"] = [
        {
            "version": span.version,
            "start": span.start,
            "end": min(span.end, num_output_tokens),
        }
        for span in visible
    ]
    meta_info["weight_version"] = visible[-1].version


def parse_watermark_key(value: Any) -> int:
    if not isinstance(value, str):
        raise ValueError("watermark key must be a hex string")
    digits = value[2:] if value.lower().startswith("0x") else value
    if not 1 <= len(digits) <= 16:
        raise ValueError("watermark key must contain 1 to 16 hex digits")
    if any(character not in "0123456789abcdefABCDEF" for character in digits):
        raise ValueError("watermark key must contain only hex digits")
    key = int(digits, 16)
    return key if key < (1 << 63) else key - (1 << 64)


class WatermarkRequestConfig(msgspec.Struct, frozen=True, kw_only=True):
    enabled: Optional[bool] = None
    key: Optional[str] = None
    context_window: Optional[int] = None

    def __repr__(self) -> str:
        return (
            f"WatermarkRequestConfig(enabled={self.enabled!r}, key=<redacted>, "
            f"context_window={self.context_window!r})"
        )


def normalize_watermark_request(value: Any) -> Optional[WatermarkRequestConfig]:
    if value is None:
        return None
    if isinstance(value, WatermarkRequestConfig):
        enabled = value.enabled
        key = value.key
        context_window = value.context_window
    else:
        if not isinstance(value, dict):
            raise ValueError("watermark must be an object")
        unknown = set(value) - {"enabled", "key", "context_window"}
        if unknown:
            raise ValueError("watermark contains unknown fields")
        enabled = value.get("enabled")
        key = value.get("key")
        context_window = value.get("context_window")
    if enabled is not None and type(enabled) is not bool:
        raise ValueError("watermark enabled must be a boolean")
    if key is not None:
        parse_watermark_key(key)
    if context_window is not None and (
        isinstance(context_window, bool)
        or not isinstance(context_window, int)
        or context_window < 1
    ):
        raise ValueError("watermark context_window must be a positive integer")
    return WatermarkRequestConfig(
        enabled=enabled,
        key=key,
        context_window=context_window,
    )


FinishReasonDict = Dict[str, Optional[Union[str, int, List[int]]]]


# Single lines of the wheel's source the client relies on (see vendor.py), by path.
SOURCE_LINES = {'sglang/srt/managers/tokenizer_manager.py': ['meta_info["output_token_sampling_logprobs"] = ('], 'sglang/srt/entrypoints/http_server.py': ['content = {"success": success, "message": message}'], 'sglang/srt/managers/scheduler_components/weight_updater.py': ['message="a weight-update session is already open; "'], 'sglang/srt/arg_groups/fields/exec_.py': ['    enable_memory_saver: A[', '    enable_weights_cpu_backup: A[', '    enable_deterministic_inference: A['], 'sglang/srt/constants.py': ['GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"', 'GPU_MEMORY_TYPE_WEIGHTS = "weights"', 'GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"'], 'sglang/srt/arg_groups/fields/serving.py': ['    ] = "default"']}
