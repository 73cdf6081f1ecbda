"""Losses, calibration and the replay against naive references (torchtune-style; CORE.md stages 2–4)."""

from __future__ import annotations

import math

import pytest
import torch

from core_kv.budget import protected_mask
from core_kv.distill.losses import (
    calibration_error,
    excluded_mass,
    fit_temperature,
    kl_to_teacher,
    memory_loss,
    shared_view,
    topb_boundary_bce,
    topb_overlap,
)
from core_kv.distill.replay import ReplaySpec, capture, replay_layer, segment_attention
from core_kv.models.fingerprint import model_fingerprint
from core_kv.teacher.geometry import fit_geometry


def test_kl_matches_naive():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(3, 9, generator=g)
    p[0, 2] = 0.0  # 0 log 0 = 0
    p = p / p.sum(-1, keepdim=True)
    s = torch.randn(3, 9, generator=g)
    ref = []
    for r in range(3):
        q = [math.exp(x) / sum(math.exp(y) for y in s[r].tolist()) for x in s[r].tolist()]
        ref.append(sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p[r].tolist(), q, strict=True) if pi > 0))
    torch.testing.assert_close(kl_to_teacher(p, s), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert kl_to_teacher(p, p.log()).abs().max() < 1e-6


def test_topb_boundary_bce_matches_naive():
    g = torch.Generator().manual_seed(1)
    p, s = torch.rand(2, 12, generator=g), torch.randn(2, 12, generator=g)
    prot = protected_mask(12, 2, 3)
    b_free = 3
    out = topb_boundary_bce(p, s, prot, b_free)
    for r in range(2):
        free = [i for i in range(12) if not prot[i]]
        top_p = sorted(free, key=lambda i: -float(p[r, i]))[:b_free]
        fs = sorted((float(s[r, i]) for i in free), reverse=True)
        tau = (fs[b_free - 1] + fs[b_free]) / 2
        terms = []
        for i in free:
            x, y = float(s[r, i]) - tau, 1.0 if i in top_p else 0.0
            sig = 1 / (1 + math.exp(-x))
            terms.append(-(y * math.log(sig) + (1 - y) * math.log(1 - sig)))
        assert abs(float(out[r]) - sum(terms) / len(free)) < 1e-5


def test_overlap_and_masses():
    s = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    p = torch.tensor([[0.0, 0.1, 0.4, 0.3, 0.2, 0.0]])
    prot = torch.tensor([True, False, False, False, False, True])
    assert float(topb_overlap(s, p, prot, 2)) == 0.5  # student {1, 2}, teacher {2, 3}
    ev = torch.tensor([[False, False, True, True, False, False]])
    ref = sum(math.exp(x / 2) for x in (3.0, 2.0)) / sum(math.exp(x / 2) for x in s[0].tolist())
    assert abs(float(excluded_mass(s, ev, 2.0)) - ref) < 1e-6
    assert calibration_error(torch.tensor([0.1, 0.5]), torch.tensor([0.2, 0.2])) == pytest.approx(0.2)


def test_fit_temperature_recovers_the_true_one():
    g = torch.Generator().manual_seed(2)
    scores, evicted, alpha = [], [], []
    for _ in range(30):
        s = torch.randn(2, 20, generator=g) * 2
        ev = s < s.median(-1, keepdim=True).values
        scores.append(s)
        evicted.append(ev)
        alpha.append(excluded_mass(s, ev, 2.5))
    t, stats = fit_temperature(scores, evicted, alpha)
    assert abs(t - 2.5) < 1e-3
    assert stats["after"] < 1e-4 < stats["before"] and stats["n"] == 60


def test_memory_loss_matches_naive():
    g = torch.Generator().manual_seed(3)
    o_hat, o = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    gate, alpha = torch.rand(2, 3, generator=g), torch.rand(2, 3, generator=g)
    loss, rel = memory_loss(o_hat, o, gate, alpha, gate_weight=0.3)
    rels, bces = [], []
    for h in range(2):
        for t in range(3):
            rels.append(float(((o_hat[h, t] - o[h, t]) ** 2).sum() / ((o[h, t] ** 2).sum() + 1e-6)))
            a, x = float(alpha[h, t]), float(gate[h, t])
            bces.append(-(a * math.log(x) + (1 - a) * math.log(1 - x)))
    assert abs(float(rel) - sum(rels) / 6) < 1e-5
    assert abs(float(loss) - (sum(rels) / 6 + 0.3 * sum(bces) / 6)) < 1e-5


def test_shared_view_matches_naive():
    """Head-shared training (issue 56): the pooled teacher target and the student's pooled distribution, and the KL
    and boundary BCE on them, against per-element Python."""
    g = torch.Generator().manual_seed(5)
    hkv, n = 3, 10
    p = torch.rand(hkv, n, generator=g)
    p = p / p.sum(-1, keepdim=True)
    s = torch.randn(hkv, n, generator=g) * 2
    p_bar, log_q = shared_view(p, s)
    assert p_bar.shape == log_q.shape == (1, n)
    soft = [[math.exp(x) / sum(math.exp(y) for y in s[h].tolist()) for x in s[h].tolist()] for h in range(hkv)]
    q_ref = [sum(soft[h][i] for h in range(hkv)) / hkv for i in range(n)]
    p_ref = [sum(float(p[h, i]) for h in range(hkv)) / hkv for i in range(n)]
    torch.testing.assert_close(log_q[0], torch.tensor(q_ref).log(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p_bar[0], torch.tensor(p_ref), rtol=1e-6, atol=1e-7)
    kl_ref = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p_ref, q_ref, strict=True))
    assert abs(float(kl_to_teacher(p_bar, log_q)[0]) - kl_ref) < 1e-5
    # the boundary BCE ranks the served score: the Top-B of the pooled target against the pooled distribution
    prot = protected_mask(n, 1, 2)
    b_free = 3
    free = [i for i in range(n) if not prot[i]]
    top = sorted(free, key=lambda i: -p_ref[i])[:b_free]
    lq = sorted((math.log(q_ref[i]) for i in free), reverse=True)
    tau = (lq[b_free - 1] + lq[b_free]) / 2
    bce = []
    for i in free:
        x, y = math.log(q_ref[i]) - tau, 1.0 if i in top else 0.0
        sig = 1 / (1 + math.exp(-x))
        bce.append(-(y * math.log(sig) + (1 - y) * math.log(1 - sig)))
    assert abs(float(topb_boundary_bce(p_bar, log_q, prot, b_free)[0]) - sum(bce) / len(free)) < 1e-5
    # one head: the shared view is the per-head one
    p1, lq1 = shared_view(p[:1], s[:1])
    torch.testing.assert_close(lq1, s[:1].log_softmax(-1))
    torch.testing.assert_close(kl_to_teacher(p1, lq1), kl_to_teacher(p[:1], s[:1]))


