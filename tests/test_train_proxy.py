"""The proxy-LM training loop (``core_kv.proxy.train``): resume equivalence, warm start, export.

A config-sized model (1 layer, hidden 32) and a 512-token tokenizer trained on the fly; 4 steps of 2-3 short
sequences each, so the whole file runs in a few seconds on CPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from core_kv.proxy.train import ProxyTrainConfig, export, train


def _cfg(out, **kw) -> ProxyTrainConfig:
    base = dict(
        out_dir=str(out),
        export_dir=str(out / "export"),
        base_vocab=512,
        key_word_tokens=False,
        lm_fraction=1.0,
        total_steps=4,
        warmup_steps=40,  # every step is in the warm-up: the lr does not depend on total_steps
        phases=[{"min_len": 48, "max_len": 96, "tokens_per_step": 256, "mix": {"niah_single_1": 0.5, "mk_noise": 0.5}}],
        probe_every=10_000,
        probe_lengths=[256],
        probe_n=1,
        log_every=1,
        threads=1,
        bf16=False,
        ckpt_every_s=1e9,
    )
    base["model"] = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "intermediate_size": 64}  # fmt: skip
    base.update(kw)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ProxyTrainConfig), base))


def _weights(ckpt) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    return out, train(_cfg(out))


def test_resume_reaches_the_same_weights(straight, tmp_path):
    _, ckpt = straight
    train(_cfg(tmp_path, total_steps=2))  # "interrupted" after 2 steps (checkpoint written on exit)
    resumed = train(_cfg(tmp_path))  # the rerun resumes from step 2
    assert json.loads((resumed / "state.json").read_text())["step"] == 4
    a, b = _weights(ckpt), _weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_warm_start_keeps_weights_and_tokenizer_and_chains_the_log(straight, tmp_path):
    out, _ = straight
    parent = export(_cfg(out))
    child_cfg = _cfg(tmp_path / "child", init_from=str(parent), total_steps=2, export_dir=str(tmp_path / "final"))
    from core_kv.proxy.train import latest_checkpoint

    # before any step the warm-started model is the parent (zero steps: only the start-up checkpoint is written)
    start = train(_cfg(tmp_path / "zero", init_from=str(parent), total_steps=0))
    for k, v in _weights(parent).items():
        torch.testing.assert_close(_weights(start)[k], v, rtol=0, atol=0, msg=k)
    assert (tmp_path / "zero" / "tokenizer" / "tokenizer.json").read_text() == (parent / "tokenizer.json").read_text()

    train(child_cfg)
    assert latest_checkpoint(tmp_path / "child") is not None
    final = export(child_cfg)
    rows = [json.loads(line) for line in (final / "training_log.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["step"]) for r in rows] == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 5), (1, 6)]
    assert (final / "loss_curve.png").stat().st_size > 0


def test_warm_start_refuses_a_folder_without_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an exported proxy folder"):
        train(_cfg(tmp_path / "run", init_from=str(tmp_path)))


def test_micro_batches_group_by_length_within_the_token_cap():
    from core_kv.proxy.train import micro_batches

    lengths = [100, 900, 120, 480, 500, 3000, 110]
    groups = micro_batches(lengths, max_tokens=1000)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every sequence exactly once
    assert groups[0] == [5]  # longer than the cap: alone
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 1000
    assert [4, 3] in groups and [2, 6, 0] in groups  # similar lengths share a forward pass


def test_micro_batched_step_equals_one_padded_batch(tmp_path):
    """Length-bucketed forward/backward passes give the loss and gradients of one padded batch (naive reference:
    mean LM cross-entropy over the selected targets + answer_weight x mean answer cross-entropy + attn_weight x mean
    retrieval-head cross-entropy, the last from eager attention probabilities)."""
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    from core_kv.documents import Generator
    from core_kv.proxy.tokenizer import build_proxy_tokenizer
    from core_kv.proxy.train import (
        ProxyModelConfig,
        RetrievalHead,
        build_model,
        collate,
        lm_selection,
        train_step_loss,
    )

    cfg = _cfg(tmp_path, lm_fraction=0.5, answer_weight=3.0)
    cfg.model.num_hidden_layers, cfg.model.num_attention_heads = 2, 4  # GQA: query head 1 reads the one KV head
    build_proxy_tokenizer(512, key_words=False).save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    torch.manual_seed(0)
    model = build_model(ProxyModelConfig(**OmegaConf.to_container(OmegaConf.structured(cfg.model))), tok)
    model.config._attn_implementation = "eager"
    seqs = Generator(tok, seed=5).batch({"niah_single_1": 1, "mk_noise": 1, "copy": 1}, 60, 200, 1500)
    assert len({len(s.ids) for s in seqs}) > 1 and any(x >= 0 for s in seqs for x in s.src)

    retrieval, gather = RetrievalHead(model, -1, 1, "src"), RetrievalHead(model, 0, 2, "nsrc")
    heads = [(retrieval, 0.7), (gather, 0.4)]
    lm, ans, (attn, attn_n), _ = train_step_loss(
        model, seqs, tok.pad_token_id, cfg, torch.Generator().manual_seed(9), 400, heads
    )
    retrieval.remove()
    gather.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    batch = collate(seqs, tok.pad_token_id, lm_selection(seqs, 0.5, torch.Generator().manual_seed(9)))
    ids, keep, answer, targets = batch
    out = model(input_ids=ids, output_attentions=True)
    logits = out.logits[:, :-1].float()
    tgt, keep, answer = ids[:, 1:], keep[:, 1:], answer[:, 1:]
    ref_lm = F.cross_entropy(logits[keep], tgt[keep])
    ref_ans = F.cross_entropy(logits[answer > 0], tgt[answer > 0])

    def head_ce(layer: int, head: int, name: str) -> torch.Tensor:
        probs = out.attentions[layer][:, head, :-1]  # (B, T-1, T): query t of this head
        src = targets[name][:, 1:]
        rows = (src >= 0).nonzero(as_tuple=True)
        assert len(rows[0])
        return -probs[rows[0], rows[1], src[rows]].log().mean()

    ref_attn, ref_gather = head_ce(-1, 1, "src"), head_ce(0, 2, "nsrc")
    (ref_lm + 3.0 * ref_ans + 0.7 * ref_attn + 0.4 * ref_gather).backward()
    assert lm == pytest.approx(ref_lm.item(), rel=1e-5) and ans == pytest.approx(ref_ans.item(), rel=1e-5)
    assert attn == pytest.approx(ref_attn.item(), rel=1e-4) and attn_n == pytest.approx(ref_gather.item(), rel=1e-4)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_answer_tokens_point_at_their_needle_tokens(tmp_path):
    from transformers import AutoTokenizer

    from core_kv.documents import Generator
    from core_kv.proxy.tokenizer import build_proxy_tokenizer

    build_proxy_tokenizer(512, key_words=False, uuid_chars=True).save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    gen = Generator(tok, seed=8)
    for task in ("niah_single_1", "niah_multikey_3", "niah_multivalue", "niah_multiquery", "mk_noise"):
        s = gen.sample(task, 400)
        answer = [i for i, a in enumerate(s.ans) if a > 0]
        mapped = [i for i in answer if s.src[i] >= 0]
        assert len(mapped) >= len(answer) - 3, task  # all but the ", " separators of a 4-value answer
        first_answer = answer[0]
        for i in mapped:
            j = s.src[i]
            assert s.ids[j] == s.ids[i] and j < first_answer, task  # the same token, inside the context
        # consecutive answer tokens of one value come from consecutive needle tokens
        pairs = [a for a in mapped if a + 1 in mapped]
        assert pairs and all(s.src[a + 1] == s.src[a] + 1 for a in pairs), task
    assert all(x == -1 for x in gen.sample("vt", 300).src)


def test_key_gather_targets_are_the_keys_last_token(tmp_path):
    from transformers import AutoTokenizer

    from core_kv.documents import Generator
    from core_kv.proxy.tokenizer import build_proxy_tokenizer

    build_proxy_tokenizer(512, key_words=False).save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    s = Generator(tok, seed=2, kvpress_newline=0.0).sample("niah_multiquery", 500)
    text = [tok.decode(s.ids[: i + 1]) for i in range(len(s.ids))]  # text up to and including token i
    question = tok.decode(s.ids).rsplit("mentioned in the provided text?", 1)[0]
    keys = question.rsplit(" for ", 1)[1].strip().replace(", and ", ", ").split(", ")  # the 4 queried keys, in order
    answer = [i for i, a in enumerate(s.ans) if a > 0 and s.qsrc[i] >= 0]
    targets = [s.qsrc[i] for i in answer]
    assert len(set(targets)) == 4 and targets == sorted(targets)  # one key per value, in query order
    for key, pos in zip(keys, sorted(set(targets)), strict=True):
        assert text[pos].endswith(key) and pos > max(s.src)  # the key in the answer prefix, after the context
    for i, j in enumerate(s.nsrc):
        if j >= 0:  # a needle value token gathers the last token of its own needle's key
            sentence = text[i - 1].rsplit("One of the special magic", 1)[1]
            assert text[j].endswith(sentence.split(" for ", 1)[1].split(" is: ")[0])


def test_bf16_export_loads_as_fp32_and_replaces_the_folder_whole(straight, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out, ckpt = straight
    dst = tmp_path / "export"
    dst.mkdir()
    (dst / "stale.json").write_text("{}")  # a file of an earlier export: gone after the swap, and named
    with pytest.warns(UserWarning, match=r"removed stale\.json \(not written by export\)"):
        export(_cfg(out, export_dir=str(dst), export_dtype="bfloat16"))
    assert not (dst / "stale.json").exists() and not (tmp_path / "export.tmp").exists()
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    model = AutoModelForCausalLM.from_pretrained(dst)
    params = model.state_dict()
    for name, w in _weights(ckpt).items():
        assert params[name].dtype == torch.float32, name
        torch.testing.assert_close(params[name], w.to(torch.bfloat16).float(), rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="export_dtype"):
        _cfg(out, export_dtype="int8")


def test_auxiliary_head_losses_are_trained_and_logged(tmp_path):
    phase = {"min_len": 48, "max_len": 96, "tokens_per_step": 256, "gather_weight": 0.5,
             "mix": {"niah_single_1": 0.5, "mk_noise": 0.5}}  # fmt: skip
    train(_cfg(tmp_path, total_steps=2, attn_weight=1.0, gather_layer=0, phases=[phase], probe_every=1))
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert all(r["attn_loss"] > 0 and r["gather_loss"] > 0 for r in rows)
    assert all(0 <= v <= 1 for r in rows for v in r["probe"].values())  # the periodic probe runs too


def test_resume_state_is_stored_without_pickle(straight, tmp_path):
    """The checkpoint holds safetensors + JSON only; the optimizer and RNG states round-trip exactly, and a checkpoint
    of the older ``train_state.pt`` format still loads (with ``weights_only=True``)."""
    import random

    from core_kv.proxy.train import load_train_state, save_train_state

    _, ckpt = straight
    assert not [p.name for p in ckpt.iterdir() if p.suffix in (".pt", ".pkl", ".bin")]
    assert (ckpt / "train_state.safetensors").is_file() and (ckpt / "train_state.json").is_file()
    w = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.AdamW([w], lr=1e-3, betas=(0.9, 0.95))
    w.sum().backward()
    opt.step()
    rng, gen = random.Random(7), torch.Generator().manual_seed(3)
    save_train_state(tmp_path, opt.state_dict(), rng.getstate(), torch.get_rng_state(), gen.get_state())
    back = load_train_state(tmp_path)
    want = opt.state_dict()
    assert back["optimizer"]["param_groups"] == want["param_groups"]
    for name, value in want["state"][0].items():
        assert torch.equal(back["optimizer"]["state"][0][name], value), name
    assert back["data_rng"] == rng.getstate()
    assert torch.equal(back["loss_rng"], gen.get_state()) and torch.equal(back["torch_rng"], torch.get_rng_state())
    opt.load_state_dict(back["optimizer"])  # accepted as is
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save({"optimizer": want, "data_rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
                "loss_rng": gen.get_state()}, legacy / "train_state.pt")  # fmt: skip
    assert load_train_state(legacy)["data_rng"] == rng.getstate()
