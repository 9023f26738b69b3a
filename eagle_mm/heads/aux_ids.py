"""Which target hidden states vLLM and SGLang capture for an EAGLE-3 head, and the ids we write so they capture ours.

Ours (``Eagle3Config.aux_layers``) are HF ``hidden_states`` indices of an N-layer target: 0 the input embeddings,
i in 1..N-1 the input of decoder layer i, N the final *normed* output. Both engines capture the residual stream
while their decoder loop runs, so they concatenate the captured states in ascending layer order whatever the id
order, and their fc takes three of them. The rules below, and the source file and release of each, are tabled
in docs/serving.md; tests/engine_oracles.py re-implements each engine's reading to check what we write.

vLLM (its ``eagle_aux_hidden_state_layer_ids``, also what it reads from the speculators format): id i is our i
for 1..N-1 in every release. Id 0 fails before 0.18.0 (the loop adds a residual that is still None there); from
0.18.0 it is the input embeddings. Id N is never our N (nothing before 0.18.0, the pre-norm output after).

SGLang (``eagle_config.eagle_aux_hidden_state_layer_ids``): most model files (llama.py and every release) add 1
to each id, so id j captures the input of layer j + 1; deepseek_v2.py and glm4_moe_lite.py since 0.5.13 add 1
only when the first id is 1 and otherwise take the ids as they are. Loop index 0 (the embeddings) fails before
0.5.22 like vLLM's; from 0.5.22 the layer boundary captures the embeddings there.
"""
from __future__ import annotations

from packaging.version import InvalidVersion, Version

from ..config import Eagle3Config

__all__ = ["AUX_COUNT", "export_aux", "check_aux", "engine_ids", "aux_from_engine", "sglang_rule", "aux_notes",
           "engine_of"]

AUX_COUNT = 3  # the fc of both engines' EAGLE-3 head: 3 x hidden (newer releases: one per id, still 3 for ours)
VLLM_EMBEDDINGS_SINCE = Version("0.18.0")
SGLANG_EMBEDDINGS_SINCE = Version("0.5.22")
SGLANG_FIRST_ID_RULE_SINCE = Version("0.5.13")
# Targets whose SGLang model file applies the first-id rule: its EntryClass names, and the HF model types of them.
SGLANG_FIRST_ID_ARCHITECTURES = frozenset(
    {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "Glm4MoeLiteForCausalLM"})
SGLANG_FIRST_ID_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe_lite"})
PLUS_ONE, FIRST_ID = "plus_one", "first_id"  # SGLang's two readings of explicit ids
_ENGINES = {"vllm": ("vLLM", VLLM_EMBEDDINGS_SINCE), "speculators": ("vLLM", VLLM_EMBEDDINGS_SINCE),
            "sglang": ("SGLang", SGLANG_EMBEDDINGS_SINCE)}


def engine_of(layout: str) -> str:
    """The engine that reads ``layout``'s aux ids: "vLLM" or "SGLang"."""
    if layout not in _ENGINES:
        raise ValueError(f"engine_version names a vLLM or SGLang release; the {layout!r} layout is served by neither")
    return _ENGINES[layout][0]


def parse_version(text) -> Version | None:
    """``None`` stays None (the newest conventions); "0.18.0", "v0.5.22", "0.5.13.post1" parse."""
    if text is None:
        return None
    try:
        return Version(str(text).strip().removeprefix("v"))
    except InvalidVersion:
        raise ValueError(f"engine_version {text!r} is not a release number; expected one such as 0.18.0") from None


def export_aux(cfg: Eagle3Config, num_layers: int | None):
    """The aux layers an engine export names: the head's own, or on a 4-6 layer target our default (the engines'
    own default, the official (2, N//2, N-3), collides there); None leaves the engine's default."""
    if cfg.aux_layers is None and num_layers is not None and 4 <= num_layers <= 6:
        return Eagle3Config.default_aux_layers(num_layers)
    return cfg.aux_layers


