"""GPU smoke check: greedy speculative decoding on CUDA (Triton verify) equals generate(), bf16 and fp32."""
import json
import os
import sys

import torch
import transformers as tf

sys.path.insert(0, os.getcwd())
import eagle_mm as em  # noqa: E402
from bench.forced import ForcedHead  # noqa: E402

_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=96, max_position_embeddings=512, tie_word_embeddings=False)
_FAMILIES = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM, "sdpa", {}),
             "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, "sdpa", {}),
             "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, "eager",
                        dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8))}


def tiny_model(family: str):
    """A tiny random target of ``family``, with sharpened logits so that greedy choices are far from ties."""
    config_class, model_class, attention, extra = _FAMILIES[family]
    config = config_class(**_SHAPE, **extra)
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.set_attn_implementation(attention)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model


def prompt(length: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(1))


results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
for family in ("llama", "gemma2", "qwen2"):
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(family).to("cuda", dtype)
        ids = prompt(9, batch=2).cuda()
        ref = model.generate(ids, max_new_tokens=32, do_sample=False)
        ok = []
        for tree in (em.TreeConfig.chain(4), em.TreeConfig(depth=4, top_k=3, total_tokens=10)):
            out = em.speculative_generate(model, em.Eagle3Head.from_target(model), input_ids=ids,
                                          max_new_tokens=32, tree=tree)
            ok.append(bool(torch.equal(out, ref)))
        one = ids[:1]
        ref1 = model.generate(one, max_new_tokens=32, do_sample=False)
        long = model.generate(one, max_new_tokens=64, do_sample=False)[0]
        wrong = torch.rand(long.numel(), generator=torch.Generator().manual_seed(0)) < 0.2
        head = ForcedHead(em.Eagle3Head.from_target(model), long, wrong.cuda())
        out1 = em.speculative_generate(model, head, input_ids=one, max_new_tokens=32, tree=em.TreeConfig.chain(5),
                                       return_dict_in_generate=True)
        ok.append(bool(torch.equal(out1.sequences, ref1)))
        results[f"{family}-{dtype}"] = {"identical": ok, "forced_mean_accept": out1.stats.mean_accept_length}
print(json.dumps(results, indent=1))
out_dir = os.environ.get("OUT")
if out_dir:
    json.dump(results, open(os.path.join(out_dir, "gpu_smoke.json"), "w"), indent=1)
