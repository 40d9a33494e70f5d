"""Generation with interventions is correct with a KV cache (the released code's bug, fixed)."""

from __future__ import annotations

import pytest
import torch

from me_interp.interventions import WeMask, generate, hf_interventions

PROMPTS = ["w3 w9 w14 w2", "w40 w41 w7 w8 w22 w5", "w11 w12"]


@pytest.fixture(scope="module")
def full_mask(plain_tiny):
    hf, _ = plain_tiny
    return WeMask.build(hf, range(len(hf.model.layers)), 1.0, "weight")


def test_masked_generation_with_cache_equals_without(plain_tiny, full_mask):
    hf, tok = plain_tiny
    a = generate(hf, PROMPTS, 8, [full_mask], use_cache=True, tokenizer=tok)
    b = generate(hf, PROMPTS, 8, [full_mask], use_cache=False, tokenizer=tok)
    assert a.new_tokens == b.new_tokens
    plain = generate(hf, PROMPTS, 8, use_cache=True, tokenizer=tok)
    assert plain.new_tokens != a.new_tokens  # the mask matters on this model


def test_released_index_positions_mask_generated_tokens_with_cache(plain_tiny, full_mask):
    """positions_from='index' reproduces the bug: cache and no-cache disagree."""
    hf, tok = plain_tiny
    a = generate(hf, PROMPTS, 8, [full_mask], use_cache=True, positions_from="index", tokenizer=tok)
    b = generate(
        hf, PROMPTS, 8, [full_mask], use_cache=False, positions_from="index", tokenizer=tok
    )
    assert a.new_tokens != b.new_tokens


def test_decode_steps_never_edit_the_new_token(plain_tiny, full_mask):
    hf, tok = plain_tiny
    ids = torch.tensor([tok(PROMPTS[0])["input_ids"]])
    with torch.no_grad(), hf_interventions(hf, full_mask) as h:
        out = hf(ids, use_cache=True)
        prefill = dict(h.stats[0])
        hf(
            ids[:, :1],
            past_key_values=out.past_key_values if hasattr(out, "past_key_values") else out.cache,
            use_cache=True,
        )
        after = dict(h.stats[0])
    assert prefill == {"calls": 1, "edited_tokens": 1}
    assert after == {"calls": 2, "edited_tokens": 1}  # the decode step edited nothing


def test_padded_batch_equals_one_prompt_at_a_time(plain_tiny, full_mask):
    hf, tok = plain_tiny
    batched = generate(hf, PROMPTS, 5, [full_mask], tokenizer=tok).new_tokens
    single = [generate(hf, [p], 5, [full_mask], tokenizer=tok).new_tokens[0] for p in PROMPTS]
    assert batched == single


def test_generation_errors(plain_tiny, planted):
    hf, tok = plain_tiny
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(hf, PROMPTS, 0, tokenizer=tok)
    with pytest.raises(ValueError, match="tokenizer"):
        generate(hf, PROMPTS, 2)
    with pytest.raises(ValueError, match="plain HF model"):
        generate(planted[0], PROMPTS, 2)
    out = generate(planted[0], PROMPTS[:1], 2, use_cache=False)
    assert len(out.new_tokens[0]) == 2 and isinstance(out.texts[0], str)


def test_hf_generate_with_hooks_matches(plain_tiny, full_mask):
    """HF's own generate (left padding, KV cache) derives position_ids from the attention mask, so the
    hooks are correct there too: same tokens as the reference no-cache loop."""
    hf, tok = plain_tiny
    old = tok.padding_side
    tok.padding_side = "left"
    try:
        enc = tok(PROMPTS, return_tensors="pt", padding=True)
        with torch.no_grad(), hf_interventions(hf, full_mask):
            out = hf.generate(
                **enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id
            )
    finally:
        tok.padding_side = old
    ours = generate(hf, PROMPTS, 6, [full_mask], use_cache=False, tokenizer=tok).new_tokens
    assert out[:, enc["input_ids"].shape[1] :].tolist() == ours


def test_bundled_masked_generation_cache_equals_no_cache(plain_bundled):
    hf, tok = plain_bundled
    spec = WeMask.build(
        hf, range(11, len(hf.model.layers)), 0.1, "weight"
    )  # ME layer 11 (measured)
    prompts = ["The capital of France is", "Once upon a time"]
    a = generate(hf, prompts, 6, [spec], tokenizer=tok, use_cache=True)
    b = generate(hf, prompts, 6, [spec], tokenizer=tok, use_cache=False)
    assert a.new_tokens == b.new_tokens
    bug = generate(hf, prompts, 6, [spec], tokenizer=tok, use_cache=True, positions_from="index")
    assert bug.new_tokens != a.new_tokens
