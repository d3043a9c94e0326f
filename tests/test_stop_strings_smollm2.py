"""Stop strings on smollm2's BPE tokenizer (its own file, so that it alone compiles at full
optimisation: tests/conftest.py's REAL_MODEL_FILES): the streamed text is exactly the
tokenizer's decode of the final token ids cut at the stop string, for stop strings that
span tokens, end mid-token or inside a multi-byte character (test_stop_strings.py's checks)."""

from __future__ import annotations

import asyncio

from sampling_params import SamplingParams
from test_stop_strings import VARIANTS, check, check_all, stops_from

# smollm2 at test_real_model_server's shapes (its programs are in the persistent cache)
SMOLLM2 = dict(model="smollm2", max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128, num_kv_blocks=96,
               warmup=False)
FRENCH = [{"role": "user", "content": "Translate to French: I would like a coffee at the café, please."}]


def test_smollm2_stop_strings_stream_exactly_the_reference_text() -> None:
    from async_engine import AsyncEngine
    from engine import EngineConfig

    loop = asyncio.new_event_loop()
    engine = AsyncEngine(EngineConfig(**SMOLLM2), log=lambda *_: None)
    loop.run_until_complete(engine.start())
    try:
        tok = engine.tokenizer
        prompt = tok.encode(tok.apply_chat_template(FRENCH, add_generation_prompt=True, tokenize=False),
                            add_special_tokens=False)
        base = dict(max_tokens=32, temperature=0.0)
        free = check(loop, engine, prompt, SamplingParams(**base))
        assert len(free.encode()) > len(free), f"the answer should have multi-byte characters: {free!r}"
        # ending inside a token: the first characters of a multi-character token
        piece = next(t for t in (tok.decode([i]) for i in tok.encode(free, add_special_tokens=False)[2:])
                     if len(t.strip()) > 2).strip()
        stops = stops_from(free) + [(piece[0],), (piece[:2],)]
        check_all(loop, engine, prompt, [SamplingParams(**base, stop=stop) for stop in stops]
                  + [SamplingParams(**base, stop=stops[i], **VARIANTS[1]) for i in (0, 2, 6)]
                  + [SamplingParams(**base, stop=stops[3], **VARIANTS[2]),
                     SamplingParams(**base, stop=stops[5], **VARIANTS[3])])
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