@pytest.fixture(scope="module")
def replayed(llama):
    ids = torch.randint(3, 200, (1, 300), generator=torch.Generator().manual_seed(4))
    acts = capture(llama, ids)
    geo = fit_geometry([a.k_pre for a in acts], model_fingerprint(llama), d_z=16, num_prototypes=64)
    return acts, geo


def test_capture_matches_model_attention(llama, replayed):
    """Full-cache attention recomputed from the captured activations equals the model's own pre-W_O output."""
    acts, _ = replayed
    a = acts[0]
    captured = {}
    h = llama.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
        lambda m, args: captured.setdefault("x", args[0])
    )
    ids = torch.randint(3, 200, (1, 300), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        llama.model(input_ids=ids)
    h.remove()
    from core_kv.distill.replay import Event

    ev = Event(0, 300, torch.zeros(2, 0, dtype=torch.long), None, None, None, None,
               torch.zeros(2, 0, dtype=torch.bool), torch.zeros(0, dtype=torch.bool), 0, 0)  # fmt: skip
    seg = segment_attention(a, ev)
    ref = captured["x"][0].view(300, 4, 16).transpose(0, 1)
    torch.testing.assert_close(seg["o_full"], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("policy", ["student", "teacher"])
def test_replay_budget_protection_and_error_identity(replayed, policy):
    acts, geo = replayed
    spec = ReplaySpec(chunk_size=64, ratio=0.75, protected_sinks=4, protected_recent=16, policy=policy)
    score = lambda layer, f: f[..., 0] + 0.1 * f[..., 5]  # noqa: E731  (any deterministic scorer)
    times = list(range(64, 300, 64))
    events = replay_layer(acts[1], 1, times, None, geo, spec, score)
    assert [e.t_e for e in events] == times
    for e, nxt in zip(events, events[1:], strict=False):
        kept = e.cand[e.kept].view(2, -1)
        assert kept.shape[1] == e.budget <= max(math.floor(e.t_e * 0.25), e.cand.shape[1])
        assert (kept[:, :4] == torch.arange(4)).all()  # sinks always kept
        assert e.kept[:, e.protected].all()
        assert torch.equal(nxt.cand[:, : kept.shape[1]], kept)  # next candidates = retained + new tokens
        assert torch.allclose(e.p_star.sum(-1), torch.ones(2, dtype=torch.float64))
    ev = events[2]
    seg = segment_attention(acts[1], ev)
    a = acts[1]
    kept = torch.zeros(2, ev.end, dtype=torch.bool)
    kept[torch.arange(2)[:, None], ev.cand[ev.kept].view(2, -1)] = True
    kept[:, ev.t_e :] = True
    for hq in (0, 3):
        for j in (0, 7):  # query position t_e + j; it sees keys <= t_e + j
            tau = ev.t_e + j
            logit = (a.q_post[hq, tau] @ a.k_post[hq // 2, : tau + 1].T) * a.scaling
            v = a.v[hq // 2, : tau + 1]
            r, e = kept[hq // 2, : tau + 1], ~kept[hq // 2, : tau + 1]
            o_r = logit.masked_fill(~r, -math.inf).softmax(-1) @ v
            o_e = logit.masked_fill(~e, -math.inf).softmax(-1) @ v
            o_full = logit.softmax(-1) @ v
            alpha = logit.softmax(-1)[e].sum()
            torch.testing.assert_close(seg["o_ret"][hq, j], o_r, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(seg["o_full"][hq, j], o_full, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(seg["alpha"][hq, j], alpha, rtol=1e-4, atol=1e-5)
            # the paper's exact identity: o* - o_R = α_E (o_E - o_R)
            torch.testing.assert_close(o_full - o_r, alpha * (o_e - o_r), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("policy", ["student", "teacher"])
def test_shared_replay_keeps_one_set_per_layer(replayed, policy):
    """``selection="shared"``: every KV head keeps the same positions, the protected ones plus the free Top-B of the
    per-head distributions averaged over the heads (softmax of the student's logits, or p*), at the exact budget."""
    acts, geo = replayed
    spec = ReplaySpec(chunk_size=64, ratio=0.75, protected_sinks=4, protected_recent=16, policy=policy,
                      selection="shared")  # fmt: skip
    score = lambda layer, f: f[..., 0] + 0.1 * f[..., 5]  # noqa: E731
    events = replay_layer(acts[1], 1, list(range(64, 300, 64)), None, geo, spec, score)
    evicting = [e for e in events if e.evicts]
    assert evicting
    for e in evicting:
        kept = e.cand[e.kept].view(2, -1)
        assert torch.equal(kept[0], kept[1]) and kept.shape[1] == e.budget
        assert e.kept[:, e.protected].all()
        per_head = e.p_star if policy == "teacher" else e.scores.softmax(-1)
        pooled = per_head.float().mean(0)
        free = [i for i in range(e.cand.shape[1]) if not e.protected[i]]
        top = sorted(free, key=lambda i: -float(pooled[i]))[: e.b_free]
        assert set(torch.nonzero(e.kept[0] & ~e.protected).flatten().tolist()) == set(top)
    # a calibrated distribution changes the pooled ranking: the replay uses the one it is given
    sharp = replay_layer(acts[1], 1, list(range(64, 300, 64)), None, geo, spec, score,
                         distribution_fn=lambda layer, s: (s / 0.05).softmax(-1))  # fmt: skip
    if policy == "student":
        e = next(x for x in sharp if x.evicts)
        pooled = (e.scores / 0.05).softmax(-1).mean(0)
        free = [i for i in range(e.cand.shape[1]) if not e.protected[i]]
        top = sorted(free, key=lambda i: -float(pooled[i]))[: e.b_free]
        assert set(torch.nonzero(e.kept[0] & ~e.protected).flatten().tolist()) == set(top)
    with pytest.raises(ValueError, match="selection must be one of"):
        replay_layer(acts[1], 1, [64], None, geo, ReplaySpec(selection="both"), score)


def test_retained_attention_mask_matches_naive(replayed):
    """Query τ sees 0..τ before the first event, then its event's retained set plus t_e..τ."""
    from core_kv.distill.replay import retained_attention_mask

    acts, geo = replayed
    spec = ReplaySpec(chunk_size=64, ratio=0.75, protected_sinks=4, protected_recent=16, targets=False)
    score = lambda layer, f: f[..., 0] + 0.1 * f[..., 5]  # noqa: E731
    events = replay_layer(acts[1], 1, list(range(64, 300, 64)), None, geo, spec, score)
    allowed = retained_attention_mask(events, 2, 300)
    for h in range(2):
        for tau in (0, 63, 64, 100, 191, 192, 299):
            ev = next((e for e in reversed(events) if e.t_e <= tau), None)
            if ev is None:
                want = set(range(tau + 1))
            else:
                want = set(ev.cand[h][ev.kept[h]].tolist()) | set(range(ev.t_e, tau + 1))
            assert set(allowed[h, tau].nonzero().flatten().tolist()) == want, (h, tau)


def test_cascade_capture_equals_full_capture_without_evictions(llama):
    """Nothing evicted: the cascade's activations are the full-cache forward's, layer by layer."""
    from core_kv.distill.replay import cascade_capture

    ids = torch.randint(3, 200, (1, 160), generator=torch.Generator().manual_seed(5))
    full = capture(llama, ids)
    casc = cascade_capture(llama, ids, lambda layer, a: [])
    for f, c in zip(full, casc, strict=True):
        torch.testing.assert_close(c.q_post, f.q_post, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c.v, f.v, rtol=1e-4, atol=1e-5)


def test_cascade_capture_layer_inputs_match_naive_forward(llama, replayed):
    """With evictions, layer 1's activations are those of a hand-written forward whose layer-0 attention reads only
    the retained keys (naive per-query softmax), and they differ from the full cache's."""
    from core_kv.distill.replay import cascade_capture
    from core_kv.models.attention import layer_qkv

    _, geo = replayed
    ids = torch.randint(3, 200, (1, 300), generator=torch.Generator().manual_seed(6))
    spec = ReplaySpec(chunk_size=64, ratio=0.75, protected_sinks=4, protected_recent=16, targets=False)
    score = lambda layer, f: f[..., 0] + 0.1 * f[..., 5]  # noqa: E731
    times = list(range(64, 300, 64))
    seen = {}

    def replay(layer, a):
        seen[layer] = replay_layer(a, layer, times, None, geo, spec, score)
        return seen[layer]

    casc = cascade_capture(llama, ids, replay)
    full = capture(llama, ids)
    torch.testing.assert_close(casc[0].q_post, full[0].q_post)  # layer 0's input is the embedding either way
    assert (casc[1].q_post - full[1].q_post).abs().max() > 1e-3  # the evictions change layer 1's inputs
    inner = llama.model
    with torch.no_grad():
        h = inner.embed_tokens(ids)
        pe = inner.rotary_emb(h, torch.arange(300)[None])
        layer0 = inner.layers[0]
        a = layer_qkv(layer0.self_attn, layer0.input_layernorm(h), pe)
        out = torch.zeros(300, 4, 16)
        for tau in range(300):
            ev = next((e for e in reversed(seen[0]) if e.t_e <= tau), None)
            for hq in range(4):
                kv = hq // 2
                keys = list(range(tau + 1)) if ev is None else sorted(
                    set(ev.cand[kv][ev.kept[kv]].tolist()) | set(range(ev.t_e, tau + 1)))  # fmt: skip
                logit = (a.q_post[hq, tau] @ a.k_post[kv, keys].T) * a.scaling
                out[tau, hq] = logit.softmax(-1) @ a.v[kv, keys]
        h = h + layer0.self_attn.o_proj(out.reshape(1, 300, -1))
        h = h + layer0.mlp(layer0.post_attention_layernorm(h))
        layer1 = inner.layers[1]
        ref = layer_qkv(layer1.self_attn, layer1.input_layernorm(h), pe)
    torch.testing.assert_close(casc[1].q_post, ref.q_post, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(casc[1].k_pre, ref.k_pre, rtol=1e-4, atol=1e-5)


def test_replay_targets_follow_the_utility_pool(replayed):
    """The on-policy π_U follows ``ReplaySpec.utility_pool`` (the teacher's): max-pooled per query group over the
    student's candidates, against future_utility written out; ``from_teacher`` reads it, mean when absent."""
    from core_kv.distill.replay import future_queries
    from core_kv.teacher.utility import future_utility, normalise

    acts, geo = replayed
    base = dict(chunk_size=64, ratio=0.75, protected_sinks=4, protected_recent=16, qa_weight=0.5)
    score = lambda layer, f: f[..., 0]  # noqa: E731
    times, qa = [64, 128, 192], 240
    mean = replay_layer(acts[1], 1, times, qa, geo, ReplaySpec(**base), score)
    peak = replay_layer(acts[1], 1, times, qa, geo, ReplaySpec(**base, utility_pool="max"), score)
    a = acts[1]
    for em, ex in zip(mean, peak, strict=True):
        assert torch.equal(em.cand, ex.cand) and not torch.allclose(em.pi_u, ex.pi_u)
        torch.testing.assert_close(ex.mass, em.pi_u)  # α is measured with the mean pool either way
        assert em.mass is em.pi_u
        fpos, fw = future_queries(ex.t_e, 64, qa, a.q_post.shape[1], 0.5)
        qf = a.q_post[:, fpos].view(2, 2, len(fpos), -1)
        u = future_utility(qf, a.k_post[:, : int(fpos.max()) + 1], fpos, ex.t_e, a.scaling, fw, pools=("max",))["max"]
        torch.testing.assert_close(ex.pi_u, normalise(u.gather(1, ex.cand).double()))
    t = {"chunk_size": 64, "protected_sinks": 4, "protected_recent": 16, "qa_weight": 0.5, "lam": 1.0, "steps": 8,
         "eta": "auto"}  # fmt: skip
    assert ReplaySpec.from_teacher(t).utility_pool == "mean"
    assert ReplaySpec.from_teacher({**t, "utility_pool": "max"}).utility_pool == "max"


def test_future_utility_one_pass_equals_each_pool_alone():
    """``future_utility`` under two pools (the replay's single pass for the teacher's pool and α's mean) returns,
    pool for pool, exactly what it returns for that pool alone, across query blocks and two query groups."""
    from core_kv.teacher.utility import future_utility

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 10, 8, generator=g), torch.randn(2, 40, 8, generator=g)
    pos = torch.tensor([20, 21, 22, 23, 24, 25, 34, 35, 36, 39])
    w = torch.cat([torch.full((6,), 0.5 / 6), torch.full((4,), 0.5 / 4)])
    both = future_utility(q, k, pos, 20, 0.35, w, block=4, pools=("max", "mean"))
    assert set(both) == {"max", "mean"}
    for pool in ("mean", "max"):
        assert set(alone := future_utility(q, k, pos, 20, 0.35, w, block=4, pools=(pool,))) == {pool}
        assert torch.equal(both[pool], alone[pool])
    with pytest.raises(ValueError, match="utility pool"):
        future_utility(q, k, pos, 20, 0.35, w, pools=("median",))
