"""TreeConfig.coerce: what a ``tree=`` argument may be (a dict as HF users pass configs), and the error otherwise."""
from __future__ import annotations

import re

import pytest
import torch

import eagle_mm as em
from eagle_mm import TreeConfig
from tests.tiny import prompt, tiny_model


def test_a_dict_becomes_a_tree_config():
    assert TreeConfig.coerce({"depth": 3, "top_k": 4, "total_tokens": 8}) == TreeConfig(depth=3, top_k=4,
                                                                                         total_tokens=8)
    assert TreeConfig.coerce({"depth": 3}) == TreeConfig(depth=3)


def test_none_a_tree_config_and_auto_pass_through():
    tree = TreeConfig.chain(4)
    assert TreeConfig.coerce(tree) is tree
    assert TreeConfig.coerce(None) == TreeConfig()
    assert TreeConfig.coerce("auto") == "auto"


def test_a_dict_with_an_unknown_field_names_it():
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['width'\]; a tree dict takes depth, top_k"):
        TreeConfig.coerce({"depth": 3, "width": 4})


@pytest.mark.parametrize("value", ((3, 4, 8), "big", 5))
def test_anything_else_is_a_type_error_naming_it(value):
    with pytest.raises(TypeError, match=re.escape(f"tree={value!r}: expected a TreeConfig, a dict")):
        TreeConfig.coerce(value)


def test_a_dict_keeps_its_field_checks():
    with pytest.raises(ValueError, match="total_tokens=50 exceeds"):
        TreeConfig.coerce({"depth": 2, "top_k": 2, "total_tokens": 50})


def test_an_empty_prompt_row_is_an_error_naming_it():
    model = tiny_model("llama").eval()
    ids = prompt(4, batch=2)
    mask = torch.ones_like(ids)
    mask[1] = 0
    head = em.Eagle3Head.from_target(model)
    with pytest.raises(ValueError, match=r"prompt row\(s\) \[1\] are empty \(attention_mask all 0\)"):
        em.speculative_generate(model, head, input_ids=ids, attention_mask=mask, max_new_tokens=4)