def check_aux(aux, layout: str, *, num_layers: int | None = None, engine_version=None) -> None:
    """Raise ``ValueError`` unless the engine serving ``layout`` captures exactly the states ``aux`` names.

    num_layers: the target's layer count (None: the checks that need it are skipped); engine_version: the
    release to be served with (None: the newest conventions).
    """
    engine, embeddings_since = _ENGINES[layout]
    aux = tuple(aux)
    if len(aux) != AUX_COUNT:
        raise ValueError(f"{engine}'s EAGLE-3 fc fuses {AUX_COUNT} target states; this head reads {len(aux)}: {aux}")
    if len(set(aux)) != len(aux):
        raise ValueError(
            f"aux layers {aux} name a hidden state twice: {engine} captures each layer once, so its fc would get "
            f"fewer features than it was trained on; use three distinct indices, e.g. {_example(num_layers)}")
    if list(aux) != sorted(aux):
        raise ValueError(
            f"aux layers {aux} are not in ascending order: {engine} concatenates the states it captures in layer "
            f"order {tuple(sorted(aux))}, while this head's fc was trained on them in the order {aux}")
    if num_layers is not None:
        high = [i for i in aux if i >= num_layers]
        if high:
            raise ValueError(
                f"aux layer(s) {high} out of range for {engine}: the target has {num_layers} layers, and {engine} "
                f"captures hidden_states indices 0..{num_layers - 1} (index {num_layers}, the final normed output, "
                f"it captures before the norm or not at all)")
    version = parse_version(engine_version)
    if 0 in aux and version is not None and version < embeddings_since:
        raise ValueError(
            f"{engine} {version} cannot capture aux layer 0 (the input embeddings): its decoder loop adds a residual "
            f"that is still None before layer 0; {engine} >= {embeddings_since} captures it (docs/serving.md)")


def sglang_rule(*, architectures=(), model_type: str | None = None, engine_version=None) -> str:
    """How SGLang reads explicit ids for this target: ``PLUS_ONE`` (llama.py and most model files) or
    ``FIRST_ID`` (deepseek_v2.py, glm4_moe_lite.py from 0.5.13: +1 only when the first id is 1)."""
    version = parse_version(engine_version)
    first_id = (bool(set(architectures or ()) & SGLANG_FIRST_ID_ARCHITECTURES)
                or model_type in SGLANG_FIRST_ID_MODEL_TYPES)
    return FIRST_ID if first_id and (version is None or version >= SGLANG_FIRST_ID_RULE_SINCE) else PLUS_ONE


def engine_ids(aux, layout: str, *, rule: str = PLUS_ONE) -> list[int]:
    """The ``eagle_aux_hidden_state_layer_ids`` to write so that ``layout``'s engine captures ``aux`` (checked).

    vLLM: our indices as they are. SGLang: one less each (-1 for the embeddings); when index 2 is among them that
    list starts with 1, which both SGLang rules read alike, so ``rule`` matters only without index 2.
    """
    aux = list(aux)
    if layout != "sglang":
        return aux
    if 2 in aux:  # written 1: put first, where the first-id rule adds 1 like the other
        return [1] + [i - 1 for i in aux if i != 2]
    if rule == PLUS_ONE:
        return [i - 1 for i in aux]
    # The first-id rule takes the ids as they are unless the first is 1: start with another.
    return aux[1:] + aux[:1] if aux[0] == 1 else aux


def aux_from_engine(ids, layout: str) -> tuple[int, ...]:
    """Our indices from ids a file names for ``layout``, read as llama.py reads them (SGLang: +1), in layer order."""
    shift = 1 if layout == "sglang" else 0
    return tuple(sorted(int(i) + shift for i in ids))


def aux_notes(aux, layout: str, *, num_layers: int | None = None, engine_version=None,
              rule_known: bool = True) -> list[str]:
    """What an export could not check, or serves only from some release on: one sentence each (empty if none)."""
    engine, embeddings_since = _ENGINES[layout]
    notes = []
    if aux is None:
        if num_layers is None:
            notes.append(f"this head names no aux layers: {engine} takes (2, N//2, N-3) of an N-layer target, the "
                         f"head's own default only for N >= 7; pass the target to write the ids")
        return notes
    aux = tuple(aux)
    if num_layers is None:
        notes.append(f"aux layers {aux} are not checked against the target's layer count N: {engine} captures "
                     f"indices 0..N-1 only, so {max(aux)} must be below N; pass the target to check")
    if 0 in aux and engine_version is None:
        notes.append(f"aux layer 0 (the input embeddings) is captured from {engine} {embeddings_since} on"
                     + (" (native model implementation; not the Transformers backend, up to vLLM 0.34.0)"
                        if engine == "vLLM" else ""))
    if layout == "sglang" and 2 not in aux and not rule_known:
        notes.append(f"SGLang reads these ids as its llama.py does (+1 each); deepseek_v2.py and glm4_moe_lite.py "
                     f"(SGLang >= {SGLANG_FIRST_ID_RULE_SINCE}) read them otherwise unless aux layer 2 is among "
                     f"them: pass the target so the ids follow its architecture")
    return notes


def _example(num_layers) -> tuple[int, int, int]:
    return Eagle3Config.default_aux_layers(num_layers) if num_layers is not None and num_layers >= 4 else (1, 2, 3)
