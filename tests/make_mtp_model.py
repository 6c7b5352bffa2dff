#!/usr/bin/env python3
"""Write tiny-deepseek2-mtp: the golden tiny-deepseek2 with one next-token-prediction (MTP) block.

The block is what GLM-4.5 and DeepSeek-V3 GGUFs carry and llama.cpp runs as ``--spec-type draft-mtp``
(``llama_model_deepseek2::graph_mtp``): ``deepseek2.block_count`` counts it, ``deepseek2.nextn_predict_layers``
is 1, and ``blk.{n_layer}`` holds a whole MoE block (MLA attention, routed + shared experts) plus
``nextn.eh_proj`` (``[n_embd, 2 n_embd]``: the normed token embedding and the normed trunk state,
concatenated, to the block's input), ``nextn.enorm``, ``nextn.hnorm`` and ``nextn.shared_head_norm``. It
has no ``nextn.embed_tokens`` or ``nextn.shared_head_head``: the block then reads ``token_embd`` and
``output`` (llama.cpp's fallbacks), as files that share them do.

Built by ``../shared/golden/make_moe_models.py``'s own deepseek2 builder (imported, not copied) with one
block more and the same seed, so the trunk's four blocks, its embeddings and output head are the tiny-
deepseek2's tensors draw for draw (the MTP block's own layers are drawn after them); the nextn tensors
come from a generator of their own (seed + 1).
``eh_proj`` is mostly the identity on the token half (plus noise), so the block's state stays close to
the embedding of the token it reads, and the model's next-token table (``output.weight``, see
make_moe_models.py) makes its drafts often right: a tiny model whose drafts are worth verifying.

The tokenizer is read from tiny-deepseek2.gguf (SmolLM2's, copied verbatim there).

Usage: python tests/make_mtp_model.py --golden ../shared/golden --out DIR
"""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
from pathlib import Path

import numpy as np

NAME = "tiny-deepseek2-mtp"
EH_IDENTITY = 1.0  # gain of the token half's identity in eh_proj
EH_NOISE = 0.25  # gain of eh_proj's random part


def _golden_modules(golden: Path):
    if str(golden) not in sys.path:
        sys.path.insert(0, str(golden))
    return importlib.import_module("make_moe_models")


def build(golden: Path, out_dir: Path) -> Path:
    """Write ``out_dir/tiny-deepseek2-mtp.gguf`` (byte-for-byte reproducible) and return its path.

    Raises:
        FileNotFoundError: ``golden`` lacks make_moe_models.py or models-moe/tiny-deepseek2.gguf.
    """
    src = golden / "models-moe" / "tiny-deepseek2.gguf"
    if not (golden / "make_moe_models.py").is_file() or not src.is_file():
        raise FileNotFoundError(f"{golden} lacks make_moe_models.py or {src.name}")
    moe = _golden_modules(golden)
    tok = moe.base.load_smollm2_tokenizer(str(src))
    spec = copy.deepcopy(moe.DEEPSEEK2)
    n_trunk = spec["n_layer"]
    spec["n_layer"] = n_trunk + 1  # block_count counts the MTP block; the builder writes blk.{n_trunk} too
    out_dir.mkdir(parents=True, exist_ok=True)
    finish = moe.finish

    def finish_with_nextn(w, path):
        rng = np.random.default_rng(spec["seed"] + 1)
        E = spec["n_embd"]
        b = moe.Builder(w, rng, spec["init"])
        p = f"blk.{n_trunk}.nextn."
        w.add_uint32(f"{spec['arch']}.nextn_predict_layers", 1)
        eh = b.lin(E, 2 * E, gain=EH_NOISE)
        eh[:, :E] += np.eye(E, dtype=np.float32) * EH_IDENTITY
        b.add(p + "eh_proj.weight", eh, spec["types"]["attn"])
        b.add(p + "enorm.weight", b.norm_w(E))
        b.add(p + "hnorm.weight", b.norm_w(E))
        b.add(p + "shared_head_norm.weight", b.norm_w(E))
        return finish(w, path)

    moe.finish = finish_with_nextn
    try:
        return Path(moe.build_deepseek2(spec, NAME, tok, str(out_dir), spec["seed"]))
    finally:
        moe.finish = finish


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--golden", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "golden")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    path = build(args.golden, args.out)
    print(path, path.stat().st_size)


if __name__ == "__main__":
    main()
