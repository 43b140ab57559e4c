"""Shared helpers of the Python tests: the build tree's CLI, synthetic checkpoints written by
`wna16 synth`, a minimal safetensors reader/writer, and a float64 reference of the MoE layer in
pure torch, dequantizing the checkpoint-layout tensors per the published GPTQ/AWQ semantics
(../shared/docs/formats.md) independently of the library's unpacking."""
import json
import os
import struct
import subprocess

import pytest
import torch

import wna16

# <build>/python/wna16/__init__.py -> <build>
BUILD_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(wna16.__file__))))
CLI = os.path.join(BUILD_DIR, "wna16")

_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32,
           "I64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}


def cli(*args):
    r = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, f"wna16 {' '.join(map(str, args))} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = bytearray(data[8 + n + b:8 + n + e])
        t = torch.frombuffer(raw, dtype=_DTYPES[info["dtype"]]) if raw else torch.empty(0, dtype=_DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    return out


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        t = t.contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def read_checkpoint(d):
    tensors = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            tensors.update(read_safetensors(os.path.join(d, f)))
    return tensors


@pytest.fixture(scope="session")
def synth(tmp_path_factory):
    """synth(arch, format, *flags) -> directory of a synthetic checkpoint (cached per arguments)."""
    cache = {}

    def make(arch, fmt, *flags):
        key = (arch, fmt) + flags
        if key not in cache:
            d = tmp_path_factory.mktemp("ckpt") / "model"
            cli("synth", d, "--arch", arch, "--format", fmt, "--layers", 2, "--max-shard-size", 1 << 30, *flags)
            cache[key] = str(d)
        return cache[key]

    return make


# ---- float64 reference from checkpoint-layout tensors -------------------------------------------

_AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]  # column 8c+j is in nibble _AWQ_REVERSE[j]
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]    # nibble i holds column 8c + _AWQ_ORDER[i]


def _unpack_k(words, bits):  # GPTQ qweight [K*bits/32, N] -> [K, N], LSB first along K
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    return ((w[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)).reshape(-1, words.shape[1])


def _unpack_n(words, bits, order=None):  # packed along N: [R, N*bits/32] -> [R, N]
    w = words.to(torch.int64) & 0xFFFFFFFF
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    if order is not None:
        shifts = shifts[torch.tensor(order)]
    return ((w[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)).reshape(words.shape[0], -1)


def dequantize(lin, fmt, bits, group_size):
    """W [K, N] float64 per formats.md."""
    scales = lin["scales"].to(torch.float64)
    if fmt == "awq":
        q = _unpack_n(lin["qweight"], 4, _AWQ_REVERSE)
        z = _unpack_n(lin["qzeros"], 4, _AWQ_REVERSE)
    else:
        q = _unpack_k(lin["qweight"], bits)
        z = _unpack_n(lin["qzeros"], bits) + (1 if fmt == "gptq" else 0)  # v1 stores zero - 1
    K = q.shape[0]
    g = lin.get("g_idx")
    g = g.to(torch.int64) if g is not None else torch.arange(K) // (K if group_size == -1 else group_size)
    return scales[g] * (q - z[g]).to(torch.float64)


def _words(codes, axis):
    """4-bit codes (int64) packed 8 per int32 along axis 0 (GPTQ qweight) or 1 (qzeros)."""
    c = codes if axis == 0 else codes.t()
    c = c.reshape(c.shape[0] // 8, 8, c.shape[1])
    w = sum(c[:, j, :] << (4 * j) for j in range(8))
    w = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)
    return w if axis == 0 else w.t().contiguous()


def quantize_rtn(w, fmt, group):
    """w [N, K] (torch layout) -> 4-bit checkpoint tensors by rounding to nearest: GPTQ v1 sym
    ("gptq") or AWQ asym ("awq"), groups of `group` along K."""
    wt_ = w.t().to(torch.float64)  # [K, N]
    K, N = wt_.shape
    g = wt_.reshape(K // group, group, N)
    if fmt == "gptq":
        s = (g.abs().amax(1) / 7).clamp_min(1e-6)
        z = torch.full_like(s, 8)
    else:
        lo, hi = g.amin(1), g.amax(1)
        s = ((hi - lo) / 15).clamp_min(1e-6)
        z = (-lo / s).round().clamp(0, 15)
    s = s.to(torch.float16).to(torch.float64)  # the checkpoint's scales are fp16
    q = ((g / s[:, None, :]).round() + z[:, None, :]).clamp(0, 15).to(torch.int64).reshape(K, N)
    z = z.to(torch.int64)
    if fmt == "gptq":
        return {"qweight": _words(q, 0), "scales": s.to(torch.float16), "qzeros": _words(z - 1, 1),
                "g_idx": (torch.arange(K) // group).to(torch.int32)}
    perm = [c * 8 + _AWQ_ORDER[i] for c in range(N // 8) for i in range(8)]  # nibble order -> column
    return {"qweight": _words(q[:, perm].t().contiguous(), 0).t().contiguous(), "scales": s.to(torch.float16),
            "qzeros": _words(z[:, perm].t().contiguous(), 0).t().contiguous()}


def mlp64(x, deq):
    g, u, d = (deq[n] for n in ("gate", "up", "down"))
    return (torch.nn.functional.silu(x @ g) * (x @ u)) @ d


def moe_reference(x, topk_ids, topk_weights, experts64, shared64=None, shared_gate=None):
    """x [M, H] float64; experts64: list of {"gate","up","down"} float64 [K, N]."""
    out = torch.zeros_like(x)
    for m in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            out[m] += float(topk_weights[m, j]) * mlp64(x[m:m + 1], experts64[int(topk_ids[m, j])])[0]
    if shared64 is not None:
        s = mlp64(x, shared64)
        if shared_gate is not None:
            s = s * torch.sigmoid(x @ shared_gate.to(torch.float64).reshape(-1, 1))
        out += s
    return out


def rel_error(got, ref):
    return float(torch.linalg.norm(got.to(torch.float64) - ref) / torch.linalg.norm(ref))
