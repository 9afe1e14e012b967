"""Engine process of the handoff test: a TorchEngine on the tiny model, fed by rlblocks.sync.open_handoff.

Protocol on stdin/stdout (launched by test_handoff.py, never by pytest): prints READY once the engine is built;
then for each length-prefixed pickled HandoffMessage on stdin it loads it into the engine, flips one byte of the
first tensor's view (so the sender can see that the views were its own memory, not a copy) and prints one JSON
line: the engine's version, the CRC-32 of every engine weight, and whether all views of a bucket share one storage
that no engine weight uses.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import struct
import sys
import zlib

import torch


def main() -> None:
    from rlblocks.rollout.engines import TorchEngine
    from rlblocks.sync import open_handoff

    engine = TorchEngine.from_pretrained(sys.argv[1], device="cpu")
    weights = dict(engine.model.state_dict())
    print("READY", flush=True)
    while True:
        head = sys.stdin.buffer.read(8)
        if len(head) < 8:
            return
        msg = pickle.loads(sys.stdin.buffer.read(struct.unpack("<Q", head)[0]))
        with open_handoff(msg) as named:
            storages = {}
            handles = [bucket.handle for bucket in msg.buckets for _ in bucket.tensors]
            for (_, t), handle in zip(named, handles):
                storages.setdefault(handle, set()).add(t.untyped_storage().data_ptr())
            engine_ptrs = {t.untyped_storage().data_ptr() for t in weights.values()}
            one_each = all(len(p) == 1 and not p & engine_ptrs for p in storages.values())
            asyncio.run(engine.update_weights(named, version=msg.version))  # what update_from_handoff does
            named[0][1].view(-1).view(torch.uint8)[0] ^= 0xFF  # visible to the sender only if memory is shared
        crcs = {n: zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()) for n, t in weights.items()}
        print(json.dumps({"version": engine.version, "crc": crcs, "views_share_bucket_storage": one_each}), flush=True)


if __name__ == "__main__":
    main()
