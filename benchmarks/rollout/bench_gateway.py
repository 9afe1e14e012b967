"""Gateway overhead and throughput, measured side by side in one run.

    python benchmarks/rollout/bench_gateway.py [--seconds 8] [--requests 300] [--concurrency 1,8,64]

1. Added latency per request (loopback). The gateway and its engine run on this process's event loop; the client
   is a separate process (a keep-alive HTTP/1.1 client on raw sockets, so the client's own cost stays small). Each
   figure is a p50/p90 over ``--requests`` sequential requests (in ``--rounds`` interleaved rounds), compared with
   the same engine called directly (``await engine.generate(request)`` on pre-tokenised ids) in this process:
   - ``instant`` engine: returns a fixed 8-token generation at once, so the difference is the gateway alone (HTTP
     parse and write, JSON, session lookup, chat-template render and tokenisation, decoding, trajectory append);
   - TorchEngine on a tiny random Llama, 8 new tokens: the same difference with real generation around it.
   ``chat`` is ``/v1/chat/completions`` (template render included), ``completions`` is ``/v1/completions`` with
   token ids (token-in: no render).
2. Tokens/s through the gateway at 1, 8 and 64 concurrent sessions (multi-turn: each session sends 4 chat turns
   that re-send the growing history, then starts again), against the same engine driven directly by as many
   concurrent ``generate`` loops over the same prompts, for ``--seconds`` each (two interleaved halves).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import string
import sys
import time

import torch

from rlblocks.rollout import Generation, GenerationRequest, SamplingParams
from rlblocks.rollout.engines import TorchEngine
from rlblocks.rollout.gateway import Gateway

NEW_TOKENS = 8


def build_tokenizer():
    """Char-level tokenizer over printable ASCII with ChatML markers (local, no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   eos_token="<|im_end|>", additional_special_tokens=specials[2:])
    fast.chat_template = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
                          "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
                          "{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    return fast


class InstantEngine:
    """Returns a fixed generation at once (isolates the gateway's own cost); protocol methods it needs only."""

    def __init__(self, output_ids: list[int]) -> None:
        self.output_ids = output_ids
        self.version = 0
        self.is_paused = False

    async def generate(self, request: GenerationRequest) -> Generation:
        n = min(len(self.output_ids), request.sampling.max_new_tokens)
        return Generation(request.request_id, list(request.prompt_ids), self.output_ids[:n], [-0.5] * n, [0] * n,
                          "length")


def tiny_model(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048)
    return LlamaForCausalLM(cfg).eval()


# ------------------------------------------------------------------------------------------------ client process
async def _http(reader, writer, path: str, body: dict, headers: dict) -> dict:
    data = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", "Host: bench", "Content-Type: application/json", f"Content-Length: {len(data)}",
            *[f"{k}: {v}" for k, v in headers.items()]]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    await writer.drain()
    status = await reader.readline()
    length = 0
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        k, _, v = line.decode().partition(":")
        if k.lower() == "content-length":
            length = int(v)
    payload = json.loads(await reader.readexactly(length))
    if b" 200 " not in status:
        raise RuntimeError(f"{status!r}: {payload}")
    return payload


async def _latency(port: int, n: int, kind: str, prompt_ids: list[int]) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = []
    for i in range(n + 10):  # 10 warm-up requests
        if kind == "chat":
            path, body = "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hello"}],
                                                  "max_tokens": NEW_TOKENS, "temperature": 1.0}
        else:
            path, body = "/v1/completions", {"model": "m", "prompt": prompt_ids, "max_tokens": NEW_TOKENS}
        t0 = time.perf_counter()
        await _http(reader, writer, path, body, {"X-Session-Id": f"{kind}-{i}-{os.getpid()}"})
        if i >= 10:
            out.append(time.perf_counter() - t0)
    writer.close()
    return out


async def _throughput(port: int, sessions: int, seconds: float, tag: str) -> tuple[int, int, float]:
    stop = time.perf_counter() + seconds
    counts = [0, 0]

    async def one(k: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        n = 0
        while time.perf_counter() < stop:
            sid = f"{tag}-{k}-{n}"
            n += 1
            msgs = [{"role": "user", "content": "count to ten"}]
            for _ in range(4):
                r = await _http(reader, writer, "/v1/chat/completions",
                                {"model": "m", "messages": msgs, "max_tokens": NEW_TOKENS, "temperature": 1.0},
                                {"X-Session-Id": sid})
                counts[0] += r["usage"]["completion_tokens"]
                counts[1] += 1
                msgs += [r["choices"][0]["message"], {"role": "user", "content": "more"}]
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*[one(k) for k in range(sessions)])
    return counts[0], counts[1], time.perf_counter() - t0


def _client_main(conn) -> None:
    """The client process: runs the jobs it is sent (one asyncio loop each) until it receives None."""
    while True:
        job = conn.recv()
        if job is None:
            return
        if job["what"] == "latency":
            conn.send(asyncio.run(_latency(job["port"], job["n"], job["kind"], job["prompt_ids"])))
        else:
            conn.send(asyncio.run(_throughput(job["port"], job["sessions"], job["seconds"], job["tag"])))


