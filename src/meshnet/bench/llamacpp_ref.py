"""llama.cpp reference timings, run as its own process (``python -m meshnet.bench.llamacpp_ref``).

Imports llama-cpp-python only: its ggml libraries must not share a process with ggml-python's.
Settings follow the goldens: flash attention on (llama.cpp's CPU default), f16 KV cache, one batch for
the prompt, ``logits_all=False``. Prints one JSON object with median tokens/s.

usage: python -m meshnet.bench.llamacpp_ref MODEL PROMPT_IDS_JSON N_DECODE THREADS REPEATS
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main() -> None:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    model, ids_json, n_decode, threads, repeats = sys.argv[1:6]
    ids, n_decode, threads, repeats = json.loads(ids_json), int(n_decode), int(threads), int(repeats)
    n_ctx = 512 if len(ids) + n_decode <= 512 else 4096
    llm = Llama(model_path=model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, flash_attn=True, logits_all=False, verbose=False, seed=1234)
    prefill, decode = [], []
    for i in range(repeats + 1):
        llm.reset()
        llm._ctx.memory_clear(True) if hasattr(llm._ctx, "memory_clear") else None
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t2 = time.perf_counter()
        for _ in range(n_decode):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t3 = time.perf_counter()
        if i:
            prefill.append(len(ids) / (t1 - t0))
            decode.append(n_decode / (t3 - t2))
    print(json.dumps({"llama_cpp_python": llama_cpp.__version__, "flash_attn": True,
                      "prefill_tokens_per_s": round(statistics.median(prefill), 2),
                      "decode_tokens_per_s": round(statistics.median(decode), 2),
                      "prefill_runs": [round(x, 2) for x in prefill], "decode_runs": [round(x, 2) for x in decode]}))


if __name__ == "__main__":
    main()
