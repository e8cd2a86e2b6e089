"""The BD3-LM objective: the vectorised loss equals the block-by-block one, the mask is BD3's, and the noise,
padding, token shift and loss terms do what docs/training.md says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clover import CloverConfig, CloverForBlockDiffusion
from clover.model.layout import BlockLayout
from clover.model.lora import apply_lora
from clover.training.config import LoraConfig, NoiseConfig
from clover.training.batches import collate
from clover.training.objective import (Noise, _draft_kl, bd3_loss, loss_denominators, position_weights,
                                       reference_block_loss, sample_noise)

MASK, EOS = 255, 254


def tiny_model(preset: str, seed: int = 0) -> CloverForBlockDiffusion:
    """A tiny random model whose Clover-only parameters are not at their (identity) initial values."""
    torch.manual_seed(seed)
    model = CloverForBlockDiffusion(CloverConfig.from_preset(preset)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "conv1d_right" in name:
                param.normal_(0.0, 0.3)
            elif "memory_calibration" in name:
                param.normal_(0.0, 0.5)
    return model


def documents(seed: int = 0, spec=((3, 9), (5, 6), (1, 12))) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for prompt_len, response_len in spec:
        ids = torch.randint(0, 250, (prompt_len + response_len,), generator=g)
        mask = torch.zeros(prompt_len + response_len, dtype=torch.bool)
        mask[prompt_len:] = True
        docs.append((ids, mask, prompt_len))
    docs[0][1][docs[0][2] + 4] = False  # an unsupervised token inside a response (e.g. a tool result)
    return docs


@pytest.fixture(scope="module")
def models() -> dict[str, CloverForBlockDiffusion]:
    return {p: tiny_model(p) for p in ("clover-tiny", "clover-tiny-dense")}


def test_training_attention_mask_is_bd3s():
    """P=2 causal prompt, B=2, two clean blocks, two noised blocks (rows: queries, columns: keys)."""
    layout = BlockLayout(clean_len=6, block_size=2, prefix_len=2, query_blocks=2, query_start=2)
    mask, _ = layout.attention_mask(None, None, 1, torch.device("cpu"))
    #              prompt   clean b0  clean b1  noised b0 noised b1
    expected = [[1, 0,    0, 0,     0, 0,     0, 0,     0, 0],   # prompt 0: causal
                [1, 1,    0, 0,     0, 0,     0, 0,     0, 0],   # prompt 1
                [1, 1,    1, 1,     0, 0,     0, 0,     0, 0],   # clean b0: prompt + itself (both ways)
                [1, 1,    1, 1,     0, 0,     0, 0,     0, 0],
                [1, 1,    1, 1,     1, 1,     0, 0,     0, 0],   # clean b1: everything clean before + itself
                [1, 1,    1, 1,     1, 1,     0, 0,     0, 0],
                [1, 1,    0, 0,     0, 0,     1, 1,     0, 0],   # noised b0: prompt + itself
                [1, 1,    0, 0,     0, 0,     1, 1,     0, 0],
                [1, 1,    1, 1,     0, 0,     0, 0,     1, 1],   # noised b1: clean before b1 + itself
                [1, 1,    1, 1,     0, 0,     0, 0,     1, 1]]
    assert torch.equal(mask[0, 0], torch.tensor(expected, dtype=torch.bool))


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
@pytest.mark.parametrize("weighting,sampling,complementary", [
    ("none", "bernoulli", True), ("inverse_rate", "exact", True), ("inverse_rate", "bernoulli", False)])
def test_vectorised_loss_equals_block_by_block(models, preset, weighting, sampling, complementary):
    model = models[preset]
    batch = collate(documents(), 4, mask_token_id=MASK, seeds=[11, 12, 13])
    assert batch.padded  # prompts of 3, 5 and 1 tokens: left padding is exercised too
    noise = sample_noise(batch, 4, NoiseConfig(weighting=weighting, sampling=sampling, complementary=complementary))
    assert noise.mask.any()
    loss, metrics = bd3_loss(model, batch, 4, noise)
    ref, ref_metrics = reference_block_loss(model, batch, 4, noise)
    assert abs(loss.item() - ref.item()) < 1e-5
    assert metrics["masked_tokens"] == ref_metrics["masked_tokens"] == float(noise.mask.sum())
    assert metrics["first_tokens"] == ref_metrics["first_tokens"] > 0
    assert abs(metrics["first_ce"] - ref_metrics["first_ce"]) < 1e-5


def test_vectorised_gradients_equal_block_by_block(models):
    model = models["clover-tiny"]
    batch = collate(documents(1), 4, mask_token_id=MASK, seeds=[1, 2, 3])
    noise = sample_noise(batch, 4, NoiseConfig())
    grads = []
    for fn in (bd3_loss, reference_block_loss):
        model.zero_grad()
        fn(model, batch, 4, noise)[0].backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    model.zero_grad()
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_collate_layout_prompt_left_padded_response_padded_with_mask():
    docs = [(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 0, 1, 1, 1]), 2),
            (torch.tensor([6, 7, 8, 9, 10, 11, 12, 13]), torch.tensor([0, 0, 0, 1, 1, 1, 1, 1]), 3)]
    b = collate(docs, 4, mask_token_id=MASK, eos_token_id=EOS)
    assert b.prompt_len == 3 and b.response_len == 8 and b.num_blocks == [1, 2]
    assert b.input_ids.tolist() == [[MASK, 1, 2, 3, 4, 5, MASK, MASK, MASK, MASK, MASK],
                                    [6, 7, 8, 9, 10, 11, 12, 13, MASK, MASK, MASK]]
    assert b.attention_mask[0].tolist() == [False] + [True] * 10
    assert b.loss_mask.tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert b.num_tokens == 13
    eos = collate(docs, 4, mask_token_id=MASK, eos_token_id=EOS, pad_target="eos")
    assert eos.input_ids[0, 3:].tolist() == [3, 4, 5, EOS, MASK, MASK, MASK, MASK]  # own block: EOS, trained
    assert eos.loss_mask[0].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    text = collate([(torch.tensor([5, 6, 7]), torch.tensor([1, 1, 1]), 0)], 2, mask_token_id=MASK)
    assert text.prompt_len == 1 and text.response.tolist() == [[6, 7]]  # first token is the context
    short = collate([(torch.arange(10), torch.ones(10), 2)], 4, mask_token_id=MASK, max_seq_len=7)
    assert short.response.tolist() == [[2, 3, 4, 5, 6, MASK, MASK, MASK]]


def test_noise_masks_only_supervised_positions_and_complement_partitions_them():
    batch = collate(documents(), 4, mask_token_id=MASK, seeds=[5, 6, 7])
    for sampling in ("bernoulli", "exact"):
        noise = sample_noise(batch, 4, NoiseConfig(sampling=sampling))
        n = batch.rows
        first, second = noise.mask[:n], noise.mask[n:]
        assert not (first & second).any()
        assert torch.equal(first | second, batch.loss_mask)
    exact = sample_noise(batch, 4, NoiseConfig(sampling="exact", complementary=False))
    sup = batch.loss_mask.view(batch.rows, -1, 4)
    blocks = exact.mask.view(batch.rows, -1, 4)
    assert ((blocks.sum(-1) >= 1) | (sup.sum(-1) == 0)).all()  # exact: at least one masked per block


def test_noise_of_a_document_does_not_depend_on_its_batch():
    docs = documents()
    alone = collate(docs[1:2], 4, mask_token_id=MASK, seeds=[42])
    together = collate(docs, 4, mask_token_id=MASK, seeds=[1, 42, 3])
    a = sample_noise(alone, 4, NoiseConfig())
    b = sample_noise(together, 4, NoiseConfig())
    width = alone.response_len
    assert torch.equal(a.mask[0], b.mask[1, :width])
    assert torch.equal(a.mask[1], b.mask[4, :width])  # the complementary copy


def test_left_padding_and_batching_do_not_change_a_documents_loss(models):
    model = models["clover-tiny"]
    docs = documents()
    together = collate(docs, 4, mask_token_id=MASK, seeds=[1, 2, 3])
    noise = sample_noise(together, 4, NoiseConfig(weighting="inverse_rate"))
    _, m_all = bd3_loss(model, together, 4, noise)
    total = 0.0
    for i, doc in enumerate(docs):
        alone = collate([doc], 4, mask_token_id=MASK, seeds=[i + 1])
        _, m = bd3_loss(model, alone, 4, sample_noise(alone, 4, NoiseConfig(weighting="inverse_rate")))
        total += m["diffusion_sum"]
    assert abs(total - m_all["diffusion_sum"]) < 1e-4


def test_loss_is_on_masked_tokens_with_token_shift(models):
    """Hand-built noise: one masked position per block, checked against logits computed directly."""
    model = models["clover-tiny-dense"]
    batch = collate(documents()[2:], 4, mask_token_id=MASK)  # P=1, 12 response tokens, 3 blocks
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, [0, 5, 11]] = True  # first position of block 0, inner positions of blocks 1 and 2
    noise = Noise(mask, torch.full((1, 3), 0.5), 1, "none")
    loss, metrics = bd3_loss(model, batch, 4, noise)
    ids = batch.input_ids
    expected = []
    with torch.no_grad():
        clean = model(ids, 4, prefix_len=1).logits
        expected.append(F.cross_entropy(clean[0, 0], ids[0, 1]))  # block 0 start: clean output at the prompt
        for pos in (5, 11):
            start = 1 + pos // 4 * 4
            noised = ids[:, : start + 4].clone()
            noised[0, 1 + pos] = MASK
            out = model(noised, 4, prefix_len=1).logits
            expected.append(F.cross_entropy(out[0, pos], ids[0, 1 + pos]))
    assert metrics["masked_tokens"] == 3 and metrics["first_tokens"] == 1
    assert abs(loss.item() - float(torch.stack(expected).mean())) < 1e-5
    weighted = Noise(mask, torch.full((1, 3), 0.5), 1, "inverse_rate")
    loss_w, _ = bd3_loss(model, batch, 4, weighted)
    assert abs(loss_w.item() - 2.0 * float(torch.stack(expected).sum()) / 12) < 1e-5  # sum CE / r / supervised
    assert loss_denominators(batch, weighted) == {"diffusion": 12.0, "ar": 12.0, "masked": 3.0, "draft": 2.0}


def test_ar_term_is_the_causal_next_token_loss(models):
    model = models["clover-tiny"]
    batch = collate(documents(), 4, mask_token_id=MASK, seeds=[1, 2, 3])
    noise = sample_noise(batch, 4, NoiseConfig())
    loss0, _ = bd3_loss(model, batch, 4, noise)
    loss, metrics = bd3_loss(model, batch, 4, noise, ar_weight=0.5)
    with torch.no_grad():
        logits = model(batch.input_ids, 1, attention_mask=batch.attention_mask).logits
    p = batch.prompt_len
    pred = logits[:, p - 1: -1][batch.loss_mask]
    expected = F.cross_entropy(pred, batch.response[batch.loss_mask])
    assert abs(metrics["ar_loss"] - float(expected)) < 1e-5
    assert abs(loss.item() - loss0.item() - 0.5 * float(expected)) < 1e-5


def test_kl_term_is_zero_against_itself(models):
    model = models["clover-tiny-dense"]
    batch = collate(documents(), 4, mask_token_id=MASK, seeds=[1, 2, 3])

    def reference(ids, attention, keep):
        return model(ids, 1, attention_mask=attention, logits_to_keep=keep).logits

    _, metrics = bd3_loss(model, batch, 4, NoiseConfig(), kl_weight=1.0, reference=reference)
    assert abs(metrics["kl"]) < 1e-6
    with pytest.raises(ValueError, match="reference"):
        bd3_loss(model, batch, 4, NoiseConfig(), kl_weight=1.0)


def test_confidence_term_is_the_entropy_of_correct_masked_predictions(models):
    """CAP / certainty forcing: + w * (entropy summed over masked positions whose argmax is the target) / masked."""
    model = models["clover-tiny-dense"]
    batch = collate(documents(), 4, mask_token_id=MASK, seeds=[1, 2, 3])
    noise = sample_noise(batch, 4, NoiseConfig(complementary=False))
    # make some predictions right: at every other masked position the target becomes the model's own argmax
    rows, pos = noise.mask.nonzero(as_tuple=True)
    argmax = _masked_logits(model, batch, noise).argmax(-1)
    batch.input_ids[:, batch.prompt_len:][rows[::2], pos[::2]] = argmax[::2]
    loss0, m0 = bd3_loss(model, batch, 4, noise)
    loss, m = bd3_loss(model, batch, 4, noise, confidence_weight=0.5)
    logp = _masked_logits(model, batch, noise).log_softmax(-1)
    right = logp.argmax(-1) == batch.response[rows, pos]
    assert 0 < int(right.sum()) == m["correct"] < len(right)
    entropy = -(logp.exp() * logp).sum(-1)[right].sum()
    assert abs(m["confidence_sum"] - float(entropy)) < 1e-4
    assert abs(loss.item() - loss0.item() - 0.5 * float(entropy) / float(noise.mask.sum())) < 1e-5
    assert "confidence_sum" not in m0


def _masked_logits(model, batch, noise):
    """Logits at the masked positions, block by block (the reference layout), in noise.mask.nonzero order."""
    p, b = batch.prompt_len, 4
    out = []
    with torch.no_grad():
        for row, pos in zip(*noise.mask.nonzero(as_tuple=True)):
            start = p + int(pos) // b * b
            block = batch.input_ids[row: row + 1, start: start + b]
            noised = torch.where(noise.mask[row: row + 1, start - p: start - p + b], MASK, block)
            o = model(batch.input_ids[row: row + 1, :start], b, prefix_len=p, query_ids=noised,
                      attention_mask=batch.attention_mask[row: row + 1, :start])
            shifted = torch.cat([o.logits[:, -1:], o.query_logits[:, :-1]], dim=1)
            out.append(shifted[0, int(pos) % b])
    return torch.stack(out)


def _gated(preset: str = "clover-tiny-dense", seed: int = 0) -> CloverForBlockDiffusion:
    """A tiny random model with a gated adapter whose factors and [MASK] row are nonzero."""
    model = tiny_model(preset, seed)
    apply_lora(model, LoraConfig(rank=4, dropout=0.0, gated=True, extra_trainable=[]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "row_delta" in name:
                param.normal_(0.0, 0.2)
    return model


def _loss_grads_saved(model, batch, noise) -> tuple[float, torch.Tensor, int]:
    """Loss, gradient of the trainable parameters, and bytes of activations autograd keeps for the backward."""
    saved = [0]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[0] += t.numel() * t.element_size()
        return t

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = bd3_loss(model, batch, 4, noise, confidence_weight=0.3)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad()
    return loss.item(), grads, saved[0]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gated_frozen_clean_stream_runs_once_without_autograd(monkeypatch, checkpointing):
    """A gated adapter's clean stream is the frozen base: computed under no_grad it gives the loss and gradients of
    the per-layer-detach forward, and autograd keeps far fewer tensors (the clean stream is 2/3 of the tokens)."""
    model = _gated()
    model.gradient_checkpointing = checkpointing
    model.train(checkpointing)  # checkpointing runs in training mode only
    batch = collate(documents(), 4, mask_token_id=MASK, seeds=[1, 2, 3])
    assert batch.padded
    noise = sample_noise(batch, 4, NoiseConfig())
    loss, grads, saved = _loss_grads_saved(model, batch, noise)
    monkeypatch.setattr(CloverForBlockDiffusion, "_runs_frozen_clean", lambda self, ctx, cache: False)
    loss_d, grads_d, saved_d = _loss_grads_saved(model, batch, noise)
    assert abs(loss - loss_d) < 1e-5
    assert grads.abs().max() > 0 and torch.allclose(grads, grads_d, atol=1e-6, rtol=1e-4)
    if not checkpointing:
        assert saved < 0.7 * saved_d  # 17 clean + 12 query positions a row here


def test_gated_block_starts_are_not_trained_and_not_counted():
    """A gated adapter's block start is the frozen base's prediction: no gradient, so out of every denominator."""
    model = _gated()
    batch = collate(documents()[2:], 4, mask_token_id=MASK)  # P=1, 12 response tokens, 3 blocks
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, [0, 4, 5, 11]] = True  # two block starts, two drafted positions
    noise = Noise(mask, torch.full((1, 3), 0.5), 1, "none")
    den = loss_denominators(batch, noise, frozen_starts=True)
    assert den == {"diffusion": 2.0, "ar": 12.0, "masked": 2.0, "draft": 2.0}
    assert loss_denominators(batch, Noise(mask, noise.rate, 1, "inverse_rate"), frozen_starts=True)["diffusion"] == 9
    loss, m = bd3_loss(model, batch, 4, noise, confidence_weight=0.5)
    logits = _masked_logits(model, batch, noise)
    ce = F.cross_entropy(logits, batch.response[mask], reduction="none")
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1) * (logp.argmax(-1) == batch.response[mask])
    assert abs(m["diffusion_loss"] - float(ce[[2, 3]].mean())) < 1e-5
    assert abs(loss.item() - float(ce[[2, 3]].mean() + 0.5 * entropy[[2, 3]].sum() / 2)) < 1e-5
    assert m["first_tokens"] == 2 and abs(m["first_ce"] - float(ce[[0, 1]].mean())) < 1e-5  # still logged
    ref, _ = reference_block_loss(model, batch, 4, noise, confidence_weight=0.5)
    assert abs(ref.item() - loss.item()) < 1e-5


def test_untrained_tail_is_hidden_from_the_noised_copies():
    """A chat answer ends with a trained <|im_end|> and an untrained newline: the noised block must not show the
    newline (decoding drafts the block after <|im_end|> from masks alone), so its value cannot change the loss."""
    def doc(newline: int):
        ids = torch.tensor([7, 8, 9, 10, 11, 12, 13, EOS, newline])
        return ids, torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 0]), 1

    batch = collate([doc(10)], 4, mask_token_id=MASK, eos_token_id=EOS, pad_target="eos")
    assert batch.response.tolist() == [[8, 9, 10, 11, 12, 13, EOS, 10]]  # own block full: no EOS padding
    assert batch.tail.tolist() == [[0] * 7 + [1]]
    padded = collate([(torch.arange(1, 8), torch.tensor([0, 1, 1, 1, 1, 0, 0]), 1)], 4, mask_token_id=MASK,
                     eos_token_id=EOS, pad_target="eos")
    assert padded.response.tolist() == [[2, 3, 4, 5, 6, 7, EOS, EOS]]
    assert padded.tail.tolist() == [[0, 0, 0, 0, 1, 1, 0, 0]] and padded.loss_mask[0, 6:].all()  # EOS trained
    model = tiny_model("clover-tiny-dense")
    losses = []
    for newline in (10, 200):
        b = collate([doc(newline)], 4, mask_token_id=MASK, eos_token_id=EOS, pad_target="eos", seeds=[3])
        noise = sample_noise(b, 4, NoiseConfig(t_min=0.5))
        assert noise.mask[:, 4:7].any()  # the last block is noised in some copy
        losses.append(bd3_loss(model, b, 4, noise)[0].item())
        assert abs(reference_block_loss(model, b, 4, noise)[0].item() - losses[-1]) < 1e-5
    assert losses[0] == losses[1]


def test_full_mask_prob_masks_whole_blocks():
    batch = collate(documents(), 4, mask_token_id=MASK, seeds=[5, 6, 7])
    n, sup = batch.rows, batch.loss_mask.view(batch.rows, -1, 4)
    assert torch.equal(sample_noise(batch, 4, NoiseConfig(full_mask_prob=0.0)).mask,
                       sample_noise(batch, 4, NoiseConfig()).mask)  # old configs: the same masks as before
    for sampling in ("bernoulli", "exact"):
        every = sample_noise(batch, 4, NoiseConfig(full_mask_prob=1.0, sampling=sampling))
        assert torch.equal(every.mask[:n], batch.loss_mask) and not every.mask[n:].any()
        assert (every.rate[:n] == 1).all()
        half = sample_noise(batch, 4, NoiseConfig(full_mask_prob=0.5, sampling=sampling, t_max=0.3))
        blocks = half.mask[:n].view(n, -1, 4)
        full = (blocks == sup).all(-1) & sup.any(-1)
        assert 0 < int(full.sum()) < int(sup.any(-1).sum())
        assert torch.equal(half.mask[:n] | half.mask[n:], batch.loss_mask)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="full_mask_prob"):
            NoiseConfig(full_mask_prob=bad).validate()


def test_position_decay_weights_drafts_by_block_position():
    """w_p = gamma^max(p - 1, 0); the diffusion loss is sum w CE / sum w over the trained masked positions."""
    assert position_weights(4, 0.5).tolist() == [1.0, 1.0, 0.5, 0.25]
    model = _gated()
    batch = collate(documents()[2:], 4, mask_token_id=MASK)
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, [0, 1, 6, 7, 11]] = True  # block positions 0, 1, 2, 3, 3
    noise = Noise(mask, torch.full((1, 3), 0.5), 1, "none", position_decay=0.5)
    w = torch.tensor([1.0, 0.5, 0.25, 0.25])
    assert loss_denominators(batch, noise, frozen_starts=True)["diffusion"] == float(w.sum())
    _, m = bd3_loss(model, batch, 4, noise)
    ce = F.cross_entropy(_masked_logits(model, batch, noise), batch.response[mask], reduction="none")[1:]
    assert abs(m["diffusion_loss"] - float((w * ce).sum() / w.sum())) < 1e-5
    _, plain = bd3_loss(model, batch, 4, Noise(mask, noise.rate, 1, "none"))
    assert abs(plain["diffusion_loss"] - float(ce.mean())) < 1e-5
    with pytest.raises(ValueError, match="position_decay"):
        NoiseConfig(position_decay=0.0).validate()


def test_draft_kl_is_kl_to_the_base_next_token_distribution():
    logits = torch.randn(5, 11)
    assert abs(float(_draft_kl(logits.log_softmax(-1), logits, None))) < 1e-6
    assert float(_draft_kl((logits + torch.randn(5, 11)).log_softmax(-1), logits, None)) > 0
    model = _gated()
    batch = collate(documents(), 4, mask_token_id=MASK, seeds=[1, 2, 3])
    noise = sample_noise(batch, 4, NoiseConfig(complementary=False, position_decay=0.7))
    rows, pos = noise.mask.nonzero(as_tuple=True)
    draft = pos % 4 > 0
    query = _masked_logits(model, batch, noise)[draft].log_softmax(-1)
    with torch.no_grad():  # the base given the true prefix: the causal forward's output at P + pos - 1
        causal = model(batch.input_ids, 1, attention_mask=batch.attention_mask).logits
    base = causal[rows[draft], batch.prompt_len + pos[draft] - 1].log_softmax(-1)
    w = position_weights(4, 0.7).float()[pos[draft] % 4]
    expected = float((w * (base.exp() * (base - query)).sum(-1)).sum() / w.sum())
    loss0, m0 = bd3_loss(model, batch, 4, noise)
    loss, m = bd3_loss(model, batch, 4, noise, draft_kl_weight=0.5)
    assert expected > 0 and abs(m["draft_kl"] - expected) < 1e-5
    assert abs(loss.item() - loss0.item() - 0.5 * expected) < 1e-5
    pure, _ = bd3_loss(model, batch, 4, noise, ce_weight=0.0, draft_kl_weight=1.0)
    assert abs(pure.item() - expected) < 1e-5
    with pytest.raises(ValueError, match="causal"):
        bd3_loss(tiny_model("clover-tiny-dense"), batch, 4, noise, draft_kl_weight=1.0)
