"""CPU check of the Gluon pre-pass (Triton interpreter): attention computed from its tiles, walked
exactly as the producer/consumer walk them (one-cube tiles, packed 32/16/8 boxes at their row
offsets, fill masks), must equal attention over each row's cubes; bad values must set the flag and
mark the row.  Run: python3 bench/gluon_prepass_check.py  (about 20 s)."""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from tilegen.backends.gluon.prepass import prepass_buffers, run_prepass

def emulate(q, k, v, idx, vbs, counts, bufs, pack, scale):
    """attention computed from the pre-pass's tiles exactly as the producer/consumer walk them"""
    B, S, H, D = q.shape; NQ = S // 64; TOPK = idx.shape[3]
    o = torch.zeros(B, S, H, D); sidx, tinfo, meta = bufs["sidx"], bufs["tinfo"], bufs["meta"]
    for b in range(B):
        for h in range(H):
            for qc in range(NQ):
                row = (b * H + h) * NQ + qc
                n_tiles, n_big = int(meta[row, 0]), int(meta[row, 1])
                qq = q[b, qc*64:(qc+1)*64, h].float()
                if n_tiles < 0:
                    o[b, qc*64:(qc+1)*64, h] = float("nan"); continue
                if n_tiles == 0: continue
                Ks, Vs, masks = [], [], []
                for t in range(n_tiles):
                    kt = torch.full((64, D), float("nan")); vt = torch.zeros(64, D)
                    if t < n_big:
                        c = int(sidx[row, t]); kt[:] = k[b, c*64:(c+1)*64, h]; vt[:] = v[b, c*64:(c+1)*64, h]
                        fill = int(tinfo[row, t]) >> 16
                        assert fill == int(vbs[c])
                    else:
                        info = int(tinfo[row, t]); first = info & 0xFFFF; fill = info >> 16
                        last = int(tinfo[row, t+1]) & 0xFFFF
                        off = 0
                        for i in range(first, last):
                            c = int(sidx[row, i]); sz = int(vbs[c]); assert sz in (32, 16, 8)
                            assert off % sz == 0 and off + sz <= 64
                            kt[off:off+sz] = k[b, c*64:c*64+sz, h]; vt[off:off+sz] = v[b, c*64:c*64+sz, h]
                            off += sz
                        assert off == fill, (off, fill)
                    Ks.append(kt); Vs.append(vt); masks.append(torch.arange(64) < fill)
                K = torch.cat(Ks); V = torch.cat(Vs); M = torch.cat(masks)
                s = (qq @ K.float().T) * scale
                s[:, ~M] = float("-inf")
                p = torch.softmax(s, -1)
                o[b, qc*64:(qc+1)*64, h] = p @ V.float()
    return o

def ref(q, k, v, idx, vbs, counts, scale):
    B, S, H, D = q.shape; NQ = S // 64
    o = torch.zeros(B, S, H, D)
    for b in range(B):
        for h in range(H):
            for qc in range(NQ):
                n = idx.shape[3] if counts is None else int(counts[b, h, qc])
                if n == 0: continue
                cubes = idx[b, h, qc, :n].tolist()
                K = torch.cat([k[b, c*64:c*64+int(vbs[c]), h] for c in cubes]).float()
                V = torch.cat([v[b, c*64:c*64+int(vbs[c]), h] for c in cubes]).float()
                s = q[b, qc*64:(qc+1)*64, h].float() @ K.T * scale
                o[b, qc*64:(qc+1)*64, h] = torch.softmax(s, -1) @ V
    return o

torch.manual_seed(0)
B, H, NQ, D, TOPK = 1, 2, 12, 16, 7
S = NQ * 64
q, k, v = (torch.randn(B, S, H, D) for _ in range(3))
for pack in (True, False):
    for vbs_choices in ([64, 32, 16, 8], [64, 33, 20, 8, 1, 16, 32, 63]):
        vbs = torch.tensor([vbs_choices[i % len(vbs_choices)] for i in torch.randperm(NQ).tolist()], dtype=torch.int32)
        idx = torch.stack([torch.stack([torch.stack([torch.randperm(NQ)[:TOPK] for _ in range(NQ)]) for _ in range(H)]) for _ in range(B)]).int()
        counts = torch.randint(0, TOPK + 1, (B, H, NQ), dtype=torch.int32)
        for cnt in (None, counts):
            bufs = prepass_buffers("cpu", B * H * NQ, TOPK)
            run_prepass(idx, vbs, cnt, bufs, B * H * NQ, NQ, TOPK, pack=pack)
            assert int(bufs["err"][0]) == 0
            o1 = emulate(q, k, v, idx, vbs, cnt, bufs, pack, D ** -0.5)
            o2 = ref(q, k, v, idx, vbs, cnt, D ** -0.5)
            err = (o1 - o2).abs().max().item()
            ntile = bufs["meta"][:, 0].float().mean().item()
            print(f"pack={pack} vbs={vbs_choices} counts={cnt is not None} max err {err:.2e} mean tiles {ntile:.2f}")
            assert err < 1e-4
# bad values
vbs = torch.full((NQ,), 64, dtype=torch.int32)
idx = torch.stack([torch.stack([torch.stack([torch.randperm(NQ)[:TOPK] for _ in range(NQ)]) for _ in range(H)]) for _ in range(B)]).int()
idx[0, 1, 3, 2] = NQ + 5
vbs2 = vbs.clone(); vbs2[idx[0, 0, 5, 0]] = 0
counts = torch.full((B, H, NQ), TOPK, dtype=torch.int32); counts[0, 0, 7] = TOPK + 1
for name, a, vb, cn, want in (("idx", idx, vbs, None, 1), ("vbs", idx, vbs2, None, 2), ("counts", idx, vbs, counts, 4)):
    bufs = prepass_buffers("cpu", B * H * NQ, TOPK)
    run_prepass(a, vb, cn, bufs, B * H * NQ, NQ, TOPK, pack=True)
    bad = (bufs["meta"][:, 0] < 0).nonzero().flatten().tolist()
    print(name, "err", int(bufs["err"][0]), "bad rows", bad)
    assert int(bufs["err"][0]) & want
print("OK")
