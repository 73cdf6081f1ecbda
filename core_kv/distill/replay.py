"""Chunked-prefill replay with real evictions, one layer at a time (CORE.md stages 2–4).

A document is run once through the frozen base model; a forward pre-hook on every attention module captures the
layer's pre-/post-RoPE queries and keys and its values (:func:`capture`, with
:func:`core_kv.models.attention.layer_qkv`, the same capture as the teacher's). :func:`replay_layer` then replays the
chunked prefill of that layer: events sit where the teacher puts them (:func:`core_kv.teacher.config.event_times`);
at event ``t_e`` the candidates of KV head h are its retained set from the previous event plus the tokens that
arrived since, the 14 features come from :func:`core_kv.features.compute_features` (with the persistence EMA
carried across events), the indexer scores them, and the retained set is the protected tokens plus the top free
picks under the budget ``B = floor(t_e (1 − ratio))`` (:func:`core_kv.budget.budget_split`).

``policy`` decides who picks the retained set: ``student`` (the indexer's Top-B: the DAgger-style on-policy
replay of CORE.md stage 2), ``teacher`` (Top-B of p*: teacher forcing) or ``full`` (nothing is evicted; the
candidates are the whole prefix, exactly the teacher dataset's protocol, used for Table 7).

Teacher targets at an event are computed online on the candidates actually present, with the teacher's own
functions: future utility π_U (:func:`core_kv.teacher.utility.future_utility`, the same future queries and
weights as the teacher run) and ``p* = solve_allocation(π_U, Φ, λ)``.

[choice] By default hidden states come from the full-cache forward (teacher-forced across layers): layer l's
evictions do not change layer l+1's inputs during training. The press (issue 8) runs the real cascade; the eval
measures the gap. :func:`cascade_capture` is the alternative (``indexer.cascade``, a deviation from CORE.md): one
forward in which every layer's attention reads only the student's retained sets at each event, so layer l+1's
queries, keys and values, and with them the teacher's future utility, are those of the compressed cascade.

Shapes: H query heads, Hkv KV heads, G = H/Hkv, T document tokens, D head dim, N candidates, F = 14 features,
d_z projected key dim, M prototypes, w observation window.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from core_kv.budget import budget_split, protected_mask, top_free
from core_kv.features import OBS_WINDOW, compute_features, observation_attention
from core_kv.geometry import Geometry
from core_kv.models.attention import LayerQKV, attention_inputs, attention_modules, layer_qkv, window_layers
from core_kv.teacher.config import layer_lam
from core_kv.teacher.solver import solve_allocation
from core_kv.teacher.utility import future_utility, normalise

POLICIES = ("student", "teacher", "full")
SELECTIONS = ("per_head", "shared")
"""Who shares a retained set: ``per_head`` (each KV head its own Top-B) or ``shared`` (one set per layer, the Top-B of
the per-head distributions averaged over the KV heads: what ``head_shared`` serves at inference)."""


class Timer:
    """Wall-clock seconds per named part (CUDA-synchronised), for the step-time breakdown."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[name] += time.perf_counter() - t0


@torch.no_grad()
def capture(model: nn.Module, ids: torch.Tensor, autocast=None, inputs: dict | None = None) -> list[LayerQKV]:
    """One forward of the base model body over ``ids`` (1, T); returns every layer's activations. With ``inputs``
    (a dict), also fills ``inputs[layer] = (module, hidden_states, position_embeddings)`` (what a press's ``score``
    needs)."""
    acts: dict[int, LayerQKV] = {}

    def keep(layer, module, hidden_states, kwargs):
        acts[layer] = layer_qkv(module, hidden_states, kwargs["position_embeddings"])
        if inputs is not None:
            inputs[layer] = (module, hidden_states, kwargs["position_embeddings"])

    with attention_inputs(model, keep), autocast if autocast is not None else nullcontext():
        getattr(model, "model", model)(input_ids=ids, use_cache=False)
    for i, w in window_layers(model).items():  # presses never compress them: replay_layer gives them no event
        acts[i].window = w
    return [acts[i] for i in range(len(attention_modules(model)))]


