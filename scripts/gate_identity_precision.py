"""Why the fused gated backward forms d log_g's part after a chunk as <dS, S_out> + <dz, z_out>
and not as the sum of phi_q . dphi_q - phi_k . dphi_k over the later tokens (the same number in
exact arithmetic: a gate before token t' scales what t' sees of the past).

    python scripts/gate_identity_precision.py [--T 1024 2048 8192]

On CPU, normalised GLA, widths 128, 2 heads: both forms from a chunked backward in fp32 that rounds
what the kernel rounds to bf16 (the states S, dn, M, dS's copy, the scaled phi_q; inputs bf16),
each against the fp64 gradient of ``ops.gla.gla_parallel``. The second form also takes
phi_q . dphi_q as -eps dd (exact: o is of degree 0 in phi_q but for eps), so its error is the
key side's rounding summed over the whole sequence. Prints the relative RMS error of d log_g.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from linearize.ops.gla import gla_parallel


def errors(T: int, D: int = 128, H: int = 2, eps: float = 1e-6, BT: int = 64, dt=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    q, k = (torch.rand(1, H, T, D, generator=g, dtype=torch.float64).to(dt).double() for _ in range(2))
    v, do = (torch.randn(1, H, T, D, generator=g, dtype=torch.float64).to(dt).double() for _ in range(2))
    lg = F.logsigmoid(torch.randn(1, H, T, generator=g, dtype=torch.float64) * 3 + 2).float().double()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, lg)]
    o, _ = gla_parallel(*leaves, normalize=True)
    (o * do).sum().backward()
    ref = leaves[3].grad[0]
    r = lambda x: x.to(dt).float()  # what the kernel keeps in bf16
    NC = T // BT
    mask = torch.tril(torch.ones(BT, BT, dtype=torch.bool))
    direct, identity = torch.zeros(H, T), torch.zeros(H, T)
    for h in range(H):
        qf, kf, vf, dof, lgf = (x[0, h].float() for x in (q, k, v, do, lg))
        S, z, sc, zc = torch.zeros(D, D), torch.zeros(D), [], []
        den, of = torch.zeros(T), torch.zeros(T, D)
        for c in range(NC):  # the forward: states entering each chunk (bf16, as stored), den, o
            t = slice(c * BT, (c + 1) * BT)
            bb = lgf[t].cumsum(0)
            sc.append(r(S))
            zc.append(z.clone())
            p = torch.where(mask, bb[:, None] - bb[None, :], torch.tensor(-float("inf"))).exp()
            A = (qf[t] @ kf[t].T) * p
            den[t] = bb.exp() * (qf[t] @ z) + A.sum(1)
            of[t] = (bb.exp()[:, None] * (qf[t] @ S) + A @ vf[t]) / (den[t] + eps)[:, None]
            w = (bb[-1] - bb).exp()[:, None] * kf[t]
            S, z = bb[-1].exp() * S + w.T @ vf[t], bb[-1].exp() * z + w.sum(0)
        sc.append(r(S))
        zc.append(z.clone())
        of = r(of)
        dS, dz, sums = torch.zeros(D, D), torch.zeros(D), torch.zeros(NC)
        for c in reversed(range(NC)):  # the backward, from the end
            t = slice(c * BT, (c + 1) * BT)
            bb = lgf[t].cumsum(0)
            p = torch.where(mask, bb[:, None] - bb[None, :], torch.tensor(-float("inf"))).exp()
            rden = 1 / (den[t] + eps)
            dd = -(dof[t] * of[t]).sum(1) * rden
            dn = r(dof[t] * rden[:, None])
            M = r((dn @ vf[t].T + dd[:, None]) * p)
            dk = (bb[-1] - bb).exp()[:, None] * (vf[t] @ r(dS).T + dz) + M.T @ qf[t]
            dq = bb.exp()[:, None] * (dn @ sc[c].T + dd[:, None] * zc[c]) + M @ kf[t]
            db = (qf[t] * dq).sum(1) - (kf[t] * dk).sum(1)
            direct[h, t] = db.flip(0).cumsum(0).flip(0) + (dS * sc[c + 1]).sum() + (dz * zc[c + 1]).sum()
            db = -eps * dd - (kf[t] * dk).sum(1)
            identity[h, t] = db.flip(0).cumsum(0).flip(0)
            sums[c] = db.sum()
            dS = bb[-1].exp() * dS + r(bb.exp()[:, None] * qf[t]).T @ dn
            dz = bb[-1].exp() * dz + (bb.exp()[:, None] * qf[t]).T @ dd
        identity[h] += F.pad(sums.flip(0).cumsum(0).flip(0)[1:], (0, 1)).repeat_interleave(BT)
    rel = lambda a: ((a.double() - ref).norm() / ref.norm()).item()
    return rel(direct), rel(identity)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, nargs="+", default=[1024, 2048, 8192])
    a = p.parse_args()
    for T in a.T:
        d, i = errors(T)
        print(f"T={T}: d log_g relative RMS error: <dS, S_out> {d:.2e}, token sums {i:.2e}", flush=True)


if __name__ == "__main__":
    main()
