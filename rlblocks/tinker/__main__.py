"""``python -m rlblocks.tinker``: serve the Tinker API for local HF models (see ``--help``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rlblocks.tinker", description=(
        "Serve the Tinker training API (the official tinker SDK and tinker-cookbook recipes) for local HF models. "
        "Point the SDK at it with TINKER_BASE_URL=http://HOST:PORT and any TINKER_API_KEY starting with 'tml-'."))
    p.add_argument("--model", action="append", required=True, metavar="NAME=HF_DIR",
                   help="a model to serve: the name clients use (base_model) and its HF checkpoint directory; repeat "
                        "for several")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at startup)")
    p.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                   help="sampling engine: rlblocks' TorchEngine (default) or VLLMEngine with LoRA adapters")
    p.add_argument("--state-dir", default="tinker-state", help="where checkpoints live (default ./tinker-state)")
    p.add_argument("--device", default=None, help="training (and TorchEngine) device; default cuda if available")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="base weights' dtype (default bfloat16 on CUDA, float32 on CPU); adapters are float32")
    p.add_argument("--api-key", default=None, help="require this X-API-Key (default: accept any)")
    p.add_argument("--max-body-mb", type=float, default=256.0, help="largest request body accepted (MiB)")
    p.add_argument("--keep-snapshots", type=int, default=16,
                   help="unnamed sampler snapshots kept per training model (older ones expire)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's); 1 is fastest for small models on a few cores")
    p.add_argument("--max-num-samples", type=int, default=1024,
                   help="most num_samples of one sample request (more answers 400; default 1024)")
    p.add_argument("--max-request-tokens", type=int, default=1 << 22,
                   help="most tokens one sample request may ask for, num_samples x (prompt + max_tokens) (more "
                        "answers 400; default 4194304)")
    p.add_argument("--stable-reinforce-as", choices=("ppo", "cispo", "importance_sampling"), default=None,
                   help="run loss_fn='stable_reinforce' (tinker-cookbook's default, whose objective Tinker does not "
                        "publish) as this documented objective, announced in get_server_capabilities and in every "
                        "forward_backward / optim_step answer's metrics; default: refuse it")
    p.add_argument("--max-batch-tokens", type=int, default=16384,
                   help="padded tokens per training micro-batch (a request's datums run in micro-batches of at most "
                        "this many; fewer lowers the peak memory of a step, not its gradient; default 16384)")
    p.add_argument("--no-prefix-share", dest="prefix_share", action="store_false",
                   help="train one padded row per datum instead of forwarding the token prefixes that a request's "
                        "datums share once (a GRPO group's prompt); the log-probs and gradients are the same")
    p.add_argument("--trim-idle-s", type=float, default=300.0,
                   help="once a model's training requests have stopped for this many seconds, hand the memory their "
                        "steps freed back to the OS (0: after every request, which a training loop pays for by "
                        "faulting that memory in again at its next step; default 300)")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    args = p.parse_args(argv)
    models = {}
    for spec in args.model:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            p.error(f"--model: expected NAME=HF_DIR, got {spec!r}")
        if not os.path.isdir(path):
            p.error(f"--model {name}: {path!r} is not a directory")
        if name in models:
            p.error(f"--model: {name!r} given twice")
        models[name] = path
    for flag in ("max_num_samples", "max_request_tokens", "max_batch_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: expected an integer >= 1, got {getattr(args, flag)}")
    if not 0 <= args.trim_idle_s < math.inf:
        p.error(f"--trim-idle-s: expected a finite number of seconds >= 0, got {args.trim_idle_s}")
    args.models = models
    return args


async def _serve(args: argparse.Namespace) -> None:
    import torch

    from rlblocks.tinker.server import bind, create_app, make_server
    from rlblocks.tinker.service import TinkerService

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    service = TinkerService(args.models, state_dir=args.state_dir, engine=args.engine, device=args.device,
                            dtype=dtype, keep_snapshots=args.keep_snapshots, max_num_samples=args.max_num_samples,
                            max_request_tokens=args.max_request_tokens,
                            stable_reinforce_as=args.stable_reinforce_as, max_batch_tokens=args.max_batch_tokens,
                            prefix_share=args.prefix_share, trim_idle_s=args.trim_idle_s)
    sock = bind(args.host, args.port)
    port = sock.getsockname()[1]

    def announce() -> None:
        mapping = f", stable_reinforce runs as {args.stable_reinforce_as}" if args.stable_reinforce_as else ""
        print(f"rlblocks.tinker: serving {sorted(args.models)} at http://{args.host}:{port} "
              f"(engine {args.engine}, state {os.path.abspath(args.state_dir)}{mapping})", flush=True)

    app = create_app(service, api_key=args.api_key, max_body_bytes=int(args.max_body_mb * (1 << 20)),
                     on_ready=announce)
    await make_server(app, sock, log_level=args.log_level).serve(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop  # a faster event loop where installed (uvicorn's own default); asyncio's otherwise

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