class Client:
    """One client process for the whole run (started once: its imports must not overlap a measurement)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_client_main, args=(child,), daemon=True)
        self.proc.start()

    async def run(self, job: dict):
        loop = asyncio.get_running_loop()
        self.conn.send(job)
        return await loop.run_in_executor(None, self.conn.recv)  # the server keeps serving on this loop meanwhile

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=30)


# ------------------------------------------------------------------------------------------------ server side
def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) > 1 else xs[0]


async def direct_latency(engine, prompt_ids: list[int], n: int) -> list[float]:
    out = []
    sp = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
    for i in range(n + 10):
        t0 = time.perf_counter()
        await engine.generate(GenerationRequest(f"d{i}", prompt_ids, sp))
        if i >= 10:
            out.append(time.perf_counter() - t0)
    return out


async def direct_throughput(engine, tok, sessions: int, seconds: float) -> tuple[int, int, float]:
    """The gateway workload without the gateway: the same multi-turn prompts, rendered here, generated directly."""
    from rlblocks.rollout.agents.trajectory import render_chat

    stop = time.perf_counter() + seconds
    counts = [0, 0]
    sp = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, stop_token_ids=(tok.eos_token_id,))

    async def one(k: int) -> None:
        n = 0
        while time.perf_counter() < stop:
            msgs = [{"role": "user", "content": "count to ten"}]
            for t in range(4):
                g = await engine.generate(GenerationRequest(f"t{k}-{n}-{t}", render_chat(tok, msgs), sp))
                counts[0] += len(g.output_ids)
                counts[1] += 1
                msgs += [{"role": "assistant", "content": tok.decode(g.output_ids[:-1] if g.finish_reason == "stop"
                                                                     else g.output_ids)},
                         {"role": "user", "content": "more"}]
            n += 1

    t0 = time.perf_counter()
    await asyncio.gather(*[one(k) for k in range(sessions)])
    return counts[0], counts[1], time.perf_counter() - t0


async def main_async(args) -> dict:
    tok = build_tokenizer()
    prompt_ids = list(tok.encode(tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                                         add_generation_prompt=True), add_special_tokens=False))
    fixed = tok.encode("abcdefgh", add_special_tokens=False)
    results: dict = {"latency_ms": {}, "throughput": {}}
    engines = {"instant": InstantEngine(fixed), "torch": TorchEngine(tiny_model(len(tok)), max_batch_size=256)}
    client = Client()
    rounds = args.rounds
    per = max(args.requests // rounds, 5)
    try:
        for name, engine in engines.items():
            lat: dict[str, list[float]] = {"direct": [], "chat": [], "completions": []}
            async with Gateway(engine, tok, model="m", default_max_tokens=NEW_TOKENS) as gw:
                for _ in range(rounds):  # interleaved, so that a change of machine load hits every column alike
                    lat["direct"] += await direct_latency(engine, prompt_ids, per)
                    for kind in ("chat", "completions"):
                        lat[kind] += await client.run({"what": "latency", "port": gw.port, "n": per, "kind": kind,
                                                       "prompt_ids": prompt_ids})
            row = {}
            for k, xs in lat.items():
                row[f"{k}_p50"], row[f"{k}_p90"] = 1e3 * pct(xs, 50), 1e3 * pct(xs, 90)
            for kind in ("chat", "completions"):
                row[f"{kind}_added_p50"] = row[f"{kind}_p50"] - row["direct_p50"]
            results["latency_ms"][name] = row
            print(f"latency [{name:7s}] direct p50 {row['direct_p50']:.3f} ms | gateway chat p50 "
                  f"{row['chat_p50']:.3f} (+{row['chat_added_p50']:.3f}) p90 {row['chat_p90']:.3f} | completions "
                  f"p50 {row['completions_p50']:.3f} (+{row['completions_added_p50']:.3f}) ms", flush=True)
        engine = engines["torch"]
        for c in args.concurrency:
            d = [0, 0, 0.0]
            g = [0, 0, 0.0]
            mism = 0
            async with Gateway(engine, tok, model="m", default_max_tokens=NEW_TOKENS) as gw:
                for r in range(2):  # interleaved halves
                    for acc, res in ((d, await direct_throughput(engine, tok, c, args.seconds / 2)),
                                     (g, await client.run({"what": "throughput", "port": gw.port, "sessions": c,
                                                           "seconds": args.seconds / 2, "tag": f"c{c}-{r}"}))):
                        for i in range(3):
                            acc[i] += res[i]
                mism = gw.stats().get("prefix_mismatches", 0)
            row = {"direct_tokens_per_s": d[0] / d[2], "gateway_tokens_per_s": g[0] / g[2],
                   "direct_requests_per_s": d[1] / d[2], "gateway_requests_per_s": g[1] / g[2],
                   "ratio": (g[0] / g[2]) / (d[0] / d[2]), "prefix_mismatches": mism}
            results["throughput"][str(c)] = row
            print(f"throughput [{c:3d} sessions] direct {row['direct_tokens_per_s']:.0f} tok/s "
                  f"({row['direct_requests_per_s']:.0f} req/s) | gateway {row['gateway_tokens_per_s']:.0f} tok/s "
                  f"({row['gateway_requests_per_s']:.0f} req/s) | ratio {row['ratio']:.2f} | prefix mismatches "
                  f"{mism}", flush=True)
    finally:
        client.close()
    return results


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    p.add_argument("--seconds", type=float, default=8.0, help="duration of each throughput measurement")
    p.add_argument("--requests", type=int, default=300, help="sequential requests per latency measurement")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds the requests are split into")
    p.add_argument("--concurrency", default="1,8,64", help="concurrent sessions for the throughput rows")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    p.add_argument("--out", default="", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    torch.set_num_threads(args.threads)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"load average before: {' '.join(load)}", flush=True)
    res = asyncio.run(main_async(args))
    res["loadavg_before"] = load
    with open("/proc/loadavg") as f:
        res["loadavg_after"] = f.read().split()[:3]
    print(f"load average after: {' '.join(res['loadavg_after'])}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
