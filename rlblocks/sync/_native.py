"""The compiled loops of delta sync (numba; imported only where :func:`rlblocks.sync._bits.native_available`).

Module-level functions so that numba's disk cache finds them again in the next process (loops defined in a
closure are recompiled by every process). Their Python wrappers, contracts and the torch path that gives the same
results: :mod:`rlblocks.sync._bits`.
"""

from __future__ import annotations

import llvmlite.binding as llvm_binding
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic


@intrinsic
def crc_call(typingctx, fn, crc, ptr, length):  # pragma: no cover - compiled
    """``fn(crc, ptr, length)`` for the C function at address ``fn`` (uint32, const uint8 *, uint64 -> uint32):
    passed as an integer so that the loops stay cacheable (a ctypes global would not be)."""
    sig = types.int64(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn, crc, ptr, length = args
        i32, u8p = ir.IntType(32), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(i32, [i32, u8p, ir.IntType(64)])
        f = builder.inttoptr(fn, fnty.as_pointer())
        r = builder.call(f, [builder.trunc(crc, i32), builder.inttoptr(ptr, u8p), length])
        return builder.zext(r, ir.IntType(64))

    return sig, codegen

# --- CRC-32 folded 256 bits at a time -------------------------------------------------------------------------------
#
# ISA-L folds with 128-bit carry-less multiplies unless the CPU has AVX-512; a CPU with VPCLMULQDQ on 256-bit
# registers (AVX2) does two such folds per instruction. Four 256-bit accumulators hold 128 consecutive bytes; each
# 128-bit lane V = H * x^64 + L (reflected: bit j is the coefficient of x^(127-j), so the low qword holds H and the
# high qword L) is carried 1024 bits forward as H * (x^1088 mod P) + L * (x^1024 mod P), congruent to V * x^1024
# mod P, and xor-ed into the lane 128 bytes later. The message is then congruent (mod P) to the 128 folded bytes
# followed by the unfolded tail, so its CRC is ISA-L's CRC of those bytes. zlib's initial value enters as ~crc
# xor-ed into the first 4 bytes.

_CRC_POLY = 0x104C11DB7  # x^32 + ... + 1, zlib's CRC-32 polynomial (normal, not reflected)


def _x_pow_mod(n: int) -> int:
    """x^n mod P as an integer whose bit i is the coefficient of x^i."""
    r = 1
    for _ in range(n):
        r <<= 1
        if r >> 32:
            r ^= _CRC_POLY
    return r


def _reflect64(poly: int) -> int:
    """A polynomial of degree < 64 as a reflected 64-bit constant (bit 63 - i holds the coefficient of x^i)."""
    return sum(1 << (63 - i) for i in range(64) if poly >> i & 1)


_FOLD_BITS = 1024  # 4 registers x 256 bits
# A carry-less product of two reflected 64-bit values, read as a reflected 128-bit value, is the polynomial product
# times x: hence the exponents' - 1.
_FOLD_LO = _reflect64(_x_pow_mod(_FOLD_BITS + 63))  # multiplies a lane's low qword (H)
_FOLD_HI = _reflect64(_x_pow_mod(_FOLD_BITS - 1))  # multiplies its high qword (L)


def _host_clmul256() -> tuple[bool, bool]:
    """``(has, wanted)``: numba compiles for this CPU and it has 256-bit VPCLMULQDQ with AVX2; and it lacks
    AVX-512F (with AVX-512, ISA-L already folds 512 bits at a time, faster than :func:`crc_wide`)."""
    if numba.config.CPU_NAME not in (None, "host") or numba.config.CPU_FEATURES not in (None, ""):
        return False, False  # a portable target: the instruction may not exist where the code runs
    try:
        feats = llvm_binding.get_host_cpu_features()
    except RuntimeError:
        return False, False
    has = bool(feats.get("vpclmulqdq") and feats.get("avx2"))
    return has, has and not feats.get("avx512f")


HAS_CLMUL256, WIDE_CRC = _host_clmul256()
"""Whether :func:`crc_wide` can run here, and whether the compiled loops checksum with it (else with ISA-L's
function on every piece)."""


@intrinsic
def crc_fold256(typingctx, fn, crc, ptr, length):  # pragma: no cover - compiled
    """zlib's CRC-32 of ``length >= 256`` bytes at ``ptr`` continuing from ``crc``: the bytes folded 256 bits per
    instruction into 128, then ``fn`` (ISA-L's ``crc32_gzip_refl``) over those and the tail (< 128 bytes)."""
    sig = types.int64(types.int64, types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn, crc, ptr, n = args
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        v4 = ir.VectorType(i64, 4)
        k = ir.Constant(v4, [ir.Constant(i64, c) for c in (_FOLD_LO, _FOLD_HI, _FOLD_LO, _FOLD_HI)])
        clmul = builder.module.declare_intrinsic("llvm.x86.pclmulqdq.256", fnty=ir.FunctionType(v4, [v4, v4, i8]))

        def load(off):
            return builder.load(builder.inttoptr(builder.add(ptr, off), v4.as_pointer()), align=1)

        inv = builder.and_(builder.not_(crc), ir.Constant(i64, 0xFFFFFFFF))
        first = [load(ir.Constant(i64, 32 * j)) for j in range(4)]
        first[0] = builder.xor(first[0], builder.insert_element(ir.Constant(v4, [ir.Constant(i64, 0)] * 4), inv,
                                                                ir.Constant(i32, 0)))
        step = ir.Constant(i64, 128)
        entry = builder.block
        loop = builder.append_basic_block("crc.fold")
        done = builder.append_basic_block("crc.folded")
        builder.cbranch(builder.icmp_signed("<=", ir.Constant(i64, 256), n), loop, done)

        builder.position_at_end(loop)
        off = builder.phi(i64)
        acc = [builder.phi(v4) for _ in range(4)]
        nxt = []
        for j in range(4):
            lo = builder.call(clmul, [acc[j], k, ir.Constant(i8, 0x00)])
            hi = builder.call(clmul, [acc[j], k, ir.Constant(i8, 0x11)])
            nxt.append(builder.xor(builder.xor(lo, hi), load(builder.add(off, ir.Constant(i64, 32 * j)))))
        off2 = builder.add(off, step)
        last = builder.block
        builder.cbranch(builder.icmp_signed("<=", builder.add(off2, step), n), loop, done)
        off.add_incoming(step, entry)
        off.add_incoming(off2, last)
        for j in range(4):
            acc[j].add_incoming(first[j], entry)
            acc[j].add_incoming(nxt[j], last)

        builder.position_at_end(done)
        used = builder.phi(i64)
        used.add_incoming(step, entry)
        used.add_incoming(off2, last)
        folded = []
        for j in range(4):
            a = builder.phi(v4)
            a.add_incoming(first[j], entry)
            a.add_incoming(nxt[j], last)
            folded.append(a)
        buf = cgutils.alloca_once(builder, ir.ArrayType(v4, 4))
        for j in range(4):
            builder.store(folded[j], builder.gep(buf, [ir.Constant(i32, 0), ir.Constant(i32, j)]), align=1)
        u8p = i8.as_pointer()
        f = builder.inttoptr(fn, ir.FunctionType(i32, [i32, u8p, i64]).as_pointer())
        c = builder.call(f, [ir.Constant(i32, 0xFFFFFFFF), builder.bitcast(buf, u8p), step])  # ~0xFFFFFFFF = 0
        c = builder.call(f, [c, builder.inttoptr(builder.add(ptr, used), u8p), builder.sub(n, used)])
        return builder.zext(c, i64)

    return sig, codegen


@numba.njit(nogil=True, cache=True)
def crc_wide(fn, crc, ptr, length):  # pragma: no cover - compiled
    """``fn(crc, ptr, length)`` (zlib's CRC-32, chained) with the bulk folded by :func:`crc_fold256`; only where
    the CPU has 256-bit VPCLMULQDQ (:data:`WIDE_CRC`). Short pieces go to ``fn`` whole."""
    if length < 256:
        return crc_call(fn, crc, ptr, length)
    return crc_fold256(fn, crc, ptr, length)


@numba.njit(nogil=True, cache=True)
def crc_narrow(fn, crc, ptr, length):  # pragma: no cover - compiled
    """``fn(crc, ptr, length)``: ISA-L's CRC-32 of every piece."""
    return crc_call(fn, crc, ptr, length)


crc_piece = crc_wide if WIDE_CRC else crc_narrow  # what the loops below call (fixed per CPU, as numba's cache is)


@intrinsic
def as_ptr(typingctx, addr):  # pragma: no cover - compiled
    """An integer address as a ``void *`` (for ``numba.carray`` over a tensor's memory)."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.int64), codegen

@numba.njit(nogil=True, cache=True)
def delta_chunk(ow, nw, ol, nl, gaps, vals, wide, update, crc_fn, sub):  # pragma: no cover - compiled
    """Changed lanes of one chunk: returns (count, escapes, last local position, CRC of ``nl``); writes
    ``gaps`` (uint16, the first one relative to position -1), ``vals``, ``wide`` (true values of gaps >= ESC,
    in order) and, with ``update``, the changed words / tail elements into ``ow`` / ``ol``.

    Words go 64 at a time: first a bit mask of which of them changed (a branch-free loop the compiler
    vectorises), then only its set bits. A branch per word on whether it changed would be taken at random
    (at 3 % of bf16 elements changed, 11 % of words), and its mispredictions cost more than the whole
    comparison; per group of 64 the loop mispredicts about once. Every ``sub`` words (a multiple of 64) the
    new bytes just read are checksummed, from cache. The lane geometry comes from the element type (a
    constant of each compiled version)."""
    lanes = 8 // ol.itemsize
    bits = 8 * ol.itemsize
    mask = -1 if lanes == 1 else (1 << bits) - 1
    high = 0
    for j in range(lanes):
        high |= 1 << (bits * j + bits - 1)
    low = ~high
    one = np.uint64(1)
    k = 0
    w = 0
    prev = -1
    crc = 0
    nwords = ow.shape[0]
    addr = nl.ctypes.data
    done = 0  # words checksummed so far
    for gi in range((nwords + 63) // 64):  # one flat loop: a nested per-piece loop measured ~20 % slower
        lo = gi * 64
        m = np.uint64(0)
        if lo + 64 <= nwords:
            for j in range(64):
                m |= np.uint64(ow[lo + j] != nw[lo + j]) << np.uint64(j)
        else:  # the last < 64 words
            for j in range(nwords - lo):
                m |= np.uint64(ow[lo + j] != nw[lo + j]) << np.uint64(j)
        while m != 0:
            i = lo + np.int64(trailing_zeros(m))
            m &= m - one
            v = nw[i]
            x = ow[i] ^ v
            # the high bit of each nonzero lane of x (a carry trick), then those lanes lowest first
            nz = np.uint64((((x & low) + low) | x) & high)
            base = i * lanes
            while nz != 0:  # one iteration for ~96 % of changed words at 3 % of bf16 lanes changed
                j = np.int64(trailing_zeros(nz)) // bits
                nz &= nz - one
                g = base + j - prev
                if g >= 0xFFFF:  # rare: predictable
                    wide[w] = g
                    w += 1
                    g = 0xFFFF
                gaps[k] = g
                vals[k] = (v >> (bits * j)) & mask
                k += 1
                prev = base + j
            if update:
                ow[i] = v
        end = min(nwords, lo + 64)
        if crc_fn != 0 and (end - done >= sub or end == nwords):
            crc = crc_piece(crc_fn, crc, addr + 8 * done, 8 * (end - done))
            done = end
    for p in range(nwords * lanes, ol.shape[0]):  # the elements after the last whole word
        if ol[p] != nl[p]:
            g = p - prev
            gaps[k] = g if g < 0xFFFF else 0xFFFF
            vals[k] = nl[p]
            if g >= 0xFFFF:
                wide[w] = g
                w += 1
            prev = p
            k += 1
            if update:
                ol[p] = nl[p]
    tail = ol.shape[0] - nwords * lanes
    if crc_fn != 0 and tail:
        crc = crc_piece(crc_fn, crc, addr + 8 * nwords, tail * ol.itemsize)
    return k, w, prev, crc

@numba.njit(nogil=True, cache=True)
def check(gaps, wide, n):  # pragma: no cover - compiled
    esc = 0
    bad = False
    over = False
    pos = -1
    nwide = wide.shape[0]
    for q in range(gaps.shape[0]):
        g = np.int64(gaps[q])
        if g == 0xFFFF:  # rare: predictable
            g = wide[esc] if esc < nwide else 1
            esc += 1
        bad |= g < 1
        pos += min(max(g, 0), n + 1)  # saturated above n: a huge escaped gap cannot overflow the sum
        if pos >= n:
            over = True
            pos = n
    return esc, bad, over

@numba.njit(nogil=True, cache=True)
def apply(t, gaps, wide, vals, saved, keep, crc_fn, sub):  # pragma: no cover - compiled
    """Writes ``vals`` at the gap-coded positions, ``sub`` elements of ``t`` at a time: the piece's CRC before
    its writes, the writes (old values into ``saved`` with ``keep``), its CRC after, both from cache.
    Returns the CRCs of the whole tensor before and after (0 without ``crc_fn``) and whether the list was valid.

    Each position is checked before its write (a gap < 1 or > n, an escape without its value, the list running
    past the tensor's end, escaped values left over): the first bad one stops the writes, and with ``keep`` the
    ones made are undone here (the list's valid prefix leads back to them), so an invalid list leaves ``t`` as
    it was; without ``keep`` the list must have passed :func:`check` first."""
    n = t.shape[0]
    k = gaps.shape[0]
    nwide = wide.shape[0]
    es = t.itemsize
    addr = t.ctypes.data
    before = 0
    after = 0
    q = 0
    w = 0
    pos = -1
    nxt = -1
    ok = True
    if k:
        g = np.int64(gaps[0])
        if g == 0xFFFF:  # rare: predictable
            if nwide < 1:
                ok = False
            else:
                g = wide[0]
                w = 1
        ok = ok and 1 <= g <= n
        nxt = g - 1
    for s in range(0, n, sub):
        e = min(n, s + sub)
        if crc_fn != 0:
            before = crc_piece(crc_fn, before, addr + es * s, es * (e - s))
        while ok and q < k and nxt < e:
            pos = nxt
            if keep:
                saved[q] = t[pos]
            t[pos] = vals[q]
            q += 1
            if q < k:
                g = np.int64(gaps[q])
                if g == 0xFFFF:
                    if w >= nwide:
                        ok = False
                        break
                    g = wide[w]
                    w += 1
                if g < 1 or g > n:  # a later check (nxt < e <= n) keeps the position in range
                    ok = False
                    break
                nxt = pos + g
        if crc_fn != 0:
            after = crc_piece(crc_fn, after, addr + es * s, es * (e - s))
    ok = ok and q == k and w == nwide
    if not ok and keep:  # undo the q writes made, by the valid prefix of the list
        p = -1
        ww = 0
        for j in range(q):
            g = np.int64(gaps[j])
            if g == 0xFFFF:
                g = wide[ww]
                ww += 1
            p += g
            t[p] = saved[j]
    return before, after, ok

@numba.njit(nogil=True, cache=True)
def delta_batch(olds, news, ns, like, gaps, vals, wide, offs, woffs, update, crc_fn, sub, out):
    """:func:`delta_chunk` over many tensors in one call: tensor ``t`` is ``ns[t]`` elements of ``like``'s
    dtype at the addresses ``olds[t]`` / ``news[t]`` (8-byte aligned); its outputs follow the previous tensor's
    in ``gaps`` / ``vals`` (from ``offs[t]``, written here) and ``wide`` (from ``woffs[t]``), so the used part of
    each is one prefix; ``out[t] = (count, escapes, last, crc, dense)``. ``gaps`` / ``vals`` hold ``sum(ns)``
    entries and ``wide`` ``sum(ns // 0xFFFF + 2)``: every tensor finds room for its worst case. A tensor of
    >= 4096 elements whose sample (every ``n // 1024``-th element) has more than 1 in 8 changed is left as it
    is with ``dense = 1``: a mask is faster to build there (the caller takes it)."""
    lo = 0
    wlo = 0
    for t in range(olds.shape[0]):
        offs[t] = lo
        woffs[t] = wlo
        n = ns[t]
        ol = numba.carray(as_ptr(olds[t]), (n,), like.dtype)
        nl = numba.carray(as_ptr(news[t]), (n,), like.dtype)
        out[t, 4] = 0
        if n >= 4096:
            step = n // 1024
            seen = 0
            changed = 0
            for p in range(0, n, step):
                changed += ol[p] != nl[p]
                seen += 1
            if 8 * changed > seen:  # a mask is built faster above ~1 in 7 changed (bf16, measured)
                out[t, 4] = 1
                continue
        nwords = n * ol.itemsize // 8
        ow = numba.carray(as_ptr(olds[t]), (nwords,), np.int64)
        nw = numba.carray(as_ptr(news[t]), (nwords,), np.int64)
        k, w, last, crc = delta_chunk(ow, nw, ol, nl, gaps[lo : lo + n], vals[lo : lo + n], wide[wlo:],
                                      update, crc_fn, sub)
        lo += k
        wlo += w
        out[t, 0] = k
        out[t, 1] = w
        out[t, 2] = last
        out[t, 3] = crc

@numba.njit(nogil=True, cache=True)
def check_batch(gaddrs, ks, waddrs, nwides, ns, out):  # pragma: no cover - compiled
    """:func:`check` of many gap16 lists (at the given addresses) in one call: ``out[t] = (escapes, bad,
    over)``."""
    for t in range(gaddrs.shape[0]):
        gaps = numba.carray(as_ptr(gaddrs[t]), (ks[t],), np.uint16)
        wide = numba.carray(as_ptr(waddrs[t]), (nwides[t],), np.int64)
        esc, bad, over = check(gaps, wide, ns[t])
        out[t, 0] = esc
        out[t, 1] = bad
        out[t, 2] = over

@numba.njit(nogil=True, cache=True)
def apply_batch(taddrs, ns, like, gaddrs, ks, waddrs, nwides, vaddrs, saddrs, keep, crc_fn, sub, out):
    """:func:`apply` of many records in one call (tensor ``t``: ``ns[t]`` elements of ``like``'s dtype at
    ``taddrs[t]``; its list, values and saved values at the other addresses): ``out[t] = (before, after, ok)``."""
    for t in range(taddrs.shape[0]):
        target = numba.carray(as_ptr(taddrs[t]), (ns[t],), like.dtype)
        gaps = numba.carray(as_ptr(gaddrs[t]), (ks[t],), np.uint16)
        wide = numba.carray(as_ptr(waddrs[t]), (nwides[t],), np.int64)
        vals = numba.carray(as_ptr(vaddrs[t]), (ks[t],), like.dtype)
        saved = numba.carray(as_ptr(saddrs[t]), (ks[t],), like.dtype)
        before, after, ok = apply(target, gaps, wide, vals, saved, keep, crc_fn, sub)
        out[t, 0] = before
        out[t, 1] = after
        out[t, 2] = ok
