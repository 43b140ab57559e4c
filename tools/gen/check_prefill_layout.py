#!/usr/bin/env python3
"""Host-side check of the m144w token-tile layout (sm90_wna16_moe_prefill.cuh): the 4-byte cp.async
writer map, the wgmma K-major 128B-swizzle read model (start + 32 bytes per k-step, 8-row groups 1024
bytes apart, 16-byte unit c of row r at c ^ (r & 7)) and the packed A fragment (moe_gemm.h) agree
on which (token, real k) each wgmma operand element is; and the writes are bank-conflict free."""
BM = 144  # token rows of an m-block (CfgM144W::BLOCK_M)

def token_copies():
    """Each thread's token-tile rows: (lane, row, 16-byte unit p8, the unit's swizzled byte offset)."""
    for warp in range(8):
        for lane in range(32):
            for i in range((BM + 31) // 32):
                row = 32*i + 4*warp + (lane >> 3); p8 = lane & 7
                if row >= BM: continue
                xr0 = 4*warp + (lane >> 3)
                yield lane, row, p8, xr0*128 + ((p8 ^ (xr0 & 7)) << 4) + i*4096

# writer: which (row, real k) sits at each byte of a stage's token tile
store = {}
for lane, row, p8, xsoff in token_copies():
    for cc in range(4):
        c = (cc + (lane >> 3)) & 3
        off = xsoff + c*4
        rp = p8 + 8*c          # real pair; global element offset 2*p8 + 16*c
        assert 2*p8 + 16*c == 2*rp
        for e in range(2):
            assert off + 2*e not in store
            store[off + 2*e] = (row, 2*rp + e)
assert len(store) == BM*64 and max(store) < BM*128
# wgmma B read model (K-major, SW128, SBO 1024, start + 32 s)
def b_addr(n, kk, s):
    a = (n//8)*1024 + (n % 8)*128 + 32*s + 2*kk
    return a ^ (((a >> 7) & 7) << 4)
# A fragment of the packed layout: lane tig, k-step s, register r, element e -> real k; logical kk
bad = 0
for s in range(4):
    for tig in range(4):
        for r in range(4):
            for e in range(2):
                real_k = 16*tig + 4*s + 2*(r >> 1) + e
                kk = 2*tig + e + 8*(r >> 1)       # mma A column of register r
                for n in range(BM):
                    row, k = store[b_addr(n, kk, s)]
                    if row != n or k != real_k: bad += 1
print("mismatches", bad)
# bank conflicts of one warp-wide 4-byte cp.async write
for warp in range(8):
    for cc in range(4):
        banks = set()
        for lane in range(32):
            xr0 = 4*warp + (lane >> 3); p8 = lane & 7; c = (cc + (lane >> 3)) & 3
            banks.add(((xr0*128 + ((p8 ^ (xr0 & 7)) << 4) + c*4) // 4) % 32)
        assert len(banks) == 32
print("writes conflict-free")

# k-permuted x (GemmRun::x_kperm): x_perm holds element k of a row at kperm_pos(k) (moe_gemm.h);
# thread (warp, lane) copies bytes [16*p8, +16) of each of its rows' 128-byte chunk into unit p8 of
# the row (swizzled). The token tile must hold exactly what the 4-byte writer above puts there.
def kperm_pos(k):
    rp = (k & 63) >> 1
    return (k & ~63) + 2*(4*(rp & 7) + (rp >> 3)) + (k & 1)
inv = {kperm_pos(k): k for k in range(64)}
assert sorted(inv) == list(range(64))
store2 = {}
for lane, row, p8, xsoff in token_copies():
    for b in range(0, 16, 2):          # the 8 elements of the 16-byte copy
        gpos = 8*p8 + b // 2           # element position in the permuted chunk
        assert xsoff + b not in store2
        store2[xsoff + b] = (row, inv[gpos])
print("k-permuted writer mismatches", sum(store2[a] != store[a] for a in store))
assert store2 == store
