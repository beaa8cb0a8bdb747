"""Loss-mask alignment: the masked tokens decode to exactly the assistant contents + end-of-turn."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from eyas.data.template import render

LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def llama3_tokenizer(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def gemma_tokenizer(smol_tokenizer):
    tok = copy.deepcopy(smol_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = GEMMA_TEMPLATE
    return tok


def masked_text(tok, r):
    return tok.decode([i for i, m in zip(r.input_ids, r.loss_mask) if m])


CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6, of course."},
]


def test_smollm2_mask_is_contents_plus_im_end(smol_tokenizer):
    r = render(smol_tokenizer, CONV)
    assert masked_text(smol_tokenizer, r) == "4.<|im_end|>It is 6, of course.<|im_end|>"
    # the assistant header and the newline after <|im_end|> are not supervised
    toks = [smol_tokenizer.decode([i]) for i in r.input_ids]
    first = r.loss_mask.index(True)
    assert toks[first - 1] == "\n" and toks[first - 2] == "istant"
    assert r.loss_mask[first - 1] is False


def test_llama3_style_template_mask(llama3_tokenizer):
    r = render(llama3_tokenizer, CONV)
    assert masked_text(llama3_tokenizer, r) == "4.<|eot_id|>It is 6, of course.<|eot_id|>"


def test_gemma_style_template_mask(gemma_tokenizer):
    r = render(gemma_tokenizer, CONV[1:])
    assert masked_text(gemma_tokenizer, r) == "4.<end_of_turn>It is 6, of course.<end_of_turn>"


def test_repeated_text_is_matched_to_the_right_turn(smol_tokenizer):
    conv = [
        {"role": "user", "content": "yes"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "yes"},
        {"role": "assistant", "content": "no"},
    ]
    r = render(smol_tokenizer, conv)
    assert masked_text(smol_tokenizer, r) == "yes<|im_end|>no<|im_end|>"
    # exactly two content tokens and two end tokens
    assert sum(r.loss_mask) == 4


def test_truncated_answer_policies(smol_tokenizer):
    conv = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Once upon", "truncated": True}]
    keep = render(smol_tokenizer, conv, truncated_answers="keep")
    assert masked_text(smol_tokenizer, keep) == "Once upon"
    mask = render(smol_tokenizer, conv, truncated_answers="mask")
    assert not any(mask.loss_mask)


words = (
    st.text(alphabet=st.sampled_from(list("abcdefghij XYZ0123,.!?\n")), min_size=1, max_size=40)
    .map(str.strip)
    .filter(bool)
)


@st.composite
def conversations(draw):
    n = draw(st.integers(1, 4))
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(words)})
    for _ in range(n):
        msgs.append({"role": "user", "content": draw(words)})
        msgs.append({"role": "assistant", "content": draw(words)})
    return msgs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=conversations())
def test_property_masked_tokens_are_exactly_assistant_turns(smol_tokenizer, llama3_tokenizer, conv):
    for tok, eot, strip in ((smol_tokenizer, "<|im_end|>", False), (llama3_tokenizer, "<|eot_id|>", True)):
        r = render(tok, conv)
        expected = "".join(
            (m["content"].strip() if strip else m["content"]) + eot for m in conv if m["role"] == "assistant"
        )
        assert masked_text(tok, r) == expected
        # the rendered ids are the template's own tokenisation
        assert r.input_ids == tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]


def test_content_holding_special_token_text_is_located(smol_tokenizer):
    conv = [{"role": "user", "content": "end it"}, {"role": "assistant", "content": "Done<|endoftext|>"}]
    r = render(smol_tokenizer, conv)
    assert masked_text(smol_tokenizer, r) == "Done<|endoftext|><|im_end|>"


def test_long_text_prefix_tokenisation_matches_full(smol_tokenizer):
    long = " ".join(f"word{i}" for i in range(3000))
    conv = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": long},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "ok"},
    ]
    full = render(smol_tokenizer, conv)
    cut = render(smol_tokenizer, conv, max_tokens=256)
    assert len(full.input_ids) > len(cut.input_ids) > 256
    assert cut.input_ids[:256] == full.input_ids[:256] and cut.loss_mask[:256] == full.loss_mask[:256]
