"""Draw docs/assets/tree.png: a small EAGLE-2 draft tree and the attention mask that verifies it.

The tree is not drawn by hand: the candidates below go through the library's own
``eagle_mm.decode.tree.select_tree`` (global rerank), ``ancestors`` (mask) and
``eagle_mm.kernels.reference.greedy_accept``, so the picture shows what the code does. Run from the repository
root, with the package and matplotlib installed (``pip install -e ".[docs]"``), and commit the PNG:

    python docs/assets/make_tree_figure.py
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402

from eagle_mm.decode.tree import ancestors, select_tree  # noqa: E402
from eagle_mm.kernels.reference import greedy_accept  # noqa: E402

OUT = Path(__file__).with_name("tree.png")
DEPTH, TOP_K, TOTAL = 3, 2, 5  # TreeConfig(depth=3, top_k=2, total_tokens=5)
ROOT = "the"

# Draft candidates in creation order: (token, parent candidate index or -1 for the root, depth, draft log-prob).
# Depth 1 comes from the root; each later depth from the TOP_K best nodes of the depth before (the frontier).
CANDIDATES = [
    ("cat", -1, 1, -0.4), ("dog", -1, 1, -1.2),  # 0, 1
    ("sat", 0, 2, -0.3), ("ran", 0, 2, -1.6),  # 2, 3: children of "cat"
    ("barked", 1, 2, -0.5), ("ate", 1, 2, -1.9),  # 4, 5: children of "dog"
    ("on", 2, 3, -0.2), ("down", 2, 3, -1.4),  # 6, 7: children of "sat"
    ("at", 4, 3, -0.9), ("loudly", 4, 3, -1.1),  # 8, 9: children of "barked"
]
# What the target would choose after each kept node (its argmax), for the acceptance panel.
TARGET_NEXT = {"the": "cat", "cat": "sat", "sat": "down", "dog": "ran", "barked": "at", "on": "the"}

KEPT, ACCEPTED, DROPPED, BONUS = "#4c72b0", "#55a868", "#c8c8c8", "#dd8452"


def _cumulative() -> list[float]:
    score = []
    for _, parent, _, logp in CANDIDATES:
        score.append(logp + (score[parent] if parent >= 0 else 0.0))
    return score


def _layout() -> dict[int, tuple[float, float]]:
    """x = depth, y spread so siblings sit around their parent; key -1 is the root."""
    pos = {-1: (0.0, 0.0)}
    spread = {1: 3.0, 2: 1.4, 3: 0.8}
    for i, (_, parent, depth, _) in enumerate(CANDIDATES):
        siblings = [j for j, c in enumerate(CANDIDATES) if c[1] == parent]
        offset = (siblings.index(i) - (len(siblings) - 1) / 2) * spread[depth]
        pos[i] = (float(depth), pos[parent][1] - offset)
    return pos


def _draw_tree(ax, kept: list[int], path: set[int], score: list[float], caption: str) -> None:
    pos = _layout()
    for i, (word, parent, _, _) in enumerate(CANDIDATES):
        (x0, y0), (x1, y1) = pos[parent], pos[i]
        on = i in kept
        ax.plot([x0, x1], [y0, y1], color="#555555" if on else DROPPED, lw=1.4, ls="-" if on else "--", zorder=1)
        color = ACCEPTED if i in path else KEPT if on else DROPPED
        ax.text(x1, y1, f"{word}\n{score[i]:.1f}", ha="center", va="center", fontsize=9,
                color="white" if on else "#555555", zorder=2, bbox=dict(boxstyle="round,pad=0.35", fc=color, ec="none"))
    ax.text(0, 0, f"{ROOT}\nroot", ha="center", va="center", fontsize=9, color="white", zorder=2,
            bbox=dict(boxstyle="round,pad=0.35", fc="#333333", ec="none"))
    for d in range(DEPTH + 1):
        ax.text(d, -2.75, "root" if d == 0 else f"depth {d}", ha="center", fontsize=9, color="#555555")
    ax.text(DEPTH / 2, -3.35, caption, ha="center", fontsize=9, color=BONUS)
    ax.set_xlim(-0.5, DEPTH + 0.5)
    ax.set_ylim(-3.5, 2.9)
    ax.axis("off")
    ax.set_title(f"draft tree: depth={DEPTH}, top_k={TOP_K}, total_tokens={TOTAL} (number: cumulative draft log-prob)",
                 fontsize=9)
    handles = [plt.Line2D([], [], marker="s", ls="", color=c, markersize=9) for c in (ACCEPTED, KEPT, DROPPED)]
    ax.legend(handles, ["accepted", "kept, rejected", "dropped by the rerank"], loc="upper left", fontsize=8,
              frameon=False)


def _draw_mask(mx, mask: torch.Tensor, labels: list[str]) -> None:
    n = mask.shape[0]
    mx.imshow(mask.numpy(), cmap=ListedColormap(["#f2f2f2", KEPT, "#1f3b63"]), vmin=0, vmax=2)
    mx.set_xticks(range(n), labels, rotation=45, ha="right", fontsize=8)
    mx.set_yticks(range(n), labels, fontsize=8)
    mx.set_xticks([x - 0.5 for x in range(1, n)], minor=True)
    mx.set_yticks([y - 0.5 for y in range(1, n)], minor=True)
    mx.grid(which="minor", color="white", lw=1.5)
    mx.tick_params(which="minor", length=0)
    mx.set_xlabel("key (every query also sees the whole cached prefix)", fontsize=8)
    mx.set_ylabel("query; (+d) = position offset from the root", fontsize=8)
    mx.set_title("tree attention mask: a node sees\nits ancestors (light) and itself (dark)", fontsize=9)


def main() -> None:
    vocab = sorted({ROOT} | {c[0] for c in CANDIDATES} | set(TARGET_NEXT.values()))
    ids = {w: i for i, w in enumerate(vocab)}
    score = _cumulative()
    tree = select_tree(
        root=torch.tensor([ids[ROOT]]),  # (B=1,)
        tokens=torch.tensor([[ids[c[0]] for c in CANDIDATES]]),  # (1, M)
        parent=torch.tensor([[c[1] for c in CANDIDATES]]),  # (1, M)
        depth=torch.tensor([c[2] for c in CANDIDATES]),  # (M,)
        scores=torch.tensor([score]),  # (1, M)
        total=TOTAL,
    )
    words = [vocab[t] for t in tree.tokens[0].tolist()]  # root first, then kept nodes in creation order
    kept = tree.source[0, 1:].tolist()  # candidate index of each kept node
    target = torch.tensor([[ids[TARGET_NEXT[w]] for w in words]])  # (1, N+1) target argmax after each node
    accept_len, best = greedy_accept(tree.tokens, tree.parent, tree.depth, target, DEPTH)
    path, node = set(), int(best)
    while node:
        path.add(kept[node - 1])
        node = int(tree.parent[0, node])
    mask = ancestors(tree.parent, DEPTH)[0].int()  # (N+1, N+1): 1 where the row may attend to the column
    mask.fill_diagonal_(2)  # itself, drawn apart from its ancestors
    accepted = [CANDIDATES[i][0] for i in sorted(path)]
    bonus = TARGET_NEXT[words[int(best)]]
    caption = (f"accepted {' '.join(accepted)} ({int(accept_len)} tokens), then the target's own next token "
               f"'{bonus}': {int(accept_len) + 1} tokens from one target forward")

    fig, (ax, mx) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1.45, 1]})
    _draw_tree(ax, kept, path, score, caption)
    _draw_mask(mx, mask, [f"{w} (+{d})" for w, d in zip(words, tree.depth[0].tolist())])
    fig.tight_layout()
    fig.savefig(OUT, dpi=90)
    print(f"wrote {OUT} ({OUT.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
