"""Training on image rows: tiny LLaVA and Gemma 3 targets, pictures on disk, online features through the full VLM
forward, and the trained head decoding with pixel inputs exactly as the target's own generate()."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers

import eagle_mm as em
from eagle_mm.train import TrainConfig, train
from eagle_mm.train.data import collate, encode_rows, read_rows
from tests.test_multimodal_tiny import END, IMG, START, V, _gemma3, _llava, picture
from tests.test_train_tools import FIRST_WORD, SPECIALS, one_thread, words  # noqa: F401

# Chat rows whose content is a list of parts: {"type": "image"} renders as the <image> placeholder.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> "
    "{% if m['content'] is string %}{{ m['content'] }} {% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image> {% else %}{{ p['text'] }} {% endif %}{% endfor %}{% endif %}"
    "<|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
ROWS, HOLDOUT, NEW = 12, 2, 20
SIZES = {"llava": (28, 28), "gemma3": (56, 56)}


def vlm_tokenizer(family: str) -> tf.PreTrainedTokenizerFast:
    """Word-level: the specials, words w0.. up to the image tokens' ids, and the family's image tokens."""
    first_image_token = IMG if family == "llava" else END
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(first_image_token - len(SPECIALS))])}
    extra = {}
    if family == "llava":
        vocab["<image>"] = IMG
        specials = SPECIALS[4:] + ["<image>"]
    else:  # Gemma 3: the template writes <boi>, which the processor expands to <boi> <img>*n <eoi>
        vocab.update({"<eoi>": END, "<boi>": START, "<img>": IMG})
        specials = SPECIALS[4:]
        extra = {"extra_special_tokens": {"boi_token": "<boi>", "eoi_token": "<eoi>", "image_token": "<img>"}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                      unk_token="<unk>", additional_special_tokens=specials, **extra)
    fast.chat_template = CHAT_TEMPLATE if family == "llava" else CHAT_TEMPLATE.replace("<image>", "<boi>")
    assert len(fast) == V
    return fast


def vlm_target(family: str):
    """The tiny VLM of test_multimodal_tiny (4 image tokens per image), never greedily picking a special or image
    token, so its greedy text round-trips through the tokenizer; and its processor."""
    cfg, cls, image_processor = {"llava": _llava, "gemma3": _gemma3}[family]()
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        w = model.get_output_embeddings().weight
        w.mul_(8.0)
        w[:FIRST_WORD] = 0.0
        w[END:] = 0.0
        for name, p in model.named_parameters():  # Gemma 3 initialises its image projection to zeros
            if "multi_modal_projector" in name and not p.any():
                p.normal_(0.0, 0.2)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    if family == "llava":
        processor = tf.LlavaProcessor(image_processor=image_processor, tokenizer=vlm_tokenizer(family), patch_size=14,
                                      vision_feature_select_strategy="default", num_additional_image_tokens=1)
    else:
        processor = tf.Gemma3Processor(image_processor=image_processor, tokenizer=vlm_tokenizer(family),
                                       image_seq_length=4)
    return model, processor


def _image(family: str, i: int):
    return picture(i, size=SIZES[family])


def _user(prompt_ids):
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": words(prompt_ids)}]}


@pytest.fixture(scope="module", params=["llava", "gemma3"])
def work(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"vlm-{family}")
    model, processor = vlm_target(family)
    model.save_pretrained(root / "target")
    processor.save_pretrained(root / "target")
    (root / "pics").mkdir()
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(ROWS):
        _image(family, i).save(root / "pics" / f"{i}.png")
        msgs = [_user(torch.randint(FIRST_WORD, END, (3,), generator=g).tolist())]
        text = processor.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=[text], images=[_image(family, i)], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        reply = out[0, inputs["input_ids"].shape[1]:].tolist()
        rows.append({"images": [f"pics/{i}.png"], "messages": msgs + [{"role": "assistant", "content": words(reply)}]})
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {"family": family, "root": root, "model": model, "processor": processor, "target": str(root / "target"), "data": str(data)}


def test_image_rows_encode_to_expanded_tokens_and_pixels(work):
    processor = work["processor"]
    rows = read_rows(work["data"], images=True)
    assert rows[0][1]["images"][0] == str(work["root"] / "pics" / "0.png")  # made absolute
    with pytest.raises(ValueError, match="row 1 has images, which need the target's processor"):
        encode_rows(processor.tokenizer, rows, max_length=256)
    examples = encode_rows(processor.tokenizer, rows, max_length=256, processor=processor)
    ex = examples[0]
    ids = ex.input_ids.tolist()
    assert ids.count(IMG) == 4 and not bool(ex.loss_mask[ex.input_ids == IMG].any())
    trained = processor.tokenizer.convert_ids_to_tokens(ex.input_ids[ex.loss_mask].tolist())
    assert trained == rows[0][1]["messages"][1]["content"].split() + ["<|end|>"]
    side = SIZES[work["family"]][0]
    assert tuple(ex.model_inputs["pixel_values"].shape) == (1, 3, side, side)
    batch = collate(examples[:3])
    assert tuple(batch["model_inputs"]["pixel_values"].shape) == (3, 3, side, side)
    # A row truncated through its image tokens is dropped, not fed to the target with a broken count.
    assert len(encode_rows(processor.tokenizer, rows[:2] + [(99, {"text": "w1 w2 w3 w4"})], max_length=5,
                           processor=processor)) == 1


def test_a_vlm_target_trains_on_image_rows_and_the_head_decodes_losslessly(work):
    cfg = TrainConfig(target=work["target"], data=work["data"], output_dir=str(work["root"] / "out"), kind="eagle3",
                      max_steps=80, batch_size=2, mixed_precision="no", save_dtype="float32", lr=3e-3,
                      warmup_ratio=0.1, log_every=1000, save_every=1000, eval_holdout=HOLDOUT, eval_samples=HOLDOUT,
                      eval_max_new_tokens=12)
    result = train(cfg)  # the processor comes from the target folder (AutoProcessor)
    # The soft cross-entropy has the (sharp-logit) target's entropy as its floor: judge the fall and the accuracy.
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < first - 1.0, (first, last)
    acc_first = sum(a[0] for a in result.accuracies[:3]) / 3
    acc_last = sum(a[0] for a in result.accuracies[-10:]) / 10
    assert acc_first < 0.1 and acc_last > 0.3, (acc_first, acc_last)
    assert result.mean_accept_length is not None and result.mean_accept_length > 1.0

    model, processor = work["model"], work["processor"]
    head = em.load_head(cfg.output_dir, target=model)
    row = read_rows(work["data"], images=True)[-1][1]
    text = processor.tokenizer.apply_chat_template(row["messages"][:1], tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[_image(work["family"], ROWS - 1)], return_tensors="pt",
                       add_special_tokens=False)
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=16, do_sample=False)
        out = em.speculative_generate(model, head, **inputs, max_new_tokens=16, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats.mean_accept_length >= 1.0


def test_online_batches_carry_the_merged_embeddings(work):
    """With images the batch's head inputs are the target's layer-0 input: image features at image positions."""
    from eagle_mm.hf.parts import resolve_target
    from eagle_mm.train.loop import _batch

    model, processor = work["model"], work["processor"]
    cfg = TrainConfig(target=work["target"], data=work["data"], output_dir=str(work["root"] / "unused"))
    examples = encode_rows(processor.tokenizer, read_rows(work["data"], images=True)[:2], 256, processor=processor)
    batch = _batch(examples, model, (1, 2, 3), cfg, torch.device("cpu"))
    ids = batch["input_ids"]
    with torch.no_grad():
        ref = model(**{k: v for k, v in collate(examples).items() if k in ("input_ids", "attention_mask")},
                    **collate(examples)["model_inputs"], output_hidden_states=True).hidden_states
    torch.testing.assert_close(batch["embeds"], ref[0])
    image = ids == IMG
    assert not torch.allclose(batch["embeds"][image], resolve_target(model).embed(ids)[image])
    torch.testing.assert_close(batch["embeds"][~image], resolve_target(model).embed(ids)[~image])
