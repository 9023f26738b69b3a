"""How vLLM, SGLang and the speculators package read an exported EAGLE-3 head's aux ids: small oracles.

Re-implemented from the engines' source (read in the releases named below; docs/serving.md cites the files),
with no engine import. Each reader takes the exported config.json dict and the target's layer count N and
returns the *stream positions* the engine captures, in the order its fc receives them: position k is the
target's residual stream after k decoder layers (0 the input embeddings, N the last layer's output before the
final norm). A reader raises where the engine fails: ``TypeError`` where its loop adds a residual that is still
None (position 0 in older releases), ``KeyError`` where the Transformers backend has no layer to record, and
``ValueError`` where the captured count differs from the fc's three inputs or a config is refused.
"""
from __future__ import annotations

from packaging.version import Version

KEY = "eagle_aux_hidden_state_layer_ids"
# Releases the rules were read in.
VLLM_RELEASES = ("0.17.1", "0.18.0", "0.34.0")
SGLANG_RELEASES = ("0.5.12", "0.5.21", "0.5.22", "0.5.23")
FIRST_ID_ARCHITECTURES = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                          "Glm4MoeLiteForCausalLM"}


def _default(n: int) -> list[int]:
    # vllm/model_executor/models/llama.py get_eagle3_(default_)aux_hidden_state_layers and SGLang llama.py
    # set_eagle3_layers_to_capture(None): the same triple, used as positions directly.
    return [2, n // 2, n - 3]


def _fc_inputs(config: dict, release: Version, count_since: Version) -> int:
    """How many states the draft's fc takes (llama_eagle3.py of both engines): 3 in releases before
    ``count_since`` (vLLM 0.17.1, 0.18.0); from it (vLLM 0.34.0, SGLang 0.5.12 on) ``num_aux_hidden_states``
    or the number of ``eagle_config`` ids, else 3."""
    if release < count_since:
        return 3
    nested = (config.get("eagle_config") or {}).get(KEY)
    return config.get("num_aux_hidden_states") or (len(nested) if nested else 3)


def _checked(positions: list[int], fc_inputs: int) -> list[int]:
    if len(positions) != fc_inputs:
        raise ValueError(f"captured {len(positions)} states, the fc takes {fc_inputs}")
    return positions


def vllm_native(config: dict, n: int, release: str) -> list[int]:
    """vLLM's own model implementation (vllm/model_executor/models/llama.py LlamaModel.forward, interfaces.py
    EagleModelMixin): ids from the draft config's top level (v1 gpu_model_runner / eagle3_utils.py).

    0.17.x: the loop appends ``hidden_states + residual`` before layer ``idx`` when ``idx`` is an id, so
    position idx for idx in 0..N-1, and the residual is None at idx 0. From 0.18.0: ``_maybe_add_hidden_state``
    records position 0 (the embeddings: with the residual None, the hidden states alone) and position idx + 1
    after layer idx.
    """
    version = Version(release)
    ids = config.get(KEY) or _default(n)
    if version < Version("0.18.0"):
        if 0 in ids:
            raise TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType'")
        positions = [k for k in range(n) if k in ids]
    else:
        positions = [k for k in range(n + 1) if k in ids]
    return _checked(positions, _fc_inputs(config, version, Version("0.34.0")))


def vllm_transformers_backend(config: dict, n: int, release: str = "0.34.0") -> list[int]:
    """vLLM's Transformers modeling backend (vllm/model_executor/models/transformers/base.py
    set_aux_hidden_state_layers, 0.17.0 to 0.34.0): id k records the output of layer k - 1, in id order."""
    ids = config.get(KEY) or _default(n)
    positions = []
    for k in ids:
        if not 0 <= k - 1 < n:
            raise KeyError(k - 1)  # self._layer_names[layer - 1]
        positions.append(k)
    return _checked(positions, _fc_inputs(config, Version(release), Version("0.34.0")))


def vllm_speculators(config: dict, n: int, release: str) -> list[int]:
    """vLLM serving the speculators format: vllm/transformers_utils/configs/speculators/algos.py update_eagle3
    copies a non-empty ``eagle_aux_hidden_state_layer_ids`` to the draft config's top level; then as vllm_native.
    The speculators package itself (speculators/models/utils.py resolve_target_layer_ids, 0.9.0) refuses ids
    outside 0..N or repeated."""
    ids = config.get(KEY)
    if ids is not None and (min(ids) < 0 or max(ids) > n or len(set(ids)) != len(ids)):
        raise ValueError(f"target_layer_ids must be distinct and within [0, {n}]")
    return vllm_native({KEY: ids} if ids else {}, n, release)


def sglang(config: dict, n: int, release: str, architectures=("LlamaForCausalLM",)) -> list[int]:
    """SGLang: ids from the draft's ``eagle_config`` (model_runner spec_aux_hidden_state.py; before 0.5.22
    model_runner.py), handed to the target's ``set_eagle3_layers_to_capture``.

    llama.py (and most model files), every release: ``layers_to_capture = [id + 1 ...]``. deepseek_v2.py and
    glm4_moe_lite.py from 0.5.13: ``+ 1`` only when the first id is 1, else the ids as they are. No ids: the
    default triple as loop indices. The loop captures before layer i for i in 0..N-1: up to 0.5.21
    ``hidden_states + residual`` (None at i = 0), from 0.5.22 the layer boundary's residual stream (the
    embeddings at i = 0).
    """
    version = Version(release)
    eagle_config = config.get("eagle_config") or {}
    ids = eagle_config.get(KEY)
    if ids is None:
        loop = _default(n)
    elif set(architectures) & FIRST_ID_ARCHITECTURES and version >= Version("0.5.13") and ids[0] != 1:
        loop = list(ids)
    else:
        loop = [j + 1 for j in ids]
    if 0 in loop and version < Version("0.5.22"):
        raise TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType'")
    positions = [i for i in range(n) if i in loop]
    return _checked(positions, _fc_inputs(config, version, Version("0.5.12")))


def readers(layout: str, architectures=("LlamaForCausalLM",)):
    """(name, release, reader(config, n)) for every engine release that reads ``layout``."""
    if layout == "vllm":
        return [(f"vllm {r}", r, lambda c, n, r=r: vllm_native(c, n, r)) for r in VLLM_RELEASES] + [
            ("vllm 0.34.0 transformers backend", None, vllm_transformers_backend)]
    if layout == "speculators":
        return [(f"vllm {r} (speculators)", r, lambda c, n, r=r: vllm_speculators(c, n, r)) for r in VLLM_RELEASES]
    return [(f"sglang {r}", r, lambda c, n, r=r: sglang(c, n, r, architectures)) for r in SGLANG_RELEASES]
