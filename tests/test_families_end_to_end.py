"""The architectures beyond the Llama family through the surfaces a user meets: a tiny random model of each
(transformers' own config and model classes, save_pretrained) beside the default model's tokenizer and chat
template, run by the local pipeline (the chat template's prompt, guided decoding, logprobs) and, for a
windowed dense family and a mixture of experts, served by `mii_async.serve` in router and worker processes
(OpenAI chat route with logprobs and a guided choice). Their parity with transformers is in
tests/workers/model/."""
from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

import mii_async

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
SHAPE = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1,
             bos_token_id=1, eos_token_id=2, pad_token_id=2)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)]}
FAMILIES = {     # family → (config class, model class, the family's own settings)
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=24, max_window_layers=1)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=24, query_pre_attn_scalar=16,
                                                         attn_logit_softcapping=5.0, final_logit_softcapping=8.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=24, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=24, rope_parameters=LONGROPE,
                                                   original_max_position_embeddings=64)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2,
                                                                moe_intermediate_size=32, norm_topk_prob=True)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, default_model_dir):
    """family → a directory holding its tiny random model and the default model's tokenizer files."""
    import torch
    import transformers

    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            config_class, model_class, own = FAMILIES[family]
            out = tmp_path_factory.mktemp(family)
            torch.manual_seed(7)
            config = getattr(transformers, config_class)(**SHAPE, **own)
            getattr(transformers, model_class)(config).to(torch.float32).save_pretrained(str(out))
            for name in TOKENIZER_FILES:
                shutil.copy(default_model_dir / name, out / name)
            made[family] = out
        return made[family]

    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_local_pipeline_runs_each_family(family_dir, family):
    """pipeline(DIR) of each family: a chat's prompt is the tokenizer's chat template; greedy logprobs give the
    chosen token first and at rank 1; a guided choice and a guided regex hold whatever the random weights
    prefer; every KV block comes back."""
    from transformers import AutoTokenizer

    path = family_dir(family)
    template_ids = AutoTokenizer.from_pretrained(str(path)).apply_chat_template(CHAT, add_generation_prompt=True,
                                                                                tokenize=True, return_dict=False)
    pipe = mii_async.pipeline(str(path), kv_cache_memory=0.05)
    try:
        r = pipe.chat(CHAT, max_new_tokens=4, ignore_eos=True, logprobs=2)
        assert r.prompt_token_ids == list(template_ids)
        assert r.generated_length == 4 == len(r.logprobs)
        for tid, lp in zip(r.token_ids, r.logprobs):
            assert lp.token_id == tid and lp.rank == 1 and lp.top[0][0] == tid and lp.logprob <= 0
        assert pipe("Is Paris in France?", max_new_tokens=8, guided_choice=["yes", "no"])[0].generated_text \
            in ("yes", "no")
        assert pipe("Count:", max_new_tokens=8, guided_regex=r"[0-9]{3}!")[0].generated_text[-1] == "!"
        assert pipe.stats()["used_blocks"] == 0
    finally:
        pipe.close()


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_serve_answers_the_openai_chat_route(family_dir, family):
    """mii_async.serve(DIR) in router and worker processes: /v1/chat/completions answers with the chat
    template's prompt count, greedy logprobs, and a guided choice; the processes are gone after."""
    from transformers import AutoTokenizer

    from tests.mesh_helpers import deployment_pids, wait_gone

    path = family_dir(family)
    prompt_tokens = len(AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False))
    client = mii_async.serve(str(path), kv_cache_memory=0.05, enable_http=True, http_port=0)
    pids = [client._process.pid] + deployment_pids(client.run(client.health()))
    try:
        url = f"{client.http_url}/v1/chat/completions"
        r = httpx.post(url, json={"model": path.name, "messages": CHAT, "max_tokens": 3, "temperature": 0,
                                  "logprobs": True, "top_logprobs": 2}, timeout=120)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == prompt_tokens and body["usage"]["completion_tokens"] <= 3
        for tok in body["choices"][0]["logprobs"]["content"]:
            assert tok["top_logprobs"][0]["logprob"] == tok["logprob"]
        r = httpx.post(url, json={"model": path.name, "messages": CHAT, "max_tokens": 8,
                                  "guided_choice": ["Paris", "Lyon"]}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] in ("Paris", "Lyon")
    finally:
        client.terminate_server_sync(drain_s=0)
    assert not wait_gone(pids), "processes left behind"