def retained_attention_mask(events: list[Event], hkv: int, t_len: int, device=None) -> torch.Tensor:
    """Which keys each query sees when the cache is replaced by the retained sets of ``events``: (Hkv, T, T) bool.

    Query τ before the first event sees ``0..τ``; query τ in ``[t_e, end)`` of event e sees that event's retained
    set plus ``t_e..τ`` (the chunk arriving after it), exactly what the chunked-prefill press's cache holds."""
    pos = torch.arange(t_len, device=device)
    allowed = (pos[None, :] <= pos[:, None]).expand(hkv, -1, -1).clone()  # causal (Hkv, T, T)
    for ev in events:
        rows = slice(ev.t_e, ev.end)
        allowed[:, rows, : ev.t_e] = False
        kept = ev.cand[ev.kept].view(hkv, -1)  # (Hkv, B)
        allowed[:, rows].scatter_(2, kept[:, None].expand(-1, ev.end - ev.t_e, -1), True)
    return allowed


@torch.no_grad()
def cascade_capture(
    model: nn.Module, ids: torch.Tensor, replay: Callable[[int, LayerQKV], list[Event]], autocast=None
) -> list[LayerQKV]:
    """One forward of ``ids`` (1, T) through the compressed cascade; returns every layer's activations.

    In each attention module the activations of its (cascade) input are replayed by ``replay(layer, acts)`` (the
    student's own events), and the module's output is replaced by the attention of every query over the keys the
    retained sets leave it (:func:`retained_attention_mask`), then ``o_proj``. So layer l+1 sees the hidden states
    a chunked prefill with these evictions in layers ≤ l produces (without the latent memory: retained-only
    readout). The module's own attention is computed and discarded (the hook replaces its output)."""
    acts: dict[int, LayerQKV] = {}
    modules = attention_modules(model)
    windows = window_layers(model)

    def hook(layer: int):
        def post(module, args, kwargs, output):
            hs = kwargs.get("hidden_states", args[0] if args else None)
            a = layer_qkv(module, hs, kwargs["position_embeddings"])
            acts[layer] = a
            if layer in windows:  # a window layer is not compressed: the model's own (windowed) output stands
                a.window = windows[layer]
                return output
            hkv, t_len, _ = a.k_pre.shape
            allowed = retained_attention_mask(replay(layer, a), hkv, t_len, a.k_pre.device)
            g = a.groups
            o = torch.nn.functional.scaled_dot_product_attention(
                a.q_post[None], a.k_post.repeat_interleave(g, 0)[None], a.v.repeat_interleave(g, 0)[None],
                attn_mask=allowed.repeat_interleave(g, 0)[None], scale=a.scaling,
            )[0]  # (H, T, D)  # fmt: skip
            o = module.o_proj(o.transpose(0, 1).reshape(1, t_len, -1).to(hs.dtype))
            return (o, *output[1:]) if isinstance(output, tuple) else o

        return post

    handles = [m.register_forward_hook(hook(i), with_kwargs=True) for i, m in enumerate(modules)]
    try:
        with autocast if autocast is not None else nullcontext():
            getattr(model, "model", model)(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [acts[i] for i in range(len(modules))]


def future_queries(t_e: int, chunk: int, qa_start: int | None, t_len: int, qa_weight: float, device=None):
    """The teacher run's future queries at an event: next chunk and QA tail, weighted (positions, weights)."""
    nxt = torch.arange(t_e, min(t_e + chunk, qa_start or t_len), device=device)
    qa = torch.arange(qa_start, t_len, device=device) if qa_start is not None else nxt[:0]
    w_qa = qa_weight if len(nxt) else 1.0
    w_qa = w_qa if len(qa) else 0.0
    weights = torch.cat([torch.full((len(nxt),), (1 - w_qa) / max(len(nxt), 1)),
                         torch.full((len(qa),), w_qa / max(len(qa), 1))])  # fmt: skip
    return torch.cat([nxt, qa]), weights


@dataclass
class ReplaySpec:
    """How a layer is replayed (copied from the teacher manifest where the teacher defines it)."""

    chunk_size: int = 512
    ratio: float = 0.75
    protected_sinks: int = 4
    protected_recent: int = 32
    qa_weight: float = 0.5
    lam: float = 1.0
    lam_layers: dict = field(default_factory=dict)  # per-layer λ overrides (TeacherConfig.lam_layers)
    steps: int = 8
    eta: float | str = "auto"
    policy: str = "student"
    selection: str = "per_head"  # SELECTIONS: per-head retained sets or one set per layer shared by the KV heads
    targets: bool = True  # compute π_U and p* (training, metrics); the memory stage needs π_U only for α
    utility: bool = True
    utility_pool: str = "mean"  # TeacherConfig.utility_pool
    features: int = 1  # the feature spec (core_kv.features.FEATURE_SPECS) of the indexer being trained/replayed

    @classmethod
    def from_teacher(cls, t: dict, **options) -> ReplaySpec:
        """The spec of a teacher run's parameters ``t`` (its manifest's / artifact's ``teacher`` dict); ``options``
        set the rest (ratio, policy, ...)."""
        return cls(
            chunk_size=t["chunk_size"], protected_sinks=t["protected_sinks"], protected_recent=t["protected_recent"],
            qa_weight=t["qa_weight"], lam=t["lam"], lam_layers=t.get("lam_layers", {}), steps=t["steps"],
            eta=t["eta"] if t["eta"] == "auto" else float(t["eta"]), utility_pool=t.get("utility_pool", "mean"),
            **options,
        )  # fmt: skip


@dataclass
class Event:
    """One (event, layer): candidates, features, student scores, teacher targets and the retention decision."""

    t_e: int
    end: int  # the next event time (or the document end): queries [t_e, end) see this event's retained set
    cand: torch.Tensor  # (Hkv, N) positions, sorted
    features: torch.Tensor  # (Hkv, N, F) raw
    scores: torch.Tensor | None  # (Hkv, N) student logits (with grad when training)
    pi_u: torch.Tensor | None  # (Hkv, N)
    p_star: torch.Tensor | None  # (Hkv, N)
    kept: torch.Tensor  # (Hkv, N) retained mask
    protected: torch.Tensor  # (N,) protected mask
    budget: int  # B (tokens kept per head); N if nothing is evicted
    b_free: int  # free picks inside B
    pi_mass: torch.Tensor | None = None  # (Hkv, N) mean-pooled π_U when π_U is max-pooled (the attention-mass view)

    @property
    def mass(self) -> torch.Tensor | None:
        """The future queries' mean attention share per candidate: what α (evicted mass) is measured with."""
        return self.pi_u if self.pi_mass is None else self.pi_mass

    @property
    def evicts(self) -> bool:
        return bool((~self.kept).any())

    def evicted_positions(self) -> torch.Tensor:
        """Positions evicted at this event, (Hkv, E) (every head evicts the same count)."""
        return self.cand[~self.kept].view(self.cand.shape[0], -1)


def replay_layer(
    acts: LayerQKV,
    layer: int,
    times: list[int],
    qa_start: int | None,
    geometry: Geometry,
    spec: ReplaySpec,
    score_fn: Callable[[int, torch.Tensor], torch.Tensor] | None,
    timer: Timer | None = None,
    distribution_fn: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> list[Event]:
    """Replay the events of one layer; returns one :class:`Event` per event time.

    Args:
        acts: Captured activations of this layer.
        layer: Layer index (geometry, indexer).
        times: Event times (cached tokens at each event), ascending.
        qa_start: First question/answer token, or ``None`` for plain text.
        geometry: Stage-0 geometry (projection, prototypes, Nyström factors).
        spec: Budget, protection, teacher parameters and the retention policy.
        score_fn: ``score_fn(layer, raw_features (Hkv, N, F)) -> logits (Hkv, N)``; required for ``student``.
        timer: Optional :class:`Timer` (parts ``features``, ``teacher``, ``indexer``).
        distribution_fn: With ``spec.selection == "shared"``: ``distribution_fn(layer, logits) -> (Hkv, N)`` per-head
            distributions whose mean over the KV heads ranks the shared set (default ``softmax(logits)``, the
            uncalibrated student; the memory stage passes the calibrated :meth:`CoreIndexer.distribution`). The
            teacher policy averages ``p*``.
    """
    if spec.policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {spec.policy!r}")
    if spec.selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {spec.selection!r}")
    if acts.window is not None:  # a sliding-window layer keeps its window at inference: nothing to replay or learn
        return []
    timer = timer or Timer("cpu")
    dev = acts.k_pre.device
    hkv, t_len, d = acts.k_pre.shape
    g = acts.groups
    with timer("features"):
        z = geometry.project(layer, acts.k_pre)  # (Hkv, T, d_z)
        phi = geometry.nystrom(layer, z)  # (Hkv, T, M)
        protos = geometry.prototypes[layer].to(z)
    persistence = torch.full((hkv, t_len), float("nan"), device=dev)
    retained = torch.empty(hkv, 0, dtype=torch.long, device=dev)
    prev = 0
    events = []
    heads = torch.arange(hkv, device=dev)[:, None]
    for e, t_e in enumerate(times):
        new = torch.arange(prev, t_e, device=dev)
        cand = torch.cat([retained, new[None].expand(hkv, -1)], 1)  # (Hkv, N), sorted
        n = cand.shape[1]
        wpos = torch.arange(max(0, t_e - OBS_WINDOW), t_e, device=dev)
        with timer("features"):
            feats = []
            for h in range(hkv):
                c = cand[h]
                qs = slice(h * g, (h + 1) * g)
                obs = observation_attention(
                    acts.q_post[qs, wpos][None], acts.k_post[h, c][None], wpos, c, acts.scaling
                )  # (1, G·w, N)
                f, ema = compute_features(
                    obs, acts.q_pre[qs, wpos].reshape(1, -1, d), acts.k_pre[h, c][None], acts.v[h, c][None], c,
                    t_e - 1, z[h, c][None], phi[h, c][None], protos[h][None], persistence[h, c][None],
                    keys_post=acts.k_post[h, c][None], version=spec.features,
                )  # fmt: skip
                persistence[h, c] = ema[0]
                feats.append(f[0])
            feats = torch.stack(feats)  # (Hkv, N, F)
        scores = None
        if score_fn is not None:
            with timer("indexer"):
                scores = score_fn(layer, feats)
        pi_u = p_star = pi_mass = None
        if spec.targets or spec.utility:
            with timer("teacher"):
                fpos, fw = future_queries(t_e, spec.chunk_size, qa_start, t_len, spec.qa_weight, dev)
                if len(fpos):
                    qf = acts.q_post[:, fpos].view(hkv, g, len(fpos), d)
                    # one pass over the attention gives the teacher's pool and, when that is not the mean, the
                    # mean-pooled mass that α is measured with
                    pools = tuple(dict.fromkeys((spec.utility_pool, "mean")))
                    u = future_utility(
                        qf, acts.k_post[:, : int(fpos.max()) + 1], fpos, t_e, acts.scaling, fw, pools=pools
                    )
                    pi_u = normalise(u[spec.utility_pool].gather(1, cand).double())  # (Hkv, N)
                    if spec.utility_pool != "mean":
                        pi_mass = normalise(u["mean"].gather(1, cand).double())
                    if spec.targets:
                        p_star, _ = solve_allocation(
                            pi_u, phi[heads, cand].double(), layer_lam(spec.lam, spec.lam_layers, layer), spec.steps,
                            spec.eta,
                        )  # fmt: skip
        b, s, w = budget_split(t_e, spec.ratio, spec.protected_sinks, spec.protected_recent)
        prot = protected_mask(n, min(s, n), min(w, max(n - s, 0)), device=dev)
        if spec.policy == "full" or n <= b:
            kept = torch.ones(hkv, n, dtype=torch.bool, device=dev)
            b = n
        else:
            if spec.policy == "teacher" and p_star is None:
                raise ValueError("teacher policy needs teacher targets (future queries)")
            sel = p_star if spec.policy == "teacher" else scores
            if sel is None:
                raise ValueError("student policy needs a score_fn")
            sel = sel.detach().float()
            if spec.selection == "shared":  # one set for every head: the Top-B of the mean per-head distribution
                if spec.policy == "student":
                    sel = distribution_fn(layer, sel) if distribution_fn is not None else sel.softmax(-1)
                sel = sel.mean(0, keepdim=True).expand(hkv, -1)
            kept = top_free(sel, prot, b - int(prot.sum()))
        end = times[e + 1] if e + 1 < len(times) else t_len
        events.append(Event(t_e, end, cand, feats, scores, pi_u, p_star, kept, prot, b, b - int(prot.sum()), pi_mass))
        retained = cand[kept].view(hkv, -1) if spec.policy != "full" else cand
        prev = t_e
    return events


def segment_attention(acts: LayerQKV, ev: Event) -> dict[str, torch.Tensor]:
    """Full-cache and retained-cache attention of the queries ``[t_e, end)`` after event ``ev``.

    The retained cache of KV head h is its kept candidates plus the new tokens up to each query (causal).

    Returns:
        ``o_full``, ``o_ret`` (H, Tq, D); ``lse_ret`` (H, Tq); ``alpha`` (H, Tq) the true evicted attention mass
        ``α_E(q) = 1 − S_R / S_all``; ``q_pre`` (H, Tq, D).
    """
    hkv, _, d = acts.k_pre.shape
    h = acts.q_pre.shape[0]
    g = h // hkv
    dev = acts.k_pre.device
    qpos = torch.arange(ev.t_e, ev.end, device=dev)
    kpos = torch.arange(ev.end, device=dev)
    q = acts.q_post[:, qpos].view(hkv, g, len(qpos), d)
    logits = (q @ acts.k_post[:, None, : ev.end].mT) * acts.scaling  # (Hkv, G, Tq, K)
    causal = kpos[None, :] <= qpos[:, None]  # (Tq, K)
    keep = torch.zeros(hkv, ev.end, dtype=torch.bool, device=dev)
    keep[torch.arange(hkv, device=dev)[:, None], ev.cand[ev.kept].view(hkv, -1)] = True
    keep[:, ev.t_e :] = True
    full = logits.masked_fill(~causal, float("-inf"))
    ret = full.masked_fill(~keep[:, None, None, :], float("-inf"))
    lse_full, lse_ret = full.logsumexp(-1), ret.logsumexp(-1)  # (Hkv, G, Tq)
    v = acts.v[:, None, : ev.end]  # (Hkv, 1, K, D)
    o_full = (full - lse_full[..., None]).exp() @ v
    o_ret = (ret - lse_ret[..., None]).exp() @ v
    alpha = (1 - (lse_ret - lse_full).exp()).clamp(0, 1)
    return {
        "o_full": o_full.reshape(h, len(qpos), d),
        "o_ret": o_ret.reshape(h, len(qpos), d),
        "lse_ret": lse_ret.reshape(h, len(qpos)),
        "alpha": alpha.reshape(h, len(qpos)),
        "q_pre": acts.q_pre[:, qpos],
    }
